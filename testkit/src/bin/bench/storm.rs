//! A reconnect storm: one worker takes over every `wss://` stream of a peer
//! that crashed (SIGKILL), all at once. Time from the kill until each stream
//! has a new session at the upstream (p50/p99/max) and from the first of those
//! (the takeover itself), the taker's CPU during it, and whether any lease was
//! lost or renewal failed meanwhile; then the same with a connect-rate limit,
//! counted at the upstream per second. Next to it, in the same run, the floor:
//! a bare tokio-tungstenite + tokio-rustls client opening as many sessions to
//! the same kind of upstream at once.

use crate::sessions::{apply_idle, fleet, idle_bed, tls_upstream};
use crate::{Ctx, round2, stats};
use anyhow::Context;
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tether_testkit::bed::Bed;
use tether_testkit::processes::metric_sum;
use tokio::time::Instant;

pub async fn run(ctx: &Ctx) -> anyhow::Result<Value> {
    let n = ctx.profile.storm_streams;
    let unlimited = one(ctx, n, None).await?;
    // A limit that binds: the whole takeover at about a tenth of n per second.
    let rate = (n / 10).max(1) as u32;
    let limited = one(ctx, n, Some((rate, rate))).await?;
    let bare = bare(ctx, n).await?;
    let line = |label: &str, v: &Value| {
        println!(
            "storm {n} wss {label:<22} resumed after kill p50 {:.2}s p99 {:.2}s max {:.2}s; takeover max {:.2}s; taker CPU {:.2} cores; max connects/s {}; lost {}, fences {}, renewal errors {}",
            v["since_kill"]["p50_s"].as_f64().unwrap_or(f64::NAN),
            v["since_kill"]["p99_s"].as_f64().unwrap_or(f64::NAN),
            v["since_kill"]["max_s"].as_f64().unwrap_or(f64::NAN),
            v["since_takeover"]["max_s"].as_f64().unwrap_or(f64::NAN),
            v["taker_cpu_cores"].as_f64().unwrap_or(f64::NAN),
            v["max_connects_per_s"],
            v["leases_lost"],
            v["self_fences"],
            v["renewal_errors"],
        )
    };
    line("no limit", &unlimited);
    line(&format!("limit {rate}/s burst {rate}"), &limited);
    println!(
        "storm {n} wss bare client (floor)     all handshakes p50 {:.2}s p99 {:.2}s max {:.2}s",
        bare["p50_s"].as_f64().unwrap_or(f64::NAN),
        bare["p99_s"].as_f64().unwrap_or(f64::NAN),
        bare["max_s"].as_f64().unwrap_or(f64::NAN),
    );
    Ok(json!({
        "streams": n,
        "no_limit": unlimited,
        "limited": limited,
        "limit": {"rate_per_s": rate, "burst": rate},
        "bare_tokio_tungstenite_rustls": bare,
        "lease_s": ctx.profile.lease.as_secs_f64(),
    }))
}

/// CPU seconds (user + system) a process has used so far.
fn cpu_seconds(pid: u32) -> Option<f64> {
    tether::process_metrics::stat(Some(pid)).map(|s| s.cpu_seconds)
}

