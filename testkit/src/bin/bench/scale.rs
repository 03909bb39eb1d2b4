//! Scale by simulation, said plainly: a lease-only run of tether with
//! sessions replaced by a no-op (so one 2-core machine can hold the leases),
//! 100,000 streams on 20 in-process workers, on the embedded store, through
//! the capacity model with DynamoDB's per-partition limits enforced. The
//! streams are loaded into the table first and the fleet then starts on it.
//! Measured: the time from the fleet's start until all are owned, until
//! every worker holds its fair share (±1), a crash of 2
//! workers (10% of the streams) and the time until their streams are owned
//! again, the hottest partition key's peak write units per second in steady
//! state and during the failover, and double owners counted from the store's
//! history (not the workers' word).
//!
//! The earlier design's reads (every orphan partition read whole, every
//! pass) run the same way after it, on a fresh table, for the comparison in
//! the same run.
//!
//! Then the same meter on tether 0.1 (real processes, idle sessions), with its
//! heartbeat compressed 5× so a few hundred streams show where thousands
//! would throttle: every renewal moves the `by_state` sort key inside the one
//! partition `STARTED`.

use crate::{Ctx, round2};
use serde_json::{Value, json};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tether::lease::{
    LeaseStore, OWNED_EXPIRY_MS, STREAM_PK_PREFIX, StoreConfig, WORKER_PK_PREFIX, worker_id_of,
};
use tether::metrics::StoreMetrics;
use tether_testkit::bed::{BedOptions, loopback};
use tether_testkit::capacity::{CapacityModel, HistoryEntry, double_owners};
use tether_testkit::fixtures::log_spec;
use tether_testkit::sim::{self, SimWorker, races};
use tether_testkit::store::endpoint;
use tokio::time::Instant;

pub async fn run(ctx: &Ctx) -> anyhow::Result<Value> {
    let tether = tether_run(ctx, false).await?;
    let whole = tether_run(ctx, true).await?;
    let legacy = legacy_ramp(ctx).await?;
    Ok(json!({"tether": tether, "tether_whole_reads": whole, "tether_0_1": legacy}))
}

/// The largest distance of any worker's load from the mean.
fn spread(workers: &[SimWorker], n: usize) -> f64 {
    let mean = n as f64 / workers.len() as f64;
    workers
        .iter()
        .map(|w| (w.held() as f64 - mean).abs())
        .fold(0.0, f64::max)
}

/// The worker id of the `i`th simulated worker (the first ones crash).
fn sim_worker_id(i: usize) -> String {
    format!("sim-{i:02}")
}

/// The workers' full acquisition passes so far: how many, and the seconds
/// they took together.
fn full_passes(workers: &[SimWorker]) -> (u64, f64) {
    workers.iter().fold((0, 0.0), |(count, sum), w| {
        let h = w
            .metrics
            .acquisition_pass_seconds
            .get_or_create(&[("kind", "full")]);
        (count + h.count(), sum + h.sum())
    })
}

/// Full passes finished between two `full_passes` readings, and their
/// mean length in seconds (0 when none finished).
fn passes_between(before: (u64, f64), after: (u64, f64)) -> (u64, f64) {
    let count = after.0 - before.0;
    (count, (after.1 - before.1) / count.max(1) as f64)
}

/// Full passes between two `full_passes` readings over `seconds` with
/// `workers` workers: how many each worker made a second, and how long one
/// took on average (a pass awaits its reads and acquires, and the next
/// starts a reconcile interval after it ends).
fn pass_pace(before: (u64, f64), after: (u64, f64), workers: usize, seconds: f64) -> Value {
    let (count, mean_s) = passes_between(before, after);
    let per_worker_s = count as f64 / workers.max(1) as f64 / seconds.max(f64::EPSILON);
    json!({"full_passes": count, "per_worker_per_s": per_worker_s, "mean_s": mean_s})
}

