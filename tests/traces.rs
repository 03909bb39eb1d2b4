//! Trace export end to end: real workers export OTLP/HTTP (JSON) to an
//! in-test receiver, configured only by the standard `OTEL_*` variables, and
//! the spans of one stream across a SIGTERM handoff form the expected tree.

use nix::sys::signal::Signal;
use std::time::Duration;
use tether_testkit::bed::{Bed, BedOptions, eventually, loopback};
use tether_testkit::otlp::{OtlpReceiver, Span};

const TETHER: &str = env!("CARGO_BIN_EXE_tether");

fn children<'a>(spans: &'a [Span], parent: &Span, name: &str) -> Vec<&'a Span> {
    spans
        .iter()
        .filter(|s| {
            s.name == name && s.parent_span_id == parent.span_id && s.trace_id == parent.trace_id
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_streams_spans_form_a_tree_per_session_across_a_handoff() {
    let bed = Bed::start(TETHER, BedOptions::default()).await.unwrap();
    let receiver = OtlpReceiver::start(loopback()).await.unwrap();
    let mut fleet = bed.fleet.clone();
    for (k, v) in [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json".into()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        ("OTEL_SERVICE_NAME", "tether-under-test".into()),
    ] {
        fleet.env.push((k.into(), v));
    }
    let names = bed.apply("t", 1).await.unwrap();
    let stream = format!("{}/{}", bed.namespace, names[0]);
    let mut first = fleet.spawn("first").unwrap();
    eventually(
        Duration::from_secs(20),
        "the first owner delivers",
        || async { bed.log(&names[0]).max_seq().is_some_and(|s| s >= 10) },
    )
    .await;
    let mut second = fleet.spawn("second").unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    first.signal(Signal::SIGTERM).unwrap();
    assert!(first.wait(Duration::from_secs(10)).await.unwrap().success());
    let handed_over_at = bed.log(&names[0]).max_seq().unwrap_or(0);
    eventually(
        Duration::from_secs(20),
        "the second owner delivers",
        || async {
            bed.log(&names[0])
                .max_seq()
                .is_some_and(|s| s >= handed_over_at + 10)
        },
    )
    .await;
    // Its session span ends, and the exporter flushes, at a clean exit.
    second.signal(Signal::SIGTERM).unwrap();
    assert!(
        second
            .wait(Duration::from_secs(10))
            .await
            .unwrap()
            .success()
    );

    let spans = receiver.spans();
    assert!(spans.iter().all(|s| s.service == "tether-under-test"));
    let mut sessions: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "session" && s.attr("stream") == stream)
        .collect();
    sessions.sort_by_key(|s| s.attr("token").parse::<u64>().unwrap_or(0));
    assert_eq!(
        sessions.len(),
        2,
        "one session span per owner: {sessions:#?}"
    );
    let (before, after) = (sessions[0], sessions[1]);
    assert!(before.attr("worker").starts_with("first"));
    assert!(after.attr("worker").starts_with("second"));
    assert!(
        after.attr("token").parse::<u64>().unwrap() > before.attr("token").parse::<u64>().unwrap()
    );
    for session in [before, after] {
        let connects = children(&spans, session, "connect");
        assert_eq!(connects.len(), 1, "one connect under {session:?}");
        let batches = children(&spans, session, "sink.batch");
        assert!(
            batches
                .iter()
                .any(|b| b.attr("result") == "ok" && b.attr("sink") == "http"),
            "acknowledged sink batches under the session"
        );
    }
    // The second session resumed where the first one's checkpoint was.
    let resume: i64 = children(&spans, after, "connect")[0]
        .attr("resume_from")
        .parse()
        .unwrap();
    assert!(
        resume >= 10,
        "resumed from the handed-over checkpoint, not from scratch: {resume}"
    );
    // Lease operations of the stream, by both owners.
    let lease_ops = |name: &str, worker: &str| {
        spans
            .iter()
            .filter(|s| {
                s.name == name && s.attr("stream") == stream && s.attr("worker").starts_with(worker)
            })
            .count()
    };
    assert!(lease_ops("lease.acquire", "first") >= 1);
    assert!(lease_ops("lease.acquire", "second") >= 1);
    assert!(lease_ops("lease.release", "first") >= 1);
    // The HTTP sink received the trace context of the batch that carried it.
    let batch_ids: std::collections::HashSet<(String, String)> = spans
        .iter()
        .filter(|s| s.name == "sink.batch")
        .map(|s| (s.trace_id.clone(), s.span_id.clone()))
        .collect();
    let traceparents = bed.sink_proxy.traceparents();
    assert!(!traceparents.is_empty(), "requests carry traceparent");
    for tp in &traceparents {
        let parts: Vec<&str> = tp.split('-').collect();
        assert_eq!(parts.len(), 4, "W3C traceparent: {tp}");
        assert!(
            batch_ids.contains(&(parts[1].to_string(), parts[2].to_string())),
            "{tp} names an exported sink.batch span"
        );
    }
}
