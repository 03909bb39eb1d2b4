//! The Kinesis and NATS JetStream sinks against real servers (kinesalite,
//! nats-server with JetStream), read back as their consumers would: every
//! sequence number arrives, first arrivals in order, no record of an older
//! owner after a newer one, across a sink outage and a SIGKILL.

use nix::sys::signal::Signal;
use std::time::Duration;
use tether::crd::StreamConnectionSpec;
use tether::lease::SessionStatus;
use tether_testkit::bed::{Bed, BedOptions, loopback, names};
use tether_testkit::fixtures::{kinesis_spec, nats_spec};
use tether_testkit::processes::{FleetConfig, WorkerProcess, metric_sum};
use tether_testkit::proxy::{FaultProxy, ProxyMode};
use tether_testkit::sink_servers::{Delivered, Kinesalite, NatsServer, check_stream};

const TETHER: &str = env!("CARGO_BIN_EXE_tether");
/// How long the sink is unreachable.
const OUTAGE: Duration = Duration::from_secs(3);
/// Generous bound for anything the fleet does in seconds.
const LIMIT: Duration = Duration::from_secs(40);

/// Highest sequence number delivered per stream.
fn highest(records: &[Delivered], connection: &str) -> Option<u64> {
    records
        .iter()
        .filter(|r| r.connection == connection)
        .map(|r| r.seq)
        .max()
}

/// Runs the scenario every sink must survive and returns what arrived.
/// Streams deliver through `proxy`; `records` reads the server back.
async fn outage_and_sigkill<F, Fut>(
    bed: &Bed,
    fleet: &FleetConfig,
    proxy: &FaultProxy,
    specs: &[(String, StreamConnectionSpec)],
    records: F,
) -> anyhow::Result<Vec<Delivered>>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Vec<Delivered>>>,
{
    for (name, spec) in specs {
        bed.apply_spec(name, spec, 1).await?;
    }
    let connections: Vec<String> = specs
        .iter()
        .map(|(n, _)| format!("{}/{n}", bed.namespace))
        .collect();
    let workers: Vec<WorkerProcess> = vec![fleet.spawn("a")?, fleet.spawn("b")?];
    let reached = |at_least: u64| {
        let connections = connections.clone();
        let records = &records;
        async move {
            let got = records().await.unwrap_or_default();
            connections
                .iter()
                .all(|c| highest(&got, c).is_some_and(|s| s >= at_least))
        }
    };
    Bed::wait(LIMIT, "every stream delivered 20 messages", || reached(20)).await?;

    proxy.set_mode(ProxyMode::Blackhole);
    tokio::time::sleep(OUTAGE).await;
    proxy.set_mode(ProxyMode::Pass);
    let after_outage = records().await?;
    let mark = connections
        .iter()
        .filter_map(|c| highest(&after_outage, c))
        .max()
        .unwrap_or(0);

    // SIGKILL whichever worker owns the first stream.
    let owners = bed.owners().await;
    let victim = owners
        .get(&specs[0].0)
        .and_then(|o| workers.iter().position(|w| o.starts_with(w.id.as_str())))
        .unwrap_or(0);
    workers[victim].signal(Signal::SIGKILL)?;
    let survivor = &workers[1 - victim];
    Bed::wait(LIMIT, "the survivor owns every stream", || async {
        bed.owned_by(&survivor.id).await == specs.len()
    })
    .await?;
    Bed::wait(LIMIT, "every stream moved 60 past the outage", || {
        reached(mark + 60)
    })
    .await?;
    let metrics = survivor.metrics().await.map_err(anyhow::Error::msg)?;
    anyhow::ensure!(
        metric_sum(&metrics, "tether_sink_batches_total", "result=\"ok\"") > 0.0,
        "the survivor counted acknowledged batches"
    );
    records().await
}

/// The stream's session status as its owner last wrote it, if any.
async fn status(bed: &Bed, key: &tether::lease::StreamKey) -> Option<SessionStatus> {
    bed.store
        .get(key)
        .await
        .ok()
        .flatten()
        .and_then(|r| r.status)
}

/// The reason the stream's status gives, if any.
async fn reason(bed: &Bed, key: &tether::lease::StreamKey) -> Option<String> {
    status(bed, key).await.and_then(|s| s.reason)
}

