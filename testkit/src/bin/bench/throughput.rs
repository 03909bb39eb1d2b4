//! Saturated forwarding throughput, `ws://` and `wss://`: one worker
//! forwarding every message from an upstream that sends as fast as the
//! sockets take (the blaster) to an HTTP sink in batches, next to two floors
//! over the same upstream in the same run: the forwarding floor (the
//! simplest correct forwarder, written plainly: read, batch, POST the raw
//! messages, wait for the answer; `bare.rs`) and a bare tokio-tungstenite
//! (+ tokio-rustls) read loop that sends nothing anywhere — messages per
//! second and per CPU second of the measured process.
//!
//! Saturated means the measured process is the bottleneck: it runs alone on
//! one CPU (`taskset`), while the upstream, the sink and the store (this
//! process) share the others. Its CPU use (≈ 1 core) and the load
//! generator's are reported, so a run where the generator was the limit shows.

use crate::bare::BareClient;
use crate::sessions::idle_bed;
use crate::{Ctx, round2};
use anyhow::Context;
use serde_json::{Value, json};
use std::time::Duration;
use tether::crd::StreamConnectionSpec;
use tether_testkit::bed::{Bed, loopback, names};
use tether_testkit::blaster::Blaster;
use tether_testkit::processes::metric_value;
use tether_testkit::sink::CountingSink;
use tether_testkit::upstream::{self_signed, server_config};
use tokio::time::Instant;

/// Bytes per upstream message (a small JSON event: telemetry, a quote).
const MESSAGE_BYTES: usize = 200;
/// Time after every session is open before the window starts.
const WARM_UP: Duration = Duration::from_secs(3);

pub async fn run(ctx: &Ctx) -> anyhow::Result<Value> {
    let pins = Pins::take()?;
    let sessions = ctx.profile.throughput_sessions;
    let mut out = serde_json::Map::new();
    for scheme in ["ws", "wss"] {
        let bare = bare_loop(ctx, scheme, &pins, false).await?;
        let floor = bare_loop(ctx, scheme, &pins, true).await?;
        let tether = forwarding(ctx, scheme, &pins, "string").await?;
        let tether_json = forwarding(ctx, scheme, &pins, "json").await?;
        let ratio = |of: &Value, k: &str, to: &Value| {
            round2(of[k].as_f64().unwrap_or(f64::NAN) / to[k].as_f64().unwrap_or(f64::NAN))
        };
        for (who, x) in [
            ("tether → HTTP sink", &tether),
            ("tether, json data", &tether_json),
            ("forwarding floor", &floor),
            ("bare read loop", &bare),
        ] {
            println!(
                "throughput {scheme:<3} {who:<18} {:>9} msg/s | {:>9} msg per CPU s | measured process {} cores, load generator {} cores",
                x["msgs_per_s"], x["msgs_per_cpu_s"], x["cpu_cores"], x["load_generator_cpu_cores"]
            );
        }
        let mut figures = json!({
            "tether": tether,
            "tether_json": tether_json,
            "forwarding_floor": floor,
            "bare": bare,
        });
        for (client, prefix) in [("tether", ""), ("tether_json", "json_")] {
            let x = &figures[client];
            let (floor_cpu, floor_s) = (
                ratio(x, "msgs_per_cpu_s", &floor),
                ratio(x, "msgs_per_s", &floor),
            );
            let (per_cpu, per_s) = (
                ratio(x, "msgs_per_cpu_s", &bare),
                ratio(x, "msgs_per_s", &bare),
            );
            println!(
                "throughput {scheme:<3} {client} / forwarding floor: {floor_cpu:.2}× msg per CPU s (goal ≥ 0.8), {floor_s:.2}× msg/s; / bare read loop: {per_cpu:.2}× per CPU s"
            );
            for (k, v) in [
                ("ratio_to_floor_msgs_per_cpu_s", floor_cpu),
                ("ratio_to_floor_msgs_per_s", floor_s),
                ("ratio_msgs_per_cpu_s", per_cpu),
                ("ratio_msgs_per_s", per_s),
            ] {
                figures[format!("{prefix}{k}")] = json!(v);
            }
        }
        out.insert(scheme.into(), figures);
    }
    out.insert("sessions".into(), json!(sessions));
    out.insert("message_bytes".into(), json!(MESSAGE_BYTES));
    out.insert(
        "window_s".into(),
        json!(ctx.profile.throughput_window.as_secs_f64()),
    );
    out.insert("measured_cpu".into(), json!(pins.measured));
    Ok(Value::Object(out))
}

