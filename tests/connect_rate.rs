//! Connect pacing per upstream host: a worker taking over many streams at once
//! never connects faster than `--connect-rate` after its `--connect-burst`,
//! counted where it matters, at the upstream.

use std::time::Duration;
use tether_testkit::bed::{Bed, BedOptions, eventually};
use tether_testkit::processes::metric_value;

const EXE: &str = env!("CARGO_BIN_EXE_tether");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_of_many_streams_connects_within_the_rate_limit_of_the_upstream() {
    let bed = Bed::start(EXE, BedOptions::default()).await.unwrap();
    let names = bed.apply("paced", 30).await.unwrap();
    let (rate, burst) = (5.0, 5usize);
    let worker = bed
        .fleet
        .spawn_with(
            "paced",
            bed.fleet.endpoint(),
            &["--connect-rate", "5", "--connect-burst", "5"],
        )
        .unwrap();
    eventually(Duration::from_secs(30), "every stream is served", || {
        bed.all_connected_once(&names)
    })
    .await;
    // Every session the upstream accepted, in order.
    let mut opened: Vec<_> = bed
        .upstream
        .sessions()
        .iter()
        .filter(|s| names.contains(&s.stream))
        .map(|s| s.opened)
        .collect();
    opened.sort();
    assert_eq!(opened.len(), names.len(), "one connect per stream");
    // In every one-second window: at most the burst plus one second's rate
    // (the bucket's bound), measured at the upstream.
    let window = Duration::from_secs(1);
    let most = opened
        .iter()
        .map(|start| {
            opened
                .iter()
                .filter(|t| **t >= *start && **t < *start + window)
                .count()
        })
        .max()
        .unwrap();
    assert!(
        most <= burst + rate as usize,
        "{most} connects within one second (limit {rate}/s, burst {burst})"
    );
    // And it really paced: the 25 beyond the burst took about 25 / 5 s.
    let span = *opened.last().unwrap() - opened[0];
    assert!(
        span >= Duration::from_secs_f64((names.len() - burst) as f64 / rate - 0.5),
        "all connected within {span:?}"
    );
    let paced = metric_value(
        &worker.metrics().await.unwrap_or_default(),
        "tether_connects_paced_total",
    );
    assert!(paced.is_some_and(|p| p >= 20.0), "{paced:?}");
    eventually(
        Duration::from_secs(10),
        "every stream delivered",
        || async { names.iter().all(|n| bed.log(n).max_seq().is_some()) },
    )
    .await;
    bed.assert_safe(&names, 1);
}
