//! The safety properties in the paths a review found open, each end to end
//! with real processes: one identity per process, every session and delivery
//! bounded by the fence in every state, tokens that never go backwards, no
//! stream left owned but unserved, one bad item never stopping the fleet,
//! sequence 0, clock skew measured and refused, the sink's explicit fenced
//! signal, and a tidy shutdown.

use aws_sdk_dynamodb::types::AttributeValue;
use nix::sys::signal::Signal;
use std::collections::HashSet;
use std::time::Duration;
use tether::lease::{DeleteOutcome, Ownership};
use tether_testkit::bed::{Bed, BedOptions, eventually, loopback};
use tether_testkit::dynamo_proxy::{DynamoFault, DynamoFaultProxy};
use tether_testkit::processes::{WorkerProcess, metric_value};
use tether_testkit::sink::SinkFault;
use tether_testkit::store::{endpoint, raw_client};

const EXE: &str = env!("CARGO_BIN_EXE_tether");

async fn bed() -> Bed {
    Bed::start(EXE, BedOptions::default()).await.unwrap()
}

/// Applies `n` standard streams `prefix-00`.. whose HTTP sink times out
/// after `timeout_seconds`.
async fn apply_with_sink_timeout(
    bed: &Bed,
    prefix: &str,
    n: usize,
    timeout_seconds: u32,
) -> Vec<String> {
    let names = tether_testkit::bed::names(prefix, n);
    for name in &names {
        let mut spec = bed.spec(name);
        if let Some(http) = spec.sink.http.as_mut() {
            http.timeout_seconds = timeout_seconds;
        }
        bed.apply_spec(name, &spec, 1).await.unwrap();
    }
    names
}