/// tether: `sessions` streams on one worker, the HTTP sink counting what it
/// acknowledged; `data_format` is the sink's (`string` or `json`).
async fn forwarding(
    ctx: &Ctx,
    scheme: &str,
    pins: &Pins,
    data_format: &str,
) -> anyhow::Result<Value> {
    let bed = idle_bed(ctx).await?;
    let (blaster, ca) = blaster(&bed, scheme).await?;
    let sink = CountingSink::start(loopback()).await?;
    let n = ctx.profile.throughput_sessions;
    for name in names("tput", n) {
        let spec: StreamConnectionSpec = serde_json::from_value(json!({
            "url": blaster.url(&name),
            "sequence": {"pointer": "/seq"},
            "sink": {"http": {"url": sink.url(), "maxBatchMessages": 500, "lingerMs": 5, "dataFormat": data_format}},
        }))?;
        bed.apply_spec(&name, &spec, 1).await?;
    }
    let mut fleet = bed.fleet.clone();
    fleet.workers.lease_duration = ctx.profile.lease;
    fleet.workers.heartbeat_interval = ctx.profile.heartbeat;
    fleet.workers.fence_margin = Duration::from_secs(1);
    if let Some(cpu) = pins.measured {
        let wrapper = bed.log_dir.join("pinned-worker.sh");
        std::fs::write(
            &wrapper,
            format!("#!/bin/sh\nexec taskset -c {cpu} \"$TETHER_WRAPPED_EXE\" \"$@\"\n"),
        )?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
        fleet.env.push((
            "TETHER_WRAPPED_EXE".into(),
            fleet.workers.exe.display().to_string(),
        ));
        fleet.workers.exe = wrapper;
    }
    let mut args = vec!["--connect-rate", "0"];
    let ca = ca.map(|p| p.display().to_string());
    if let Some(ca) = &ca {
        args.extend(["--ca-file", ca.as_str()]);
    }
    let worker = fleet.spawn_with("tput", fleet.endpoint(), &args)?;
    Bed::wait(
        Duration::from_secs(60),
        "throughput streams connected",
        || async {
            let m = worker.metrics().await.unwrap_or_default();
            metric_value(&m, "tether_active_connections").unwrap_or(0.0) >= n as f64
        },
    )
    .await?;
    let pid = worker.pid().context("worker pid")?;
    let figure = window(ctx, pid, || async { Ok(sink.messages()) }).await?;
    drop(worker);
    Ok(figure)
}

/// The bare read loop (`bench bare-sessions`): the same sessions, counted and
/// dropped; with `forward`, the forwarding floor, counted at the same kind
/// of sink as tether's.
async fn bare_loop(ctx: &Ctx, scheme: &str, pins: &Pins, forward: bool) -> anyhow::Result<Value> {
    let bed = idle_bed(ctx).await?;
    let (blaster, ca) = blaster(&bed, scheme).await?;
    let template = blaster.url("{name}").replace("{last_seq}", "0");
    let ca = ca.map(|p| p.display().to_string());
    let sink = CountingSink::start(loopback()).await?;
    let to = forward.then(|| sink.url());
    let client =
        BareClient::spawn_forwarding(&template, ca.as_deref(), pins.measured, to.as_deref())?;
    client.open(ctx.profile.throughput_sessions).await?;
    if forward {
        window(ctx, client.pid()?, || async { Ok(sink.messages()) }).await
    } else {
        window(ctx, client.pid()?, || client.count()).await
    }
}

