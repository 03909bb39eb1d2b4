//! A takeover in a large fleet: each survivor reads a turn of the dead
//! workers' partitions a pass, not every partition every pass, and every
//! stream is still found. Its own test binary: fourteen workers and two
//! fleets in turn load the store enough to slow the passes of any test
//! running beside them.

use std::sync::Arc;
use std::time::Duration;
use tether::metrics::StoreMetrics;
use tether_testkit::bed::Bed;
use tether_testkit::sim::{self, SimWorker};

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
    let store = sim::store_with_orphans("takeover", STREAMS).await;
    let mut fleet = Vec::new();
    for i in 0..FLEET {
        fleet.push(sim::worker_on(store.table(), &format!("w{i:02}"), ROOM, whole).await);
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
    let (departed_before, passes_before) = (
        queries(&fleet, "query_departed"),
        queries(&fleet, "query_fleet"),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    let passes = queries(&fleet, "query_fleet") - passes_before;
    assert!(passes >= 8, "{passes} passes");
    let per_pass = (queries(&fleet, "query_departed") - departed_before) as f64 / passes as f64;
    // Whatever partitions the turns skipped, a worker with room finds the rest.
    let (newcomer, _) = sim::worker_on(store.table(), "newcomer", STREAMS, whole).await;
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
    // Counted by the label the reads go by: none counted would pass below.
    assert!(
        in_turns > 0.0,
        "no read of the dead workers' partitions counted"
    );
    assert!(
        in_turns * 2.0 <= every_partition,
        "queries of the dead workers' partitions per pass: {in_turns:.1} in turns, {every_partition:.1} reading every partition every pass"
    );
}
