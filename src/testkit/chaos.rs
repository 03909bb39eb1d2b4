//! A seeded chaos run: a fleet of workers, each behind its own DynamoDB fault
//! proxy, hit by random SIGKILLs (then restarted), SIGSTOPs longer than the
//! lease, cut-offs from DynamoDB, injected throttling, and sink outages. The
//! report counts what must stay zero (overlapping sessions, sequence gaps,
//! stale deliveries) and what is merely measured (duplicates, ownerless time).

use super::bed::{Bed, loopback, names};
use super::dynamo_proxy::{DynamoFault, DynamoFaultProxy};
use super::fleet::WorkerProcess;
use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;
use tokio::time::Instant;

const NAMESPACE: &str = "chaos";
/// How often sessions are sampled for ownerless time.
const SAMPLE: Duration = Duration::from_millis(100);

#[derive(Clone, Debug)]
pub struct ChaosConfig {
    pub seed: u64,
    pub duration: Duration,
    pub streams: usize,
    pub workers: usize,
    pub lease: Duration,
    pub heartbeat: Duration,
    pub reconcile: Duration,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct ChaosReport {
    pub seed: u64,
    pub duration_s: f64,
    pub streams: usize,
    pub workers: usize,
    pub events: BTreeMap<&'static str, u32>,
    pub throttled_requests: u64,
    pub overlapping_sessions: usize,
    pub sequence_gaps: usize,
    pub stale_deliveries: u64,
    pub duplicates: u64,
    pub delivered: usize,
    pub max_ownerless_s: f64,
    pub ownerless_stream_seconds: f64,
}

enum Restore {
    Restart(usize),
    Continue(usize),
    Reconnect(usize),
    SinkUp,
}

struct Slot {
    proxy: DynamoFaultProxy,
    process: Option<WorkerProcess>,
    generation: u32,
    busy_until: Instant,
}

pub async fn run(bed: &Bed, cfg: &ChaosConfig) -> anyhow::Result<ChaosReport> {
    let store = bed
        .table(&format!("chaos-{}-{}", cfg.seed, rand::random::<u16>()))
        .await?;
    let names = names(NAMESPACE, cfg.streams);
    bed.apply(&store, NAMESPACE, &names).await?;
    let fleet = bed.fleet(&store, cfg.lease, cfg.heartbeat, cfg.reconcile);
    let mut slots = Vec::new();
    for i in 0..cfg.workers {
        let proxy = DynamoFaultProxy::start(loopback(), &bed.store_server.endpoint()).await?;
        let process = fleet.spawn_via(&format!("chaos{i}-0"), &proxy.endpoint())?;
        slots.push(Slot {
            proxy,
            process: Some(process),
            generation: 0,
            busy_until: Instant::now(),
        });
    }
    Bed::wait(
        Duration::from_secs(60),
        "every chaos stream is connected",
        || async { bed.connected_once(&names) },
    )
    .await?;

    let mut rng = StdRng::seed_from_u64(cfg.seed);
    let mut report = ChaosReport {
        seed: cfg.seed,
        streams: cfg.streams,
        workers: cfg.workers,
        ..Default::default()
    };
    let started = Instant::now();
    let end = started + cfg.duration;
    let mut next_event = started + Duration::from_millis(rng.random_range(1000..3000));
    let mut pending: Vec<(Instant, Restore)> = Vec::new();
    let mut sink_down = false;
    let mut ownerless_run: HashMap<String, f64> = HashMap::new();
    let mut sampler = tokio::time::interval(SAMPLE);
    let settle_limit = cfg.lease * 3 + Duration::from_secs(15);

    loop {
        sampler.tick().await;
        let now = Instant::now();
        sample(bed, &names, &mut ownerless_run, &mut report);
        // Undo what is due.
        let (due, later): (Vec<_>, Vec<_>) = pending.into_iter().partition(|(at, _)| *at <= now);
        pending = later;
        for (_, restore) in due {
            match restore {
                Restore::Restart(i) => {
                    let slot = &mut slots[i];
                    slot.generation += 1;
                    let id = format!("chaos{i}-{}", slot.generation);
                    slot.process = Some(fleet.spawn_via(&id, &slot.proxy.endpoint())?);
                }
                Restore::Continue(i) => {
                    if let Some(p) = &slots[i].process {
                        p.signal(Signal::SIGCONT)?;
                    }
                }
                Restore::Reconnect(i) => slots[i].proxy.set(DynamoFault::Pass),
                Restore::SinkUp => {
                    bed.sink.set_failing(false);
                    sink_down = false;
                }
            }
        }
        if now >= end {
            if pending.is_empty() {
                break;
            }
            continue;
        }
        if now < next_event {
            continue;
        }
        next_event = now + Duration::from_millis(rng.random_range(1500..4000));
        let healthy: Vec<usize> = (0..slots.len())
            .filter(|i| slots[*i].busy_until <= now)
            .collect();
        let roll = rng.random_range(0..100);
        // Never disturb the last healthy worker: the run checks safety, not a total outage.
        if roll < 15 || healthy.len() < 2 {
            if !sink_down {
                bed.sink.set_failing(true);
                sink_down = true;
                pending.push((now + Duration::from_secs(3), Restore::SinkUp));
                *report.events.entry("sink_outage").or_default() += 1;
            }
            continue;
        }
        let i = healthy[rng.random_range(0..healthy.len())];
        let slot = &mut slots[i];
        let hold = cfg.lease + Duration::from_secs(1);
        match roll {
            15..=39 => {
                if let Some(p) = &slot.process {
                    p.signal(Signal::SIGKILL)?;
                }
                slot.busy_until = now + Duration::from_secs(2);
                pending.push((slot.busy_until, Restore::Restart(i)));
                *report.events.entry("sigkill").or_default() += 1;
            }
            40..=59 => {
                if let Some(p) = &slot.process {
                    p.signal(Signal::SIGSTOP)?;
                }
                slot.busy_until = now + hold;
                pending.push((slot.busy_until, Restore::Continue(i)));
                *report.events.entry("sigstop_beyond_lease").or_default() += 1;
            }
            60..=79 => {
                slot.proxy.set(DynamoFault::Blackhole);
                slot.busy_until = now + hold;
                pending.push((slot.busy_until, Restore::Reconnect(i)));
                *report.events.entry("dynamodb_cut").or_default() += 1;
            }
            _ => {
                slot.proxy.set(DynamoFault::Throttle(0.5));
                slot.busy_until = now + Duration::from_secs(5);
                pending.push((slot.busy_until, Restore::Reconnect(i)));
                *report.events.entry("dynamodb_throttle_50pct").or_default() += 1;
            }
        }
    }

    // Everything restored: the fleet must settle with every stream connected once.
    let settle_deadline = Instant::now() + settle_limit;
    while !bed.connected_once(&names) {
        if Instant::now() > settle_deadline {
            anyhow::bail!("the fleet did not settle within {settle_limit:?} after the chaos ended");
        }
        sampler.tick().await;
        sample(bed, &names, &mut ownerless_run, &mut report);
    }
    report.duration_s = started.elapsed().as_secs_f64();
    report.throttled_requests = slots.iter().map(|s| s.proxy.throttled()).sum();
    for slot in &mut slots {
        if let Some(p) = &slot.process {
            let _ = p.signal(Signal::SIGTERM);
        }
    }
    for slot in &mut slots {
        if let Some(p) = slot.process.as_mut() {
            let _ = p.wait(Duration::from_secs(15)).await;
        }
    }
    report.overlapping_sessions = bed.overlaps(&names);
    report.sequence_gaps = bed.gaps(NAMESPACE, &names);
    report.duplicates = bed.duplicates(NAMESPACE, &names);
    report.stale_deliveries = names
        .iter()
        .map(|n| bed.sink.log(&format!("{NAMESPACE}/{n}")).stale_messages)
        .sum();
    report.delivered = names
        .iter()
        .map(|n| bed.sink.log(&format!("{NAMESPACE}/{n}")).seqs.len())
        .sum();
    Ok(report)
}

/// Adds one sample's ownerless time and tracks the longest ownerless stretch.
fn sample(bed: &Bed, names: &[String], runs: &mut HashMap<String, f64>, report: &mut ChaosReport) {
    let open = bed.upstream.open_sessions();
    let step = SAMPLE.as_secs_f64();
    for n in names {
        let run = runs.entry(n.clone()).or_insert(0.0);
        if open.contains_key(n) {
            *run = 0.0;
        } else {
            *run += step;
            report.ownerless_stream_seconds += step;
            report.max_ownerless_s = report.max_ownerless_s.max(*run);
        }
    }
}
