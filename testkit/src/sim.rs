//! In-process workers that hold leases and no sessions: for the scale
//! simulation (one 2-core machine cannot hold 100,000 sockets) and for tests
//! of the acquisition path alone.

use std::sync::Arc;
use std::time::Duration;
use tether::egress::{HostPolicy, KinesisStreams};
use tether::lease::LeaseStore;
use tether::metrics::WorkerMetrics;
use tether::probes::Health;
use tether::secrets::SecretSource;
use tether::worker::{
    SessionConfig, SessionControl, SessionDeps, SessionEnd, Sessions, StreamProgress, WorkerCtx,
    WorkerSettings,
};
use tokio::task::JoinHandle;

/// A session that holds nothing: it ends when stopped, aborted or fenced.
pub struct NoopSessions;

impl Sessions for NoopSessions {
    fn start(
        &self,
        _cfg: SessionConfig,
        _progress: Arc<StreamProgress>,
        deps: Arc<SessionDeps>,
        ctl: SessionControl,
    ) -> JoinHandle<SessionEnd> {
        tokio::spawn(async move {
            tokio::select! {
                _ = ctl.stop.cancelled() => SessionEnd::Stopped,
                _ = ctl.abort.cancelled() => SessionEnd::Aborted,
                _ = deps.fence.closed() => SessionEnd::Fenced,
            }
        })
    }
}

/// Settings of a simulated worker: rebalancing on, no connect pacing
/// (nothing connects).
pub fn settings(
    worker_id: &str,
    lease: Duration,
    heartbeat: Duration,
    reconcile: Duration,
    max_connections: usize,
) -> WorkerSettings {
    WorkerSettings {
        worker_id: worker_id.to_string(),
        lease_duration: lease,
        heartbeat_interval: heartbeat,
        reconcile_interval: reconcile,
        fence_window: lease - Duration::from_secs(1),
        max_clock_skew: Duration::from_secs(2),
        max_connections,
        drain_timeout: Duration::from_secs(10),
        rebalance: true,
        ca_file: None,
        connect_rate: 0.0,
        connect_burst: 1,
        kinesis_streams: KinesisStreams::new(["*"]),
        read_orphans_whole: false,
        poke_addr: None,
    }
}

/// A running simulated worker.
pub struct SimWorker {
    pub metrics: Arc<WorkerMetrics>,
    pub task: JoinHandle<()>,
}

impl SimWorker {
    /// Starts a worker on `store` whose sessions are no-ops.
    pub fn start(settings: WorkerSettings, store: LeaseStore) -> anyhow::Result<Self> {
        let metrics = Arc::new(WorkerMetrics::default());
        let health = Arc::new(Health::new(
            store.reachability(),
            store.clock(),
            settings.max_clock_skew,
        ));
        let ctx = WorkerCtx::new(
            settings,
            store,
            metrics.clone(),
            HostPolicy::new(["*"]),
            HostPolicy::new(["*"]),
            SecretSource::Standalone,
            None,
        )?
        .with_sessions(Arc::new(NoopSessions));
        let task = tokio::spawn(async move {
            if let Err(e) = tether::worker::run(Arc::new(ctx), health, std::future::pending()).await
            {
                eprintln!("simulated worker stopped: {e}");
            }
        });
        Ok(Self { metrics, task })
    }

    /// Streams it holds.
    pub fn held(&self) -> i64 {
        self.metrics.active_connections.get()
    }
}

/// Acquires the workers won and lost to another worker that took the
/// stream first (`taken`: each a refused conditional write, billed as a
/// write unit). Won counts every way an acquire comes to be served:
/// answered (`acquired`), or landed with its answer lost and found later by
/// the pass (`resolved`) or by the audit (`adopted`); each is one write that
/// took the stream.
pub fn races(workers: &[SimWorker]) -> (u64, u64) {
    let count = |result: &'static str| -> u64 {
        workers
            .iter()
            .map(|w| {
                w.metrics
                    .acquires
                    .get_or_create(&[("result", result)])
                    .get()
            })
            .sum()
    };
    (
        count("acquired") + count("resolved") + count("adopted"),
        count("taken"),
    )
}

/// A simulated worker on `table` with short timings (lease 4 s, heartbeat
/// 1.5 s, passes every 250 ms), room for `max_connections`, and the metrics
/// of its own store client (what it read and wrote); `whole`: it reads
/// every orphan partition whole, every pass, as 0.4 did.
pub async fn worker_on(
    table: &str,
    id: &str,
    max_connections: usize,
    whole: bool,
) -> (SimWorker, Arc<tether::metrics::StoreMetrics>) {
    let metrics = Arc::new(tether::metrics::StoreMetrics::new());
    let store = LeaseStore::connect(crate::store::store_config(table), metrics.clone())
        .await
        .expect("store client");
    let mut settings = settings(
        id,
        Duration::from_secs(4),
        Duration::from_millis(1500),
        Duration::from_millis(250),
        max_connections,
    );
    settings.read_orphans_whole = whole;
    (
        SimWorker::start(settings, store).expect("simulated worker"),
        metrics,
    )
}

/// A fresh table holding `n` STARTED streams of namespace `ns` that nobody
/// owns yet.
pub async fn store_with_orphans(ns: &str, n: usize) -> LeaseStore {
    use futures::StreamExt;
    let store = crate::store::fresh_store(None).await;
    let spec = crate::fixtures::log_spec("ws://127.0.0.1:9/never-dialled");
    let loaded: Vec<_> = futures::stream::iter((0..n).map(|i| {
        let desired = spec.to_desired(
            tether::lease::StreamKey::new(ns, format!("s{i:05}")),
            1,
            None,
        );
        let store = store.clone();
        async move { store.upsert_desired(&desired).await }
    }))
    .buffer_unordered(32)
    .collect()
    .await;
    assert!(loaded.iter().all(Result::is_ok), "loading {n} streams");
    store
}