/// Starts `victim` through `endpoint` (keeping what it has: `--no-rebalance`),
/// waits until it owns every stream, then starts `peer` and gives it a moment:
/// the failure under test hits a worker that holds everything while another
/// stands by to take over.
async fn victim_with_a_peer(
    bed: &Bed,
    names: &[String],
    endpoint: &str,
) -> (WorkerProcess, WorkerProcess) {
    let victim = bed
        .fleet
        .spawn_with("victim", endpoint, &["--no-rebalance"])
        .unwrap();
    eventually(
        Duration::from_secs(20),
        "the victim owns every stream",
        || async {
            bed.all_connected_once(names).await && bed.owned_by("victim").await == names.len()
        },
    )
    .await;
    let peer = bed.fleet.spawn("peer").unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    (victim, peer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_started_with_one_worker_id_never_serve_a_stream_twice() {
    let bed = bed().await;
    let names = bed.apply("s", 8).await.unwrap();
    let a = bed.fleet.spawn("twin").unwrap();
    let _b = bed.fleet.spawn("twin").unwrap();
    eventually(
        Duration::from_secs(20),
        "every stream is served once",
        || bed.all_connected_once(&names),
    )
    .await;
    // Two incarnations, each holding a share (fair share moves some to the
    // later one), each warned about the other.
    let distinct_owners = || async {
        bed.views()
            .await
            .iter()
            .filter_map(|v| v.live_owner())
            .map(|o| o.owner.clone())
            .collect::<HashSet<String>>()
            .len()
    };
    eventually(
        Duration::from_secs(20),
        "two distinct owners share the streams",
        || async { distinct_owners().await == 2 },
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "the duplicate id is reported",
        || async {
            metric_value(
                &a.metrics().await.unwrap_or_default(),
                "tether_duplicate_worker_id",
            ) == Some(1.0)
        },
    )
    .await;
    // One of them crashes: the other takes its streams, nothing overlaps.
    a.signal(Signal::SIGKILL).unwrap();
    eventually(
        Duration::from_secs(20),
        "the surviving twin serves every stream",
        || async { bed.all_connected_once(&names).await && distinct_owners().await == 1 },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    bed.assert_safe(&names, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_in_a_dynamodb_brownout_with_a_slow_sink_ends_every_session_by_the_fence() {
    let mut bed = bed().await;
    // A drain longer than the lease: draining must not outlive the fence.
    bed.fleet.workers.drain_timeout = Duration::from_secs(20);
    // A sink timeout far longer than the lease too: only the fence can cut a
    // POST short.
    let names = apply_with_sink_timeout(&bed, "s", 6, 60).await;
    let proxy = DynamoFaultProxy::start(loopback(), &endpoint().0)
        .await
        .unwrap();
    let (mut victim, _peer) = victim_with_a_peer(&bed, &names, &proxy.endpoint()).await;
    // Every POST now takes far longer than the lease, and the victim cannot
    // reach DynamoDB: only the fence can end its last batch in time.
    bed.sink_proxy.set(SinkFault::Slow(Duration::from_secs(10)));
    proxy.set(DynamoFault::Blackhole);
    let fence_closed_by = tokio::time::Instant::now() + bed.fleet.workers.lease_duration;
    victim.signal(Signal::SIGTERM).unwrap();
    eventually(
        Duration::from_secs(30),
        "the peer serves every stream",
        || async {
            bed.all_connected_once(&names).await && bed.owned_by("peer").await == names.len()
        },
    )
    .await;
    bed.sink_proxy.set(SinkFault::Pass);
    proxy.set(DynamoFault::Pass);
    let _ = victim.wait(Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    bed.assert_safe(&names, 5);
    // The victim's last batches were in flight when its renewals stopped: the
    // fence must have cut them, so none reached the sink after it closed
    // (a POST left running would arrive 10 s later, after the peer took over).
    for name in &names {
        for (arrived, token, worker) in bed.log(name).batches {
            assert!(
                !worker.starts_with("victim") || arrived <= fence_closed_by,
                "{name}: the victim's batch (token {token}) reached the sink {:?} after its fence closed",
                arrived - fence_closed_by
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_dynamodb_hangs_stops_every_session_within_a_second() {
    let mut bed = bed().await;
    // A lease far longer than the store's call deadline: only the drain, not
    // the fence, can end the sessions this early.
    bed.fleet.workers.lease_duration = Duration::from_secs(30);
    bed.fleet.workers.heartbeat_interval = Duration::from_secs(3);
    let names = bed.apply("s", 4).await.unwrap();
    let proxy = DynamoFaultProxy::start(loopback(), &endpoint().0)
        .await
        .unwrap();
    let mut victim = bed.fleet.spawn_via("victim", &proxy.endpoint()).unwrap();
    eventually(
        Duration::from_secs(20),
        "the victim serves every stream",
        || bed.all_connected_once(&names),
    )
    .await;
    // The draining announcement cannot land: it must not hold up the stops.
    // Neither may a status write: each holder writes "connected" at most a
    // second after its previous write, so by now every holder is waiting on
    // a write that hangs (for the store's whole call deadline).
    proxy.set(DynamoFault::Blackhole);
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let started = tokio::time::Instant::now();
    victim.signal(Signal::SIGTERM).unwrap();
    eventually(
        Duration::from_millis(1500),
        "every upstream session closed within a second of SIGTERM",
        || async { bed.upstream.open_sessions().is_empty() },
    )
    .await;
    let closed_after = started.elapsed();
    proxy.set(DynamoFault::Pass);
    assert!(
        victim
            .wait(Duration::from_secs(20))
            .await
            .unwrap()
            .success(),
        "{}",
        victim.log()
    );
    for v in bed.views().await {
        assert!(
            v.live_owner().is_none(),
            "{} still owned after a clean exit (sessions closed after {closed_after:?})",
            v.record.key
        );
    }
    bed.assert_safe(&names, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_deleted_and_recreated_keeps_its_tokens_growing_for_a_fencing_sink() {
    let bed = bed().await;
    bed.sink.set_reject_stale(true);
    let names = bed.apply("s", 1).await.unwrap();
    let name = &names[0];
    let _w = bed.fleet.spawn("w").unwrap();
    eventually(Duration::from_secs(20), "delivering", || async {
        bed.log(name).max_seq() > Some(20)
    })
    .await;
    let token_before = bed.log(name).max_token;
    for round in 0..2 {
        assert_eq!(
            bed.store
                .delete_stream(&bed.key(name), Duration::from_secs(20))
                .await
                .unwrap(),
            DeleteOutcome::Deleted
        );
        assert!(
            !bed.upstream.open_sessions().contains_key(name.as_str()),
            "closed before deletion"
        );
        bed.apply_spec(name, &bed.spec(name), 10 + round)
            .await
            .unwrap();
        let requests = bed.sink.requests();
        eventually(
            Duration::from_secs(20),
            "the re-created stream delivers again",
            || async {
                bed.sink.requests() > requests + 5 && bed.log(name).max_token > token_before
            },
        )
        .await;
    }
    assert_eq!(
        bed.sink.refused_stale() + bed.sink.stale_messages(),
        0,
        "a re-created stream is never refused as stale"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_whose_answer_was_lost_is_served_within_a_pass_not_a_lease() {
    let mut bed = bed().await;
    // A lease long enough that waiting for it would be obvious.
    bed.fleet.workers.lease_duration = Duration::from_secs(30);
    bed.fleet.workers.heartbeat_interval = Duration::from_secs(5);
    let proxy = DynamoFaultProxy::start(loopback(), &endpoint().0)
        .await
        .unwrap();
    let w = bed.fleet.spawn_via("w", &proxy.endpoint()).unwrap();
    eventually(Duration::from_secs(10), "the worker is ready", || async {
        w.get("/readyz").await.map(|(s, _)| s) == Ok(200)
    })
    .await;
    // Every answer is lost for a while: the acquire lands, the worker cannot know.
    proxy.set(DynamoFault::LoseWriteAnswers);
    let names = bed.apply("s", 1).await.unwrap();
    eventually(
        Duration::from_secs(10),
        "the acquire landed unseen",
        || async {
            bed.store
                .get(&bed.key(&names[0]))
                .await
                .unwrap()
                .is_some_and(|r| matches!(r.ownership(), Ownership::Owned(_)))
        },
    )
    .await;
    // Longer than the store call's deadline (4 s): the acquire gives up unanswered.
    tokio::time::sleep(Duration::from_secs(5)).await;
    proxy.set(DynamoFault::Pass);
    let healed = tokio::time::Instant::now();
    eventually(Duration::from_secs(10), "the stream is served", || async {
        bed.connected_once(&names)
    })
    .await;
    assert!(
        healed.elapsed() < Duration::from_secs(5),
        "owned but unserved for {:?}",
        healed.elapsed()
    );
    bed.assert_safe(&names, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_item_is_skipped_and_reported_while_the_fleet_serves_the_rest() {
    let bed = bed().await;
    let names = bed.apply("s", 4).await.unwrap();
    let client = raw_client().await;
    for shard in 0..tether::lease::HOLDER_SHARDS {
        let mut item = std::collections::HashMap::new();
        item.insert(
            "Pk".to_string(),
            AttributeValue::S(format!("CONN#hand/edited/{shard}")),
        );
        item.insert(
            "desired_state".to_string(),
            AttributeValue::S("STARTED".into()),
        );
        item.insert(
            "holder".to_string(),
            AttributeValue::S(format!("UNOWNED#{shard}")),
        );
        item.insert(
            "lease_counter".to_string(),
            AttributeValue::S("seven".into()),
        );
        client
            .put_item()
            .table_name(bed.store.table())
            .set_item(Some(item))
            .send()
            .await
            .unwrap();
    }
    let w = bed.fleet.spawn("w").unwrap();
    eventually(
        Duration::from_secs(20),
        "the good streams are served",
        || bed.all_connected_once(&names),
    )
    .await;
    eventually(Duration::from_secs(10), "data flows", || async {
        names.iter().all(|n| bed.log(n).max_seq() > Some(5))
    })
    .await;
    let metrics = w.metrics().await.unwrap();
    assert!(
        metric_value(&metrics, "tether_malformed_items_total").unwrap_or(0.0) >= 1.0,
        "{metrics}"
    );
    assert!(w.log().contains("skipping a malformed item"));
    bed.assert_safe(&names, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_based_feed_delivers_sequence_zero() {
    let bed = Bed::start(
        EXE,
        BedOptions {
            first_seq: 0,
            ..BedOptions::default()
        },
    )
    .await
    .unwrap();
    let names = bed.apply("z", 3).await.unwrap();
    let _w = bed.fleet.spawn("w").unwrap();
    eventually(Duration::from_secs(20), "delivering", || async {
        names.iter().all(|n| bed.log(n).max_seq() > Some(10))
    })
    .await;
    for n in &names {
        assert!(
            bed.log(n).seqs.contains_key(&0),
            "{n}: sequence 0 was not delivered"
        );
        let first = bed.upstream.sessions_of(n);
        assert_eq!(
            first[0].after, None,
            "{n}: the first connect says there is no checkpoint"
        );
    }
    bed.assert_safe(&names, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_clock_is_off_refuses_to_acquire_and_says_so() {
    let bed = bed().await;
    let proxy = DynamoFaultProxy::start(loopback(), &endpoint().0)
        .await
        .unwrap();
    // The store's clock 30 s ahead: this worker's is 30 s behind.
    proxy.shift_date(30);
    let skewed = bed.fleet.spawn_via("skewed", &proxy.endpoint()).unwrap();
    eventually(
        Duration::from_secs(10),
        "the skewed worker says why it is not ready",
        || async {
            skewed
                .get("/readyz")
                .await
                .is_ok_and(|(s, body)| s == 503 && body.contains("clock"))
        },
    )
    .await;
    let names = bed.apply("s", 4).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        bed.owned_by("skewed").await,
        0,
        "a skewed worker acquired streams"
    );
    let metrics = skewed.metrics().await.unwrap();
    assert_eq!(
        metric_value(&metrics, "tether_clock_skew_exceeded"),
        Some(1.0)
    );
    let healthy = bed.fleet.spawn("healthy").unwrap();
    eventually(
        Duration::from_secs(20),
        "the healthy worker serves everything",
        || bed.all_connected_once(&names),
    )
    .await;
    // Fixed clock: ready again, and it takes its share.
    proxy.shift_date(0);
    eventually(
        Duration::from_secs(30),
        "the fixed worker takes its share",
        || async { bed.owned_by("skewed").await > 0 && bed.all_connected_once(&names).await },
    )
    .await;
    drop(healthy);
    bed.assert_safe(&names, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_409_is_a_delivery_error_not_a_fenced_signal() {
    let bed = bed().await;
    let names = bed.apply("s", 2).await.unwrap();
    let w = bed.fleet.spawn("w").unwrap();
    eventually(Duration::from_secs(20), "delivering", || async {
        names.iter().all(|n| bed.log(n).max_seq() > Some(5))
    })
    .await;
    let owners_before: Vec<_> = bed
        .views()
        .await
        .iter()
        .map(|v| (v.record.key.clone(), v.record.lease_counter))
        .collect();
    bed.sink_proxy.set(SinkFault::PlainConflict);
    tokio::time::sleep(Duration::from_secs(3)).await;
    bed.sink_proxy.set(SinkFault::Pass);
    let frozen = bed.max_seqs(&names);
    eventually(Duration::from_secs(10), "delivery resumes", || async {
        names
            .iter()
            .all(|n| bed.log(n).max_seq() > frozen[n].map(|s| s + 10))
    })
    .await;
    // The same leases all along: a 409 without the fenced header is retried.
    let owners_after: Vec<_> = bed
        .views()
        .await
        .iter()
        .map(|v| (v.record.key.clone(), v.record.lease_counter))
        .collect();
    assert_eq!(
        owners_before, owners_after,
        "a plain 409 made the owner give the stream up"
    );
    let metrics = w.metrics().await.unwrap();
    assert!(!metrics.contains("result=\"fenced\""), "{metrics}");
    bed.assert_safe(&names, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_with_a_slow_sink_still_releases_every_stream_with_its_checkpoint() {
    let mut bed = bed().await;
    // A long lease: a skipped release would leave the streams a lease without owner.
    bed.fleet.workers.lease_duration = Duration::from_secs(30);
    bed.fleet.workers.heartbeat_interval = Duration::from_secs(3);
    bed.fleet.workers.drain_timeout = Duration::from_secs(6);
    let names = bed.apply("s", 6).await.unwrap();
    let (mut victim, _peer) = victim_with_a_peer(&bed, &names, bed.fleet.endpoint()).await;
    // Every POST takes longer than the whole drain.
    bed.sink_proxy.set(SinkFault::Slow(Duration::from_secs(10)));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = tokio::time::Instant::now();
    victim.signal(Signal::SIGTERM).unwrap();
    eventually(
        Duration::from_secs(2),
        "SIGTERM is acted on within a second (not ready)",
        || async { victim.get("/readyz").await.map(|(s, _)| s) != Ok(200) },
    )
    .await;
    let status = victim.wait(Duration::from_secs(15)).await.unwrap();
    assert!(status.success(), "{status:?}\n{}", victim.log());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "drain took {:?}",
        started.elapsed()
    );
    for v in bed.views().await {
        assert_ne!(
            v.live_owner().map(|o| o.worker_id.as_str()),
            Some("victim"),
            "{} not released",
            v.record.key
        );
    }
    bed.sink_proxy.set(SinkFault::Pass);
    eventually(
        Duration::from_secs(10),
        "the peer serves every stream well before a lease",
        || bed.all_connected_once(&names),
    )
    .await;
    assert!(started.elapsed() < Duration::from_secs(20));
    tokio::time::sleep(Duration::from_secs(1)).await;
    bed.assert_safe(&names, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_is_acted_on_within_a_second_in_the_middle_of_a_long_acquisition_pass() {
    let bed = bed().await;
    let proxy = DynamoFaultProxy::start(loopback(), &endpoint().0)
        .await
        .unwrap();
    let mut w = bed.fleet.spawn_via("w", &proxy.endpoint()).unwrap();
    eventually(Duration::from_secs(10), "ready", || async {
        w.get("/readyz").await.map(|(s, _)| s) == Ok(200)
    })
    .await;
    // Many orphans behind a slow store: one pass takes many seconds.
    let names = bed.apply("many", 60).await.unwrap();
    proxy.set(DynamoFault::Slow(Duration::from_millis(400)));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started = tokio::time::Instant::now();
    w.signal(Signal::SIGTERM).unwrap();
    eventually(
        Duration::from_secs(2),
        "not ready within a second of SIGTERM",
        || async { w.get("/readyz").await.map(|(s, _)| s) != Ok(200) },
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "took {:?}",
        started.elapsed()
    );
    proxy.set(DynamoFault::Pass);
    assert!(
        w.wait(Duration::from_secs(20)).await.unwrap().success(),
        "{}",
        w.log()
    );
    // Whatever it had acquired (even mid-pass) it released.
    for v in bed.views().await {
        assert!(
            v.live_owner().is_none(),
            "{} still owned after a clean exit",
            v.record.key
        );
    }
    assert_eq!(bed.owners().await.len(), 0, "{} streams", names.len());
}

/// The resource of a stream `name`, as the controller mirrors it.
fn resource(uid: &str, created_ms: u64) -> Option<tether::lease::ResourceIdentity> {
    Some(tether::lease::ResourceIdentity {
        uid: uid.into(),
        created_ms,
        installation: String::new(),
    })
}

/// Whether sequence numbers `1..=n` each reached the sink at least `times` times.
fn delivered_from_the_start(bed: &Bed, name: &str, n: u64, times: u32) -> bool {
    let log = bed.log(name);
    (1..=n).all(|seq| log.seqs.get(&seq).copied().unwrap_or(0) >= times)
}

/// A stream is its resource: a resource deleted and re-created under the same
/// name (a new UID) on a feed whose sequence starts again is served from its
/// start, with a higher token. The live owner keeps nothing of the old one:
/// not its in-memory progress (which would drop every new message up to it),
/// not its session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resource_replaced_under_a_live_owner_starts_from_its_own_first_message() {
    let bed = bed().await;
    let name = "replaced";
    let old = bed.spec(name);
    bed.store
        .upsert_desired(&old.to_desired(bed.key(name), 1, resource("uid-a", 1_000)))
        .await
        .unwrap();
    let _w = bed.fleet.spawn("w").unwrap();
    eventually(
        Duration::from_secs(20),
        "the old resource delivers",
        || async { bed.log(name).max_seq() > Some(30) },
    )
    .await;
    let old_token = bed.log(name).max_token;
    // The new resource reads another feed, whose sequence starts again at 1.
    let new = tether_testkit::fixtures::http_spec(
        &bed.upstream.url("replaced-new-feed"),
        &bed.sink_proxy.url(),
    );
    bed.store
        .upsert_desired(&new.to_desired(bed.key(name), 1, resource("uid-b", 2_000)))
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "the new resource's first messages reach the sink",
        || async { delivered_from_the_start(&bed, name, 5, 2) },
    )
    .await;
    assert!(bed.log(name).max_token > old_token, "a higher token");
    let item = bed.store.get(&bed.key(name)).await.unwrap().unwrap();
    assert_eq!(item.uid.as_deref(), Some("uid-b"));
    assert!(item.lease_counter > old_token);
    eventually(
        Duration::from_secs(10),
        "one session, on the new feed",
        || async {
            let open = bed.upstream.open_sessions();
            !open.contains_key(name) && open.get("replaced-new-feed") == Some(&1)
        },
    )
    .await;
}

/// Standalone identity is name + creation: `tether delete` and `apply` again
/// after the owner crashed start a new stream, which must not resume from the
/// dead owner's packed checkpoint of the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_deleted_and_applied_again_after_its_owner_crashed_starts_from_its_start() {
    let bed = bed().await;
    let name = "again";
    bed.apply_spec(name, &bed.spec(name), 1).await.unwrap();
    let victim = bed.fleet.spawn("victim").unwrap();
    eventually(Duration::from_secs(20), "delivering", || async {
        bed.log(name).max_seq() > Some(30)
    })
    .await;
    // A heartbeat later the victim's packed checkpoint is past 30.
    tokio::time::sleep(Duration::from_secs(2)).await;
    victim.signal(Signal::SIGKILL).unwrap();
    let _peer = bed.fleet.spawn("peer").unwrap();
    assert_eq!(
        bed.store
            .delete_stream(&bed.key(name), Duration::from_secs(30))
            .await
            .unwrap(),
        DeleteOutcome::Deleted
    );
    let new = tether_testkit::fixtures::http_spec(
        &bed.upstream.url("again-new-feed"),
        &bed.sink_proxy.url(),
    );
    bed.apply_spec(name, &new, 1).await.unwrap();
    eventually(
        Duration::from_secs(30),
        "the new stream's first messages reach the sink",
        || async { delivered_from_the_start(&bed, name, 5, 2) },
    )
    .await;
}

/// Writes one string attribute of `name`'s item straight into the table: a
/// change nobody announces (no notification, no bump of the counter).
async fn set_unannounced(
    raw: &aws_sdk_dynamodb::Client,
    bed: &Bed,
    name: &str,
    attribute: &str,
    value: String,
) -> Result<(), impl std::fmt::Debug> {
    raw.update_item()
        .table_name(bed.store.table())
        .key("Pk", AttributeValue::S(bed.key(name).pk()))
        .update_expression(format!("SET {attribute} = :v"))
        .expression_attribute_values(":v", AttributeValue::S(value))
        .send()
        .await
        .map(|_| ())
}

/// Desired state reaches the owner level-triggered (property 5b): a STOPPED
/// and a new spec written into the items with nobody telling the owner (the
/// notifications lost with their writer) are told again by the next mirror
/// of each resource (here `apply` run again), which finds the item already
/// written and its owner still holding a STOPPED stream, or serving the
/// older generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_nobody_announced_are_acted_on_when_mirrored_again() {
    let mut bed = bed().await;
    // Audit ticks every 20 s, the first 20 s after the start: neither the
    // audit nor the sweep can be what acts on the changes, which are acted
    // on within seconds of the start.
    bed.fleet.workers.lease_duration = Duration::from_secs(15);
    bed.fleet.workers.heartbeat_interval = Duration::from_secs(5);
    let names = bed.apply("quiet", 2).await.unwrap();
    let _w = bed.fleet.spawn("w").unwrap();
    eventually(Duration::from_secs(20), "both streams are served", || {
        bed.all_connected_once(&names)
    })
    .await;
    let raw = raw_client().await;
    set_unannounced(&raw, &bed, &names[0], "desired_state", "STOPPED".into())
        .await
        .unwrap();
    // A new spec and generation, as a mirror writes them, and no notification.
    let moved = "quiet-moved";
    let mut spec = bed.spec(&names[1]);
    spec.url = bed.upstream.url(moved);
    let desired = spec.to_desired(bed.key(&names[1]), 2, None);
    set_unannounced(&raw, &bed, &names[1], "ws_url", desired.ws_url.clone())
        .await
        .unwrap();
    set_unannounced(&raw, &bed, &names[1], "spec", desired.spec.clone())
        .await
        .unwrap();
    raw.update_item()
        .table_name(bed.store.table())
        .key("Pk", AttributeValue::S(bed.key(&names[1]).pk()))
        .update_expression("SET generation = :g")
        .expression_attribute_values(":g", AttributeValue::N("2".into()))
        .send()
        .await
        .unwrap();
    assert!(
        bed.upstream.open_sessions().contains_key(names[1].as_str()),
        "the unannounced spec was acted on before anyone mirrored it again"
    );
    // Mirrored again: the items already match, their owner holds a STOPPED
    // stream and serves generation 1 of the other.
    assert_eq!(
        bed.store.upsert_desired(&desired).await.unwrap(),
        tether::lease::UpsertOutcome::Unchanged
    );
    let stopped = bed.spec(&names[0]).to_desired(bed.key(&names[0]), 1, None);
    let stopped = tether::lease::DesiredStream {
        desired_state: tether::lease::DesiredState::Stopped,
        ..stopped
    };
    assert_eq!(
        bed.store.upsert_desired(&stopped).await.unwrap(),
        tether::lease::UpsertOutcome::Unchanged
    );
    eventually(
        Duration::from_secs(10),
        "the changed stream reads its new URL",
        || async {
            let open = bed.upstream.open_sessions();
            open.get(moved) == Some(&1) && !open.contains_key(names[1].as_str())
        },
    )
    .await;
    eventually(
        Duration::from_secs(10),
        "the stopped stream is closed and released",
        || async {
            let item = bed.store.get(&bed.key(&names[0])).await.unwrap().unwrap();
            !bed.upstream.open_sessions().contains_key(names[0].as_str())
                && item.ownership() == Ownership::Free
        },
    )
    .await;
}

/// A STOPPED written into an item with no notification, no bump of the
/// change counter and no mirror after it (a person editing the table) is
/// acted on at the owner's audit of its partitions, at the latest every 16
/// heartbeats while the counter stands still; one followed by a bump (a
/// writer whose notification alone was lost) at the next audit tick, every
/// 4 heartbeats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_nobody_announced_is_acted_on_at_the_audit_and_a_bump_brings_it_forward() {
    let mut bed = bed().await;
    // Ticks every 4 s, audits at least every 16 s.
    bed.fleet.workers.lease_duration = Duration::from_secs(3);
    bed.fleet.workers.heartbeat_interval = Duration::from_secs(1);
    let names = bed.apply("unsaid", 2).await.unwrap();
    let w = bed.fleet.spawn("w").unwrap();
    eventually(Duration::from_secs(20), "both streams are served", || {
        bed.all_connected_once(&names)
    })
    .await;
    let raw = raw_client().await;
    let released = |name: String| {
        let bed = &bed;
        move || {
            let name = name.clone();
            async move {
                let item = bed.store.get(&bed.key(&name)).await.unwrap().unwrap();
                !bed.upstream.open_sessions().contains_key(name.as_str())
                    && item.ownership() == Ownership::Free
            }
        }
    };
    // Unannounced: the audit at most 16 heartbeats after the last one.
    set_unannounced(&raw, &bed, &names[0], "desired_state", "STOPPED".into())
        .await
        .unwrap();
    eventually(
        Duration::from_secs(25),
        "the stream stopped by hand is released",
        released(names[0].clone()),
    )
    .await;
    // Its release moved the counter: audits follow ticks until one lands
    // past the index's lag after it (5 s here). Once no audit came for 6 s,
    // the next is the one 16 heartbeats on; right after it, the counter
    // moves after the write: the next tick audits, 4 s on, where without
    // the bump the next audit would be 16 s on.
    let audits = || w.requests("query_held");
    let (mut seen, mut since) = (audits().await, std::time::Instant::now());
    while since.elapsed() < Duration::from_secs(6) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = audits().await;
        if now != seen {
            (seen, since) = (now, std::time::Instant::now());
        }
    }
    eventually(Duration::from_secs(20), "the quiet audit", || async {
        audits().await != seen
    })
    .await;
    set_unannounced(&raw, &bed, &names[1], "desired_state", "STOPPED".into())
        .await
        .unwrap();
    bed.store.announce_change().await;
    eventually(
        Duration::from_secs(8),
        "the stream stopped with a bump is released within a tick",
        released(names[1].clone()),
    )
    .await;
}

/// A reconnect request whose notification was lost (its writer stopped
/// between the item write and the notification) is acted on when the
/// resource is mirrored again, not at the sweep minutes later: the owner
/// writes the requests its session acted on with its status, and a mirror
/// that finds them behind the item tells it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_request_nobody_announced_is_acted_on_when_mirrored_again() {
    let mut bed = bed().await;
    // Audits every 20 s, the first 20 s after the start: neither they nor
    // the sweep can be what acts on the request within seconds.
    bed.fleet.workers.lease_duration = Duration::from_secs(15);
    bed.fleet.workers.heartbeat_interval = Duration::from_secs(5);
    let names = bed.apply("asked", 1).await.unwrap();
    let name = names[0].as_str();
    let _w = bed.fleet.spawn("w").unwrap();
    eventually(
        Duration::from_secs(20),
        "the stream is served and its status records what it acted on",
        || async {
            let item = bed.store.get(&bed.key(name)).await.unwrap().unwrap();
            bed.all_connected_once(&names).await && item.served_requests.is_some()
        },
    )
    .await;
    let sessions = bed.upstream.sessions_of(name).len();
    raw_client()
        .await
        .update_item()
        .table_name(bed.store.table())
        .key("Pk", AttributeValue::S(bed.key(name).pk()))
        .update_expression("SET reconnect_request = :v")
        .expression_attribute_values(":v", AttributeValue::S("r1".into()))
        .send()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        bed.upstream.sessions_of(name).len(),
        sessions,
        "the unannounced request was acted on before anyone mirrored it again"
    );
    let mut desired = bed.spec(name).to_desired(bed.key(name), 1, None);
    desired.requests.reconnect = Some("r1".into());
    assert_eq!(
        bed.store.upsert_desired(&desired).await.unwrap(),
        tether::lease::UpsertOutcome::Unchanged
    );
    eventually(Duration::from_secs(10), "the owner reconnects", || async {
        bed.upstream.sessions_of(name).len() > sessions && bed.connected_once(&names)
    })
    .await;
    bed.assert_safe(&names, 0);
}

/// Nothing stranded (property 5b): a crashed worker whose item then
/// disappears (as a TTL would remove it, or a person) still has its streams
/// found through the roster and served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_workers_streams_are_served_again_after_its_item_disappeared() {
    let bed = bed().await;
    let names = bed.apply("vanish", 6).await.unwrap();
    let victim = bed.fleet.spawn("victim").unwrap();
    eventually(
        Duration::from_secs(20),
        "the victim serves all six",
        || async {
            bed.all_connected_once(&names).await && bed.owned_by(&victim.id).await == names.len()
        },
    )
    .await;
    let owner = bed
        .store
        .get(&bed.key(&names[0]))
        .await
        .unwrap()
        .unwrap()
        .lease_owner
        .unwrap();
    victim.signal(Signal::SIGKILL).unwrap();
    raw_client()
        .await
        .delete_item()
        .table_name(bed.store.table())
        .key(
            "Pk",
            AttributeValue::S(tether::lease::Incarnation::parse(&owner).unwrap().pk()),
        )
        .send()
        .await
        .unwrap();
    let _peer = bed.fleet.spawn("peer").unwrap();
    eventually(
        Duration::from_secs(30),
        "every stream is served again",
        || async {
            bed.owned_by("peer").await == names.len() && bed.all_connected_once(&names).await
        },
    )
    .await;
}

/// The heartbeat's critical path holds only the renewal (property 5b): in a
/// brownout where every DynamoDB call takes a second, a worker whose streams
/// keep going idle (each idle checkpoint is folded into its item, one write
/// each) still renews in time and never fences itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_brownout_never_delays_the_renewal_behind_checkpoint_folds() {
    let bed = Bed::start(
        EXE,
        BedOptions {
            message_every: Some(Duration::from_secs(5)),
            ..BedOptions::default()
        },
    )
    .await
    .unwrap();
    let names = bed.apply("idle", 20).await.unwrap();
    let proxy = DynamoFaultProxy::start(loopback(), &endpoint().0)
        .await
        .unwrap();
    let worker = bed
        .fleet
        .spawn_with("w", &proxy.endpoint(), &["--no-rebalance"])
        .unwrap();
    eventually(Duration::from_secs(20), "every stream is served", || {
        bed.all_connected_once(&names)
    })
    .await;
    proxy.set(DynamoFault::Slow(Duration::from_secs(1)));
    tokio::time::sleep(Duration::from_secs(15)).await;
    let metrics = worker.metrics().await.unwrap();
    proxy.set(DynamoFault::Pass);
    assert_eq!(
        metric_value(&metrics, "tether_self_fences_total"),
        Some(0.0),
        "a healthy worker fenced itself in a brownout"
    );
    assert!(bed.all_connected_once(&names).await);
}

/// Nothing of a released owner lands after the release (property 1b): a
/// graceful stop while the sink is slow, with a sink that keeps processing a
/// request after the client hung up. The stop budget runs out with a batch
/// still out; releasing then would let the next owner's batches land before
/// it. So the release waits until the sink can no longer apply it (its
/// timeout), or, past the drain budget, the lease lapses instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_never_lets_a_batch_still_out_land_after_the_next_owners() {
    let bed = bed().await;
    let names = apply_with_sink_timeout(&bed, "out", 3, 5).await;
    let (mut victim, _peer) = victim_with_a_peer(&bed, &names, bed.fleet.endpoint()).await;
    // The batches out now take longer than the stop budget (half the 5 s
    // drain), within the sink's timeout; later ones (the peer's) are fast.
    bed.sink_proxy
        .set(SinkFault::SlowAfterHangUp(Duration::from_secs(4)));
    victim.signal(Signal::SIGTERM).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    bed.sink_proxy.set(SinkFault::Pass);
    let _ = victim.wait(Duration::from_secs(30)).await;
    eventually(
        Duration::from_secs(30),
        "the peer serves every stream",
        || async {
            bed.all_connected_once(&names).await && bed.owned_by("peer").await == names.len()
        },
    )
    .await;
    // Whatever the victim had out has landed or never will.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        bed.stale(&names),
        0,
        "a batch of the old owner was applied after the new owner's"
    );
    bed.assert_safe(&names, 5);
}
