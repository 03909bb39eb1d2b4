//! The worker fleet end to end: real `tether worker` processes, a real
//! DynamoDB-compatible store, a replaying WebSocket upstream, an HTTP sink, and
//! real failures (SIGKILL, SIGTERM, SIGSTOP, a cut to DynamoDB, a sink outage).

mod support;

use support::eventually;

use nix::sys::signal::Signal;
use serde_json::json;
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;
use tether::crd::{LimitsSpec, StreamConnectionSpec};
use tether::lease::{DesiredState, LeaseStore, StreamKey, UpsertOutcome, now_ms};
use tether::testkit::fleet::{WorkerProcess, metric_value};
use tether::testkit::proxy::{FaultProxy, ProxyMode};
use tether::testkit::sink::RecordingSink;
use tether::testkit::upstream::{Behavior, TestUpstream};

const NS: &str = "fleet";

fn loopback() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

struct Bed {
    store: LeaseStore,
    upstream: TestUpstream,
    sink: RecordingSink,
    fleet: tether::testkit::fleet::FleetConfig,
    _logs: tempfile::TempDir,
}

fn spec(url: String, sink_url: &str) -> StreamConnectionSpec {
    serde_json::from_value(json!({
        "url": url,
        "sequence": {"pointer": "/seq"},
        "keepalive": {"intervalSeconds": 1, "timeoutSeconds": 2},
        "sink": {"http": {"url": sink_url, "maxBatchMessages": 20, "lingerMs": 20, "timeoutSeconds": 2}},
    }))
    .unwrap()
}

async fn bed() -> Bed {
    let store = support::fresh_store(None).await;
    let upstream = TestUpstream::start(loopback(), 20).await.unwrap();
    let sink = RecordingSink::start(loopback()).await.unwrap();
    let logs = tempfile::tempdir().unwrap();
    let fleet = support::fleet(&store, logs.path());
    Bed {
        store,
        upstream,
        sink,
        fleet,
        _logs: logs,
    }
}

impl Bed {
    async fn apply(&self, name: &str, spec: &StreamConnectionSpec, generation: i64) {
        let desired = spec.to_desired(StreamKey::new(NS, name), generation);
        assert_eq!(
            self.store.upsert_desired(&desired).await.unwrap(),
            UpsertOutcome::Applied
        );
    }

    async fn apply_streams(&self, n: usize) -> Vec<String> {
        let mut names = Vec::new();
        for i in 0..n {
            let name = format!("s{i:02}");
            self.apply(&name, &spec(self.upstream.url(&name), &self.sink.url()), 1)
                .await;
            names.push(name);
        }
        names
    }

    /// stream name → live owner, from the table.
    async fn owners(&self) -> HashMap<String, String> {
        let now = now_ms();
        self.store
            .list()
            .await
            .unwrap()
            .into_iter()
            .filter_map(|r| {
                r.live_owner(now)
                    .map(|o| (r.key.name.clone(), o.to_string()))
            })
            .collect()
    }

    /// Every stream has exactly one open upstream session and a live owner.
    async fn all_connected_once(&self, names: &[String]) -> bool {
        let open = self.upstream.open_sessions();
        let owners = self.owners().await;
        names
            .iter()
            .all(|n| open.get(n) == Some(&1) && owners.contains_key(n))
    }

    fn assert_no_overlap(&self) {
        let overlaps = self.upstream.overlaps();
        assert!(overlaps.is_empty(), "overlapping sessions: {overlaps:#?}");
    }

    /// Every stream's sink log is gap-free from 1 and has reached `min_seq`.
    fn assert_no_gaps(&self, names: &[String], min_seq: u64) {
        for n in names {
            let log = self.sink.log(&format!("{NS}/{n}"));
            assert!(
                log.max_seq() >= min_seq,
                "{n}: only reached seq {}",
                log.max_seq()
            );
            assert_eq!(
                log.gaps(1),
                Vec::<u64>::new(),
                "{n}: sequence gaps at the sink"
            );
        }
    }