async fn one(ctx: &Ctx, n: usize, limit: Option<(u32, u32)>) -> anyhow::Result<Value> {
    let bed = idle_bed(ctx).await?;
    let (upstream, ca) = tls_upstream(&bed).await?;
    let ca = ca.to_string_lossy().to_string();
    let fleet = fleet(ctx, &bed);
    let common = [
        "--max-connections",
        "20000",
        "--ca-file",
        ca.as_str(),
        "--no-rebalance",
    ];
    let mut victim_args = common.to_vec();
    victim_args.extend(["--connect-rate", "0"]);
    let victim = fleet.spawn_with("victim", fleet.endpoint(), &victim_args)?;
    apply_idle(&bed.store, &|s| upstream.url(s), "storm", 0, n).await?;
    Bed::wait(
        Duration::from_secs(600),
        &format!("the victim holds {n} wss sessions"),
        || async { upstream.feed.open_sessions().len() >= n },
    )
    .await?;
    let (rate, burst) = limit.map_or(("0".to_string(), "1".to_string()), |(r, b)| {
        (r.to_string(), b.to_string())
    });
    let mut taker_args = common.to_vec();
    taker_args.extend([
        "--connect-rate",
        rate.as_str(),
        "--connect-burst",
        burst.as_str(),
    ]);
    let taker = fleet.spawn_with("taker", fleet.endpoint(), &taker_args)?;
    tokio::time::sleep(ctx.profile.heartbeat * 3).await;
    let pid = taker.pid().context("taker pid")?;
    let cpu_before = cpu_seconds(pid).context("taker CPU")?;
    let killed = Instant::now();
    victim.signal(Signal::SIGKILL)?;
    Bed::wait(
        Duration::from_secs(600),
        &format!("the taker resumes {n} wss sessions"),
        || async {
            let open = upstream
                .feed
                .sessions()
                .iter()
                .filter(|s| s.opened > killed && s.closed.is_none())
                .count();
            open >= n
        },
    )
    .await?;
    let wall = killed.elapsed();
    let cpu = cpu_seconds(pid).context("taker CPU")? - cpu_before;
    let mut opened: Vec<Instant> = upstream
        .feed
        .sessions()
        .iter()
        .filter(|s| s.opened > killed)
        .map(|s| s.opened)
        .collect();
    opened.sort();
    let first = opened.first().copied().unwrap_or(killed);
    let since_kill: Vec<f64> = opened.iter().map(|t| (*t - killed).as_secs_f64()).collect();
    let since_takeover: Vec<f64> = opened.iter().map(|t| (*t - first).as_secs_f64()).collect();
    // Connects as the upstream's own limit would count them: TCP
    // connections arriving (before TLS), in any one-second window.
    let accepted: Vec<Instant> = upstream
        .accepted()
        .into_iter()
        .filter(|t| *t > killed)
        .collect();
    let max_per_s = most_in_one_second(&accepted);
    let max_handshakes_per_s = most_in_one_second(&opened);
    let metrics = taker.metrics().await.map_err(anyhow::Error::msg)?;
    Ok(json!({
        "since_kill": stats(&since_kill),
        "since_takeover": stats(&since_takeover),
        "taker_cpu_seconds": round2(cpu),
        "taker_cpu_cores": round2(cpu / wall.as_secs_f64()),
        "max_connects_per_s": max_per_s,
        "max_handshakes_per_s": max_handshakes_per_s,
        "leases_lost": metric_sum(&metrics, "tether_leases_lost_total", ""),
        "self_fences": metric_sum(&metrics, "tether_self_fences_total", ""),
        "renewal_errors": metric_sum(&metrics, "tether_lease_renewals_total", "result=\"error\""),
    }))
}

/// The most of `times` (sorted) inside any one-second window.
fn most_in_one_second(times: &[Instant]) -> usize {
    let window = Duration::from_secs(1);
    times
        .iter()
        .enumerate()
        .map(|(i, start)| {
            times[i..]
                .iter()
                .take_while(|t| **t < *start + window)
                .count()
        })
        .max()
        .unwrap_or(0)
}

/// The floor: `n` sessions opened at once by a bare client (tokio-rustls +
/// tokio-tungstenite, the same stack and buffer settings), time until each
/// handshake completes.
async fn bare(ctx: &Ctx, n: usize) -> anyhow::Result<Value> {
    let bed = idle_bed(ctx).await?;
    let (upstream, ca) = tls_upstream(&bed).await?;
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(&ca)?;
    for cert in rustls_pki_types_from_pem(&pem)? {
        roots.add(cert)?;
    }
    let config = Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth(),
    );
    let connector = tokio_rustls::TlsConnector::from(config);
    let addr = upstream.feed.addr;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let connector = connector.clone();
        let url = upstream.url(&format!("bare-{i}")).replace("{last_seq}", "");
        tasks.spawn(async move {
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?.to_owned();
            let tls = connector.connect(name, tcp).await?;
            let config = tokio_tungstenite::tungstenite::protocol::WebSocketConfig::default()
                .read_buffer_size(tether::worker::READ_BUFFER_BYTES);
            let (ws, _) =
                tokio_tungstenite::client_async_with_config(url, tls, Some(config)).await?;
            anyhow::Ok((started.elapsed().as_secs_f64(), ws))
        });
    }
    let mut times = Vec::with_capacity(n);
    let mut held = Vec::with_capacity(n);
    while let Some(joined) = tasks.join_next().await {
        let (t, ws) = joined??;
        times.push(t);
        held.push(ws);
    }
    drop(held);
    Ok(stats(&times))
}

/// Certificates in a PEM file.
fn rustls_pki_types_from_pem(
    pem: &[u8],
) -> anyhow::Result<Vec<rustls::pki_types::CertificateDer<'static>>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| anyhow::anyhow!("CA file: {e:?}"))
}
