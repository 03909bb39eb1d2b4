//! Memory per session on one worker, `ws://` and `wss://` (a TLS feed with a
//! throwaway certificate the worker trusts through `--ca-file`), at several
//! sizes, with the sessions opened in one burst per step (as after a
//! failover) and light traffic (a message every 5 s each): the worker's RSS
//! growth over its baseline, three runs each, next to a bare tokio-tungstenite
//! (+ tokio-rustls) client process with the same buffer settings (the floor).

use crate::bare::BareClient;
use crate::{Ctx, round2};
use anyhow::Context;
use serde_json::{Value, json};
use std::time::Duration;
use tether::lease::{LeaseStore, StreamKey};
use tether_testkit::bed::{Bed, BedOptions, loopback, rss_kib};
use tether_testkit::fixtures::log_spec;
use tether_testkit::processes::{FleetConfig, metric_sum};
use tether_testkit::upstream::{FeedOptions, TlsUpstream, self_signed};
use tokio::time::Instant;

/// Upserts in flight while applying many streams.
const APPLY_CONCURRENCY: usize = 32;

/// Light traffic: one message per session this often.
const LIGHT_TRAFFIC: Duration = Duration::from_secs(5);
/// Runs of each configuration (min / median / max are reported).
const RUNS: usize = 3;

/// Who holds the sessions.
#[derive(Clone, Copy, PartialEq)]
enum Client {
    Tether,
    /// tokio-tungstenite (+ tokio-rustls) with tether's buffer settings: the floor.
    Bare,
}

pub async fn run(ctx: &Ctx) -> anyhow::Result<Value> {
    let steps = &ctx.profile.session_steps;
    let mut out = serde_json::Map::new();
    for scheme in ["ws", "wss"] {
        let mut per_client = serde_json::Map::new();
        for (client, label) in [(Client::Tether, "tether"), (Client::Bare, "bare")] {
            let mut runs: Vec<Vec<Value>> = Vec::new();
            for _ in 0..RUNS {
                runs.push(one_run(ctx, scheme, client).await?);
            }
            let mut summary = Vec::new();
            for (i, &target) in steps.iter().enumerate() {
                let mut kib: Vec<f64> = runs
                    .iter()
                    .map(|r| r[i]["kib_per_session"].as_f64().unwrap_or(f64::NAN))
                    .collect();
                kib.sort_by(f64::total_cmp);
                let (min, median, max) = (kib[0], kib[kib.len() / 2], kib[kib.len() - 1]);
                println!(
                    "sessions {target:>6} {scheme:<3} {label:<6} KiB per session with light traffic, {RUNS} runs: min {min:>5.1} / median {median:>5.1} / max {max:>5.1}"
                );
                summary.push(json!({
                    "sessions": target,
                    "kib_per_session_min": round2(min),
                    "kib_per_session_median": round2(median),
                    "kib_per_session_max": round2(max),
                    "runs": runs.iter().map(|r| r[i].clone()).collect::<Vec<_>>(),
                }));
            }
            per_client.insert(label.into(), Value::Array(summary));
        }
        out.insert(scheme.into(), Value::Object(per_client));
    }
    out.insert(
        "light_traffic_message_every_s".into(),
        json!(LIGHT_TRAFFIC.as_secs_f64()),
    );
    Ok(Value::Object(out))
}

/// One run: a fresh feed and a fresh client process, the sessions opened in
/// one burst per step (as after a failover), RSS growth over the baseline.
async fn one_run(ctx: &Ctx, scheme: &str, client: Client) -> anyhow::Result<Vec<Value>> {
    let bed = Bed::start(
        ctx.exe.clone(),
        BedOptions {
            rate: 0,
            message_every: Some(LIGHT_TRAFFIC),
            // Ten thousand sessions: no second descriptor per session.
            order_closes: false,
            ..BedOptions::default()
        },
    )
    .await?;
    let tls = match scheme {
        "wss" => Some(tls_upstream_with(&bed, Some(LIGHT_TRAFFIC)).await?),
        _ => None,
    };
    let url = |n: &str| match &tls {
        Some((upstream, _)) => upstream.url(n),
        None => bed.upstream.url(n),
    };
    let open = || match &tls {
        Some((upstream, _)) => upstream.feed.open_sessions().len(),
        None => bed.upstream.open_sessions().len(),
    };
    let ca = tls.as_ref().map(|(_, ca)| ca.to_string_lossy().to_string());
    let mut steps = Vec::new();
    match client {
        Client::Tether => {
            let fleet = fleet(ctx, &bed);
            let mut args = vec!["--max-connections", "20000", "--connect-rate", "0"];
            if let Some(ca) = &ca {
                args.extend(["--ca-file", ca.as_str()]);
            }
            let worker = fleet.spawn_with("mem", fleet.endpoint(), &args)?;
            tokio::time::sleep(Duration::from_secs(3)).await;
            let pid = worker.pid().context("worker pid")?;
            let baseline = rss_kib(pid).context("reading VmRSS")?;
            let mut applied = 0;
            for &target in &ctx.profile.session_steps {
                let started = Instant::now();
                apply_idle(&bed.store, &url, "mem", applied, target).await?;
                applied = target;
                Bed::wait(
                    Duration::from_secs(300),
                    &format!("{target} {scheme} sessions are open"),
                    || async { open() >= target },
                )
                .await?;
                let connect = started.elapsed();
                tokio::time::sleep(settle(ctx)).await;
                steps.push(measure(scheme, target, pid, baseline, Some(&worker), connect).await?);
            }
        }
        Client::Bare => {
            let template = url("{name}").replace("{last_seq}", "0");
            let client = BareClient::spawn(&template, ca.as_deref(), None)?;
            tokio::time::sleep(Duration::from_secs(1)).await;
            let pid = client.pid()?;
            let baseline = rss_kib(pid).context("reading VmRSS")?;
            for &target in &ctx.profile.session_steps {
                let started = Instant::now();
                client.open(target).await?;
                let connect = started.elapsed();
                tokio::time::sleep(settle(ctx)).await;
                steps.push(measure(scheme, target, pid, baseline, None, connect).await?);
            }
        }
    }
    Ok(steps)
}

