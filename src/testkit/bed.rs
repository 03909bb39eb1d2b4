//! A complete local test bed: an embedded DynamoDB-compatible store, the test
//! upstream, a recording sink, and a fleet configuration for worker processes.
//! Shared by the chaos runner and the benchmarks.

use super::fleet::FleetConfig;
use super::sink::RecordingSink;
use super::upstream::TestUpstream;
use crate::crd::StreamConnectionSpec;
use crate::embedded::EmbeddedStore;
use crate::lease::{LeaseStore, StoreConfig, StreamKey, now_ms};
use crate::metrics::StoreMetrics;
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub fn loopback() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

/// Store, upstream and sink of one run.
pub struct Bed {
    pub store_server: EmbeddedStore,
    pub upstream: TestUpstream,
    pub sink: RecordingSink,
    pub exe: PathBuf,
    pub log_dir: PathBuf,
}

impl Bed {
    /// `rate`: messages per second per session (0: idle sessions).
    pub async fn start(exe: PathBuf, log_dir: PathBuf, rate: u32) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&log_dir)?;
        Ok(Self {
            store_server: EmbeddedStore::start(None, loopback()).await?,
            upstream: TestUpstream::start(loopback(), rate).await?,
            sink: RecordingSink::start(loopback()).await?,
            exe,
            log_dir,
        })
    }

    /// A store client on a fresh table.
    pub async fn table(&self, name: &str) -> anyhow::Result<LeaseStore> {
        let cfg = StoreConfig::local(name, self.store_server.endpoint());
        let store = LeaseStore::connect(cfg, Arc::new(StoreMetrics::new())).await?;
        store.create_table().await?;
        Ok(store)
    }

    /// Fleet settings for workers on `store`'s table.
    pub fn fleet(
        &self,
        store: &LeaseStore,
        lease: Duration,
        heartbeat: Duration,
        reconcile: Duration,
    ) -> FleetConfig {
        let mut fleet = FleetConfig::fast(
            &self.exe,
            self.store_server.endpoint(),
            store.table(),
            &self.log_dir,
        );
        fleet.lease_duration = lease;
        fleet.heartbeat_interval = heartbeat;
        fleet.reconcile_interval = reconcile;
        // Keep the window at lease - 10% skew - 5% margin (the defaults' proportions).
        fleet.max_clock_skew = lease / 10;
        fleet.fence_margin = lease / 20;
        fleet
    }

    /// Applies `names` as streams in `namespace`, sequenced by `/seq`, delivering to the sink.
    pub async fn apply(
        &self,
        store: &LeaseStore,
        namespace: &str,
        names: &[String],
    ) -> anyhow::Result<()> {
        for name in names {
            let spec: StreamConnectionSpec = serde_json::from_value(serde_json::json!({
                "url": self.upstream.url(name),
                "sequence": {"pointer": "/seq"},
                "keepalive": {"intervalSeconds": 2, "timeoutSeconds": 3},
                "sink": {"http": {"url": self.sink.url(), "maxBatchMessages": 100, "lingerMs": 20, "timeoutSeconds": 2}},
            }))?;
            store
                .upsert_desired(&spec.to_desired(StreamKey::new(namespace, name.as_str()), 1))
                .await?;
        }
        Ok(())
    }

    /// stream name → live owner.
    pub async fn owners(store: &LeaseStore) -> HashMap<String, String> {
        let now = now_ms();
        store
            .list()
            .await
            .unwrap_or_default()
            .into_iter()
            .filter_map(|r| {
                r.live_owner(now)
                    .map(|o| (r.key.name.clone(), o.to_string()))
            })
            .collect()
    }

    /// Every stream has exactly one open session.
    pub fn connected_once(&self, names: &[String]) -> bool {
        let open = self.upstream.open_sessions();
        names.iter().all(|n| open.get(n) == Some(&1))
    }

    /// Polls `check` every 100 ms until it holds or `limit` passes.
    pub async fn wait<F, Fut>(limit: Duration, what: &str, mut check: F) -> anyhow::Result<()>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = tokio::time::Instant::now() + limit;
        while !check().await {
            if tokio::time::Instant::now() > deadline {
                anyhow::bail!("gave up after {limit:?} waiting until {what}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// Sequence gaps across `names` (from seq 1 to the highest delivered).
    pub fn gaps(&self, namespace: &str, names: &[String]) -> usize {
        names
            .iter()
            .map(|n| self.sink.log(&format!("{namespace}/{n}")).gaps(1).len())
            .sum()
    }

    pub fn duplicates(&self, namespace: &str, names: &[String]) -> u64 {
        names
            .iter()
            .map(|n| self.sink.log(&format!("{namespace}/{n}")).duplicates())
            .sum()
    }

    /// Per stream: seconds from `since` to the first message of a session
    /// opened after it (how long a failover or handoff took, end to end).
    pub async fn new_session_latencies(
        &self,
        names: &[String],
        since: tokio::time::Instant,
        limit: Duration,
    ) -> anyhow::Result<Vec<f64>> {
        let mut found = HashMap::new();
        let deadline = tokio::time::Instant::now() + limit;
        while found.len() < names.len() {
            for s in self.upstream.sessions() {
                if s.opened >= since
                    && names.contains(&s.stream)
                    && let Some(first) = s.first_sent
                {
                    found
                        .entry(s.stream.clone())
                        .or_insert((first - since).as_secs_f64());
                }
            }
            if tokio::time::Instant::now() > deadline {
                anyhow::bail!(
                    "only {}/{} streams got a new session within {limit:?}",
                    found.len(),
                    names.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(found.into_values().collect())
    }

    /// Overlapping sessions among `names`.
    pub fn overlaps(&self, names: &[String]) -> usize {
        self.upstream
            .overlaps()
            .iter()
            .filter(|(a, _)| names.contains(&a.stream))
            .count()
    }
}

/// Names `prefix-00`, `prefix-01`, ...
pub fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i:02}")).collect()
}

/// p-quantile (0.0..=1.0) by nearest rank.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

/// Resident set size of a process in KiB (Linux).
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_quantiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert_eq!(quantile(&[3.0], 0.99), 3.0);
    }
}