    fn max_seqs(&self, names: &[String]) -> HashMap<String, u64> {
        names
            .iter()
            .map(|n| (n.clone(), self.sink.log(&format!("{NS}/{n}")).max_seq()))
            .collect()
    }
}

fn count_owned(owners: &HashMap<String, String>, worker: &str) -> usize {
    owners.values().filter(|o| o.as_str() == worker).count()
}

/// Waits until `victim` (started alone, with `--no-rebalance` so it keeps what it
/// has) owns every stream, then starts the others: the failure under test hits
/// a worker that holds everything.
async fn fleet_with_loaded_victim(
    bed: &Bed,
    names: &[String],
    victim: WorkerProcess,
    others: &[&str],
) -> (WorkerProcess, Vec<WorkerProcess>) {
    eventually(
        Duration::from_secs(20),
        "the first worker owns every stream",
        || async {
            bed.all_connected_once(names).await
                && count_owned(&bed.owners().await, &victim.id) == names.len()
        },
    )
    .await;
    let rest = others
        .iter()
        .map(|id| bed.fleet.spawn(id).unwrap())
        .collect();
    (victim, rest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_stream_is_connected_exactly_once_across_three_workers() {
    let bed = bed().await;
    let names = bed.apply_streams(12).await;
    let _workers: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|id| bed.fleet.spawn(id).unwrap())
        .collect();
    eventually(
        Duration::from_secs(20),
        "all 12 streams are connected once",
        || bed.all_connected_once(&names),
    )
    .await;
    // Stay a while: still exactly once, and data flowing without gaps.
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Still exactly once (rebalancing may be finishing a handoff: wait for it).
    eventually(
        Duration::from_secs(10),
        "all 12 streams are connected once",
        || bed.all_connected_once(&names),
    )
    .await;
    bed.assert_no_overlap();
    bed.assert_no_gaps(&names, 10);
    assert_eq!(bed.sink.stale_messages(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_moves_every_stream_elsewhere_without_overlap_or_gaps() {
    let bed = bed().await;
    let names = bed.apply_streams(8).await;
    let victim = bed
        .fleet
        .spawn_with("victim", &bed.fleet.endpoint, &["--no-rebalance"])
        .unwrap();
    let (victim, _others) = fleet_with_loaded_victim(&bed, &names, victim, &["b", "c"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    victim.signal(Signal::SIGKILL).unwrap();
    eventually(
        Duration::from_secs(20),
        "every stream reconnects on a survivor",
        || async {
            let owners = bed.owners().await;
            bed.all_connected_once(&names).await && count_owned(&owners, "victim") == 0
        },
    )
    .await;
    let before = bed.max_seqs(&names);
    eventually(
        Duration::from_secs(10),
        "data flows again on every stream",
        || async { bed.max_seqs(&names).iter().all(|(n, s)| *s > before[n]) },
    )
    .await;
    bed.assert_no_overlap();
    bed.assert_no_gaps(&names, 5);
    assert_eq!(bed.sink.stale_messages(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_streams_over_well_before_the_lease_would_lapse() {
    let mut bed = bed().await;
    // A long lease: if handoff waited for expiry it would take 30 s.
    bed.fleet.lease_duration = Duration::from_secs(30);
    bed.fleet.heartbeat_interval = Duration::from_secs(2);
    let names = bed.apply_streams(8).await;
    let victim = bed
        .fleet
        .spawn_with("victim", &bed.fleet.endpoint, &["--no-rebalance"])
        .unwrap();
    let (mut victim, _others) = fleet_with_loaded_victim(&bed, &names, victim, &["b", "c"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = tokio::time::Instant::now();
    victim.signal(Signal::SIGTERM).unwrap();
    let status = victim.wait(Duration::from_secs(10)).await.unwrap();
    assert!(
        status.success(),
        "graceful shutdown exits 0: {status:?}\n{}",
        victim.log()
    );
    eventually(
        Duration::from_secs(10),
        "survivors hold every stream",
        || async {
            bed.all_connected_once(&names).await && count_owned(&bed.owners().await, "victim") == 0
        },
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "handoff took {:?}",
        started.elapsed()
    );
    // The released items kept their checkpoints.
    for r in bed.store.list().await.unwrap() {
        assert!(r.last_seq.unwrap_or(0) > 0, "{} lost its checkpoint", r.key);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    bed.assert_no_overlap();
    bed.assert_no_gaps(&names, 5);
    assert_eq!(bed.sink.stale_messages(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cut_off_from_dynamodb_closes_its_sessions_before_others_take_them() {
    let bed = bed().await;
    let names = bed.apply_streams(6).await;
    let store_addr: SocketAddr = support::endpoint()
        .0
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    let proxy = FaultProxy::start(loopback(), store_addr).await.unwrap();
    let victim = bed
        .fleet
        .spawn_with("victim", &proxy.endpoint(), &["--no-rebalance"])
        .unwrap();
    let (victim, _others) = fleet_with_loaded_victim(&bed, &names, victim, &["b", "c"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.set_mode(ProxyMode::Blackhole);
    eventually(
        Duration::from_secs(20),
        "survivors hold every stream",
        || async {
            bed.all_connected_once(&names).await && count_owned(&bed.owners().await, "victim") == 0
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    bed.assert_no_overlap();
    assert_eq!(bed.sink.stale_messages(), 0, "no stale deliveries");
    bed.assert_no_gaps(&names, 5);
    let metrics = victim.metrics().await.unwrap();
    assert_eq!(
        metric_value(&metrics, "tether_active_connections"),
        Some(0.0)
    );
    assert!(
        metric_value(&metrics, "tether_self_fences_total").unwrap_or(0.0) >= names.len() as f64
    );
    eventually(
        Duration::from_secs(5),
        "the cut-off worker reports not ready",
        || async { victim.get("/readyz").await.map(|(status, _)| status) == Ok(503) },
    )
    .await;
    // Reconnected, it must not disturb the new owners.
    proxy.set_mode(ProxyMode::Pass);
    tokio::time::sleep(Duration::from_secs(2)).await;
    eventually(
        Duration::from_secs(10),
        "every stream is connected once",
        || bed.all_connected_once(&names),
    )
    .await;
    bed.assert_no_overlap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_worker_wakes_up_fenced_and_delivers_nothing_stale() {
    let mut bed = bed().await;
    // The upstream drops silent clients after ~3-4 s; a 6 s lease lets it do
    // so before anyone else may connect (as a real deployment should).
    bed.fleet.lease_duration = Duration::from_secs(6);
    bed.fleet.heartbeat_interval = Duration::from_secs(1);
    let names = bed.apply_streams(6).await;
    let victim = bed
        .fleet
        .spawn_with("victim", &bed.fleet.endpoint, &["--no-rebalance"])
        .unwrap();
    let (victim, _others) = fleet_with_loaded_victim(&bed, &names, victim, &["b", "c"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    victim.signal(Signal::SIGSTOP).unwrap();
    eventually(
        Duration::from_secs(25),
        "survivors hold every stream",
        || async {
            bed.all_connected_once(&names).await && count_owned(&bed.owners().await, "victim") == 0
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    victim.signal(Signal::SIGCONT).unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    // It fenced every lease it had on waking; whatever it holds now (rebalancing
    // may hand it streams again) is a lease it really owns in the table.
    let metrics = victim.metrics().await.unwrap();
    assert!(
        metric_value(&metrics, "tether_self_fences_total").unwrap_or(0.0) >= names.len() as f64,
        "{metrics}"
    );
    eventually(
        Duration::from_secs(5),
        "the victim's sessions match the leases it holds",
        || async {
            let metrics = victim.metrics().await.unwrap_or_default();
            let owned_now = count_owned(&bed.owners().await, "victim") as f64;
            metric_value(&metrics, "tether_active_connections") == Some(owned_now)
                && metric_value(&metrics, "tether_leases_held") == Some(owned_now)
        },
    )
    .await;
    // Rebalancing may be handing streams back to the woken worker: give a
    // handoff in flight time to finish.
    eventually(
        Duration::from_secs(10),
        "every stream is connected once",
        || bed.all_connected_once(&names),
    )
    .await;
    assert_eq!(
        bed.sink.stale_messages(),
        0,
        "no delivery after the takeover"
    );
    bed.assert_no_overlap();
    bed.assert_no_gaps(&names, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_outage_loses_nothing_and_other_streams_keep_flowing() {
    let bed = bed().await;
    let healthy_sink = RecordingSink::start(loopback()).await.unwrap();
    let failing = ["f0", "f1", "f2"].map(String::from).to_vec();
    let healthy = ["h0", "h1", "h2"].map(String::from).to_vec();
    for n in &failing {
        bed.apply(n, &spec(bed.upstream.url(n), &bed.sink.url()), 1)
            .await;
    }
    for n in &healthy {
        bed.apply(n, &spec(bed.upstream.url(n), &healthy_sink.url()), 1)
            .await;
    }
    let all: Vec<String> = failing.iter().chain(&healthy).cloned().collect();
    let _worker = bed.fleet.spawn("w").unwrap();
    eventually(Duration::from_secs(20), "all connected", || {
        bed.all_connected_once(&all)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    bed.sink.set_failing(true);
    let frozen = bed.max_seqs(&failing);
    let healthy_before: Vec<u64> = healthy
        .iter()
        .map(|n| healthy_sink.log(&format!("{NS}/{n}")).max_seq())
        .collect();
    tokio::time::sleep(Duration::from_secs(4)).await;
    for (n, before) in healthy.iter().zip(&healthy_before) {
        assert!(
            healthy_sink.log(&format!("{NS}/{n}")).max_seq() > before + 20,
            "{n} stalled during another sink's outage"
        );
    }
    // The checkpoint never passes what the failing sink acknowledged.
    for n in &failing {
        let record = bed
            .store
            .get(&StreamKey::new(NS, n.as_str()))
            .await
            .unwrap()
            .unwrap();
        assert!(
            record.last_seq.unwrap_or(0) <= frozen[n],
            "{n}: checkpoint {:?} > acknowledged {}",
            record.last_seq,
            frozen[n]
        );
    }
    bed.sink.set_failing(false);
    eventually(
        Duration::from_secs(15),
        "the failing streams catch up",
        || async {
            failing
                .iter()
                .all(|n| bed.sink.log(&format!("{NS}/{n}")).max_seq() > frozen[n] + 20)
        },
    )
    .await;
    bed.assert_no_gaps(&failing, 30);
    for n in &healthy {
        assert_eq!(
            healthy_sink.log(&format!("{NS}/{n}")).gaps(1),
            Vec::<u64>::new()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_closes_and_releases_and_starting_again_resumes_without_gaps() {
    let bed = bed().await;
    let names = bed.apply_streams(2).await;
    let _worker = bed.fleet.spawn("w").unwrap();
    eventually(Duration::from_secs(20), "connected", || {
        bed.all_connected_once(&names)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    let mut stopped = spec(bed.upstream.url("s00"), &bed.sink.url());
    stopped.desired_state = tether::crd::DesiredStateSpec::Stopped;
    bed.apply("s00", &stopped, 2).await;
    let key = StreamKey::new(NS, "s00");
    eventually(
        Duration::from_secs(5),
        "s00 is closed and released",
        || async {
            let r = bed.store.get(&key).await.unwrap().unwrap();
            !bed.upstream.open_sessions().contains_key("s00")
                && r.lease_expires_at_ms == 0
                && r.status.as_ref().map(|s| s.phase.as_str()) == Some("Stopped")
        },
    )
    .await;
    assert_eq!(
        bed.upstream.open_sessions().get("s01"),
        Some(&1),
        "the other stream is untouched"
    );
    let checkpoint = bed
        .store
        .get(&key)
        .await
        .unwrap()
        .unwrap()
        .last_seq
        .unwrap();

    bed.apply("s00", &spec(bed.upstream.url("s00"), &bed.sink.url()), 3)
        .await;
    eventually(Duration::from_secs(10), "s00 resumes", || async {
        bed.sink.log(&format!("{NS}/s00")).max_seq() > checkpoint + 10
    })
    .await;
    let resumed = bed.upstream.sessions_of("s00");
    assert_eq!(
        resumed.last().unwrap().after,
        checkpoint,
        "reconnect resumes from the checkpoint"
    );
    bed.assert_no_gaps(&names, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_upstreams_are_reported_and_retried_without_disturbing_good_streams() {
    let bed = bed().await;
    let sink = bed.sink.url();
    let closed_port = tether::testkit::fleet::free_port().unwrap();
    let good = ["good0", "good1"].map(String::from).to_vec();
    for n in &good {
        bed.apply(n, &spec(bed.upstream.url(n), &sink), 1).await;
    }
    bed.apply(
        "unreachable",
        &spec(format!("ws://{closed_port}/x"), &sink),
        1,
    )
    .await;
    bed.apply(
        "tls",
        &spec(format!("wss://{}/tls", bed.upstream.addr), &sink),
        1,
    )
    .await;
    bed.upstream.set_behavior("malformed", Behavior::Malformed);
    bed.apply("malformed", &spec(bed.upstream.url("malformed"), &sink), 1)
        .await;
    bed.upstream
        .set_behavior("oversized", Behavior::Oversized(8 * 1024));
    let mut small = spec(bed.upstream.url("oversized"), &sink);
    small.limits = LimitsSpec {
        max_message_bytes: 4096,
        max_frame_bytes: 4096,
    };
    bed.apply("oversized", &small, 1).await;
    bed.upstream.set_behavior("rejected", Behavior::Reject);
    bed.apply("rejected", &spec(bed.upstream.url("rejected"), &sink), 1)
        .await;
    bed.apply(
        "metadata",
        &spec("ws://169.254.169.254/latest".into(), &sink),
        1,
    )
    .await;

    let worker = bed.fleet.spawn("w").unwrap();
    let status_of = |name: &'static str| {
        let store = bed.store.clone();
        async move {
            store
                .get(&StreamKey::new(NS, name))
                .await
                .unwrap()
                .and_then(|r| r.status)
                .map(|s| {
                    (
                        s.phase,
                        s.reason.unwrap_or_default(),
                        s.message.unwrap_or_default(),
                    )
                })
                .unwrap_or_default()
        }
    };
    eventually(Duration::from_secs(20), "each bad stream reports why", || async {
        let unreachable = status_of("unreachable").await;
        let tls = status_of("tls").await;
        let metadata = status_of("metadata").await;
        let rejected = status_of("rejected").await;
        eprintln!("unreachable={unreachable:?}\ntls={tls:?}\nmetadata={metadata:?}\nrejected={rejected:?}");
        unreachable.0 == "Backoff"
            && unreachable.1 == "ConnectFailed"
            && tls.1 == "TLSError"
            && rejected.0 == "Backoff"
            && metadata.0 == "Failed"
            && metadata.1 == "HostRefused"
            && metadata.2.contains("169.254.169.254")
    })
    .await;
    let metrics = worker.metrics().await.unwrap();
    for kind in ["malformed", "too_large", "connect", "tls", "host_policy"] {
        let line = format!("tether_session_errors_total{{kind=\"{kind}\"}}");
        assert!(metrics.contains(&line), "missing {line} in\n{metrics}");
    }
    assert!(
        bed.upstream.sessions_of("malformed").len() >= 2,
        "malformed sessions are retried"
    );
    // Never dialled: the metadata host is refused before any connection.
    assert!(worker.log().contains("refused by host policy"));
    // Good streams flow, gap-free, the whole time.
    let before = bed.max_seqs(&good);
    tokio::time::sleep(Duration::from_secs(2)).await;
    for n in &good {
        assert!(bed.sink.log(&format!("{NS}/{n}")).max_seq() > before[n] + 10);
    }
    bed.assert_no_gaps(&good, 10);
}

#[tokio::test]
async fn apply_reports_bad_documents_by_file_index_and_field_and_applies_the_rest() {
    let store = support::fresh_store(None).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("streams.yaml"),
        "apiVersion: tether.dev/v1alpha1\nkind: StreamConnection\nmetadata: {name: ok}\nspec: {url: 'ws://127.0.0.1:9/ok', sink: {log: {}}}\n---\n\
         apiVersion: tether.dev/v1alpha1\nkind: StreamConnection\nmetadata: {name: broken}\nspec: {url: 'ws://127.0.0.1:9/b', sink: {http: {url: 'ftp://x'}}}\n",
    )
    .unwrap();
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_tether"))
            .args(["--table", store.table()])
            .args(args)
            .env("AWS_ENDPOINT_URL_DYNAMODB", support::endpoint().0)
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ACCESS_KEY_ID", "x")
            .env("AWS_SECRET_ACCESS_KEY", "x")
            .output()
            .unwrap()
    };
    let out = run(&["apply", "-f", dir.path().to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("streams.yaml document 2: spec.sink.http.url"),
        "{stderr}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("streamconnection default/ok created"));
    let ok = store
        .get(&StreamKey::new("default", "ok"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (ok.desired_state, ok.generation),
        (DesiredState::Started, 1)
    );
    assert_eq!(
        store
            .get(&StreamKey::new("default", "broken"))
            .await
            .unwrap(),
        None
    );

    // Re-applying the same manifest changes nothing; `get` shows it; delete removes it.
    let again = run(&[
        "apply",
        "-f",
        dir.path().join("streams.yaml").to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&again.stdout).contains("unchanged"));
    let get = run(&["get", "ok", "-o", "json"]);
    let json: serde_json::Value = serde_json::from_slice(&get.stdout).unwrap();
    assert_eq!(json["desiredState"], "STARTED");
    assert!(run(&["delete", "ok"]).status.success());
    assert_eq!(
        store.get(&StreamKey::new("default", "ok")).await.unwrap(),
        None
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_verified_by_default_and_a_private_ca_can_be_trusted() {
    let bed = bed().await;
    let certified = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
    let tls = TestUpstream::start_tls(loopback(), 20, vec![certified.cert.der().clone()], key)
        .await
        .unwrap();
    let url = format!("wss://{}/secure?after={{last_seq}}", tls.addr);
    bed.apply("secure", &spec(url, &bed.sink.url()), 1).await;

    // Without the CA: the self-signed certificate is refused, nothing is dialled twice in a row.
    let strict = bed.fleet.spawn("strict").unwrap();
    let key_ = StreamKey::new(NS, "secure");
    eventually(
        Duration::from_secs(15),
        "the stream reports a TLS error",
        || async {
            let status = bed.store.get(&key_).await.unwrap().and_then(|r| r.status);
            status.is_some_and(|s| s.reason.as_deref() == Some("TLSError"))
        },
    )
    .await;
    assert!(
        tls.sessions().is_empty(),
        "no WebSocket session over an unverified TLS connection"
    );
    drop(strict);

    // With --ca-file: connected, data flowing, gap-free.
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, certified.cert.pem()).unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await; // the strict worker's lease lapses
    let _trusting = bed
        .fleet
        .spawn_with(
            "trusting",
            &bed.fleet.endpoint,
            &["--ca-file", ca.to_str().unwrap()],
        )
        .unwrap();
    eventually(
        Duration::from_secs(20),
        "the wss stream delivers",
        || async { bed.sink.log(&format!("{NS}/secure")).max_seq() > 10 },
    )
    .await;
    assert_eq!(
        bed.sink.log(&format!("{NS}/secure")).gaps(1),
        Vec::<u64>::new()
    );
}
