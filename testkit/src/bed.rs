//! The one test bed every integration test, the chaos runner and the
//! benchmarks use: a fresh table on the server under test, the replaying feed,
//! the verifying sink behind a fault proxy, and a fleet configuration for
//! worker processes.

use crate::fixtures::http_spec;
use crate::processes::FleetConfig;
use crate::sink::{SinkProxy, VerifyingSink};
use crate::store::{endpoint, fresh_store};
use crate::upstream::{FeedOptions, TestUpstream};
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;
use tether::crd::StreamConnectionSpec;
use tether::lease::{LeaseStore, StreamKey, StreamView, UpsertOutcome};
use tokio::time::Instant;

/// How often waits poll.
const POLL: Duration = Duration::from_millis(100);

pub fn loopback() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

/// Names `prefix-00`, `prefix-01`, ...
pub fn names(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i:02}")).collect()
}

/// What a bed is made of.
#[derive(Clone, Debug)]
pub struct BedOptions {
    /// Messages per second per session (0: idle sessions).
    pub rate: u32,
    /// The feed's first sequence number.
    pub first_seq: u64,
    /// Light traffic: one message per session this often (overrides `rate`).
    pub message_every: Option<Duration>,
    /// Whether the feed orders closes before successors' opens (see
    /// `FeedOptions::order_closes`); off only where no overlap is checked.
    pub order_closes: bool,
    /// Namespace of the bed's streams.
    pub namespace: String,
    /// Make the table with this tether 0.1 binary (a version-1 table).
    pub legacy_table: Option<PathBuf>,
}

impl Default for BedOptions {
    fn default() -> Self {
        Self {
            rate: 20,
            first_seq: 1,
            message_every: None,
            order_closes: true,
            namespace: "fleet".into(),
            legacy_table: None,
        }
    }
}

pub struct Bed {
    pub store: LeaseStore,
    pub upstream: TestUpstream,
    /// What arrived, verified.
    pub sink: VerifyingSink,
    /// What workers deliver to: the sink behind a fault proxy.
    pub sink_proxy: SinkProxy,
    pub fleet: FleetConfig,
    pub namespace: String,
    pub first_seq: u64,
    pub log_dir: PathBuf,
}

impl Drop for Bed {
    fn drop(&mut self) {
        if std::env::var_os("TETHER_KEEP_LOGS").is_none() && !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
    }
}