/// Messages counted over the profile's window after a warm-up, against the
/// measured process's CPU time and this process's (the load generator).
async fn window<F, Fut>(ctx: &Ctx, pid: u32, count: F) -> anyhow::Result<Value>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<u64>>,
{
    let cpu = |pid: Option<u32>| {
        tether::process_metrics::stat(pid)
            .map(|s| s.cpu_seconds)
            .context("reading /proc CPU time")
    };
    tokio::time::sleep(WARM_UP).await;
    let (m0, c0, g0, t0) = (count().await?, cpu(Some(pid))?, cpu(None)?, Instant::now());
    tokio::time::sleep(ctx.profile.throughput_window).await;
    let (m1, c1, g1) = (count().await?, cpu(Some(pid))?, cpu(None)?);
    let seconds = t0.elapsed().as_secs_f64();
    let messages = m1.saturating_sub(m0) as f64;
    let used = (c1 - c0).max(1e-6);
    Ok(json!({
        "msgs_per_s": (messages / seconds).round(),
        "msgs_per_cpu_s": (messages / used).round(),
        "cpu_cores": round2(used / seconds),
        "load_generator_cpu_cores": round2((g1 - g0) / seconds),
    }))
}

/// A blaster for `scheme`; for `wss`, a fresh self-signed certificate and
/// the CA file that trusts it.
async fn blaster(bed: &Bed, scheme: &str) -> anyhow::Result<(Blaster, Option<std::path::PathBuf>)> {
    if scheme != "wss" {
        return Ok((Blaster::start(loopback(), MESSAGE_BYTES, None).await?, None));
    }
    let (certified, key) = self_signed(&["127.0.0.1"]);
    let ca = bed.log_dir.join("throughput-ca.pem");
    std::fs::write(&ca, certified.cert.pem())?;
    let config = server_config(vec![certified.cert.der().clone()], key)?;
    let blaster = Blaster::start(loopback(), MESSAGE_BYTES, Some(config)).await?;
    Ok((blaster, Some(ca)))
}

/// The measured process gets the last CPU this process may use, and this
/// process (upstream, sink, store) the others, for as long as this lives.
/// With one CPU, or without `taskset`, nothing is pinned (`measured: None`).
struct Pins {
    measured: Option<usize>,
    all: String,
}

impl Pins {
    fn take() -> anyhow::Result<Self> {
        let status = std::fs::read_to_string("/proc/self/status")?;
        let all = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .map(|l| l.trim().to_string())
            .unwrap_or_default();
        let cpus = cpu_list(&all);
        let taskset = std::process::Command::new("taskset")
            .arg("-V")
            .output()
            .is_ok_and(|o| o.status.success());
        let (Some((&measured, rest)), true) = (cpus.split_last(), taskset) else {
            return Ok(Self {
                measured: None,
                all,
            });
        };
        if rest.is_empty() {
            return Ok(Self {
                measured: None,
                all,
            });
        }
        let others: Vec<String> = rest.iter().map(usize::to_string).collect();
        set_affinity(&others.join(","))?;
        Ok(Self {
            measured: Some(measured),
            all,
        })
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        if self.measured.is_some() {
            let _ = set_affinity(&self.all);
        }
    }
}

/// Every thread of this process onto `cpus` (threads started later inherit it).
fn set_affinity(cpus: &str) -> anyhow::Result<()> {
    let status = std::process::Command::new("taskset")
        .args(["-a", "-cp", cpus, &std::process::id().to_string()])
        .stdout(std::process::Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "taskset -a -cp {cpus} failed");
    Ok(())
}

/// `0-3,6` → [0, 1, 2, 3, 6].
fn cpu_list(list: &str) -> Vec<usize> {
    list.split(',')
        .filter_map(|part| match part.trim().split_once('-') {
            Some((a, b)) => Some((a.parse().ok()?..=b.parse().ok()?).collect::<Vec<_>>()),
            None => part.trim().parse().ok().map(|c| vec![c]),
        })
        .flatten()
        .collect()
}
