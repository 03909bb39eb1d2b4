//! `bench`: tether's figures, each measured side by side with the seed design's
//! parameters (lease 20 s, heartbeat 5 s, reconcile 60 s, no rebalancing) by the
//! same harness in the same run, on real processes over loopback.
//!
//!   scripts/bench [all|failover|rolling|chaos|sessions|throughput|cost] [--quick] [--seed N]
//!
//! Prints a table and writes JSON + Markdown under bench/results/.

use anyhow::{Context, bail};
use futures::StreamExt;
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tether::crd::StreamConnectionSpec;
use tether::lease::{LeaseStore, StreamKey};
use tether::testkit::bed::{Bed, names, quantile, rss_kib};
use tether::testkit::chaos::{self, ChaosConfig};
use tether::testkit::fleet::{FleetConfig, WorkerProcess, metric_sum};
use tether::testkit::upstream::TestUpstream;
use tokio::time::Instant;

/// DynamoDB on-demand price per million write request units (us-east-1, since
/// the November 2024 price change).
const PRICE_PER_MILLION_WRU: f64 = 0.625;
const HOURS_PER_MONTH: f64 = 730.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Design {
    Tether,
    Seed,
}

impl Design {
    fn name(self) -> &'static str {
        match self {
            Design::Tether => "tether",
            Design::Seed => "seed",
        }
    }
}

/// Timings and sizes of one benchmark profile.
#[derive(Clone, Debug)]
struct Profile {
    name: &'static str,
    lease: Duration,
    heartbeat: Duration,
    tether_reconcile: Duration,
    seed_reconcile: Duration,
    failover_streams: usize,
    rolling_streams: usize,
    chaos: Duration,
    session_steps: Vec<usize>,
    throughput_sessions: usize,
    throughput_rate: u32,
    throughput_window: Duration,
    cost_streams: usize,
    cost_window: Duration,
}

impl Profile {
    fn default_profile() -> Self {
        Self {
            name: "default",
            lease: Duration::from_secs(20),
            heartbeat: Duration::from_secs(5),
            tether_reconcile: Duration::from_millis(250),
            seed_reconcile: Duration::from_secs(60),
            failover_streams: 24,
            rolling_streams: 30,
            chaos: Duration::from_secs(150),
            session_steps: vec![1000, 5000, 10000],
            throughput_sessions: 50,
            throughput_rate: 4000,
            throughput_window: Duration::from_secs(10),
            cost_streams: 50,
            cost_window: Duration::from_secs(90),
        }
    }

    /// Everything scaled down: the seed's timings by the same 0.3 as the lease.
    fn quick() -> Self {
        Self {
            name: "quick",
            lease: Duration::from_secs(6),
            heartbeat: Duration::from_millis(1500),
            tether_reconcile: Duration::from_millis(250),
            seed_reconcile: Duration::from_secs(18),
            failover_streams: 20,
            rolling_streams: 12,
            chaos: Duration::from_secs(30),
            session_steps: vec![1000],
            throughput_sessions: 20,
            throughput_rate: 5000,
            throughput_window: Duration::from_secs(5),
            cost_streams: 20,
            cost_window: Duration::from_secs(20),
        }
    }

    fn reconcile(&self, design: Design) -> Duration {
        match design {
            Design::Tether => self.tether_reconcile,
            Design::Seed => self.seed_reconcile,
        }
    }
}

fn design_args(design: Design) -> Vec<&'static str> {
    match design {
        Design::Tether => vec![],
        Design::Seed => vec!["--no-rebalance"],
    }
}