fn assert_complete(records: &[Delivered], bed: &Bed, names: &[String]) {
    let mut problems = Vec::new();
    for name in names {
        let connection = format!("{}/{name}", bed.namespace);
        let top = highest(records, &connection).unwrap_or(0);
        problems.extend(check_stream(records, &connection, bed.first_seq, top));
        let tokens: std::collections::BTreeSet<u64> = records
            .iter()
            .filter(|r| r.connection == connection)
            .map(|r| r.token)
            .collect();
        assert!(
            !tokens.contains(&0),
            "{connection}: every record carries its token"
        );
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinesis_sink_keeps_every_message_in_order_across_an_outage_and_a_sigkill() {
    let bed = Bed::start(TETHER, BedOptions::default()).await.unwrap();
    let kinesis = Kinesalite::start("feeds", 2).await.unwrap();
    let proxy = FaultProxy::start(loopback(), kinesis.addr).await.unwrap();
    let mut fleet = bed.fleet.clone();
    fleet
        .env
        .push(("AWS_ENDPOINT_URL_KINESIS".into(), proxy.endpoint()));
    let names = names("kin", 3);
    // The first stream's records carry each message as a JSON value.
    let specs: Vec<_> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let mut spec = kinesis_spec(&bed.upstream.url(n), "feeds");
            if i == 0 {
                as_json(&mut spec);
            }
            (n.clone(), spec)
        })
        .collect();
    let records = outage_and_sigkill(&bed, &fleet, &proxy, &specs, || kinesis.records())
        .await
        .unwrap();
    assert_complete(&records, &bed, &names);
    // Per stream, one partition key: a consumer reads a stream's records in order.
    for (i, name) in names.iter().enumerate() {
        let connection = format!("{}/{name}", bed.namespace);
        assert!(
            records
                .iter()
                .filter(|r| r.connection == connection)
                .all(|r| !r.worker.is_empty() && r.data.contains("\"seq\"")),
            "records carry the owner and the upstream's message"
        );
        assert_carried(&records, &connection, i == 0);
    }
}

/// `dataFormat: json` on whichever sink `spec` has.
fn as_json(spec: &mut StreamConnectionSpec) {
    let format = tether::crd::DataFormat::Json;
    if let Some(http) = &mut spec.sink.http {
        http.data_format = format;
    }
    if let Some(kinesis) = &mut spec.sink.kinesis {
        kinesis.data_format = format;
    }
}

/// Every record of `connection` carried its message as a JSON value (or
/// every one as a string), and a value is the upstream's message itself:
/// its own `seq` is the record's.
fn assert_carried(records: &[Delivered], connection: &str, as_json: bool) {
    let ours: Vec<&Delivered> = records
        .iter()
        .filter(|r| r.connection == connection)
        .collect();
    assert!(!ours.is_empty(), "{connection}: no records");
    for r in ours {
        assert_eq!(r.as_json, as_json, "{connection}: {r:?}");
        let message: serde_json::Value = serde_json::from_str(&r.data).unwrap();
        assert_eq!(message["seq"].as_u64(), Some(r.seq), "{connection}: {r:?}");
    }
}

