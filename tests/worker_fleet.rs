//! The worker fleet end to end: real `tether worker` processes, a real
//! DynamoDB-compatible store, the replaying feed, the verifying sink, and real
//! failures (SIGKILL, SIGTERM, SIGSTOP, a cut to DynamoDB, a sink outage, bad
//! upstreams, TLS).

use nix::sys::signal::Signal;
use std::time::Duration;
use tether::crd::{DesiredStateSpec, LimitsSpec};
use tether::lease::{DesiredState, Ownership, Phase, StreamKey};
use tether_testkit::bed::{Bed, BedOptions, eventually, loopback};
use tether_testkit::fixtures::http_spec;
use tether_testkit::processes::{WorkerProcess, metric_value};
use tether_testkit::proxy::{FaultProxy, ProxyMode};
use tether_testkit::sink::SinkFault;
use tether_testkit::store::endpoint;
use tether_testkit::upstream::{
    CloseIgnoringUpstream, FaultyUpstream, FeedOptions, Misbehavior, TlsUpstream, self_signed,
};

const EXE: &str = env!("CARGO_BIN_EXE_tether");

async fn bed() -> Bed {
    Bed::start(EXE, BedOptions::default()).await.unwrap()
}

/// Waits until `victim` (started alone with `--no-rebalance`, so it keeps what
/// it has) owns every stream, then starts the others: the failure under test
/// hits a worker that holds everything.
async fn loaded_victim(
    bed: &Bed,
    names: &[String],
    victim: WorkerProcess,
    others: &[&str],
) -> (WorkerProcess, Vec<WorkerProcess>) {
    eventually(
        Duration::from_secs(20),
        "the first worker owns every stream",
        || async {
            bed.all_connected_once(names).await && bed.owned_by(&victim.id).await == names.len()
        },
    )
    .await;
    let rest = others
        .iter()
        .map(|id| bed.fleet.spawn(id).unwrap())
        .collect();
    (victim, rest)
}

/// [`loaded_victim`] with a worker `victim` started straight on the store.
async fn victim_holding_everything(
    bed: &Bed,
    names: &[String],
    others: &[&str],
) -> (WorkerProcess, Vec<WorkerProcess>) {
    let victim = bed
        .fleet
        .spawn_with("victim", bed.fleet.endpoint(), &["--no-rebalance"])
        .unwrap();
    loaded_victim(bed, names, victim, others).await
}

