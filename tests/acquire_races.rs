//! Workers starting together on thousands of orphans: each acquire is a
//! conditional write, and one that finds the stream taken is refused but
//! still billed and still a request. Workers that read the same stretch of a
//! partition used to try the same streams one after another (in a 10,000-stream
//! simulation, six races lost for every ten won; here, more lost than won); a
//! pass that keeps losing races in a partition now leaves the rest of it to
//! the partition's next read (`Contested` in `worker/acquirer/pass.rs`).
//! Its own test binary: eight workers load the store.

use std::time::Duration;
use tether_testkit::bed::Bed;
use tether_testkit::sim::{self, SimWorker};

const STREAMS: usize = 3_000;
const WORKERS: usize = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_that_lose_a_race_in_a_partition_leave_the_rest_of_it_for_the_pass() {
    let store = sim::store_with_orphans("races", STREAMS).await;
    let mut fleet = Vec::new();
    for i in 0..WORKERS {
        fleet.push(
            sim::worker_on(store.table(), &format!("w{i}"), STREAMS, false)
                .await
                .0,
        );
    }
    let held = |fleet: &[SimWorker]| -> i64 { fleet.iter().map(SimWorker::held).sum() };
    Bed::wait(Duration::from_secs(90), "every stream is held", || async {
        held(&fleet) == STREAMS as i64
    })
    .await
    .unwrap();
    let (won, lost) = sim::races(&fleet);
    eprintln!("{won} acquires won, {lost} lost their race");
    assert!(won >= STREAMS as u64, "{won} won");
    assert!(
        lost * 2 <= won,
        "{lost} acquires lost their race for {won} won: workers kept trying streams another worker was taking"
    );
    for w in fleet {
        w.task.abort();
    }
}
