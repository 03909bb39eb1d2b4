//! Sink throughput: one worker forwarding the same offered load to each sink
//! kind in turn — the HTTP sink (a counting server), Kinesis (kinesalite) and
//! NATS JetStream (nats-server) — measured in the same run. Messages are
//! counted by the worker (`tether_messages_delivered_total`, acknowledged
//! only) and its CPU is read from /proc. The servers share this machine's two
//! cores with the worker, and kinesalite is a Node.js emulator, not Kinesis:
//! the figures compare the sinks' paths here, not the services.

use crate::Ctx;
use serde_json::{Value, json};
use std::time::Duration;
use tether::crd::StreamConnectionSpec;
use tether_testkit::bed::{Bed, BedOptions, loopback, names};
use tether_testkit::processes::metric_value;
use tether_testkit::sink::CountingSink;
use tether_testkit::sink_servers::{Kinesalite, NatsServer};
use tokio::time::Instant;

/// Messages per second each session is offered.
const RATE: u32 = 1000;
/// Sessions, so the offered load is RATE × SESSIONS.
const SESSIONS: usize = 10;

pub async fn run(ctx: &Ctx) -> anyhow::Result<Value> {
    let window = ctx.profile.throughput_window;
    let mut out = serde_json::Map::new();
    for kind in ["http", "kinesis", "nats"] {
        let figure = one(ctx, kind, window).await?;
        println!(
            "sink throughput    {kind:<8} {:>8} msg/s acknowledged | {:>8} msg per worker CPU second (offered {} msg/s)",
            figure["msgs_per_s"],
            figure["msgs_per_cpu_s"],
            RATE as usize * SESSIONS
        );
        out.insert(kind.into(), figure);
    }
    out.insert("offered_msgs_per_s".into(), json!(RATE as usize * SESSIONS));
    out.insert("window_s".into(), json!(window.as_secs_f64()));
    Ok(Value::Object(out))
}

async fn one(ctx: &Ctx, kind: &str, window: Duration) -> anyhow::Result<Value> {
    let bed = Bed::start(
        ctx.exe.clone(),
        BedOptions {
            rate: RATE,
            ..BedOptions::default()
        },
    )
    .await?;
    let mut fleet = bed.fleet.clone();
    fleet.workers.lease_duration = ctx.profile.lease;
    fleet.workers.heartbeat_interval = ctx.profile.heartbeat;
    fleet.workers.fence_margin = Duration::from_secs(1);
    let (mut _http, mut _kinesis, mut _nats) = (None, None, None);
    let sink = match kind {
        "http" => {
            let s = CountingSink::start(loopback()).await?;
            let sink = json!({"http": {"url": s.url(), "maxBatchMessages": 500, "lingerMs": 5}});
            _http = Some(s);
            sink
        }
        "kinesis" => {
            let k = Kinesalite::start("bench", 4).await?;
            fleet.env.push((
                "AWS_ENDPOINT_URL_KINESIS".into(),
                format!("http://{}", k.addr),
            ));
            _kinesis = Some(k);
            json!({"kinesis": {"streamName": "bench", "maxBatchRecords": 500, "lingerMs": 5}})
        }
        _ => {
            let n = NatsServer::start("BENCH", &["bench.>"]).await?;
            fleet.env.push(("NATS_USER".into(), n.user.clone()));
            fleet.env.push(("NATS_PASSWORD".into(), n.password.clone()));
            let sink = json!({"nats": {
                "url": n.url(), "subject": "bench.all", "stream": "BENCH",
                "credentials": {"user": {"env": "NATS_USER"}, "password": {"env": "NATS_PASSWORD"}},
                "maxBatchMessages": 500, "lingerMs": 5
            }});
            _nats = Some(n);
            sink
        }
    };
    let names = names(&format!("sink-{kind}"), SESSIONS);
    for n in &names {
        let spec: StreamConnectionSpec = serde_json::from_value(json!({
            "url": bed.upstream.url(n),
            "sequence": {"pointer": "/seq"},
            "sink": sink,
        }))?;
        bed.apply_spec(n, &spec, 1).await?;
    }
    let worker = fleet.spawn(&format!("sinks-{kind}"))?;
    let pid = worker.pid().unwrap_or_default();
    Bed::wait(
        Duration::from_secs(60),
        "sink streams connected",
        || async { bed.connected_once(&names) },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let delivered = |text: Result<String, String>| {
        text.ok()
            .and_then(|t| metric_value(&t, "tether_messages_delivered_total"))
            .unwrap_or(0.0)
    };
    let cpu = || tether::process_metrics::stat(Some(pid)).map_or(0.0, |s| s.cpu_seconds);
    let (m0, c0, t0) = (delivered(worker.metrics().await), cpu(), Instant::now());
    tokio::time::sleep(window).await;
    let (m1, c1) = (delivered(worker.metrics().await), cpu());
    let seconds = t0.elapsed().as_secs_f64();
    let rate = (m1 - m0) / seconds;
    let cpu_used = (c1 - c0).max(1e-6);
    Ok(json!({
        "msgs_per_s": rate.round(),
        "worker_cpu_cores": ((cpu_used / seconds) * 100.0).round() / 100.0,
        "msgs_per_cpu_s": ((m1 - m0) / cpu_used).round(),
    }))
}
