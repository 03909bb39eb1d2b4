//! A short, seeded chaos soak as part of the suite, with streams on the HTTP,
//! Kinesis and NATS sinks. It asserts only the safety
//! properties (no overlapping sessions, no sequence gaps, no stale
//! deliveries) and that the fleet settles; timings belong to the benchmark
//! (`scripts/bench chaos`).

use std::time::Duration;
use tether_testkit::bed::{Bed, BedOptions};
use tether_testkit::chaos::{ChaosConfig, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_chaos_keeps_every_safety_property() {
    // A zero-based feed: sequence 0 must arrive like every other.
    let bed = Bed::start(
        env!("CARGO_BIN_EXE_tether"),
        BedOptions {
            rate: 20,
            first_seq: 0,
            namespace: "chaos".into(),
            ..BedOptions::default()
        },
    )
    .await
    .unwrap();
    let seed = std::env::var("TETHER_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(33);
    let cfg = ChaosConfig {
        seed,
        duration: Duration::from_secs(40),
        streams: 12,
        workers: 4,
        // Longer than the feed's 3-4 s timeout for silent (paused) clients.
        lease: Duration::from_secs(6),
        heartbeat: Duration::from_millis(1500),
        reconcile: Duration::from_millis(300),
        real_sinks: true,
    };
    let report = run(&bed, &cfg).await.unwrap();
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    assert!(
        report.events.values().sum::<u32>() >= 8,
        "the run injected too few faults: {report:?}"
    );
    assert_eq!(report.overlapping_sessions, 0, "{report:?}");
    assert_eq!(report.sequence_gaps, 0, "{report:?}");
    assert_eq!(report.stale_deliveries, 0, "{report:?}");
    assert!(report.delivered > 1000, "{report:?}");
    assert!(report.real_sink_problems.is_empty(), "{report:#?}");
    assert!(
        report.kinesis_delivered > 100 && report.nats_delivered > 100,
        "{report:?}"
    );
}