/// The HTTP sink with `dataFormat: json`, beside a stream with the default:
/// each body carries the messages as values (the verifying sink checks each
/// value's own `seq` against the envelope's), the other stream's as
/// strings, across a SIGKILL of the owner, with nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_sink_carries_messages_as_json_values_when_asked() {
    let bed = Bed::start(TETHER, BedOptions::default()).await.unwrap();
    let names = names("js", 2);
    for (i, name) in names.iter().enumerate() {
        let mut spec = bed.spec(name);
        if i == 0 {
            as_json(&mut spec);
        }
        bed.apply_spec(name, &spec, 1).await.unwrap();
    }
    let a = bed.fleet.spawn("a").unwrap();
    let b = bed.fleet.spawn("b").unwrap();
    let past = |seq: u64| {
        let names = names.clone();
        let bed = &bed;
        async move {
            names
                .iter()
                .all(|n| bed.log(n).max_seq().is_some_and(|s| s >= seq))
        }
    };
    Bed::wait(LIMIT, "both streams delivered 20", || past(20))
        .await
        .unwrap();
    let owner = bed
        .owners()
        .await
        .get(&names[0])
        .cloned()
        .unwrap_or_default();
    let victim = if owner.starts_with(a.id.as_str()) {
        &a
    } else {
        &b
    };
    victim.signal(Signal::SIGKILL).unwrap();
    let mark = names
        .iter()
        .filter_map(|n| bed.log(n).max_seq())
        .max()
        .unwrap_or(0);
    Bed::wait(LIMIT, "both streams moved 30 past the kill", || {
        past(mark + 30)
    })
    .await
    .unwrap();
    bed.assert_safe(&names, mark + 30);
    let json = bed.log(&names[0]);
    let total: u32 = json.seqs.values().sum();
    assert_eq!(
        u64::from(total),
        json.carried_as_json,
        "every message as a value"
    );
    assert_eq!(json.json_mismatched, 0, "each value is its own message");
    let string = bed.log(&names[1]);
    assert_eq!(string.carried_as_json, 0, "the default carries strings");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinesis_sink_outside_the_allowed_streams_is_refused_with_a_reason() {
    let bed = Bed::start(TETHER, BedOptions::default()).await.unwrap();
    let mut fleet = bed.fleet.clone();
    fleet.extra_args = vec!["--kinesis-streams".into(), "{namespace}-*".into()];
    let mut worker = fleet.spawn("a").unwrap();
    bed.apply_spec(
        "other",
        &kinesis_spec(&bed.upstream.url("other"), "team-b-audio"),
        1,
    )
    .await
    .unwrap();
    let key = bed.key("other");
    Bed::wait(LIMIT, "the stream reports SinkNotAllowed", || async {
        reason(&bed, &key).await.as_deref() == Some("SinkNotAllowed")
    })
    .await
    .unwrap();
    assert!(
        !bed.connected_once(&["other".to_string()]),
        "nothing was dialled"
    );
    worker.signal(Signal::SIGTERM).unwrap();
    let _ = worker.wait(Duration::from_secs(10)).await;
    // Released on shutdown, the refusal still says what to fix.
    assert_eq!(
        reason(&bed, &key).await.as_deref(),
        Some("SinkNotAllowed"),
        "the owner's graceful stop overwrote the reason"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_sink_keeps_every_message_in_order_across_an_outage_and_a_sigkill() {
    let bed = Bed::start(TETHER, BedOptions::default()).await.unwrap();
    let nats = NatsServer::start("FEEDS", &["feeds.>"]).await.unwrap();
    let proxy = FaultProxy::start(loopback(), nats.addr).await.unwrap();
    let mut fleet = bed.fleet.clone();
    fleet.env.push(("NATS_USER".into(), nats.user.clone()));
    fleet
        .env
        .push(("NATS_PASSWORD".into(), nats.password.clone()));
    let names = names("nats", 3);
    let url = format!("nats://{}", proxy.addr);
    let specs: Vec<_> = names
        .iter()
        .map(|n| {
            let subject = format!("feeds.{n}");
            (
                n.clone(),
                nats_spec(&bed.upstream.url(n), &url, &subject, "FEEDS"),
            )
        })
        .collect();
    let records = outage_and_sigkill(&bed, &fleet, &proxy, &specs, || nats.records())
        .await
        .unwrap();
    assert_complete(&records, &bed, &names);
    // JetStream's duplicate window (Nats-Msg-Id) stores a replayed message once.
    let mut ids: Vec<(String, u64)> = records
        .iter()
        .map(|r| (r.connection.clone(), r.seq))
        .collect();
    let total = ids.len();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), total, "no message stored twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_jetstream_stream_holds_the_rest_of_a_batch_until_there_is_room() {
    let bed = Bed::start(TETHER, BedOptions::default()).await.unwrap();
    let nats = NatsServer::start("FULL", &["full.>"]).await.unwrap();
    let js = nats.jetstream();
    let mut config = js
        .get_stream("FULL")
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    config.max_messages = 30;
    config.discard = async_nats::jetstream::stream::DiscardPolicy::New;
    js.update_stream(config.clone()).await.unwrap();
    let mut fleet = bed.fleet.clone();
    fleet.env.push(("NATS_USER".into(), nats.user.clone()));
    fleet
        .env
        .push(("NATS_PASSWORD".into(), nats.password.clone()));
    let worker = fleet.spawn("a").unwrap();
    let mut spec = nats_spec(&bed.upstream.url("full"), &nats.url(), "full.one", "FULL");
    // Full batches of 20, so the one that crosses the limit is partly accepted.
    if let Some(n) = spec.sink.nats.as_mut() {
        n.linger_ms = 2000;
    }
    bed.apply_spec("full", &spec, 1).await.unwrap();
    let key = bed.key("full");
    Bed::wait(
        LIMIT,
        "the full stream holds reads and says why",
        || async { reason(&bed, &key).await.as_deref() == Some("SinkUnavailable") },
    )
    .await
    .unwrap();
    let metrics = worker.metrics().await.unwrap();
    assert!(
        metric_sum(&metrics, "tether_sink_batches_total", "result=\"partial\"") > 0.0,
        "a batch was partly accepted"
    );
    let held = nats.records().await.unwrap();
    assert_eq!(held.len(), 30, "the stream took exactly its limit");
    config.max_messages = -1;
    js.update_stream(config).await.unwrap();
    Bed::wait(LIMIT, "delivery resumes past the limit", || async {
        highest(&nats.records().await.unwrap_or_default(), "fleet/full").is_some_and(|s| s >= 80)
    })
    .await
    .unwrap();
    let records = nats.records().await.unwrap();
    let top = highest(&records, "fleet/full").unwrap();
    let problems = check_stream(&records, "fleet/full", bed.first_seq, top);
    assert!(problems.is_empty(), "{problems:#?}");
}

/// Two rows of the tenancy matrix, through a real worker process and real
/// sockets: a sink that answers `307` to a forbidden address (an IP literal,
/// which no resolver and so no host policy ever sees) and a sink on an IPv6
/// link-local address. Both get nothing and say why in their status; a
/// stream with an ordinary sink on the same worker keeps flowing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sinks_that_redirect_or_sit_on_link_local_addresses_get_nothing() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    let bed = Bed::start(TETHER, BedOptions::default()).await.unwrap();
    // The forbidden address counts every connection it is offered.
    let forbidden = TcpListener::bind(loopback()).await.unwrap();
    let forbidden_addr = forbidden.local_addr().unwrap();
    let offered = Arc::new(AtomicUsize::new(0));
    let counter = offered.clone();
    tokio::spawn(async move {
        while let Ok((_socket, _)) = forbidden.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
        }
    });
    let redirector = TcpListener::bind(loopback()).await.unwrap();
    let redirector_addr = redirector.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = redirector.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = socket.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    let answer = format!(
                        "HTTP/1.1 307 Temporary Redirect\r\nLocation: http://{forbidden_addr}/steal\r\nContent-Length: 0\r\n\r\n"
                    );
                    if socket.write_all(answer.as_bytes()).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    let mut worker = bed.fleet.spawn("a").unwrap();
    let http_spec = tether_testkit::fixtures::http_spec;
    bed.apply_spec(
        "redirected",
        &http_spec(
            &bed.upstream.url("redirected"),
            &format!("http://{redirector_addr}/ingest"),
        ),
        1,
    )
    .await
    .unwrap();
    bed.apply_spec(
        "link-local",
        &http_spec(
            &bed.upstream.url("link-local"),
            "http://[fe80::1]:8080/ingest",
        ),
        1,
    )
    .await
    .unwrap();
    bed.apply_spec("ordinary", &bed.spec("ordinary"), 1)
        .await
        .unwrap();
    Bed::wait(
        LIMIT,
        "the link-local sink is refused with a reason",
        || async {
            reason(&bed, &bed.key("link-local")).await.as_deref() == Some("SinkNotAllowed")
        },
    )
    .await
    .unwrap();
    Bed::wait(LIMIT, "the redirect is reported as such", || async {
        status(&bed, &bed.key("redirected")).await.is_some_and(|s| {
            s.reason.as_deref() == Some("SinkUnavailable")
                && s.message
                    .is_some_and(|m| m.contains("307") && m.contains("redirect"))
        })
    })
    .await
    .unwrap();
    Bed::wait(LIMIT, "the ordinary stream keeps flowing", || async {
        bed.delivered(&["ordinary".to_string()]) > 10
    })
    .await
    .unwrap();
    assert_eq!(
        offered.load(Ordering::SeqCst),
        0,
        "a batch followed the redirect"
    );
    assert!(
        !bed.connected_once(&["link-local".to_string()]),
        "the link-local stream's upstream was dialled"
    );
    worker.signal(Signal::SIGTERM).unwrap();
    let _ = worker.wait(Duration::from_secs(10)).await;
}