impl Bed {
    /// A bed whose workers run `exe` (the `tether` binary).
    pub async fn start(exe: impl Into<PathBuf>, options: BedOptions) -> anyhow::Result<Self> {
        let store = match &options.legacy_table {
            None => fresh_store(None).await,
            Some(legacy) => legacy_store(legacy).await?,
        };
        let upstream = TestUpstream::start(
            loopback(),
            FeedOptions {
                rate: options.rate,
                first_seq: options.first_seq,
                message_every: options.message_every,
                order_closes: options.order_closes,
            },
        )
        .await?;
        let sink = VerifyingSink::start(loopback()).await?;
        let sink_proxy = SinkProxy::start(loopback(), sink.url()).await?;
        let log_dir = std::env::temp_dir().join(format!(
            "tether-bed-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&log_dir)?;
        let fleet = FleetConfig::fast(exe, endpoint().0, store.table(), &log_dir);
        Ok(Self {
            store,
            upstream,
            sink,
            sink_proxy,
            fleet,
            namespace: options.namespace,
            first_seq: options.first_seq,
            log_dir,
        })
    }

    pub fn key(&self, name: &str) -> StreamKey {
        StreamKey::new(self.namespace.as_str(), name)
    }

    /// The sink log of stream `name`.
    pub fn log(&self, name: &str) -> crate::sink::StreamLog {
        self.sink.log(&format!("{}/{name}", self.namespace))
    }

    /// The standard spec of stream `name` (the feed, the sink via its proxy).
    pub fn spec(&self, name: &str) -> StreamConnectionSpec {
        http_spec(&self.upstream.url(name), &self.sink_proxy.url())
    }

    /// Writes `spec` for `name` as generation `generation` (standalone: no resource).
    pub async fn apply_spec(
        &self,
        name: &str,
        spec: &StreamConnectionSpec,
        generation: i64,
    ) -> anyhow::Result<()> {
        match self
            .store
            .upsert_desired(&spec.to_desired(self.key(name), generation, None))
            .await?
        {
            UpsertOutcome::Applied | UpsertOutcome::Unchanged => Ok(()),
            UpsertOutcome::Refused { reason } => anyhow::bail!("{name}: refused: {reason:?}"),
        }
    }

    /// Applies `n` standard streams `prefix-00`.. and returns their names.
    pub async fn apply(&self, prefix: &str, n: usize) -> anyhow::Result<Vec<String>> {
        let names = names(prefix, n);
        for name in &names {
            self.apply_spec(name, &self.spec(name), 1).await?;
        }
        Ok(names)
    }

    /// Applies one more standard stream, `prefix-00`, adds it to `names`, and
    /// waits at most `limit` until every one of `names` has connected (`what`
    /// names the wait in the error).
    pub async fn apply_one_served_within(
        &self,
        prefix: &str,
        names: &mut Vec<String>,
        limit: Duration,
        what: &str,
    ) -> anyhow::Result<()> {
        names.extend(self.apply(prefix, 1).await?);
        Self::wait(limit, what, || async { self.connected_once(names) }).await
    }

    /// Every stream with its owner.
    pub async fn views(&self) -> Vec<StreamView> {
        self.store
            .view_all()
            .await
            .map(|(v, _)| v)
            .unwrap_or_default()
    }

    /// stream name → live owner's worker id.
    pub async fn owners(&self) -> HashMap<String, String> {
        self.views()
            .await
            .into_iter()
            .filter(|v| v.record.key.namespace == self.namespace)
            .filter_map(|v| {
                v.live_owner()
                    .map(|o| (v.record.key.name.clone(), o.worker_id.clone()))
            })
            .collect()
    }

    /// Streams per live owner.
    pub async fn loads(&self) -> HashMap<String, usize> {
        let mut load = HashMap::new();
        for owner in self.owners().await.into_values() {
            *load.entry(owner).or_insert(0) += 1;
        }
        load
    }

    /// The item of `worker`'s LIVE incarnation, as stored (strongly
    /// consistent), to see what its renewals write.
    pub async fn worker_item(
        &self,
        worker: &str,
    ) -> Option<HashMap<String, aws_sdk_dynamodb::types::AttributeValue>> {
        let fleet = self.store.fleet().await.ok()?;
        let me = fleet.workers.iter().find(|w| {
            w.state == tether::lease::WorkerState::Live && w.incarnation.worker_id() == worker
        })?;
        crate::store::raw_client()
            .await
            .get_item()
            .table_name(self.store.table())
            .key(
                "Pk",
                aws_sdk_dynamodb::types::AttributeValue::S(me.incarnation.pk()),
            )
            .consistent_read(true)
            .send()
            .await
            .ok()?
            .item
    }

    /// Whether `worker`'s checkpoints go by slot: its item carries slotted
    /// entries and none by name.
    pub async fn packs_by_slot(&self, worker: &str) -> bool {
        self.worker_item(worker).await.is_some_and(|item| {
            item.contains_key("slotted_checkpoints") && !item.contains_key("checkpoints")
        })
    }

    /// Whether `worker`'s checkpoints go by name only, `n` of them.
    pub async fn packs_by_name(&self, worker: &str, n: usize) -> bool {
        self.worker_item(worker).await.is_some_and(|item| {
            !item.contains_key("slotted_checkpoints")
                && item
                    .get("checkpoints")
                    .and_then(|m| m.as_m().ok())
                    .is_some_and(|m| m.len() == n)
        })
    }

    /// Waits until every one of `names` delivers past where it is now.
    pub async fn until_data_flows_again(
        &self,
        names: &[String],
        limit: Duration,
    ) -> anyhow::Result<()> {
        let before = self.max_seqs(names);
        Self::wait(limit, "data flows again on every stream", || async {
            self.max_seqs(names).iter().all(|(n, s)| *s > before[n])
        })
        .await
    }

    /// The most messages any of `names` was delivered again (a takeover
    /// replays from the checkpoint it found).
    pub fn most_replayed(&self, names: &[String]) -> u64 {
        names
            .iter()
            .map(|n| self.log(n).duplicates())
            .max()
            .unwrap_or(0)
    }

    /// Streams whose live owner is `worker`.
    pub async fn owned_by(&self, worker: &str) -> usize {
        self.owners()
            .await
            .values()
            .filter(|o| *o == worker)
            .count()
    }

    /// Every stream has exactly one open upstream session.
    pub fn connected_once(&self, names: &[String]) -> bool {
        let open = self.upstream.open_sessions();
        names.iter().all(|n| open.get(n) == Some(&1))
    }

    /// Every stream has exactly one open session and a live owner.
    pub async fn all_connected_once(&self, names: &[String]) -> bool {
        let owners = self.owners().await;
        self.connected_once(names) && names.iter().all(|n| owners.contains_key(n))
    }

    /// Polls `check` until it holds or `limit` passes.
    pub async fn wait<F, Fut>(limit: Duration, what: &str, mut check: F) -> anyhow::Result<()>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + limit;
        while !check().await {
            if Instant::now() > deadline {
                anyhow::bail!("gave up after {limit:?} waiting until {what}");
            }
            tokio::time::sleep(POLL).await;
        }
        Ok(())
    }

    /// Sequence gaps across `names` (from the feed's first sequence number to
    /// the highest delivered).
    pub fn gaps(&self, names: &[String]) -> usize {
        names
            .iter()
            .map(|n| self.log(n).gaps(self.first_seq).len())
            .sum()
    }

    pub fn duplicates(&self, names: &[String]) -> u64 {
        names.iter().map(|n| self.log(n).duplicates()).sum()
    }

    pub fn stale(&self, names: &[String]) -> u64 {
        names.iter().map(|n| self.log(n).stale_messages).sum()
    }

    pub fn delivered(&self, names: &[String]) -> usize {
        names.iter().map(|n| self.log(n).seqs.len()).sum()
    }

    /// Highest sequence number delivered per stream.
    pub fn max_seqs(&self, names: &[String]) -> HashMap<String, Option<u64>> {
        names
            .iter()
            .map(|n| (n.clone(), self.log(n).max_seq()))
            .collect()
    }

    /// Overlapping sessions among `names`.
    pub fn overlaps(&self, names: &[String]) -> usize {
        self.upstream
            .overlaps()
            .iter()
            .filter(|(a, _)| names.contains(&a.stream))
            .count()
    }

    /// Per stream: seconds from `since` to the first message of a session
    /// opened after it.
    pub async fn new_session_latencies(
        &self,
        names: &[String],
        since: Instant,
        limit: Duration,
    ) -> anyhow::Result<Vec<f64>> {
        tether::cli::demo::new_session_latencies(&self.upstream, names, since, limit).await
    }

    /// Asserts the safety properties over `names`: no overlapping sessions, no
    /// sequence gaps, no stale deliveries; and that each reached `min_seq`.
    pub fn assert_safe(&self, names: &[String], min_seq: u64) {
        let overlaps = self.upstream.overlaps();
        let ours: Vec<_> = overlaps
            .iter()
            .filter(|(a, _)| names.contains(&a.stream))
            .collect();
        assert!(ours.is_empty(), "overlapping sessions: {ours:#?}");
        for n in names {
            let log = self.log(n);
            assert!(
                log.max_seq().unwrap_or(0) >= min_seq,
                "{n}: only reached seq {:?}",
                log.max_seq()
            );
            assert_eq!(
                log.gaps(self.first_seq),
                Vec::<u64>::new(),
                "{n}: sequence gaps at the sink"
            );
            assert_eq!(log.stale_messages, 0, "{n}: stale deliveries");
        }
    }
}

/// A table made by tether 0.1 (only the `by_state` index), and a client for it.
pub async fn legacy_store(legacy: &std::path::Path) -> anyhow::Result<LeaseStore> {
    let table = crate::store::unique_table("v1");
    let out = std::process::Command::new(legacy)
        .args(["--table", &table, "table", "create"])
        .env("AWS_ENDPOINT_URL_DYNAMODB", endpoint().0)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "x")
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "tether 0.1 table create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(LeaseStore::connect(
        crate::store::store_config(&table),
        std::sync::Arc::new(tether::metrics::StoreMetrics::new()),
    )
    .await?)
}

/// Resident set size of a process in KiB (Linux).
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// [`Bed::wait`] for tests: panics with `what` after `limit`.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    if let Err(e) = Bed::wait(limit, what, check).await {
        panic!("{e}");
    }
}

/// [`eventually`], adding what `explain` returns (a process's log) to the panic.
pub async fn eventually_or<F, Fut>(
    limit: Duration,
    what: &str,
    check: F,
    explain: impl Fn() -> String,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    if let Err(e) = Bed::wait(limit, what, check).await {
        panic!("{e}\n{}", explain());
    }
}