/// Long enough for every session to have received light traffic and for
/// the worker to have renewed and checkpointed a few times.
fn settle(ctx: &Ctx) -> Duration {
    (ctx.profile.heartbeat * 3).max(LIGHT_TRAFFIC * 2)
}

/// A bed whose feed sends nothing: sessions stay idle.
pub async fn idle_bed(ctx: &Ctx) -> anyhow::Result<Bed> {
    Bed::start(
        ctx.exe.clone(),
        BedOptions {
            rate: 0,
            ..BedOptions::default()
        },
    )
    .await
}

pub fn fleet(ctx: &Ctx, bed: &Bed) -> FleetConfig {
    let mut fleet = bed.fleet.clone();
    fleet.workers.lease_duration = ctx.profile.lease;
    fleet.workers.heartbeat_interval = ctx.profile.heartbeat;
    fleet.workers.reconcile_interval = ctx.profile.reconcile;
    fleet.workers.fence_margin = Duration::from_secs(1);
    // For finding where the bytes go: extra worker environment
    // (`TETHER_BENCH_WORKER_ENV="K=V,K=V"`) and a wrapper the worker runs under
    // (`TETHER_BENCH_WORKER_WRAPPER=/path/to/script`, e.g. one that execs heaptrack).
    if let Ok(extra) = std::env::var("TETHER_BENCH_WORKER_ENV") {
        fleet.env.extend(
            extra
                .split(',')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string())),
        );
    }
    if let Ok(wrapper) = std::env::var("TETHER_BENCH_WORKER_WRAPPER") {
        fleet.env.push((
            "TETHER_WRAPPED_EXE".into(),
            fleet.workers.exe.display().to_string(),
        ));
        fleet.workers.exe = wrapper.into();
    }
    fleet
}

async fn measure(
    scheme: &str,
    target: usize,
    pid: u32,
    baseline: u64,
    worker: Option<&tether_testkit::processes::WorkerProcess>,
    connect: Duration,
) -> anyhow::Result<Value> {
    let rss = rss_kib(pid).context("reading VmRSS")?;
    let metrics = match worker {
        Some(w) => w.metrics().await.map_err(anyhow::Error::msg)?,
        None => String::new(),
    };
    let fences = metric_sum(&metrics, "tether_self_fences_total", "");
    let renew_errors = metric_sum(&metrics, "tether_lease_renewals_total", "result=\"error\"");
    let per = rss.saturating_sub(baseline) as f64 / target as f64;
    let who = if worker.is_some() { "tether" } else { "bare" };
    println!(
        "  run: {who:<6} {target:>6} {scheme:<3} RSS {:>7.1} MiB, {per:>5.1} KiB per idle session; self-fences {fences}, renewal errors {renew_errors}; connected in {:.1}s",
        rss as f64 / 1024.0,
        connect.as_secs_f64()
    );
    Ok(json!({
        "sessions": target,
        "rss_kib": rss,
        "baseline_rss_kib": baseline,
        "kib_per_session": round2(per),
        "self_fences": fences,
        "renewal_errors": renew_errors,
        "connect_all_s": connect.as_secs_f64(),
    }))
}

/// An idle `wss://` upstream on loopback with a fresh self-signed
/// certificate, and the CA file workers trust it by.
pub async fn tls_upstream(bed: &Bed) -> anyhow::Result<(TlsUpstream, std::path::PathBuf)> {
    tls_upstream_with(bed, None).await
}

/// The same, sending one message per session every `message_every`.
async fn tls_upstream_with(
    bed: &Bed,
    message_every: Option<Duration>,
) -> anyhow::Result<(TlsUpstream, std::path::PathBuf)> {
    let (certified, key) = self_signed(&["127.0.0.1"]);
    let ca = bed.log_dir.join("bench-ca.pem");
    std::fs::write(&ca, certified.cert.pem())?;
    let upstream = TlsUpstream::start(
        loopback(),
        FeedOptions {
            rate: 0,
            message_every,
            ..FeedOptions::default()
        },
        vec![certified.cert.der().clone()],
        key,
    )
    .await?;
    Ok((upstream, ca))
}

/// Applies idle log-sink streams `prefix-<from>` .. `prefix-<to>`.
pub async fn apply_idle(
    store: &LeaseStore,
    url: &dyn Fn(&str) -> String,
    prefix: &str,
    from: usize,
    to: usize,
) -> anyhow::Result<()> {
    use futures::StreamExt;
    let desired: Vec<_> = (from..to)
        .map(|i| {
            let name = format!("{prefix}-{i:05}");
            log_spec(&url(&name)).to_desired(StreamKey::new("mem", name.as_str()), 1, None)
        })
        .collect();
    futures::stream::iter(desired)
        .map(|d| async move { store.upsert_desired(&d).await })
        .buffer_unordered(APPLY_CONCURRENCY)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    Ok(())
}