/// CPU time used so far by this process (the simulated workers, the
/// capacity model and the store), by the embedded store's threads and by
/// the capacity model's.
struct CpuMark {
    at: Instant,
    process: Option<f64>,
    store: Option<f64>,
    model: Option<f64>,
}

impl CpuMark {
    fn now() -> Self {
        Self {
            at: Instant::now(),
            process: tether::process_metrics::stat(None).map(|s| s.cpu_seconds),
            store: tether_testkit::store::threads_cpu_seconds(
                tether_testkit::store::STORE_THREAD_NAME,
            ),
            model: tether_testkit::store::threads_cpu_seconds(
                tether_testkit::capacity::MODEL_THREAD_NAME,
            ),
        }
    }

    /// Cores used on average from this mark to `later`, in all, by the
    /// store, by the model and by the rest (the workers), and the machine's:
    /// a simulation using all of them is paced by this machine, not by the
    /// protocol.
    fn cores_until(&self, later: &CpuMark) -> Cores {
        let seconds = later
            .at
            .duration_since(self.at)
            .as_secs_f64()
            .max(f64::EPSILON);
        let cores = |a: Option<f64>, b: Option<f64>| Some((b? - a?) / seconds);
        let (process, store, model) = (
            cores(self.process, later.process),
            cores(self.store, later.store),
            cores(self.model, later.model),
        );
        Cores {
            process_cores: process,
            store_cores: store,
            model_cores: model,
            worker_cores: process
                .zip(store)
                .zip(model)
                .map(|((p, s), m)| (p - s - m).max(0.0)),
            machine_cores: std::thread::available_parallelism().map_or(0, usize::from),
            seconds,
        }
    }

    fn cores_since(&self) -> Cores {
        self.cores_until(&Self::now())
    }
}

/// Cores used over a span (`None` where `/proc` could not be read).
#[derive(serde::Serialize)]
struct Cores {
    process_cores: Option<f64>,
    store_cores: Option<f64>,
    model_cores: Option<f64>,
    /// The process less the store and the model: the simulated workers
    /// (their DynamoDB clients included) and the bench's own sampling.
    worker_cores: Option<f64>,
    machine_cores: usize,
    seconds: f64,
}

impl Cores {
    /// The workers' CPU milliseconds per acquire sent (won or lost) over the
    /// span: what the product spent, whatever the harness around it did.
    fn worker_ms_per_acquire(&self, acquires: u64) -> Option<f64> {
        Some(self.worker_cores? * self.seconds * 1000.0 / acquires.max(1) as f64)
    }
}

/// The reads a worker makes, by the operation its store client names them.
const READ_OPERATIONS: [&str; 14] = [
    "query_fleet",
    "query_unowned",
    "query_departed",
    "query_held",
    "query_holder_end",
    "get_item",
    "reread_item",
    "get_worker",
    "batch_get_workers",
    "batch_get_checkpoints",
    "read_changes",
    "read_changes_poked",
    "query_changes",
    "roster",
];

/// Successful reads and their read units, by operation.
type Reads = std::collections::BTreeMap<&'static str, (u64, f64)>;

/// The reads made so far.
fn reads_by_operation(metrics: &StoreMetrics) -> Reads {
    READ_OPERATIONS
        .iter()
        .map(|op| (*op, (metrics.succeeded(op), round2(metrics.read_units(op)))))
        .collect()
}

/// The reads between two [`reads_by_operation`] marks, the ones made.
fn reads_since(before: &Reads, after: &Reads) -> Reads {
    after
        .iter()
        .map(|(op, (n, units))| {
            let (n0, u0) = before.get(op).copied().unwrap_or_default();
            (*op, (n - n0, round2(units - u0)))
        })
        .filter(|(_, (n, _))| *n > 0)
        .collect()
}

fn held(workers: &[SimWorker]) -> i64 {
    workers.iter().map(SimWorker::held).sum()
}