struct Ctx {
    profile: Profile,
    exe: PathBuf,
    logs: PathBuf,
    seed: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tether::install_crypto_provider();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let seed = args
        .iter()
        .position(|a| a == "--seed")
        .and_then(|i| args.get(i + 1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(42);
    let which = args
        .iter()
        .find(|a| !a.starts_with("--") && a.parse::<u64>().is_err())
        .cloned()
        .unwrap_or_else(|| "all".into());
    let profile = if quick {
        Profile::quick()
    } else {
        Profile::default_profile()
    };
    let exe = std::env::current_exe()?.with_file_name("tether");
    if !exe.exists() {
        bail!(
            "{} not found: build both binaries (`cargo build --release --bins`), or use scripts/bench",
            exe.display()
        );
    }
    raise_fd_limit();
    let logs = std::env::temp_dir().join(format!("tether-bench-{}", std::process::id()));
    std::fs::create_dir_all(&logs)?;
    let ctx = Ctx {
        profile,
        exe,
        logs,
        seed,
    };
    let started = Instant::now();
    let mut results = serde_json::Map::new();
    let all = which == "all";
    println!(
        "tether benchmarks, profile {} (worker logs in {})",
        ctx.profile.name,
        ctx.logs.display()
    );
    if all || which == "failover" {
        results.insert("failover".into(), failover(&ctx).await?);
    }
    if all || which == "rolling" {
        results.insert("rolling_restart".into(), rolling(&ctx).await?);
    }
    if all || which == "chaos" {
        results.insert("chaos".into(), chaos_soak(&ctx).await?);
    }
    if all || which == "sessions" {
        results.insert("sessions_per_worker".into(), sessions(&ctx).await?);
    }
    if all || which == "throughput" {
        results.insert("throughput".into(), throughput(&ctx).await?);
    }
    if all || which == "cost" {
        results.insert("dynamodb_cost".into(), cost(&ctx).await?);
    }
    let report = json!({
        "profile": ctx.profile.name,
        "parameters": {
            "lease_s": ctx.profile.lease.as_secs_f64(),
            "heartbeat_s": ctx.profile.heartbeat.as_secs_f64(),
            "tether_reconcile_s": ctx.profile.tether_reconcile.as_secs_f64(),
            "seed_reconcile_s": ctx.profile.seed_reconcile.as_secs_f64(),
            "seed_rebalancing": false,
        },
        "machine": machine(),
        "started_unix_s": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "wall_time_s": started.elapsed().as_secs_f64(),
        "results": Value::Object(results),
    });
    write_results(&report, &which)?;
    let _ = std::fs::remove_dir_all(&ctx.logs);
    Ok(())
}

fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

fn machine() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .next()
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0);
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    json!({
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "cpu_model": cpu,
        "memory_gib": (mem_kib as f64 / 1048576.0 * 10.0).round() / 10.0,
        "git_commit": commit,
    })
}

fn secs(d: Duration) -> String {
    format!("{:.2}s", d.as_secs_f64())
}

fn stats(values: &[f64]) -> Value {
    json!({
        "n": values.len(),
        "p50_s": quantile(values, 0.5),
        "p99_s": quantile(values, 0.99),
        "max_s": quantile(values, 1.0),
    })
}

// ---- 1 & 2: crash failover and graceful handoff ----------------------------------

async fn failover(ctx: &Ctx) -> anyhow::Result<Value> {
    let bed = Bed::start(ctx.exe.clone(), ctx.logs.clone(), 10).await?;
    let mut out = serde_json::Map::new();
    for (label, signal) in [
        ("crash_sigkill", Signal::SIGKILL),
        ("graceful_sigterm", Signal::SIGTERM),
    ] {
        // Both designs at once, on their own tables, workers and streams.
        let (tether, seed) = tokio::join!(
            one_failover(ctx, &bed, Design::Tether, signal, label),
            one_failover(ctx, &bed, Design::Seed, signal, label)
        );
        let (tether, seed) = (tether?, seed?);
        println!(
            "{label:<18} tether p50 {:>6.2}s p99 {:>6.2}s | seed p50 {:>6.2}s p99 {:>6.2}s | overlaps {}/{} gaps {}/{}",
            tether["p50_s"].as_f64().unwrap_or(f64::NAN),
            tether["p99_s"].as_f64().unwrap_or(f64::NAN),
            seed["p50_s"].as_f64().unwrap_or(f64::NAN),
            seed["p99_s"].as_f64().unwrap_or(f64::NAN),
            tether["overlapping_sessions"],
            seed["overlapping_sessions"],
            tether["sequence_gaps"],
            seed["sequence_gaps"],
        );
        out.insert(label.into(), json!({"tether": tether, "seed": seed}));
    }
    Ok(Value::Object(out))
}