/// A worker `victim` (keeping what it takes: `--no-rebalance`) whose store
/// traffic goes through a fault proxy, to cut it off from DynamoDB.
async fn victim_behind_a_proxy(bed: &Bed) -> (FaultProxy, WorkerProcess) {
    let store_addr = endpoint().0.trim_start_matches("http://").parse().unwrap();
    let proxy = FaultProxy::start(loopback(), store_addr).await.unwrap();
    let victim = bed
        .fleet
        .spawn_with("victim", &proxy.endpoint(), &["--no-rebalance"])
        .unwrap();
    (proxy, victim)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_stream_is_connected_exactly_once_across_three_workers() {
    let bed = bed().await;
    let names = bed.apply("s", 12).await.unwrap();
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
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Rebalancing may be finishing a handoff: wait for it.
    eventually(
        Duration::from_secs(10),
        "all 12 streams are connected once",
        || bed.all_connected_once(&names),
    )
    .await;
    bed.assert_safe(&names, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_moves_every_stream_elsewhere_within_a_lease_without_overlap_or_gaps() {
    let bed = bed().await;
    let names = bed.apply("s", 8).await.unwrap();
    let (victim, _others) = victim_holding_everything(&bed, &names, &["b", "c"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed = tokio::time::Instant::now();
    victim.signal(Signal::SIGKILL).unwrap();
    let latencies = bed
        .new_session_latencies(&names, killed, Duration::from_secs(20))
        .await
        .unwrap();
    let worst = latencies.iter().cloned().fold(0.0, f64::max);
    let bound = bed.fleet.workers.lease_duration + Duration::from_secs(3);
    assert!(
        worst < bound.as_secs_f64(),
        "failover took {worst:.2}s (lease {:?})",
        bed.fleet.workers.lease_duration
    );
    eventually(
        Duration::from_secs(10),
        "survivors hold every stream",
        || async { bed.all_connected_once(&names).await && bed.owned_by("victim").await == 0 },
    )
    .await;
    bed.until_data_flows_again(&names, Duration::from_secs(10))
        .await
        .unwrap();
    bed.assert_safe(&names, 5);
}

/// A SIGKILLed worker's busy streams resume from the checkpoints it packed
/// by slot, not from where it took them: a busy stream's own item is not
/// written while it is held, so without them the successor would replay
/// everything the victim delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_resumes_busy_streams_from_the_checkpoints_packed_by_slot() {
    let bed = bed().await;
    let names = bed.apply("s", 6).await.unwrap();
    let (victim, _others) = victim_holding_everything(&bed, &names, &["b"]).await;
    eventually(
        Duration::from_secs(15),
        "the victim packs its checkpoints by slot",
        || bed.packs_by_slot("victim"),
    )
    .await;
    // Long enough that replaying from the take would be ~8 s of messages.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(bed.packs_by_slot("victim").await);
    victim.signal(Signal::SIGKILL).unwrap();
    eventually(Duration::from_secs(15), "b holds every stream", || async {
        bed.all_connected_once(&names).await && bed.owned_by("b").await == names.len()
    })
    .await;
    bed.until_data_flows_again(&names, Duration::from_secs(10))
        .await
        .unwrap();
    // 20 messages a second, a renewal every 0.75 s: a second or two of
    // messages at most.
    let replayed = bed.most_replayed(&names);
    assert!(replayed <= 50, "a stream replayed {replayed} messages");
    bed.assert_safe(&names, 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_hands_streams_over_well_before_a_lease_with_their_checkpoints() {
    let mut bed = bed().await;
    // A long lease: if a handoff waited for the lease it would take 30 s.
    bed.fleet.workers.lease_duration = Duration::from_secs(30);
    bed.fleet.workers.heartbeat_interval = Duration::from_secs(2);
    let names = bed.apply("s", 8).await.unwrap();
    let victim = bed
        .fleet
        .spawn_with("victim", bed.fleet.endpoint(), &["--no-rebalance"])
        .unwrap();
    let (mut victim, _others) = loaded_victim(&bed, &names, victim, &["b", "c"]).await;
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
        || async { bed.all_connected_once(&names).await && bed.owned_by("victim").await == 0 },
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "handoff took {:?}",
        started.elapsed()
    );
    for v in bed.views().await {
        assert!(
            v.checkpoint.is_some(),
            "{} lost its checkpoint",
            v.record.key
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    bed.assert_safe(&names, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cut_off_from_dynamodb_closes_its_sessions_before_others_take_them() {
    let bed = bed().await;
    let names = bed.apply("s", 6).await.unwrap();
    let (proxy, victim) = victim_behind_a_proxy(&bed).await;
    let (victim, _others) = loaded_victim(&bed, &names, victim, &["b", "c"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.set_mode(ProxyMode::Blackhole);
    eventually(
        Duration::from_secs(20),
        "survivors hold every stream",
        || async { bed.all_connected_once(&names).await && bed.owned_by("victim").await == 0 },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    bed.assert_safe(&names, 5);
    let metrics = victim.metrics().await.unwrap();
    assert_eq!(
        metric_value(&metrics, "tether_sessions_connected"),
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
    // Reconnected, it learns it was declared dead, starts over, and disturbs nobody.
    proxy.set_mode(ProxyMode::Pass);
    eventually(
        Duration::from_secs(10),
        "the victim starts over as a new incarnation",
        || async {
            let m = victim.metrics().await.unwrap_or_default();
            metric_value(&m, "tether_incarnation_restarts_total") == Some(1.0)
        },
    )
    .await;
    eventually(
        Duration::from_secs(15),
        "every stream is connected once",
        || bed.all_connected_once(&names),
    )
    .await;
    bed.assert_safe(&names, 5);
}

/// At the fence a session drops its socket at once, without a close
/// handshake: the fence margin (0.5 s here) is for the socket to be gone, and
/// an upstream that never answers a close frame would otherwise hold it open
/// for the whole close timeout (1 s), into the next owner's session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_session_is_gone_before_its_successor_even_if_the_upstream_never_answers_close() {
    let bed = bed().await;
    let upstream = CloseIgnoringUpstream::start(loopback()).await.unwrap();
    let names: Vec<String> = (0..6).map(|i| format!("d-{i:02}")).collect();
    for n in &names {
        bed.apply_spec(n, &http_spec(&upstream.url(n), &bed.sink.url()), 1)
            .await
            .unwrap();
    }
    let (proxy, victim) = victim_behind_a_proxy(&bed).await;
    eventually(
        Duration::from_secs(20),
        "the first worker serves every stream",
        || async {
            bed.owned_by(&victim.id).await == names.len()
                && names.iter().all(|n| upstream.sessions(n).len() == 1)
        },
    )
    .await;
    let _others: Vec<_> = ["b", "c"]
        .iter()
        .map(|id| bed.fleet.spawn(id).unwrap())
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.set_mode(ProxyMode::Blackhole);
    eventually(
        Duration::from_secs(20),
        "every stream is served again by a survivor",
        || async {
            bed.owned_by("victim").await == 0
                && names.iter().all(|n| upstream.sessions(n).len() >= 2)
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        upstream.overlaps(),
        Vec::new(),
        "sessions open at once (stream, earlier, later)"
    );
    for n in &names {
        assert_eq!(
            bed.log(n).gaps(bed.first_seq),
            Vec::<u64>::new(),
            "{n}: gaps"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_started_while_dynamodb_is_unreachable_waits_not_ready_then_serves() {
    let bed = bed().await;
    let names = bed.apply("s", 3).await.unwrap();
    let store_addr = endpoint().0.trim_start_matches("http://").parse().unwrap();
    let proxy = FaultProxy::start(loopback(), store_addr).await.unwrap();
    proxy.set_mode(ProxyMode::Blackhole);
    let mut worker = bed
        .fleet
        .spawn_with("late", &proxy.endpoint(), &[])
        .unwrap();
    // Longer than a store call's deadline: it must still be running, not ready.
    eventually(
        Duration::from_secs(10),
        "the waiting worker reports not ready",
        || async { worker.get("/readyz").await.map(|(status, _)| status) == Ok(503) },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        worker.wait(Duration::from_millis(10)).await.is_err(),
        "the worker exited instead of waiting for DynamoDB:\n{}",
        worker.log()
    );
    proxy.set_mode(ProxyMode::Pass);
    eventually(
        Duration::from_secs(20),
        "every stream served once DynamoDB answers",
        || async { bed.all_connected_once(&names).await },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_worker_wakes_up_fenced_and_delivers_nothing_stale() {
    let mut bed = bed().await;
    // A fencing-aware sink: a stop that lands between a delivery's fence check
    // and its write lets that one request out when the process resumes (no
    // margin covers a pause of any length), and only the token can refuse it.
    // What must hold is that nothing stale is applied.
    bed.sink.set_reject_stale(true);
    // The feed drops silent clients after ~3-4 s; a 6 s lease lets it do so
    // before anyone else may connect (as a real deployment should).
    bed.fleet.workers.lease_duration = Duration::from_secs(6);
    bed.fleet.workers.heartbeat_interval = Duration::from_secs(1);
    let names = bed.apply("s", 6).await.unwrap();
    let victim = bed
        .fleet
        .spawn_with("victim", bed.fleet.endpoint(), &["--no-rebalance"])
        .unwrap();
    let (victim, _others) = loaded_victim(&bed, &names, victim, &["b", "c"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    victim.signal(Signal::SIGSTOP).unwrap();
    eventually(
        Duration::from_secs(25),
        "survivors hold every stream",
        || async { bed.all_connected_once(&names).await && bed.owned_by("victim").await == 0 },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    victim.signal(Signal::SIGCONT).unwrap();
    eventually(
        Duration::from_secs(10),
        "the woken worker finds it was declared dead and starts over",
        || async {
            let m = victim.metrics().await.unwrap_or_default();
            metric_value(&m, "tether_incarnation_restarts_total") == Some(1.0)
        },
    )
    .await;
    eventually(
        Duration::from_secs(15),
        "every stream is connected once",
        || bed.all_connected_once(&names),
    )
    .await;
    bed.assert_safe(&names, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_outage_loses_nothing_and_other_streams_keep_flowing() {
    let bed = bed().await;
    let failing = bed.apply("f", 3).await.unwrap();
    // Healthy streams deliver to the sink directly, not through the faulty proxy.
    let healthy: Vec<String> = (0..3).map(|i| format!("h-{i:02}")).collect();
    for n in &healthy {
        bed.apply_spec(n, &http_spec(&bed.upstream.url(n), &bed.sink.url()), 1)
            .await
            .unwrap();
    }
    let all: Vec<String> = failing.iter().chain(&healthy).cloned().collect();
    let _worker = bed.fleet.spawn("w").unwrap();
    eventually(Duration::from_secs(20), "all connected", || {
        bed.all_connected_once(&all)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    bed.sink_proxy.set(SinkFault::Unavailable);
    let frozen = bed.max_seqs(&failing);
    let healthy_before = bed.max_seqs(&healthy);
    tokio::time::sleep(Duration::from_secs(4)).await;
    for n in &healthy {
        assert!(
            bed.log(n).max_seq() > healthy_before[n].map(|s| s + 20),
            "{n} stalled during another sink's outage"
        );
    }
    // The checkpoint never passes what the failing sink applied. Read now, not
    // when the outage began: a batch the proxy forwarded just before it may
    // still have been applied (and acknowledged) after that first reading.
    let applied = bed.max_seqs(&failing);
    for v in bed
        .views()
        .await
        .iter()
        .filter(|v| failing.contains(&v.record.key.name))
    {
        assert!(
            v.checkpoint <= applied[&v.record.key.name],
            "{}: checkpoint {:?} > applied {:?}",
            v.record.key,
            v.checkpoint,
            applied[&v.record.key.name]
        );
    }
    bed.sink_proxy.set(SinkFault::Pass);
    eventually(
        Duration::from_secs(15),
        "the failing streams catch up",
        || async {
            failing
                .iter()
                .all(|n| bed.log(n).max_seq() > frozen[n].map(|s| s + 20))
        },
    )
    .await;
    bed.assert_safe(&all, 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_closes_and_releases_and_starting_again_resumes_without_gaps() {
    let bed = bed().await;
    let names = bed.apply("s", 2).await.unwrap();
    let _worker = bed.fleet.spawn("w").unwrap();
    eventually(Duration::from_secs(20), "connected", || {
        bed.all_connected_once(&names)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    let mut stopped = bed.spec("s-00");
    stopped.desired_state = DesiredStateSpec::Stopped;
    bed.apply_spec("s-00", &stopped, 2).await.unwrap();
    let key = bed.key("s-00");
    eventually(
        Duration::from_secs(5),
        "s-00 is closed and released",
        || async {
            let r = bed.store.get(&key).await.unwrap().unwrap();
            !bed.upstream.open_sessions().contains_key("s-00")
                && r.ownership() == Ownership::Free
                && r.status.as_ref().map(|s| s.phase) == Some(Phase::Stopped)
        },
    )
    .await;
    assert_eq!(
        bed.upstream.open_sessions().get("s-01"),
        Some(&1),
        "the other stream is untouched"
    );
    let checkpoint = bed
        .store
        .get(&key)
        .await
        .unwrap()
        .unwrap()
        .checkpoint
        .unwrap();

    bed.apply_spec("s-00", &bed.spec("s-00"), 3).await.unwrap();
    eventually(Duration::from_secs(10), "s-00 resumes", || async {
        bed.log("s-00").max_seq() > Some(checkpoint + 10)
    })
    .await;
    let resumed = bed.upstream.sessions_of("s-00");
    assert_eq!(
        resumed.last().unwrap().after,
        Some(checkpoint),
        "reconnect resumes from the checkpoint"
    );
    bed.assert_safe(&names, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_upstreams_and_forbidden_sinks_are_reported_without_disturbing_good_streams() {
    let bed = bed().await;
    let faulty = FaultyUpstream::start(loopback()).await.unwrap();
    let sink = bed.sink_proxy.url();
    let closed_port = tether_testkit::processes::free_port().unwrap();
    let good = bed.apply("good", 2).await.unwrap();
    let apply = |name: &str, url: String| {
        let spec = http_spec(&url, &sink);
        let bed = &bed;
        let name = name.to_string();
        async move { bed.apply_spec(&name, &spec, 1).await.unwrap() }
    };
    apply("unreachable", format!("ws://{closed_port}/x")).await;
    apply("tls", format!("wss://{}/tls", bed.upstream.addr)).await;
    faulty.set("malformed", Misbehavior::Malformed);
    apply("malformed", faulty.url("malformed")).await;
    faulty.set("oversized", Misbehavior::Oversized(8 * 1024));
    let mut small = http_spec(&faulty.url("oversized"), &sink);
    small.limits = LimitsSpec {
        max_message_bytes: 4096,
        max_frame_bytes: 4096,
    };
    bed.apply_spec("oversized", &small, 1).await.unwrap();
    faulty.set("rejected", Misbehavior::Reject);
    apply("rejected", faulty.url("rejected")).await;
    apply("metadata", "ws://169.254.169.254/latest".into()).await;
    // A good upstream whose sink is the metadata service: refused before
    // anything is read, so nothing is ever POSTed there.
    let to_metadata = http_spec(
        &bed.upstream.url("to-metadata"),
        "http://169.254.169.254/latest/meta-data/",
    );
    bed.apply_spec("to-metadata", &to_metadata, 1)
        .await
        .unwrap();

    let worker = bed.fleet.spawn("w").unwrap();
    let status_of = |name: &'static str| {
        let key = bed.key(name);
        let store = bed.store.clone();
        async move {
            store
                .get(&key)
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
    eventually(
        Duration::from_secs(20),
        "each bad stream reports why",
        || async {
            let unreachable = status_of("unreachable").await;
            let tls = status_of("tls").await;
            let metadata = status_of("metadata").await;
            let rejected = status_of("rejected").await;
            let to_metadata = status_of("to-metadata").await;
            to_metadata.0 == Phase::Failed
                && to_metadata.1 == "SinkNotAllowed"
                && to_metadata.2.contains("169.254.169.254")
                && unreachable.0 == Phase::Backoff
                && unreachable.1 == "ConnectFailed"
                && tls.1 == "TLSError"
                && rejected.0 == Phase::Backoff
                && metadata.0 == Phase::Failed
                && metadata.1 == "HostRefused"
                && metadata.2.contains("169.254.169.254")
        },
    )
    .await;
    let metrics = worker.metrics().await.unwrap();
    for kind in [
        "malformed",
        "too_large",
        "connect",
        "tls",
        "host_policy",
        "sink_policy",
    ] {
        let line = format!("tether_session_errors_total{{kind=\"{kind}\"}}");
        assert!(metrics.contains(&line), "missing {line} in\n{metrics}");
    }
    eventually(
        Duration::from_secs(15),
        "malformed sessions are retried",
        || async { faulty.sessions("malformed") >= 2 },
    )
    .await;
    // Never dialled: the metadata host is refused before any connection.
    assert!(worker.log().contains("refused by host policy"));
    let before = bed.max_seqs(&good);
    tokio::time::sleep(Duration::from_secs(2)).await;
    for n in &good {
        assert!(bed.log(n).max_seq() > before[n].map(|s| s + 10));
    }
    bed.assert_safe(&good, 10);
}

fn run_cli(bed: &Bed, args: &[&str]) -> std::process::Output {
    std::process::Command::new(EXE)
        .args(["--table", bed.store.table()])
        .args(args)
        .env("AWS_ENDPOINT_URL_DYNAMODB", endpoint().0)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "x")
        .output()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_reports_bad_documents_by_file_index_and_field_applies_the_rest_and_delete_removes() {
    let bed = bed().await;
    let dir = bed.log_dir.join("manifests");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("streams.yaml"),
        "apiVersion: tether.dev/v1alpha1\nkind: StreamConnection\nmetadata: {name: ok}\nspec: {url: 'ws://127.0.0.1:9/ok', sink: {log: {}}}\n---\n\
         apiVersion: tether.dev/v1alpha1\nkind: StreamConnection\nmetadata: {name: broken}\nspec: {url: 'ws://127.0.0.1:9/b', sink: {http: {url: 'ftp://x'}}}\n",
    )
    .unwrap();
    let out = run_cli(&bed, &["apply", "-f", dir.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("streams.yaml document 2: spec.sink.http.url"),
        "{stderr}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("streamconnection default/ok created"));
    let ok = bed
        .store
        .get(&StreamKey::new("default", "ok"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (ok.desired_state, ok.generation),
        (DesiredState::Started, 1)
    );
    assert_eq!(
        bed.store
            .get(&StreamKey::new("default", "broken"))
            .await
            .unwrap(),
        None
    );

    let again = run_cli(
        &bed,
        &["apply", "-f", dir.join("streams.yaml").to_str().unwrap()],
    );
    assert!(String::from_utf8_lossy(&again.stdout).contains("unchanged"));
    let get = run_cli(&bed, &["get", "ok", "-o", "json"]);
    let json: serde_json::Value = serde_json::from_slice(&get.stdout).unwrap();
    assert_eq!(json["desiredState"], "STARTED");
    let deleted = run_cli(&bed, &["delete", "ok"]);
    assert!(
        deleted.status.success(),
        "{}",
        String::from_utf8_lossy(&deleted.stderr)
    );
    assert!(
        bed.store
            .get(&StreamKey::new("default", "ok"))
            .await
            .unwrap()
            .unwrap()
            .is_tombstone()
    );
    assert!(
        !run_cli(&bed, &["get", "ok"]).status.success(),
        "a deleted stream is gone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_is_verified_by_default_and_a_private_ca_can_be_trusted() {
    let bed = bed().await;
    let (certified, key) = self_signed(&["127.0.0.1"]);
    let tls = TlsUpstream::start(
        loopback(),
        FeedOptions {
            rate: 20,
            ..FeedOptions::default()
        },
        vec![certified.cert.der().clone()],
        key,
    )
    .await
    .unwrap();
    bed.apply_spec(
        "secure",
        &http_spec(&tls.url("secure"), &bed.sink_proxy.url()),
        1,
    )
    .await
    .unwrap();

    let strict = bed.fleet.spawn("strict").unwrap();
    let stream = bed.key("secure");
    eventually(
        Duration::from_secs(15),
        "the stream reports a TLS error",
        || async {
            let status = bed.store.get(&stream).await.unwrap().and_then(|r| r.status);
            status.is_some_and(|s| s.reason.as_deref() == Some("TLSError"))
        },
    )
    .await;
    assert!(
        tls.feed.sessions().is_empty(),
        "no WebSocket session over an unverified TLS connection"
    );
    let mut strict = strict;
    strict.signal(Signal::SIGTERM).unwrap();
    strict.wait(Duration::from_secs(10)).await.unwrap();

    let ca = bed.log_dir.join("ca.pem");
    std::fs::write(&ca, certified.cert.pem()).unwrap();
    let _trusting = bed
        .fleet
        .spawn_with(
            "trusting",
            bed.fleet.endpoint(),
            &["--ca-file", ca.to_str().unwrap()],
        )
        .unwrap();
    eventually(
        Duration::from_secs(20),
        "the wss stream delivers",
        || async { bed.log("secure").max_seq() > Some(10) },
    )
    .await;
    assert_eq!(bed.log("secure").gaps(1), Vec::<u64>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_streams_connecting_at_once_opens_a_bounded_number_of_dynamodb_connections() {
    let bed = bed().await;
    // Every one of these writes its status as soon as it connects.
    let names = bed.apply("burst", 150).await.unwrap();
    let store_addr = endpoint().0.trim_start_matches("http://").parse().unwrap();
    let proxy = FaultProxy::start(loopback(), store_addr).await.unwrap();
    let worker = bed
        .fleet
        .spawn_with(
            "burst",
            &proxy.endpoint(),
            &["--connect-rate", "0", "--no-rebalance"],
        )
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "every stream is connected and has written its status",
        || async {
            bed.connected_once(&names)
                && bed
                    .views()
                    .await
                    .iter()
                    .filter(|v| {
                        v.record
                            .status
                            .as_ref()
                            .is_some_and(|s| s.phase == Phase::Connected)
                    })
                    .count()
                    == names.len()
        },
    )
    .await;
    // 32 stream writes in flight, plus the worker's own calls (renewals,
    // fleet and partition reads) — never one connection per stream.
    let connections = proxy.accepted();
    assert!(
        connections <= 64,
        "{connections} connections to DynamoDB for {} streams\n{}",
        names.len(),
        worker.log()
    );
}
