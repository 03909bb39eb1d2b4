//! A dead worker's last streams go to their heirs first: the survivors that
//! read the same few orphans do not all try every one of them.

use std::time::Duration;
use tether_testkit::bed::Bed;
use tether_testkit::sim::{self, SimWorker};
use tether_testkit::store::store_config;

/// Acquires lost to another worker, fleet-wide.
fn lost_races(fleet: &[SimWorker]) -> u64 {
    fleet
        .iter()
        .map(|w| {
            w.metrics
                .acquires
                .get_or_create(&[("result", "taken")])
                .get()
        })
        .sum()
}

fn held(fleet: &[SimWorker]) -> i64 {
    fleet.iter().map(SimWorker::held).sum()
}

/// Five workers without rebalancing (so nothing moves but the takeover);
/// the one holding the most crashes. Its streams are fewer than the four
/// survivors may take from its partitions in a pass, and each survivor reads
/// every partition every pass (a fleet of four does): before heirs, each
/// tried every stream and three of four writes were refused. Now each
/// stream is tried by its heir first, so few races are lost (the heir may
/// see the death up to a pass after the others, who then wait for it), and
/// every stream is owned again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_workers_last_streams_are_tried_by_their_heirs_first() {
    const STREAMS: usize = 60;
    let store = sim::store_with_orphans("heirs", STREAMS).await;
    let mut fleet = Vec::new();
    for i in 0..5 {
        let mut settings = sim::settings(
            &format!("w{i}"),
            Duration::from_secs(4),
            Duration::from_millis(1500),
            Duration::from_millis(250),
            STREAMS,
        );
        settings.rebalance = false;
        let client = tether::lease::LeaseStore::connect(
            store_config(store.table()),
            std::sync::Arc::new(tether::metrics::StoreMetrics::new()),
        )
        .await
        .expect("store client");
        fleet.push(SimWorker::start(settings, client).expect("simulated worker"));
    }
    Bed::wait(Duration::from_secs(60), "every stream is held", || async {
        held(&fleet) == STREAMS as i64
    })
    .await
    .unwrap();
    let busiest = (0..fleet.len()).max_by_key(|&i| fleet[i].held()).unwrap();
    let crashed = fleet.remove(busiest);
    let orphaned = crashed.held();
    assert!(orphaned >= 12, "the busiest of five holds {orphaned}");
    let lost_before = lost_races(&fleet);
    crashed.task.abort();
    Bed::wait(
        Duration::from_secs(60),
        "every stream is held again",
        || async { held(&fleet) == STREAMS as i64 },
    )
    .await
    .unwrap();
    let lost = lost_races(&fleet) - lost_before;
    assert!(
        lost * 4 <= orphaned as u64,
        "{lost} acquires lost to another worker while taking {orphaned} streams"
    );
    for w in fleet {
        w.task.abort();
    }
}
