//! A short, seeded chaos soak as part of the suite. It asserts only the safety
//! properties (no overlapping sessions, no sequence gaps, no stale deliveries);
//! timings belong to the benchmark (`scripts/bench chaos`).

use std::time::Duration;
use tether::testkit::bed::Bed;
use tether::testkit::chaos::{ChaosConfig, run};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_chaos_keeps_every_safety_property() {
    tether::install_crypto_provider();
    let logs = tempfile::tempdir().unwrap();
    let bed = Bed::start(
        env!("CARGO_BIN_EXE_tether").into(),
        logs.path().to_path_buf(),
        20,
    )
    .await
    .unwrap();
    let seed = std::env::var("TETHER_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let cfg = ChaosConfig {
        seed,
        duration: Duration::from_secs(30),
        streams: 12,
        workers: 4,
        // Longer than the upstream's 3-4 s timeout for silent (paused) clients.
        lease: Duration::from_secs(6),
        heartbeat: Duration::from_secs(1),
        reconcile: Duration::from_millis(300),
    };
    let report = run(&bed, &cfg).await.unwrap();
    println!("{}", serde_json::to_string_pretty(&report).unwrap());
    assert!(
        report.events.values().sum::<u32>() >= 5,
        "the run injected too few faults: {report:?}"
    );
    assert_eq!(report.overlapping_sessions, 0, "{report:?}");
    assert_eq!(report.sequence_gaps, 0, "{report:?}");
    assert_eq!(report.stale_deliveries, 0, "{report:?}");
    assert!(report.delivered > 1000, "{report:?}");
}
