//! Memory per idle session on one worker: `ws://` at several sizes and
//! `wss://` (a TLS feed with a throwaway certificate the worker trusts through
//! `--ca-file`), each measured as the worker's RSS growth over its baseline.

use crate::{Ctx, round2};
use anyhow::Context;
use serde_json::{Value, json};
use std::time::Duration;
use tether::lease::{LeaseStore, StreamKey};
use tether_testkit::bed::{Bed, BedOptions, loopback, rss_kib};
use tether_testkit::fixtures::log_spec;
use tether_testkit::fleet::{FleetConfig, metric_sum};
use tether_testkit::upstream::{FeedOptions, TlsUpstream, self_signed};
use tokio::time::Instant;

/// Upserts in flight while applying many streams.
const APPLY_CONCURRENCY: usize = 32;

pub async fn run(ctx: &Ctx) -> anyhow::Result<Value> {
    let bed = idle_bed(ctx).await?;
    let fleet = fleet(ctx, &bed);
    // Opened in one burst, as after a failover: no connect pacing.
    let worker = fleet.spawn_with(
        "mem",
        fleet.endpoint(),
        &["--max-connections", "20000", "--connect-rate", "0"],
    )?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pid = worker.pid().context("worker pid")?;
    let baseline = rss_kib(pid).context("reading VmRSS")?;
    let mut steps = Vec::new();
    let mut applied = 0;
    for &target in &ctx.profile.session_steps {
        let started = Instant::now();
        apply_idle(
            &bed.store,
            &|n| bed.upstream.url(n),
            "idle",
            applied,
            target,
        )
        .await?;
        applied = target;
        Bed::wait(
            Duration::from_secs(300),
            &format!("{target} idle sessions are open"),
            || async { bed.upstream.open_sessions().len() >= target },
        )
        .await?;
        let connect = started.elapsed();
        tokio::time::sleep(ctx.profile.heartbeat * 3).await;
        steps.push(measure("ws", target, pid, baseline, &worker, connect).await?);
    }
    drop(worker);
    drop(bed);
    // A table of its own: on the ws table the new worker would also take
    // over every ws stream the dropped one left behind.
    let tls_bed = idle_bed(ctx).await?;
    let wss = tls(ctx, &tls_bed, ctx.profile.session_steps[0]).await?;
    Ok(json!({"ws": steps, "wss": wss}))
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
    fleet
}

async fn measure(
    scheme: &str,
    target: usize,
    pid: u32,
    baseline: u64,
    worker: &tether_testkit::fleet::WorkerProcess,
    connect: Duration,
) -> anyhow::Result<Value> {
    let rss = rss_kib(pid).context("reading VmRSS")?;
    let metrics = worker.metrics().await.map_err(anyhow::Error::msg)?;
    let fences = metric_sum(&metrics, "tether_self_fences_total", "");
    let renew_errors = metric_sum(&metrics, "tether_lease_renewals_total", "result=\"error\"");
    let per = rss.saturating_sub(baseline) as f64 / target as f64;
    println!(
        "sessions {target:>6} {scheme:<3} RSS {:>7.1} MiB, {per:>5.1} KiB per idle session; self-fences {fences}, renewal errors {renew_errors}; connected in {:.1}s",
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
    let (certified, key) = self_signed(&["127.0.0.1"]);
    let ca = bed.log_dir.join("bench-ca.pem");
    std::fs::write(&ca, certified.cert.pem())?;
    let upstream = TlsUpstream::start(
        loopback(),
        FeedOptions {
            rate: 0,
            first_seq: 1,
        },
        vec![certified.cert.der().clone()],
        key,
    )
    .await?;
    Ok((upstream, ca))
}

async fn tls(ctx: &Ctx, bed: &Bed, target: usize) -> anyhow::Result<Value> {
    let (upstream, ca) = tls_upstream(bed).await?;
    let fleet = fleet(ctx, bed);
    let ca_arg = ca.to_string_lossy().to_string();
    let worker = fleet.spawn_with(
        "mem-tls",
        fleet.endpoint(),
        &[
            "--max-connections",
            "20000",
            "--ca-file",
            &ca_arg,
            "--connect-rate",
            "0",
        ],
    )?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pid = worker.pid().context("worker pid")?;
    let baseline = rss_kib(pid).context("reading VmRSS")?;
    let started = Instant::now();
    apply_idle(&bed.store, &|n| upstream.url(n), "tls", 0, target).await?;
    Bed::wait(
        Duration::from_secs(300),
        &format!("{target} idle wss sessions are open"),
        || async { upstream.feed.open_sessions().len() >= target },
    )
    .await?;
    let connect = started.elapsed();
    tokio::time::sleep(ctx.profile.heartbeat * 3).await;
    measure("wss", target, pid, baseline, &worker, connect).await
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
