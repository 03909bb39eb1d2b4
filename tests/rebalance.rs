//! Load follows the fleet: fair-share rebalancing with real worker processes,
//! and the Prometheus endpoint an HPA reads.

mod support;

use support::eventually;

use nix::sys::signal::Signal;
use serde_json::json;
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;
use tether::crd::StreamConnectionSpec;
use tether::lease::{StreamKey, now_ms};
use tether::testkit::sink::RecordingSink;
use tether::testkit::upstream::TestUpstream;

fn loopback() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

async fn load(store: &tether::lease::LeaseStore) -> HashMap<String, usize> {
    let now = now_ms();
    let mut load = HashMap::new();
    for r in store.list().await.unwrap() {
        if let Some(owner) = r.live_owner(now) {
            *load.entry(owner.to_string()).or_insert(0) += 1;
        }
    }
    load
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_worker_gets_its_fair_share_and_a_leaving_one_s_streams_are_shared() {
    let store = support::fresh_store(None).await;
    let upstream = TestUpstream::start(loopback(), 10).await.unwrap();
    let sink = RecordingSink::start(loopback()).await.unwrap();
    let logs = tempfile::tempdir().unwrap();
    let fleet = support::fleet(&store, logs.path());
    let names: Vec<String> = (0..30).map(|i| format!("r{i:02}")).collect();
    for n in &names {
        let spec: StreamConnectionSpec = serde_json::from_value(json!({
            "url": upstream.url(n),
            "sequence": {"pointer": "/seq"},
            "sink": {"http": {"url": sink.url(), "lingerMs": 20}},
        }))
        .unwrap();
        store
            .upsert_desired(&spec.to_desired(StreamKey::new("rb", n.as_str()), 1))
            .await
            .unwrap();
    }
    let _a = fleet.spawn("a").unwrap();
    let _b = fleet.spawn("b").unwrap();
    let balanced = |expect: usize, workers: usize| {
        let store = store.clone();
        let upstream = &upstream;
        async move {
            let load = load(&store).await;
            let open = upstream.open_sessions();
            load.len() == workers
                && load.values().all(|n| n.abs_diff(expect) <= 1)
                && load.values().sum::<usize>() == 30
                && open.len() == 30
                && open.values().all(|n| *n == 1)
        }
    };
    eventually(
        Duration::from_secs(30),
        "two workers hold 15 ± 1 each",
        || balanced(15, 2),
    )
    .await;

    let mut c = fleet.spawn("c").unwrap();
    eventually(
        Duration::from_secs(30),
        "three workers hold 10 ± 1 each",
        || balanced(10, 3),
    )
    .await;
    // Stable: nothing keeps moving once balanced.
    let before = upstream.sessions().len();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(balanced(10, 3).await);
    assert!(
        upstream.sessions().len() - before <= 2,
        "a balanced fleet keeps churning"
    );
    let metrics = c.metrics().await.unwrap();
    assert!(metrics.contains("tether_live_workers 3"), "{metrics}");

    c.signal(Signal::SIGTERM).unwrap();
    assert!(c.wait(Duration::from_secs(10)).await.unwrap().success());
    eventually(
        Duration::from_secs(30),
        "the remaining two share the streams",
        || balanced(15, 2),
    )
    .await;

    tokio::time::sleep(Duration::from_secs(1)).await;
    let overlaps = upstream.overlaps();
    assert!(
        overlaps.is_empty(),
        "overlapping sessions during rebalancing: {overlaps:#?}"
    );
    for n in &names {
        let log = sink.log(&format!("rb/{n}"));
        assert!(log.max_seq() > 0, "{n} received nothing");
        assert_eq!(log.gaps(1), Vec::<u64>::new(), "{n}: gaps");
    }
    assert_eq!(sink.stale_messages(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_as_prometheus_text_with_the_documented_names_and_types() {
    let store = support::fresh_store(None).await;
    let upstream = TestUpstream::start(loopback(), 10).await.unwrap();
    let logs = tempfile::tempdir().unwrap();
    let fleet = support::fleet(&store, logs.path());
    let spec: StreamConnectionSpec =
        serde_json::from_value(json!({"url": upstream.url("m"), "sink": {"log": {}}})).unwrap();
    store
        .upsert_desired(&spec.to_desired(StreamKey::new("m", "m"), 1))
        .await
        .unwrap();
    let worker = fleet.spawn("m").unwrap();
    eventually(
        Duration::from_secs(20),
        "the stream is connected",
        || async { upstream.open_sessions().get("m") == Some(&1) },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let text = worker.metrics().await.unwrap();
    let scrape = prometheus_parse::Scrape::parse(text.lines().map(|l| Ok(l.to_string()))).unwrap();
    let kind = |name: &str| {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name)
            .map(|s| match &s.value {
                prometheus_parse::Value::Gauge(v) => format!("gauge {v}"),
                prometheus_parse::Value::Counter(v) => format!("counter {v}"),
                prometheus_parse::Value::Histogram(_) => "histogram".to_string(),
                other => format!("{other:?}"),
            })
            .unwrap_or_else(|| format!("missing {name}"))
    };
    assert_eq!(kind("tether_active_connections"), "gauge 1");
    assert_eq!(kind("tether_leases_held"), "gauge 1");
    assert!(
        kind("tether_lease_acquires_total").starts_with("counter"),
        "{}",
        kind("tether_lease_acquires_total")
    );
    assert!(kind("tether_lease_renewals_total").starts_with("counter"));
    assert!(kind("tether_messages_received_total").starts_with("counter"));
    assert!(kind("tether_messages_delivered_total").starts_with("counter"));
    assert!(kind("tether_sink_batches_total").starts_with("counter"));
    assert!(kind("tether_dynamodb_requests_total").starts_with("counter"));
    assert!(kind("tether_dynamodb_consumed_write_units_total").starts_with("counter"));
    assert_eq!(
        kind("tether_dynamodb_request_duration_seconds"),
        "histogram"
    );
    assert_eq!(kind("tether_sink_batch_duration_seconds"), "histogram");
    assert_eq!(kind("tether_build_info"), "gauge 1");
    // No per-stream labels anywhere.
    for s in &scrape.samples {
        for label in ["stream", "connection", "name", "namespace"] {
            assert!(
                s.labels.get(label).is_none(),
                "{} has a per-stream label {label}",
                s.metric
            );
        }
    }
    let (status, _) = worker.get("/healthz").await.unwrap();
    assert_eq!(status, 200);
    let (status, _) = worker.get("/readyz").await.unwrap();
    assert_eq!(status, 200);
}
