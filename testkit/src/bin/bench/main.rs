//! `bench`: tether's figures, each measured side by side with tether 0.1 (the
//! per-stream-lease version this one replaces) and the seed design's
//! parameters, by the same harness in the same run, on real processes over
//! loopback (the 100,000-stream run is a lease-only simulation in one process,
//! through a capacity model of DynamoDB partitions).
//!
//!   scripts/bench [all|failover|rolling|join|chaos|cost|scale|restart|controller|sessions|storm|throughput|sinks] [--quick] [--seed N] [--scale-streams N] [--scale-workers N]
//!
//! Prints a table and writes JSON + Markdown under bench/results/.

mod bare;
mod controller;
mod cost;
mod designs;
mod failover;
mod join;
mod report;
mod restart;
mod rolling;
mod scale;
mod sessions;
mod sinks;
mod storm;
mod throughput;

use anyhow::{Context, bail};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::Duration;
use tether::support::quantile;

/// The product's allocator (`tether::support::Allocator`): the simulated
/// fleet's workers, and the bare client the sessions are compared with, run
/// under the allocator the `tether` binary ships with.
#[global_allocator]
static ALLOCATOR: tether::support::Allocator = tether::support::Allocator;
use tether_testkit::processes::WorkerProcess;
use tokio::time::Instant;

/// DynamoDB on-demand prices (us-east-1, since the November 2024 price change).
pub const PRICE_PER_MILLION_WRU: f64 = 0.625;
pub const PRICE_PER_MILLION_RRU: f64 = 0.125;
pub const HOURS_PER_MONTH: f64 = 730.0;

/// Timings and sizes of one benchmark profile.
#[derive(Clone, Debug)]
pub struct Profile {
    pub name: &'static str,
    /// tether's lease, heartbeat and orphan scan (the defaults in `default`).
    pub lease: Duration,
    pub heartbeat: Duration,
    pub reconcile: Duration,
    /// tether 0.1's lease and heartbeat (its defaults), and the seed's scan.
    pub v1_lease: Duration,
    pub v1_heartbeat: Duration,
    pub seed_reconcile: Duration,
    pub failover_streams: usize,
    pub rolling_streams: usize,
    pub chaos: Duration,
    pub cost_window: Duration,
    pub scale_streams: usize,
    pub scale_workers: usize,
    pub session_steps: Vec<usize>,
    pub storm_streams: usize,
    pub throughput_sessions: usize,
    pub throughput_window: Duration,
    /// Resources and measuring window of the controller run.
    pub controller_resources: usize,
    pub controller_window: Duration,
}

impl Profile {
    fn default_profile() -> Self {
        Self {
            name: "default",
            lease: Duration::from_secs(8),
            heartbeat: Duration::from_secs(4),
            reconcile: Duration::from_millis(250),
            v1_lease: Duration::from_secs(20),
            v1_heartbeat: Duration::from_secs(5),
            seed_reconcile: Duration::from_secs(60),
            failover_streams: 24,
            rolling_streams: 30,
            chaos: Duration::from_secs(150),
            cost_window: Duration::from_secs(180),
            scale_streams: 100_000,
            scale_workers: 20,
            session_steps: vec![1000, 5000, 10000],
            storm_streams: 5000,
            throughput_sessions: 50,
            throughput_window: Duration::from_secs(10),
            controller_resources: 1000,
            controller_window: Duration::from_secs(60),
        }
    }

    /// Everything scaled down (the 0.1 and seed timings by the same 0.3).
    fn quick() -> Self {
        Self {
            name: "quick",
            lease: Duration::from_secs(4),
            heartbeat: Duration::from_millis(1500),
            reconcile: Duration::from_millis(250),
            v1_lease: Duration::from_secs(6),
            v1_heartbeat: Duration::from_millis(1500),
            seed_reconcile: Duration::from_secs(18),
            failover_streams: 12,
            rolling_streams: 12,
            chaos: Duration::from_secs(30),
            cost_window: Duration::from_secs(20),
            scale_streams: 10_000,
            scale_workers: 10,
            session_steps: vec![1000],
            storm_streams: 1000,
            throughput_sessions: 20,
            throughput_window: Duration::from_secs(5),
            controller_resources: 200,
            controller_window: Duration::from_secs(30),
        }
    }
}

