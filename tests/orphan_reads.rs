//! How much of the orphans a pass reads: a bounded share from a random place
//! in each partition, never all of them, and still every orphan is taken.
//! (100,000 new streams on 20 workers took minutes to acquire while every
//! pass read every orphan.)

use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tether::lease::{HOLDER_SHARDS, LeaseStore, StreamKey};
use tether::metrics::StoreMetrics;
use tether_testkit::bed::Bed;
use tether_testkit::fixtures::log_spec;
use tether_testkit::sim::{self, SimWorker};
use tether_testkit::store::{fresh_store, store_config};

const STREAMS: usize = 4_000;

async fn worker(table: &str, id: &str, max_connections: usize) -> (SimWorker, Arc<StoreMetrics>) {
    worker_reading(table, id, max_connections, false).await
}

/// A simulated worker; `whole`: it reads every orphan partition whole, every
/// pass, as 0.4 did.
async fn worker_reading(
    table: &str,
    id: &str,
    max_connections: usize,
    whole: bool,
) -> (SimWorker, Arc<StoreMetrics>) {
    let metrics = Arc::new(StoreMetrics::new());
    let store = LeaseStore::connect(store_config(table), metrics.clone())
        .await
        .unwrap();
    let mut settings = sim::settings(
        id,
        Duration::from_secs(4),
        Duration::from_millis(1500),
        Duration::from_millis(250),
        max_connections,
    );
    settings.read_orphans_whole = whole;
    (SimWorker::start(settings, store).unwrap(), metrics)
}

/// Loads `n` streams of namespace `ns` into a fresh table.
async fn loaded_store(ns: &str, n: usize) -> tether::lease::LeaseStore {
    let store = fresh_store(None).await;
    let spec = log_spec("ws://127.0.0.1:9/never-dialled");
    let loaded: Vec<_> = futures::stream::iter((0..n).map(|i| {
        let desired = spec.to_desired(StreamKey::new(ns, format!("s{i:05}")), 1, None);
        let store = store.clone();
        async move { store.upsert_desired(&desired).await }
    }))
    .buffer_unordered(32)
    .collect()
    .await;
    assert!(loaded.iter().all(Result::is_ok));
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_reads_a_bounded_share_of_thousands_of_orphans_and_every_one_is_still_taken() {
    let store = loaded_store("orphans", STREAMS).await;

    // What reading every orphan costs: each unowned partition whole.
    let whole = Arc::new(StoreMetrics::new());
    let reader = LeaseStore::connect(store_config(store.table()), whole.clone())
        .await
        .unwrap();
    for shard in 0..HOLDER_SHARDS {
        reader.unowned(shard).await.unwrap();
    }
    let whole_per_read =
        whole.read_units("query_unowned") / whole.succeeded("query_unowned") as f64;

    // A worker with room for 10 streams keeps seeing orphans, pass after pass.
    let (small, metrics) = worker(store.table(), "small", 10).await;
    Bed::wait(
        Duration::from_secs(20),
        "the small worker is full",
        || async { small.held() == 10 },
    )
    .await
    .unwrap();
    let (units, reads) = (
        metrics.read_units("query_unowned"),
        metrics.succeeded("query_unowned"),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let reads = metrics.succeeded("query_unowned") - reads;
    let per_read = (metrics.read_units("query_unowned") - units) / reads as f64;
    assert!(
        reads >= u64::from(HOLDER_SHARDS) * 4,
        "the worker stopped looking at the orphans: {reads} reads in 3 s"
    );
    assert!(
        per_read * 4.0 <= whole_per_read,
        "a pass read {per_read:.2} read units per partition; the whole partition is {whole_per_read:.2}"
    );

    // Bounded reads still reach every orphan.
    let (big, _) = worker(store.table(), "big", STREAMS).await;
    Bed::wait(Duration::from_secs(90), "every stream is held", || async {
        small.held() + big.held() == STREAMS as i64
    })
    .await
    .unwrap();
    small.task.abort();
    big.task.abort();
}

/// Queries of the dead workers' partitions per survivor's pass, while a
/// fleet of fourteen at its connection limit has two workers' streams it cannot
/// all take (so they stay orphans and every pass looks at them); then a
/// newcomer with room takes every one that is left. `whole`: every worker
/// reads every partition every pass, as 0.4 did.
async fn reads_of_a_dead_workers_partitions(whole: bool) -> f64 {
    const FLEET: usize = 14;
    const CRASHED: usize = 2;
    const STREAMS: usize = 800;
    const ROOM: usize = 58; // 12 survivors hold 696 of 800
    let store = loaded_store("takeover", STREAMS).await;
    let mut fleet = Vec::new();
    for i in 0..FLEET {
        fleet.push(worker_reading(store.table(), &format!("w{i:02}"), ROOM, whole).await);
    }
    let held = |fleet: &[(SimWorker, Arc<StoreMetrics>)]| -> i64 {
        fleet.iter().map(|(w, _)| w.held()).sum()
    };
    Bed::wait(Duration::from_secs(60), "every stream is held", || async {
        held(&fleet) == STREAMS as i64
    })
    .await
    .unwrap();
    // The crash: the first two vanish without releasing anything.
    for (w, _) in fleet.drain(..CRASHED) {
        w.task.abort();
    }
    Bed::wait(
        Duration::from_secs(60),
        "the survivors are at their limit",
        || async { held(&fleet) == ((FLEET - CRASHED) * ROOM) as i64 },
    )
    .await
    .unwrap();
    // Per pass: every pass that sees orphans queries the fleet once.
    let queries = |fleet: &[(SimWorker, Arc<StoreMetrics>)], operation| -> u64 {
        fleet.iter().map(|(_, m)| m.succeeded(operation)).sum()
    };
    let (held_before, passes_before) = (
        queries(&fleet, "query_held"),
        queries(&fleet, "query_fleet"),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let passes = queries(&fleet, "query_fleet") - passes_before;
    assert!(passes >= 8, "{passes} passes");
    let per_pass = (queries(&fleet, "query_held") - held_before) as f64 / passes as f64;
    // Whatever partitions the turns skipped, a worker with room finds the rest.
    let (newcomer, _) = worker_reading(store.table(), "newcomer", STREAMS, whole).await;
    Bed::wait(
        Duration::from_secs(60),
        "the orphans left are held by the newcomer",
        || async { held(&fleet) + newcomer.held() == STREAMS as i64 },
    )
    .await
    .unwrap();
    newcomer.task.abort();
    for (w, _) in fleet {
        w.task.abort();
    }
    per_pass
}

/// Fourteen workers, two crash: each survivor reads a turn of a few of the dead
/// workers' partitions a pass (about four readers per partition; see
/// `worker/acquirer/rotation.rs`), not every partition every pass, and
/// every stream is still found. Both designs in the same run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_fleet_reads_a_dead_workers_partitions_in_turns_and_finds_every_stream() {
    let every_partition = reads_of_a_dead_workers_partitions(true).await;
    let in_turns = reads_of_a_dead_workers_partitions(false).await;
    assert!(
        in_turns * 2.0 <= every_partition,
        "queries of the dead workers' partitions per pass: {in_turns:.1} in turns, {every_partition:.1} reading every partition every pass"
    );
}