async fn one_failover(
    ctx: &Ctx,
    bed: &Bed,
    design: Design,
    signal: Signal,
    label: &str,
) -> anyhow::Result<Value> {
    let p = &ctx.profile;
    let tag = format!("{}-{}", &label[..5], design.name());
    let store = bed
        .table(&format!("bench-{tag}-{}", rand::random::<u16>()))
        .await?;
    let names = names(&tag, p.failover_streams);
    bed.apply(&store, "bench", &names).await?;
    let mut fleet = bed.fleet(&store, p.lease, p.heartbeat, p.reconcile(design));
    fleet.drain_timeout = Duration::from_secs(10);
    let mut victim = fleet.spawn_with(
        &format!("{tag}-victim"),
        &fleet.endpoint,
        &["--no-rebalance"],
    )?;
    let limit = p.lease * 2 + p.reconcile(design) * 2 + Duration::from_secs(30);
    Bed::wait(limit, "the victim holds every stream", || async {
        bed.connected_once(&names)
            && Bed::owners(&store)
                .await
                .values()
                .filter(|o| o.ends_with("-victim"))
                .count()
                == names.len()
    })
    .await?;
    let mut others: Vec<WorkerProcess> = (0..2)
        .map(|i| {
            fleet.spawn_with(
                &format!("{tag}-w{i}"),
                &fleet.endpoint,
                &design_args(design),
            )
        })
        .collect::<Result<_, _>>()?;
    tokio::time::sleep(p.heartbeat * 2).await;
    let t0 = Instant::now();
    victim.signal(signal)?;
    let latencies = bed.new_session_latencies(&names, t0, limit).await?;
    if signal == Signal::SIGTERM {
        victim.wait(Duration::from_secs(20)).await?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop_all(&mut others).await;
    let mut result = stats(&latencies);
    result["overlapping_sessions"] = json!(bed.overlaps(&names));
    result["sequence_gaps"] = json!(bed.gaps("bench", &names));
    result["streams"] = json!(names.len());
    Ok(result)
}

async fn stop_all(workers: &mut [WorkerProcess]) {
    for w in workers.iter() {
        let _ = w.signal(Signal::SIGTERM);
    }
    for w in workers.iter_mut() {
        let _ = w.wait(Duration::from_secs(20)).await;
    }
}

// ---- 3: rolling restart -----------------------------------------------------------

async fn rolling(ctx: &Ctx) -> anyhow::Result<Value> {
    let bed = Bed::start(ctx.exe.clone(), ctx.logs.clone(), 10).await?;
    let (tether, seed) = tokio::join!(
        one_rolling(ctx, &bed, Design::Tether),
        one_rolling(ctx, &bed, Design::Seed)
    );
    let (tether, seed) = (tether?, seed?);
    println!(
        "rolling restart    tether {:>7.1} stream-s ownerless (max {:.2}s) | seed {:>7.1} stream-s (max {:.2}s) | overlaps {}/{} gaps {}/{}",
        tether["ownerless_stream_seconds"].as_f64().unwrap_or(0.0),
        tether["max_ownerless_s"].as_f64().unwrap_or(0.0),
        seed["ownerless_stream_seconds"].as_f64().unwrap_or(0.0),
        seed["max_ownerless_s"].as_f64().unwrap_or(0.0),
        tether["overlapping_sessions"],
        seed["overlapping_sessions"],
        tether["sequence_gaps"],
        seed["sequence_gaps"],
    );
    Ok(json!({"tether": tether, "seed": seed}))
}

async fn one_rolling(ctx: &Ctx, bed: &Bed, design: Design) -> anyhow::Result<Value> {
    let p = &ctx.profile;
    let tag = format!("roll-{}", design.name());
    let store = bed
        .table(&format!("bench-{tag}-{}", rand::random::<u16>()))
        .await?;
    let names = names(&tag, p.rolling_streams);
    bed.apply(&store, "bench", &names).await?;
    let fleet = bed.fleet(&store, p.lease, p.heartbeat, p.reconcile(design));
    let mut workers: Vec<WorkerProcess> = (0..3)
        .map(|i| {
            fleet.spawn_with(
                &format!("{tag}-a{i}"),
                &fleet.endpoint,
                &design_args(design),
            )
        })
        .collect::<Result<_, _>>()?;
    let limit = p.lease * 2 + p.reconcile(design) * 3 + Duration::from_secs(30);
    Bed::wait(limit, "all rolling streams connected", || async {
        bed.connected_once(&names)
    })
    .await?;
    tokio::time::sleep(p.heartbeat * 2).await;
    let started = Instant::now();
    let mut ownerless = 0.0;
    let mut max_run: f64 = 0.0;
    let mut runs = std::collections::HashMap::new();
    for (i, slot) in workers.iter_mut().enumerate() {
        // As the chart's Deployment does (maxSurge 1, maxUnavailable 0): the new
        // pod starts first, then the old one gets SIGTERM.
        let replacement = fleet.spawn_with(
            &format!("{tag}-b{i}"),
            &fleet.endpoint,
            &design_args(design),
        )?;
        tokio::time::sleep(p.heartbeat * 2).await;
        let mut old = std::mem::replace(slot, replacement);
        old.signal(Signal::SIGTERM)?;
        let deadline = Instant::now() + limit;
        let mut exited = false;
        // Sample until the old worker is gone and every stream is connected again.
        loop {
            let open = bed.upstream.open_sessions();
            let mut all = true;
            for n in &names {
                let run = runs.entry(n.clone()).or_insert(0.0);
                if open.get(n) == Some(&1) {
                    *run = 0.0;
                } else {
                    all = false;
                    *run += 0.1;
                    ownerless += 0.1;
                    max_run = max_run.max(*run);
                }
            }
            if !exited {
                exited = old.wait(Duration::from_millis(1)).await.is_ok();
            }
            if all && exited {
                break;
            }
            if Instant::now() > deadline {
                bail!("{tag}: streams not reconnected within {limit:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Let a restarted tether worker take its share before the next restart.
        tokio::time::sleep(p.heartbeat * 2).await;
    }
    let elapsed = started.elapsed();
    stop_all(&mut workers).await;
    Ok(json!({
        "workers": 3,
        "streams": names.len(),
        "ownerless_stream_seconds": (ownerless * 10.0_f64).round() / 10.0,
        "max_ownerless_s": (max_run * 10.0_f64).round() / 10.0,
        "restart_wall_time_s": elapsed.as_secs_f64(),
        "overlapping_sessions": bed.overlaps(&names),
        "sequence_gaps": bed.gaps("bench", &names),
    }))
}

// ---- 4: chaos soak ----------------------------------------------------------------

async fn chaos_soak(ctx: &Ctx) -> anyhow::Result<Value> {
    let bed = Bed::start(ctx.exe.clone(), ctx.logs.clone(), 20).await?;
    let p = &ctx.profile;
    // The soak uses a lease longer than the upstream's 3-4 s cut-off for silent
    // (paused) clients, as any deployment should; tether's defaults otherwise.
    let lease = p.lease.max(Duration::from_secs(6));
    let cfg = ChaosConfig {
        seed: ctx.seed,
        duration: p.chaos,
        streams: 16,
        workers: 4,
        lease,
        heartbeat: p.heartbeat.min(lease / 4),
        reconcile: p.tether_reconcile,
    };
    let report = chaos::run(&bed, &cfg).await?;
    println!(
        "chaos soak         {:.0}s seed {} events {:?}: overlaps {} gaps {} stale {} duplicates {} max ownerless {:.1}s",
        report.duration_s,
        report.seed,
        report.events,
        report.overlapping_sessions,
        report.sequence_gaps,
        report.stale_deliveries,
        report.duplicates,
        report.max_ownerless_s
    );
    let mut value = serde_json::to_value(&report)?;
    value["lease_s"] = json!(lease.as_secs_f64());
    Ok(value)
}

// ---- 5: memory per session --------------------------------------------------------

async fn sessions(ctx: &Ctx) -> anyhow::Result<Value> {
    let bed = Bed::start(ctx.exe.clone(), ctx.logs.clone(), 0).await?;
    let p = &ctx.profile;
    let store = bed
        .table(&format!("bench-mem-{}", rand::random::<u16>()))
        .await?;
    let fleet = bed.fleet(&store, p.lease, p.heartbeat, p.tether_reconcile);
    let worker = fleet.spawn_with("mem", &fleet.endpoint, &["--max-connections", "20000"])?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pid = worker.pid().context("worker pid")?;
    let baseline = rss_kib(pid).context("reading VmRSS")?;
    let mut steps = Vec::new();
    let mut applied = 0;
    let ws_url = |name: &str| bed.upstream.url(name);
    for &target in &p.session_steps {
        let started = Instant::now();
        apply_idle(&store, &ws_url, "idle", applied, target).await?;
        applied = target;
        Bed::wait(
            Duration::from_secs(300),
            &format!("{target} idle sessions are open"),
            || async { bed.upstream.open_sessions().len() >= target },
        )
        .await?;
        let connect = started.elapsed();
        // Hold for three heartbeats: every lease renewed at this size.
        tokio::time::sleep(p.heartbeat * 3).await;
        let rss = rss_kib(pid).context("reading VmRSS")?;
        let metrics = worker.metrics().await.map_err(anyhow::Error::msg)?;
        // `+ 0.0` turns the empty sum's -0.0 into 0.
        let lost = metric_sum(&metrics, "tether_leases_lost_total", "") + 0.0;
        let renew_errors =
            metric_sum(&metrics, "tether_lease_renewals_total", "result=\"error\"") + 0.0;
        let per = (rss.saturating_sub(baseline)) as f64 / target as f64;
        println!(
            "sessions {target:>6}     RSS {:>7.1} MiB, {per:>5.1} KiB per idle ws:// session; leases lost {lost}, renewal errors {renew_errors}; connected in {}",
            rss as f64 / 1024.0,
            secs(connect)
        );
        steps.push(json!({
            "sessions": target,
            "rss_kib": rss,
            "baseline_rss_kib": baseline,
            "kib_per_session": (per * 10.0).round() / 10.0,
            "leases_lost": lost,
            "renewal_errors": renew_errors,
            "connect_all_s": connect.as_secs_f64(),
        }));
    }
    drop(worker);
    let wss = tls_sessions(ctx, &bed, &store, p.session_steps[0]).await?;
    Ok(json!({"ws": steps, "wss": wss}))
}

/// The same measurement for `wss://`: a TLS upstream with a throwaway
/// certificate, and a fresh worker that trusts it through `--ca-file`.
async fn tls_sessions(
    ctx: &Ctx,
    bed: &Bed,
    store: &LeaseStore,
    target: usize,
) -> anyhow::Result<Value> {
    let certified = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()])?;
    let ca = ctx.logs.join("bench-ca.pem");
    std::fs::write(&ca, certified.cert.pem())?;
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
    let upstream = TestUpstream::start_tls(
        tether::testkit::bed::loopback(),
        0,
        vec![certified.cert.der().clone()],
        key,
    )
    .await?;
    let p = &ctx.profile;
    let fleet = bed.fleet(store, p.lease, p.heartbeat, p.tether_reconcile);
    let ca_arg = ca.to_string_lossy().to_string();
    let worker = fleet.spawn_with(
        "mem-tls",
        &fleet.endpoint,
        &["--max-connections", "20000", "--ca-file", &ca_arg],
    )?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let pid = worker.pid().context("worker pid")?;
    let baseline = rss_kib(pid).context("reading VmRSS")?;
    let started = Instant::now();
    let addr = upstream.addr;
    let wss_url = move |name: &str| format!("wss://{addr}/{name}?after={{last_seq}}");
    apply_idle(store, &wss_url, "tls", 0, target).await?;
    Bed::wait(
        Duration::from_secs(300),
        &format!("{target} idle wss sessions are open"),
        || async { upstream.open_sessions().len() >= target },
    )
    .await?;
    let connect = started.elapsed();
    tokio::time::sleep(ctx.profile.heartbeat * 3).await;
    let rss = rss_kib(pid).context("reading VmRSS")?;
    let metrics = worker.metrics().await.map_err(anyhow::Error::msg)?;
    let lost = metric_sum(&metrics, "tether_leases_lost_total", "") + 0.0;
    let renew_errors =
        metric_sum(&metrics, "tether_lease_renewals_total", "result=\"error\"") + 0.0;
    let per = (rss.saturating_sub(baseline)) as f64 / target as f64;
    println!(
        "sessions {target:>6} wss RSS {:>7.1} MiB, {per:>5.1} KiB per idle wss:// session; leases lost {lost}, renewal errors {renew_errors}; connected in {}",
        rss as f64 / 1024.0,
        secs(connect)
    );
    drop(worker);
    Ok(json!({
        "sessions": target,
        "rss_kib": rss,
        "baseline_rss_kib": baseline,
        "kib_per_session": (per * 10.0).round() / 10.0,
        "leases_lost": lost,
        "renewal_errors": renew_errors,
        "connect_all_s": connect.as_secs_f64(),
    }))
}

async fn apply_idle(
    store: &LeaseStore,
    url: &dyn Fn(&str) -> String,
    prefix: &str,
    from: usize,
    to: usize,
) -> anyhow::Result<()> {
    let specs: Vec<(String, StreamConnectionSpec)> = (from..to)
        .map(|i| {
            let name = format!("{prefix}-{i:05}");
            let spec = serde_json::from_value(json!({"url": url(&name), "sink": {"log": {}}}))
                .expect("valid spec");
            (name, spec)
        })
        .collect();
    futures::stream::iter(specs)
        .map(|(name, spec)| async move {
            store
                .upsert_desired(&spec.to_desired(StreamKey::new("mem", name.as_str()), 1))
                .await
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    Ok(())
}

// ---- 6: throughput -----------------------------------------------------------------

async fn throughput(ctx: &Ctx) -> anyhow::Result<Value> {
    let p = &ctx.profile;
    let bed = Bed::start(ctx.exe.clone(), ctx.logs.clone(), p.throughput_rate).await?;
    bed.sink.set_count_only(true);
    // Baseline: bare tokio-tungstenite read loops over the same upstream.
    let bare = bare_read_rate(&bed, p.throughput_sessions, p.throughput_window).await?;
    // tether: one worker forwarding the same number of sessions to the HTTP sink.
    let store = bed
        .table(&format!("bench-tput-{}", rand::random::<u16>()))
        .await?;
    let names = names("tput", p.throughput_sessions);
    for n in &names {
        let spec: StreamConnectionSpec = serde_json::from_value(json!({
            "url": bed.upstream.url(n),
            "sequence": {"pointer": "/seq"},
            "sink": {"http": {"url": bed.sink.url(), "maxBatchMessages": 500, "lingerMs": 5}},
        }))?;
        store
            .upsert_desired(&spec.to_desired(StreamKey::new("tput", n.as_str()), 1))
            .await?;
    }
    let fleet: FleetConfig = bed.fleet(
        &store,
        Duration::from_secs(20),
        Duration::from_secs(5),
        Duration::from_millis(500),
    );
    let worker = fleet.spawn("tput")?;
    Bed::wait(
        Duration::from_secs(60),
        "throughput streams connected",
        || async { bed.connected_once(&names) },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let m0 = bed.sink.messages();
    let t0 = Instant::now();
    tokio::time::sleep(p.throughput_window).await;
    let tether_rate = (bed.sink.messages() - m0) as f64 / t0.elapsed().as_secs_f64();
    drop(worker);
    let offered = f64::from(p.throughput_rate) * p.throughput_sessions as f64;
    let ratio = tether_rate / bare;
    println!(
        "throughput         tether {tether_rate:>9.0} msg/s to the HTTP sink | bare read loop {bare:>9.0} msg/s | ratio {ratio:.2} (offered {offered:.0} msg/s)"
    );
    Ok(json!({
        "sessions": p.throughput_sessions,
        "offered_msgs_per_s": offered,
        "tether_msgs_per_s": tether_rate.round(),
        "bare_tokio_tungstenite_msgs_per_s": bare.round(),
        "ratio": (ratio * 100.0).round() / 100.0,
    }))
}

async fn bare_read_rate(bed: &Bed, sessions: usize, window: Duration) -> anyhow::Result<f64> {
    let counter = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
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
                            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
    let c0 = counter.load(std::sync::atomic::Ordering::Relaxed);
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let rate = (counter.load(std::sync::atomic::Ordering::Relaxed) - c0) as f64
        / t0.elapsed().as_secs_f64();
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    Ok(rate)
}

// ---- 7: DynamoDB cost ------------------------------------------------------------------

async fn cost(ctx: &Ctx) -> anyhow::Result<Value> {
    let bed = Bed::start(ctx.exe.clone(), ctx.logs.clone(), 5).await?;
    let (tether, seed) = tokio::join!(
        one_cost(ctx, &bed, Design::Tether),
        one_cost(ctx, &bed, Design::Seed)
    );
    let (tether, seed) = (tether?, seed?);
    println!(
        "dynamodb cost      tether {:.0} WRU/stream-hour (${:.2}/month for 500 streams, ${:.2} for 10,000) | seed {:.0} WRU/stream-hour (${:.2}, ${:.2}); ${PRICE_PER_MILLION_WRU}/M WRU",
        tether["wru_per_stream_hour"].as_f64().unwrap_or(0.0),
        tether["monthly_usd_500_streams"].as_f64().unwrap_or(0.0),
        tether["monthly_usd_10000_streams"].as_f64().unwrap_or(0.0),
        seed["wru_per_stream_hour"].as_f64().unwrap_or(0.0),
        seed["monthly_usd_500_streams"].as_f64().unwrap_or(0.0),
        seed["monthly_usd_10000_streams"].as_f64().unwrap_or(0.0),
    );
    Ok(json!({"price_usd_per_million_wru": PRICE_PER_MILLION_WRU, "tether": tether, "seed": seed}))
}

async fn one_cost(ctx: &Ctx, bed: &Bed, design: Design) -> anyhow::Result<Value> {
    let p = &ctx.profile;
    let tag = format!("cost-{}", design.name());
    let store = bed
        .table(&format!("bench-{tag}-{}", rand::random::<u16>()))
        .await?;
    let names = names(&tag, p.cost_streams);
    bed.apply(&store, "bench", &names).await?;
    let fleet = bed.fleet(&store, p.lease, p.heartbeat, p.reconcile(design));
    let mut workers: Vec<WorkerProcess> = (0..2)
        .map(|i| fleet.spawn_with(&format!("{tag}-{i}"), &fleet.endpoint, &design_args(design)))
        .collect::<Result<_, _>>()?;
    Bed::wait(
        p.lease + p.reconcile(design) * 2 + Duration::from_secs(30),
        "cost streams connected",
        || async { bed.connected_once(&names) },
    )
    .await?;
    tokio::time::sleep(p.heartbeat * 2).await;
    let w0 = total_wru(&workers).await?;
    let t0 = Instant::now();
    tokio::time::sleep(p.cost_window).await;
    let wru = total_wru(&workers).await? - w0;
    let hours = t0.elapsed().as_secs_f64() / 3600.0;
    let per = wru / (names.len() as f64 * hours);
    stop_all(&mut workers).await;
    let monthly = |streams: f64| per * streams * HOURS_PER_MONTH * PRICE_PER_MILLION_WRU / 1e6;
    Ok(json!({
        "streams": names.len(),
        "workers": 2,
        "window_s": t0.elapsed().as_secs_f64(),
        "wru_per_stream_hour": per.round(),
        "monthly_usd_500_streams": (monthly(500.0) * 100.0).round() / 100.0,
        "monthly_usd_10000_streams": (monthly(10000.0) * 100.0).round() / 100.0,
        "heartbeat_s": p.heartbeat.as_secs_f64(),
    }))
}

async fn total_wru(workers: &[WorkerProcess]) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for w in workers {
        let text = w.metrics().await.map_err(anyhow::Error::msg)?;
        total += metric_sum(&text, "tether_dynamodb_consumed_write_units_total", "");
    }
    Ok(total)
}

// ---- output -----------------------------------------------------------------------------

fn write_results(report: &Value, which: &str) -> anyhow::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/results");
    std::fs::create_dir_all(&dir)?;
    let profile = report["profile"].as_str().unwrap_or("default");
    let stem = if which == "all" {
        profile.to_string()
    } else {
        format!("{profile}-{which}")
    };
    let json_path = dir.join(format!("{stem}.json"));
    std::fs::write(&json_path, serde_json::to_string_pretty(report)? + "\n")?;
    let md_path = dir.join(format!("{stem}.md"));
    std::fs::write(&md_path, markdown(report))?;
    println!("wrote {} and {}", json_path.display(), md_path.display());
    Ok(())
}

fn markdown(r: &Value) -> String {
    let f = |v: &Value| {
        v.as_f64()
            .map(|x| format!("{x:.2}"))
            .unwrap_or_else(|| v.to_string())
    };
    let mut md = format!(
        "# tether benchmark results ({} profile)\n\nMachine: {} CPUs ({}), {} GiB; commit {}; wall time {:.0} s.\n\
         Parameters: lease {} s, heartbeat {} s, reconcile {} s (tether) vs {} s (seed design, no rebalancing).\n\n",
        r["profile"].as_str().unwrap_or(""),
        r["machine"]["cpus"],
        r["machine"]["cpu_model"].as_str().unwrap_or(""),
        r["machine"]["memory_gib"],
        r["machine"]["git_commit"].as_str().unwrap_or(""),
        r["wall_time_s"].as_f64().unwrap_or(0.0),
        r["parameters"]["lease_s"],
        r["parameters"]["heartbeat_s"],
        r["parameters"]["tether_reconcile_s"],
        r["parameters"]["seed_reconcile_s"],
    );
    let res = &r["results"];
    if let Some(fo) = res.get("failover") {
        md.push_str("## Failover (kill → new session's first message)\n\n| scenario | design | p50 s | p99 s | max s | overlaps | gaps |\n|---|---|---|---|---|---|---|\n");
        for scenario in ["crash_sigkill", "graceful_sigterm"] {
            for design in ["tether", "seed"] {
                let x = &fo[scenario][design];
                md.push_str(&format!(
                    "| {scenario} | {design} | {} | {} | {} | {} | {} |\n",
                    f(&x["p50_s"]),
                    f(&x["p99_s"]),
                    f(&x["max_s"]),
                    x["overlapping_sessions"],
                    x["sequence_gaps"]
                ));
            }
        }
        md.push('\n');
    }
    if let Some(ro) = res.get("rolling_restart") {
        md.push_str("## Rolling restart of 3 workers\n\n| design | ownerless stream-seconds | max ownerless s | overlaps | gaps |\n|---|---|---|---|---|\n");
        for design in ["tether", "seed"] {
            let x = &ro[design];
            md.push_str(&format!(
                "| {design} | {} | {} | {} | {} |\n",
                f(&x["ownerless_stream_seconds"]),
                f(&x["max_ownerless_s"]),
                x["overlapping_sessions"],
                x["sequence_gaps"]
            ));
        }
        md.push('\n');
    }
    if let Some(c) = res.get("chaos") {
        md.push_str(&format!(
            "## Chaos soak (seed {}, {:.0} s, {} streams, {} workers, lease {} s)\n\nEvents: {}. Throttled requests: {}.\n\n\
             | overlaps | gaps | stale deliveries | duplicates | max ownerless s | ownerless stream-seconds |\n|---|---|---|---|---|---|\n| {} | {} | {} | {} | {} | {} |\n\n",
            c["seed"], c["duration_s"].as_f64().unwrap_or(0.0), c["streams"], c["workers"], c["lease_s"], c["events"], c["throttled_requests"],
            c["overlapping_sessions"], c["sequence_gaps"], c["stale_deliveries"], c["duplicates"], f(&c["max_ownerless_s"]), f(&c["ownerless_stream_seconds"])
        ));
    }
    if let Some(s) = res.get("sessions_per_worker") {
        md.push_str("## Memory per idle session (one worker)\n\n| scheme | sessions | RSS MiB | KiB per session | leases lost | renewal errors | connect all s |\n|---|---|---|---|---|---|---|\n");
        let wss = s
            .get("wss")
            .cloned()
            .map(|w| vec![("wss", w)])
            .unwrap_or_default();
        let rows = s["ws"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| ("ws", v.clone()))
            .chain(wss);
        for (scheme, step) in rows {
            md.push_str(&format!(
                "| {scheme} | {} | {:.1} | {} | {} | {} | {} |\n",
                step["sessions"],
                step["rss_kib"].as_f64().unwrap_or(0.0) / 1024.0,
                step["kib_per_session"],
                step["leases_lost"],
                step["renewal_errors"],
                f(&step["connect_all_s"])
            ));
        }
        md.push('\n');
    }
    if let Some(t) = res.get("throughput") {
        md.push_str(&format!(
            "## Throughput ({} sessions, offered {} msg/s)\n\n| tether → HTTP sink msg/s | bare tokio-tungstenite read msg/s | ratio |\n|---|---|---|\n| {} | {} | {} |\n\n",
            t["sessions"], t["offered_msgs_per_s"], t["tether_msgs_per_s"], t["bare_tokio_tungstenite_msgs_per_s"], t["ratio"]
        ));
    }
    if let Some(c) = res.get("dynamodb_cost") {
        md.push_str(&format!(
            "## DynamoDB write cost (on-demand, ${} per million WRU)\n\n| design | WRU per stream-hour | $/month 500 streams | $/month 10,000 streams |\n|---|---|---|---|\n",
            c["price_usd_per_million_wru"]
        ));
        for design in ["tether", "seed"] {
            let x = &c[design];
            md.push_str(&format!(
                "| {design} | {} | {} | {} |\n",
                x["wru_per_stream_hour"],
                x["monthly_usd_500_streams"],
                x["monthly_usd_10000_streams"]
            ));
        }
        md.push('\n');
    }
    md
}