pub struct Ctx {
    pub profile: Profile,
    /// The tether binary.
    pub exe: PathBuf,
    /// The tether 0.1 binary.
    pub legacy: PathBuf,
    /// Another tether build measured beside this one where a section
    /// supports it (`TETHER_BENCH_BASELINE_BIN`): an A/B in the same run.
    pub baseline: Option<PathBuf>,
    pub seed: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tether::install_crypto_provider();
    // The in-process workers of the scale run log here when asked (RUST_LOG).
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    // Re-renders the Markdown of a results file (after the report format changed).
    if args.first().map(String::as_str) == Some("render") {
        let path = args
            .get(1)
            .context("render bench/results/<profile>[-<figure>].json")?;
        let report: Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
        let stem = std::path::Path::new(path)
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        let which = stem.split_once('-').map_or("all", |(_, w)| w);
        return report::write(&report, which);
    }
    if args.first().map(String::as_str) == Some("bare-sessions") {
        let template = args
            .get(1)
            .context("bare-sessions URL_TEMPLATE [CA_FILE]")?;
        return bare::run(template, args.get(2).map(String::as_str)).await;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let seed = flag_value(&args, "--seed")?.unwrap_or(42);
    let scale_streams: Option<usize> = flag_value(&args, "--scale-streams")?;
    // A small fleet (2-4 workers) reads every partition whole; the default
    // profiles run 10 and 20. The failover crashes workers: one must stay.
    let scale_workers: Option<usize> = flag_value(&args, "--scale-workers")?;
    if let Some(n) = scale_workers.filter(|&n| n < 2) {
        bail!("--scale-workers {n}: at least 2 (the failover crashes some and needs one left)");
    }
    let which = args
        .iter()
        .find(|a| !a.starts_with("--") && a.parse::<u64>().is_err())
        .cloned()
        .unwrap_or_else(|| "all".into());
    let exe = std::env::current_exe()?.with_file_name("tether");
    if !exe.exists() {
        bail!(
            "{} not found: build it (`cargo build --release -p tether`), or use scripts/bench",
            exe.display()
        );
    }
    let legacy = PathBuf::from(std::env::var("TETHER_LEGACY_BIN").unwrap_or_default());
    if !legacy.exists() {
        bail!(
            "TETHER_LEGACY_BIN must name a tether 0.1 binary (scripts/legacy-binary release); scripts/bench sets it"
        );
    }
    raise_fd_limit();
    let mut profile = if quick {
        Profile::quick()
    } else {
        Profile::default_profile()
    };
    if let Some(n) = scale_streams {
        profile.scale_streams = n;
    }
    if let Some(n) = scale_workers {
        profile.scale_workers = n;
    }
    let ctx = Ctx {
        profile,
        exe,
        legacy,
        baseline: std::env::var_os("TETHER_BENCH_BASELINE_BIN").map(PathBuf::from),
        seed,
    };
    let started = Instant::now();
    let mut results = serde_json::Map::new();
    let all = which == "all";
    println!("tether benchmarks, profile {}", ctx.profile.name);
    if all || which == "failover" {
        results.insert("failover".into(), failover::run(&ctx).await?);
        save(&ctx, &results, started, &which)?;
    }
    if all || which == "restart" {
        results.insert("container_restart".into(), restart::run(&ctx).await?);
        save(&ctx, &results, started, &which)?;
    }
    if all || which == "rolling" {
        results.insert("rolling_restart".into(), rolling::run(&ctx).await?);
        save(&ctx, &results, started, &which)?;
    }
    if all || which == "join" {
        results.insert("join".into(), join::run(&ctx).await?);
        save(&ctx, &results, started, &which)?;
    }
    if all || which == "chaos" {
        results.insert("chaos".into(), rolling::chaos(&ctx).await?);
        save(&ctx, &results, started, &which)?;
    }
    if all || which == "cost" {
        results.insert("dynamodb_cost".into(), cost::run(&ctx).await?);
        save(&ctx, &results, started, &which)?;
    }
    if all || which == "scale" {
        results.insert("scale".into(), scale::run(&ctx).await?);
        save(&ctx, &results, started, &which)?;
    }
    if all || which == "controller" {
        results.insert("controller".into(), controller::run(&ctx).await?);
        save(&ctx, &results, started, &which)?;
    }
    if all || which == "sessions" {
        results.insert("sessions_per_worker".into(), sessions::run(&ctx).await?);
        save(&ctx, &results, started, &which)?;
    }
    if all || which == "storm" {
        results.insert("reconnect_storm".into(), storm::run(&ctx).await?);
        save(&ctx, &results, started, &which)?;
    }
    if all || which == "throughput" {
        results.insert("throughput".into(), throughput::run(&ctx).await?);
        save(&ctx, &results, started, &which)?;
    }
    if all || which == "sinks" {
        results.insert("sink_throughput".into(), sinks::run(&ctx).await?);
        save(&ctx, &results, started, &which)?;
    }
    Ok(())
}

/// Writes what has been measured so far, after every figure: a run cut short
/// (or one figure failing) keeps the figures before it.
fn save(
    ctx: &Ctx,
    results: &serde_json::Map<String, Value>,
    started: Instant,
    which: &str,
) -> anyhow::Result<()> {
    let report = json!({
        "profile": ctx.profile.name,
        "parameters": {
            "lease_s": ctx.profile.lease.as_secs_f64(),
            "heartbeat_s": ctx.profile.heartbeat.as_secs_f64(),
            "reconcile_s": ctx.profile.reconcile.as_secs_f64(),
            "v1_lease_s": ctx.profile.v1_lease.as_secs_f64(),
            "v1_heartbeat_s": ctx.profile.v1_heartbeat.as_secs_f64(),
            "seed_reconcile_s": ctx.profile.seed_reconcile.as_secs_f64(),
        },
        "machine": report::machine(),
        "wall_time_s": started.elapsed().as_secs_f64(),
        "results": Value::Object(results.clone()),
    });
    report::write(&report, which)
}

/// File descriptors the bench wants: its feed holds two per session (the
/// socket and the probe it orders closes by) for 10,000 sessions, next to the
/// store, the sinks and the workers' children, which inherit the limit.
const WANTED_FDS: u64 = 65_536;

/// The value after `name` on the command line: `None` when the flag is not
/// given (the profile's own value stands), an error when it is given
/// without a value that parses (a run with a setting other than the one
/// asked for would be mistaken for it).
fn flag_value<T: std::str::FromStr>(args: &[String], name: &str) -> anyhow::Result<Option<T>> {
    let Some(at) = args.iter().position(|a| a == name) else {
        return Ok(None);
    };
    let value = args
        .get(at + 1)
        .with_context(|| format!("{name} needs a value"))?;
    match value.parse() {
        Ok(v) => Ok(Some(v)),
        Err(_) => bail!("{name} {value}: not a whole number"),
    }
}

fn raise_fd_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        // Raising the hard limit works as root; otherwise the hard limit it is.
        if setrlimit(
            Resource::RLIMIT_NOFILE,
            WANTED_FDS.max(hard),
            WANTED_FDS.max(hard),
        )
        .is_err()
        {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
        }
    }
}