/// One design through the simulation; `whole` reads every orphan partition
/// whole, every pass (0.4's reads).
async fn tether_run(ctx: &Ctx, whole: bool) -> anyhow::Result<Value> {
    let p = &ctx.profile;
    let design = if whole {
        "whole reads (0.4)"
    } else {
        "bounded reads"
    };
    println!("scale: {design}");
    let n = p.scale_streams;
    // The table is loaded first, directly (not through the model): the cold
    // start is a fleet starting on a table that already holds every stream,
    // as after a cluster restart or with resources applied while no worker
    // ran. (Created while the fleet runs, the streams arrive only as fast as
    // the simulated store takes them: 30,000 took 41 s.)
    let loading = Instant::now();
    let table = sim::store_with_orphans("scale", n)
        .await
        .table()
        .to_string();
    let loaded_in = loading.elapsed().as_secs_f64();
    println!("scale: {n} streams loaded in {loaded_in:.0}s");
    let model = CapacityModel::start(loopback(), &endpoint().0, true).await?;
    model.remember_table_descriptions();
    // Every write from here passes through the model, so it keeps the items'
    // attributes it meters by itself rather than reading them around each
    // write (the simulated store's time is the simulation's, not DynamoDB's).
    let remembered = model.remember_items(&table).await?;
    println!("scale: the capacity model read {remembered} items");
    let t0 = Instant::now();
    let cold_cpu = CpuMark::now();
    let mut workers = Vec::new();
    // One set of store metrics for the whole fleet: what it read, by operation.
    let store_metrics = Arc::new(StoreMetrics::new());
    for i in 0..p.scale_workers {
        let store = LeaseStore::connect(
            StoreConfig::local(&table, model.endpoint()),
            store_metrics.clone(),
        )
        .await?;
        let mut settings = sim::settings(&sim_worker_id(i), p.lease, p.heartbeat, p.reconcile, n);
        settings.read_orphans_whole = whole;
        workers.push(SimWorker::start(settings, store)?);
    }
    all_held(&workers, n, "acquired", |_| {}).await?;
    let acquire_all = t0.elapsed().as_secs_f64();
    let cold_cores = cold_cpu.cores_since();
    let cold_cpu = json!(cold_cores);
    println!("scale: CPU during the cold start: {cold_cpu}");
    let cold_passes = pass_pace((0, 0.0), full_passes(&workers), workers.len(), acquire_all);
    println!("scale: full passes during the cold start: {cold_passes}");
    let (races_won, races_lost) = races(&workers);
    println!("scale: acquires won {races_won}, lost to another worker {races_lost}");
    let cold_ms_per_acquire = cold_cores.worker_ms_per_acquire(races_won + races_lost);
    println!(
        "scale: the workers' CPU per acquire during the cold start: {cold_ms_per_acquire:?} ms"
    );
    let during_acquisition = model.report();
    let cold_reads = reads_by_operation(&store_metrics);
    println!(
        "scale: the workers' reads during the cold start by operation (requests, read units): {cold_reads:?}"
    );
    println!(
        "scale: requests during the cold start by operation: {:?}; {} write units, {} of them for {} refused writes",
        during_acquisition.requests_by_target,
        during_acquisition.write_units,
        during_acquisition.refused_write_units,
        during_acquisition.refused_writes
    );
    println!(
        "scale: {} workers acquired {n} streams in {acquire_all:.1}s; hottest key {:?} at {:.0} WCU/s, {} throttled",
        p.scale_workers,
        during_acquisition.hottest_write_key,
        during_acquisition.hottest_write_units_per_s,
        during_acquisition.throttled_requests
    );
    // Steady state: once fair share has balanced the fleet (a mass creation
    // lands unevenly; rebalancing halves the excess every two heartbeats).
    let moves = |workers: &[SimWorker]| -> (u64, u64) {
        workers.iter().fold((0, 0), |(h, s), w| {
            (
                h + w.metrics.rebalance_handoffs.get(),
                s + w.metrics.self_fences.get(),
            )
        })
    };
    // Fair share: every worker within one stream of the mean (the mean is
    // whole here), or the largest distance after two minutes (the goal is
    // one).
    let converging = Instant::now();
    let mut reported = Instant::now();
    while spread(&workers, n) > 1.0 && converging.elapsed() < Duration::from_secs(120) {
        if reported.elapsed() >= Duration::from_secs(15) {
            reported = Instant::now();
            let mut loads: Vec<i64> = workers.iter().map(SimWorker::held).collect();
            loads.sort_unstable();
            println!(
                "scale: loads {:.0}s after the acquisition: {loads:?}",
                converging.elapsed().as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let converged_after = converging.elapsed().as_secs_f64();
    let spread_then = spread(&workers, n);
    println!(
        "scale: every worker within {spread_then:.0} of its fair share {converged_after:.1}s after the acquisition"
    );
    let balancing = Instant::now();
    loop {
        let before = moves(&workers).0;
        tokio::time::sleep(p.heartbeat * 3).await;
        if moves(&workers).0 == before || balancing.elapsed() > Duration::from_secs(300) {
            break;
        }
    }
    let balanced_after = balancing.elapsed().as_secs_f64();
    println!("scale: balanced {balanced_after:.0}s after the acquisition");
    model.reset_usage();
    let (handoffs_before, fences_before) = moves(&workers);
    let steady_window = p.heartbeat * 4;
    tokio::time::sleep(steady_window).await;
    let steady = model.report();
    let (handoffs_after, fences_after) = moves(&workers);
    println!(
        "scale: steady window: {} handoffs, {} self-fences",
        handoffs_after - handoffs_before,
        fences_after - fences_before
    );
    println!(
        "scale: steady state hottest key {:?} at {:.1} WCU/s; {:.0} WCU/s in all",
        steady.hottest_write_key,
        steady.hottest_write_units_per_s,
        steady.write_units / steady_window.as_secs_f64()
    );
    // Crash 10%: two workers vanish without releasing anything.
    model.reset_usage();
    let killed: usize = 2.min(workers.len() - 1);
    let lost = held(&workers[..killed]);
    let (won_before, lost_before) = races(&workers[killed..]);
    let killed_at_ms = model.now_ms();
    let reads_before_failover = reads_by_operation(&store_metrics);
    let t1 = Instant::now();
    let failover_cpu = CpuMark::now();
    for w in workers.drain(..killed) {
        w.task.abort();
    }
    let passes_before = full_passes(&workers);
    // Acquires won and lost in each second of the failover.
    let mut races_by_second = Vec::new();
    // And the full passes finished in each second, with their mean length (ms).
    let mut passes_by_second = Vec::new();
    let mut last = (won_before, lost_before);
    let mut last_passes = passes_before;
    // And the cores the process used in each second (the store's apart).
    let mut cpu_by_second = Vec::new();
    let mut last_cpu = CpuMark::now();
    all_held(&workers, n, "owned again", |workers| {
        let mark = CpuMark::now();
        let cpu = last_cpu.cores_until(&mark);
        last_cpu = mark;
        let rounded = |cores: Option<f64>| cores.map_or(f64::NAN, round2);
        cpu_by_second.push((
            rounded(cpu.process_cores),
            rounded(cpu.store_cores),
            rounded(cpu.model_cores),
        ));
        let now = races(workers);
        races_by_second.push((now.0 - last.0, now.1 - last.1));
        last = now;
        let passes = full_passes(workers);
        let (count, mean_s) = passes_between(last_passes, passes);
        passes_by_second.push((count, (1000.0 * mean_s).round() as u64));
        last_passes = passes;
    })
    .await?;
    println!(
        "scale: acquires won / lost to another worker in each second of the failover: {races_by_second:?}"
    );
    println!(
        "scale: cores used (all / the store / the model) in each second of the failover: {cpu_by_second:?}"
    );
    println!(
        "scale: full passes finished / their mean ms in each second of the failover: {passes_by_second:?}"
    );
    let failover = t1.elapsed().as_secs_f64();
    let failover_cores = failover_cpu.cores_since();
    let failover_cpu = json!(failover_cores);
    println!("scale: CPU during the failover: {failover_cpu}");
    let failover_passes = pass_pace(
        passes_before,
        full_passes(&workers),
        workers.len(),
        failover,
    );
    println!("scale: full passes during the failover: {failover_passes}");
    let (won_after, lost_after) = races(&workers);
    let (failover_won, failover_lost) = (won_after - won_before, lost_after - lost_before);
    let failover_ms_per_acquire =
        failover_cores.worker_ms_per_acquire(failover_won + failover_lost);
    println!(
        "scale: the workers' CPU per acquire during the failover: {failover_ms_per_acquire:?} ms"
    );
    let during_failover = model.report();
    let failover_reads = reads_since(&reads_before_failover, &reads_by_operation(&store_metrics));
    println!(
        "scale: the workers' reads during the failover by operation (requests, read units): {failover_reads:?}"
    );
    let history = model.history();
    let crashed: Vec<String> = (0..killed).map(sim_worker_id).collect();
    let declared_dead_s = declared_dead_after(&history, &crashed, killed_at_ms);
    let taken_by_second = taken_over_by_second(&history, &crashed, killed_at_ms);
    println!("scale: streams taken over by each second after the crash: {taken_by_second:?}");
    println!(
        "scale: requests during the failover by operation: {:?}; {} write units, {} of them for {} refused writes",
        during_failover.requests_by_target,
        during_failover.write_units,
        during_failover.refused_write_units,
        during_failover.refused_writes
    );
    let doubles = double_owners(&history);
    if !doubles.is_empty() {
        // Keep the evidence: every write to the streams and workers involved.
        let path = std::env::temp_dir().join("tether-scale-double-owners.json");
        let involved: Vec<_> = history
            .iter()
            .filter(|h| {
                doubles
                    .iter()
                    .any(|d| d.starts_with(&h.pk) || h.pk.starts_with("WORKER#"))
            })
            .collect();
        std::fs::write(&path, serde_json::to_string_pretty(&involved)?)?;
        println!("scale: double owners! evidence in {}", path.display());
    }
    println!(
        "scale: crash of {killed} workers ({lost} streams): declared dead after {}, all owned again after {failover:.1}s (acquires won {failover_won}, lost to another worker {failover_lost}); hottest key {:?} at {:.0} WCU/s, {} throttled; double owners {}",
        declared_dead_s.map_or("never".to_string(), |s| format!("{s:.1}s")),
        during_failover.hottest_write_key,
        during_failover.hottest_write_units_per_s,
        during_failover.throttled_requests,
        doubles.len()
    );
    for w in workers {
        w.task.abort();
    }
    Ok(json!({
        "simulation": "lease-only: no-op sessions, in-process workers, embedded store behind the capacity model",
        "design": design,
        "streams": n,
        "workers": p.scale_workers,
        "loaded_in_s": loaded_in,
        "acquires_won": races_won,
        "acquires_lost_races": races_lost,
        "acquire_all_s": acquire_all,
        "acquisition_passes": cold_passes,
        "acquisition_cpu": cold_cpu,
        "acquisition_worker_ms_per_acquire": cold_ms_per_acquire,
        "acquisition": during_acquisition,
        "steady": steady,
        "steady_window_s": steady_window.as_secs_f64(),
        "fair_share_within_1_after_s": converged_after,
        "largest_distance_from_fair_share": spread_then,
        "balanced_after_s": balanced_after,
        "steady_handoffs": handoffs_after - handoffs_before,
        "steady_self_fences": fences_after - fences_before,
        "crashed_workers": killed,
        "crashed_streams": lost,
        "failover_declared_dead_s": declared_dead_s,
        "failover_all_owned_again_s": failover,
        "failover_taken_over_by_second": taken_by_second,
        "failover_races_by_second": races_by_second,
        "failover_passes": failover_passes,
        "failover_cpu": failover_cpu,
        "failover_worker_ms_per_acquire": failover_ms_per_acquire,
        "failover_cpu_by_second": cpu_by_second,
        "failover_passes_by_second": passes_by_second,
        "failover_acquires_won": failover_won,
        "failover_acquires_lost_races": failover_lost,
        "failover": during_failover,
        "double_owners": doubles.len(),
        "double_owner_examples": doubles.into_iter().take(5).collect::<Vec<_>>(),
    }))
}

/// Seconds from the crash (`killed_at_ms` on the model's clock) until the
/// last of the `crashed` workers (by worker id) was declared dead in the
/// store: the part of a failover the lease sets, before any of its streams
/// can be taken over. `None` if one never was.
fn declared_dead_after(
    history: &[HistoryEntry],
    crashed: &[String],
    killed_at_ms: u64,
) -> Option<f64> {
    crashed
        .iter()
        .map(|id| {
            history
                .iter()
                .find(|h| {
                    h.at_ms >= killed_at_ms
                        && h.worker_state.as_deref() == Some("DEAD")
                        && h.pk
                            .strip_prefix(WORKER_PK_PREFIX)
                            .is_some_and(|inc| worker_id_of(inc) == id)
                })
                .map(|h| (h.at_ms - killed_at_ms) as f64 / 1000.0)
        })
        .try_fold(0.0, |latest: f64, at| Some(latest.max(at?)))
}

/// How many of the crashed workers' streams survivors had taken by the end
/// of each second after the crash, from the store's history: the failover's
/// pace once the crashed workers were declared dead.
fn taken_over_by_second(
    history: &[HistoryEntry],
    crashed: &[String],
    killed_at_ms: u64,
) -> Vec<usize> {
    let mut first_taken: HashMap<&str, u64> = HashMap::new();
    let mut held_by_crashed: HashSet<&str> = HashSet::new();
    for h in history
        .iter()
        .filter(|h| h.pk.starts_with(STREAM_PK_PREFIX))
    {
        let owner = h.owner.as_deref().unwrap_or("");
        let owned = h.expires_at_ms == Some(OWNED_EXPIRY_MS);
        if h.at_ms < killed_at_ms {
            if owned && crashed.iter().any(|id| worker_id_of(owner) == id) {
                held_by_crashed.insert(&h.pk);
            } else {
                held_by_crashed.remove(h.pk.as_str());
            }
        } else if owned && held_by_crashed.contains(h.pk.as_str()) {
            first_taken.entry(&h.pk).or_insert(h.at_ms - killed_at_ms);
        }
    }
    let last = first_taken.values().max().map_or(0, |ms| ms / 1000 + 1);
    (1..=last)
        .map(|second| {
            first_taken
                .values()
                .filter(|&&ms| ms < second * 1000)
                .count()
        })
        .collect()
}

/// tether 0.1 through the same meter, its heartbeat 5× faster than its
/// default so each step stands for five times as many streams.
async fn legacy_ramp(ctx: &Ctx) -> anyhow::Result<Value> {
    // As much as 0.1's own rule allows (lease - skew - margin >= 2 heartbeats).
    let compression: u32 = if ctx.profile.name == "quick" { 2 } else { 5 };
    let steps: &[usize] = if ctx.profile.name == "quick" {
        &[200, 400]
    } else {
        &[200, 400, 600, 800]
    };
    let bed = tether_testkit::bed::Bed::start(
        ctx.legacy.clone(),
        BedOptions {
            rate: 0,
            first_seq: 1,
            namespace: "ramp".into(),
            legacy_table: Some(ctx.legacy.clone()),
            ..BedOptions::default()
        },
    )
    .await?;
    let model = CapacityModel::start(loopback(), &endpoint().0, true).await?;
    let mut fleet = tether_testkit::processes::FleetConfig::fast(
        &ctx.legacy,
        model.endpoint(),
        bed.store.table(),
        &bed.log_dir,
    );
    fleet.workers.lease_duration = ctx.profile.v1_lease / compression;
    fleet.workers.heartbeat_interval = ctx.profile.v1_heartbeat / compression;
    fleet.workers.fence_margin = Duration::from_millis(500);
    fleet.extra_args = vec![
        "--max-clock-skew".into(),
        "500ms".into(),
        "--max-connections".into(),
        "5000".into(),
    ];
    let mut workers: Vec<_> = (0..3)
        .map(|i| fleet.spawn(&format!("v1-{i}")))
        .collect::<Result<_, _>>()?;
    let mut rows = Vec::new();
    let mut applied = 0;
    for &target in steps {
        for i in applied..target {
            let name = format!("s{i:05}");
            bed.apply_spec(&name, &log_spec(&bed.upstream.url(&name)), 1)
                .await?;
        }
        applied = target;
        let names: Vec<String> = (0..target).map(|i| format!("s{i:05}")).collect();
        // A step the throttled fleet cannot even connect is a result too.
        let connected_all = tether_testkit::bed::Bed::wait(
            Duration::from_secs(120),
            "ramp streams connected",
            || async { bed.connected_once(&names) },
        )
        .await
        .is_ok();
        tokio::time::sleep(fleet.workers.heartbeat_interval * 3).await;
        model.reset_usage();
        let window = Duration::from_secs(10);
        tokio::time::sleep(window).await;
        let r = model.report();
        let equivalent = target * compression as usize;
        println!(
            "scale: tether 0.1, {target} streams at a {:?} heartbeat (= {equivalent} at its default): hottest key {:?} at {:.0} WCU/s, {} throttled",
            fleet.workers.heartbeat_interval,
            r.hottest_write_key,
            r.hottest_write_units_per_s,
            r.throttled_requests
        );
        rows.push(json!({
            "streams": target,
            "equivalent_streams_at_default_heartbeat": equivalent,
            "hottest_write_key": r.hottest_write_key,
            "hottest_write_units_per_s": r.hottest_write_units_per_s,
            "throttled_requests": r.throttled_requests,
            "connected": bed.upstream.open_sessions().len(),
            "all_connected_within_120s": connected_all,
        }));
        // Past the first throttled step the fleet only sinks further.
        if r.throttled_requests > 0 || !connected_all {
            break;
        }
    }
    crate::stop_all(&mut workers).await;
    Ok(json!({"heartbeat_compression": compression, "steps": rows}))
}

/// Waits until the simulated workers hold all `n` streams, calling
/// `every_second` with them each second meanwhile; fails if a worker stopped
/// or half an hour passed.
async fn all_held(
    workers: &[SimWorker],
    n: usize,
    what: &str,
    mut every_second: impl FnMut(&[SimWorker]),
) -> anyhow::Result<()> {
    const LIMIT: Duration = Duration::from_secs(1800);
    let started = Instant::now();
    let mut reported = Instant::now();
    let mut next_second = started + Duration::from_secs(1);
    while held(workers) < n as i64 {
        if Instant::now() >= next_second {
            next_second += Duration::from_secs(1);
            every_second(workers);
        }
        if reported.elapsed() >= Duration::from_secs(15) {
            reported = Instant::now();
            println!(
                "scale: {} of {n} {what} after {:.0}s",
                held(workers),
                started.elapsed().as_secs_f64()
            );
        }
        anyhow::ensure!(
            started.elapsed() < LIMIT,
            "only {} of {n} {what} in {LIMIT:?}",
            held(workers)
        );
        anyhow::ensure!(
            workers.iter().all(|w| !w.task.is_finished()),
            "a simulated worker stopped (its error is printed above)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}
