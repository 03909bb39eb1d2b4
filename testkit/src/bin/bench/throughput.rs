//! Forwarding throughput: one worker forwarding sessions' messages to an HTTP
//! sink, against bare tokio-tungstenite read loops over the same feed.

use crate::Ctx;
use futures::StreamExt;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tether::crd::StreamConnectionSpec;
use tether_testkit::bed::{Bed, BedOptions, loopback, names};
use tether_testkit::sink::CountingSink;
use tokio::time::Instant;

/// Messages per second each session is offered.
const RATE: u32 = 4000;

pub async fn run(ctx: &Ctx) -> anyhow::Result<Value> {
    let p = &ctx.profile;
    let bed = Bed::start(
        ctx.exe.clone(),
        BedOptions {
            rate: RATE,
            ..BedOptions::default()
        },
    )
    .await?;
    let bare = bare_read_rate(&bed, p.throughput_sessions, p.throughput_window).await?;
    let sink = CountingSink::start(loopback()).await?;
    let names = names("tput", p.throughput_sessions);
    for n in &names {
        let spec: StreamConnectionSpec = serde_json::from_value(json!({
            "url": bed.upstream.url(n),
            "sequence": {"pointer": "/seq"},
            "sink": {"http": {"url": sink.url(), "maxBatchMessages": 500, "lingerMs": 5}},
        }))?;
        bed.apply_spec(n, &spec, 1).await?;
    }
    let mut fleet = bed.fleet.clone();
    fleet.workers.lease_duration = p.lease;
    fleet.workers.heartbeat_interval = p.heartbeat;
    fleet.workers.fence_margin = Duration::from_secs(1);
    let worker = fleet.spawn("tput")?;
    Bed::wait(
        Duration::from_secs(60),
        "throughput streams connected",
        || async { bed.connected_once(&names) },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let m0 = sink.messages();
    let t0 = Instant::now();
    tokio::time::sleep(p.throughput_window).await;
    let rate = (sink.messages() - m0) as f64 / t0.elapsed().as_secs_f64();
    drop(worker);
    let offered = f64::from(RATE) * p.throughput_sessions as f64;
    let ratio = rate / bare;
    println!(
        "throughput         tether {rate:>9.0} msg/s to the HTTP sink | bare read loop {bare:>9.0} msg/s | ratio {ratio:.2} (offered {offered:.0} msg/s)"
    );
    Ok(json!({
        "sessions": p.throughput_sessions,
        "offered_msgs_per_s": offered,
        "tether_msgs_per_s": rate.round(),
        "bare_tokio_tungstenite_msgs_per_s": bare.round(),
        "ratio": (ratio * 100.0).round() / 100.0,
    }))
}

async fn bare_read_rate(bed: &Bed, sessions: usize, window: Duration) -> anyhow::Result<f64> {
    let counter = Arc::new(AtomicU64::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    let mut tasks = Vec::new();
    for i in 0..sessions {
        let url = bed
            .upstream
            .url(&format!("bare-{i:03}"))
            .replace("{last_seq}", "0");
        let (mut ws, _) = tokio_tungstenite::connect_async(url).await?;
        let counter = counter.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    m = ws.next() => match m {
                        Some(Ok(tokio_tungstenite::tungstenite::Message::Text(_))) => {
                            counter.fetch_add(1, Ordering::Relaxed);
                        }
                        Some(Ok(_)) => {}
                        _ => break,
                    }
                }
            }
            let _ = ws.close(None).await;
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let c0 = counter.load(Ordering::Relaxed);
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let rate = (counter.load(Ordering::Relaxed) - c0) as f64 / t0.elapsed().as_secs_f64();
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    Ok(rate)
}