/// p50/p99/max of latencies.
pub fn stats(values: &[f64]) -> Value {
    json!({
        "n": values.len(),
        "p50_s": round2(quantile(values, 0.5)),
        "p99_s": round2(quantile(values, 0.99)),
        "max_s": round2(quantile(values, 1.0)),
    })
}

pub fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

pub async fn stop_all(workers: &mut [WorkerProcess]) {
    for w in workers.iter() {
        let _ = w.signal(nix::sys::signal::Signal::SIGTERM);
    }
    for w in workers.iter_mut() {
        let _ = w.wait(Duration::from_secs(30)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::flag_value;

    fn args(of: &[&str]) -> Vec<String> {
        of.iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn a_flag_is_read_when_given_and_refused_without_a_usable_value() {
        let given = args(&["scale", "--scale-workers", "3"]);
        assert_eq!(
            flag_value::<usize>(&given, "--scale-workers").unwrap(),
            Some(3)
        );
        assert_eq!(flag_value::<usize>(&given, "--seed").unwrap(), None);
        for bad in [
            &["scale", "--scale-workers"][..],
            &["--scale-workers", "two"],
        ] {
            let error = flag_value::<usize>(&args(bad), "--scale-workers").unwrap_err();
            assert!(error.to_string().contains("--scale-workers"), "{error}");
        }
    }
}
