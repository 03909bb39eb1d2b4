//! How much of the orphans a pass reads: a bounded share from a random place
//! in each partition, never all of them, and still every orphan is taken.
//! (100,000 new streams on 20 workers took minutes to acquire while every
//! pass read every orphan.)

use std::sync::Arc;
use std::time::Duration;
use tether::lease::{HOLDER_SHARDS, LeaseStore};
use tether::metrics::StoreMetrics;
use tether_testkit::bed::Bed;
use tether_testkit::sim;
use tether_testkit::store::store_config;

const STREAMS: usize = 4_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_reads_a_bounded_share_of_thousands_of_orphans_and_every_one_is_still_taken() {
    let store = sim::store_with_orphans("orphans", STREAMS).await;

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
    let (small, metrics) = sim::worker_on(store.table(), "small", 10, false).await;
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
    let (big, _) = sim::worker_on(store.table(), "big", STREAMS, false).await;
    Bed::wait(Duration::from_secs(90), "every stream is held", || async {
        small.held() + big.held() == STREAMS as i64
    })
    .await
    .unwrap();
    small.task.abort();
    big.task.abort();
}
