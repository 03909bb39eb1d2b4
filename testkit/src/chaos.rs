//! A seeded chaos run. A fleet of workers — two of them started with the same
//! worker id — each behind its own DynamoDB fault proxy, serving a zero-based
//! feed, is hit by random faults: SIGKILL (then a restart), SIGSTOP beyond
//! the lease, cut-offs from DynamoDB, throttling, brownouts (slow answers),
//! sink outages, a slow sink, a sink that goes on processing requests after
//! the client hung up, SIGTERM during a brownout with a slow sink, handoffs
//! during a brownout (a worker joins while another is browned out), a write
//! whose answer is lost, answers that arrive late after the write landed, a
//! crashed worker whose item then disappears, delete/re-create of a stream,
//! and a worker whose clock is skewed beyond the budget. The sink checks
//! tokens, and stale is judged when it applies a batch. With `real_sinks`, some streams deliver to Kinesis (kinesalite)
//! and NATS JetStream (nats-server) instead, each behind a TCP fault proxy
//! that the sink outages cut too, and are read back from those servers.
//! The report counts what must stay zero (overlapping sessions,
//! sequence gaps, stale deliveries) and what is measured (duplicates,
//! ownerless time).

use crate::bed::{Bed, loopback};
use crate::dynamo_proxy::{DynamoFault, DynamoFaultProxy};
use crate::processes::WorkerProcess;
use crate::sink::SinkFault;
use crate::store::endpoint;
use aws_sdk_dynamodb::types::AttributeValue;
use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;
use tether::lease::{DeleteOutcome, WorkerState};
use tokio::time::Instant;

/// How often sessions are sampled for ownerless time.
const SAMPLE: Duration = Duration::from_millis(100);
/// Worker id shared by slots 0 and 1 (duplicate identities).
const DUPLICATE_ID: &str = "chaos-dup";
/// A clock shift well beyond the default `--max-clock-skew`.
const SKEW_SECONDS: i64 = 30;

#[derive(Clone, Debug)]
pub struct ChaosConfig {
    pub seed: u64,
    pub duration: Duration,
    pub streams: usize,
    pub workers: usize,
    pub lease: Duration,
    pub heartbeat: Duration,
    pub reconcile: Duration,
    /// Also run streams on the Kinesis and NATS sinks.
    pub real_sinks: bool,
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
    /// Sequence numbers missing, per stream identity (a replaced stream is
    /// a new identity whose feed starts again).
    pub sequence_gaps: usize,
    /// Stream identities verified (streams, plus one per replacement).
    pub identities: usize,
    /// Batches of a superseded owner the sink *applied* (judged when the
    /// sink applies them, by a sink that keeps processing after the client
    /// hung up): must be 0.
    pub stale_deliveries: u64,
    /// Such batches the sink refused with the fenced signal (the verifying
    /// sink checks tokens, as the contract lets a sink do): not applied.
    pub stale_refused: u64,
    pub duplicates: u64,
    pub delivered: usize,
    pub max_ownerless_s: f64,
    pub ownerless_stream_seconds: f64,
    /// The longest a stream went without a session when no fault was holding
    /// it back: after the fleet settled.
    pub settle_s: f64,
    /// Records read back from Kinesis and NATS (with `real_sinks`).
    pub kinesis_delivered: usize,
    pub nats_delivered: usize,
    /// Gaps, disorder or stale records found in them: must stay empty.
    pub real_sink_problems: Vec<String>,
}

/// The Kinesis and NATS servers of a run, behind fault proxies.
struct RealSinks {
    kinesis: crate::sink_servers::Kinesalite,
    kinesis_proxy: crate::proxy::FaultProxy,
    nats: crate::sink_servers::NatsServer,
    nats_proxy: crate::proxy::FaultProxy,
    kinesis_names: Vec<String>,
    nats_names: Vec<String>,
}

impl RealSinks {
    /// Starts both servers and applies `per_sink` streams on each.
    async fn start(bed: &Bed, per_sink: usize) -> anyhow::Result<Self> {
        use crate::fixtures::{kinesis_spec, nats_spec};
        let kinesis = crate::sink_servers::Kinesalite::start("chaos", 2).await?;
        let kinesis_proxy = crate::proxy::FaultProxy::start(loopback(), kinesis.addr).await?;
        let nats = crate::sink_servers::NatsServer::start("CHAOS", &["chaos.>"]).await?;
        let nats_proxy = crate::proxy::FaultProxy::start(loopback(), nats.addr).await?;
        let kinesis_names = crate::bed::names("kin", per_sink);
        let nats_names = crate::bed::names("nats", per_sink);
        for name in &kinesis_names {
            bed.apply_spec(name, &kinesis_spec(&bed.upstream.url(name), "chaos"), 1)
                .await?;
        }
        let nats_url = format!("nats://{}", nats_proxy.addr);
        for name in &nats_names {
            let spec = nats_spec(
                &bed.upstream.url(name),
                &nats_url,
                &format!("chaos.{name}"),
                "CHAOS",
            );
            bed.apply_spec(name, &spec, 1).await?;
        }
        Ok(Self {
            kinesis,
            kinesis_proxy,
            nats,
            nats_proxy,
            kinesis_names,
            nats_names,
        })
    }

    fn env(&self) -> Vec<(String, String)> {
        vec![
            (
                "AWS_ENDPOINT_URL_KINESIS".into(),
                self.kinesis_proxy.endpoint(),
            ),
            ("NATS_USER".into(), self.nats.user.clone()),
            ("NATS_PASSWORD".into(), self.nats.password.clone()),
        ]
    }

    fn cut(&self, cut: bool) {
        let mode = if cut {
            crate::proxy::ProxyMode::Blackhole
        } else {
            crate::proxy::ProxyMode::Pass
        };
        self.kinesis_proxy.set_mode(mode);
        self.nats_proxy.set_mode(mode);
    }

    fn names(&self) -> Vec<String> {
        self.kinesis_names
            .iter()
            .chain(&self.nats_names)
            .cloned()
            .collect()
    }

    /// Reads both servers back and checks each stream from its first
    /// sequence number to the highest that arrived.
    async fn check(&self, bed: &Bed, report: &mut ChaosReport) -> anyhow::Result<()> {
        for (records, names, delivered) in [
            (
                self.kinesis.records().await?,
                &self.kinesis_names,
                &mut report.kinesis_delivered,
            ),
            (
                self.nats.records().await?,
                &self.nats_names,
                &mut report.nats_delivered,
            ),
        ] {
            *delivered = records.len();
            for name in names {
                let connection = format!("{}/{name}", bed.namespace);
                let Some(top) = records
                    .iter()
                    .filter(|r| r.connection == connection)
                    .map(|r| r.seq)
                    .max()
                else {
                    report
                        .real_sink_problems
                        .push(format!("{connection}: nothing arrived"));
                    continue;
                };
                report
                    .real_sink_problems
                    .extend(crate::sink_servers::check_stream(
                        &records,
                        &connection,
                        bed.first_seq,
                        top,
                    ));
            }
        }
        Ok(())
    }
}

enum Restore {
    Restart(usize),
    Continue(usize),
    StorePass(usize),
    SinkPass,
    Unskew(usize),
}

struct Slot {
    proxy: DynamoFaultProxy,
    process: Option<WorkerProcess>,
    id: String,
    busy_until: Instant,
}

pub async fn run(bed: &Bed, cfg: &ChaosConfig) -> anyhow::Result<ChaosReport> {
    let names = bed.apply("chaos", cfg.streams).await?;
    let real_sinks = match cfg.real_sinks {
        true => Some(RealSinks::start(bed, (cfg.streams / 4).max(1)).await?),
        false => None,
    };
    let mut fleet = bed.fleet.clone();
    fleet.env.extend(real_sinks.iter().flat_map(RealSinks::env));
    let watched: Vec<String> = names
        .iter()
        .cloned()
        .chain(real_sinks.iter().flat_map(RealSinks::names))
        .collect();
    fleet.workers.lease_duration = cfg.lease;
    fleet.workers.heartbeat_interval = cfg.heartbeat;
    fleet.workers.reconcile_interval = cfg.reconcile;
    fleet.workers.fence_margin = cfg.lease / 8;
    let mut slots = Vec::new();
    for i in 0..cfg.workers {
        let proxy = DynamoFaultProxy::start(loopback(), &endpoint().0).await?;
        let id = if i < 2 {
            DUPLICATE_ID.to_string()
        } else {
            format!("chaos{i}")
        };
        let process = fleet.spawn_via(&id, &proxy.endpoint())?;
        slots.push(Slot {
            proxy,
            process: Some(process),
            id,
            busy_until: Instant::now(),
        });
    }
    Bed::wait(
        Duration::from_secs(60),
        "every chaos stream is connected",
        || async { bed.connected_once(&watched) },
    )
    .await?;

    // A sink that checks tokens: a superseded owner's batch that arrives
    // late (the fence path) is refused, never applied; one it applied would
    // count as stale.
    bed.sink.set_reject_stale(true);
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
    let mut sink_busy_until = Instant::now();
    let mut ownerless_run: HashMap<String, f64> = HashMap::new();
    let mut sampler = tokio::time::interval(SAMPLE);
    let hold = cfg.lease + Duration::from_secs(1);
    let mut recreations = 0u32;
    let mut identity_floors: HashMap<String, Vec<u64>> = HashMap::new();

    loop {
        sampler.tick().await;
        let now = Instant::now();
        sample(bed, &names, &mut ownerless_run, &mut report);
        let (due, later): (Vec<_>, Vec<_>) = pending.into_iter().partition(|(at, _)| *at <= now);
        pending = later;
        for (_, restore) in due {
            match restore {
                Restore::Restart(i) => {
                    let slot = &mut slots[i];
                    slot.process = Some(fleet.spawn_via(&slot.id, &slot.proxy.endpoint())?);
                }
                Restore::Continue(i) => {
                    if let Some(p) = &slots[i].process {
                        p.signal(Signal::SIGCONT)?;
                    }
                }
                Restore::StorePass(i) => slots[i].proxy.set(DynamoFault::Pass),
                Restore::SinkPass => {
                    bed.sink_proxy.set(SinkFault::Pass);
                    if let Some(r) = &real_sinks {
                        r.cut(false);
                    }
                }
                Restore::Unskew(i) => slots[i].proxy.shift_date(0),
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
        next_event = now + Duration::from_millis(rng.random_range(1500..3500));
        let healthy: Vec<usize> = (0..slots.len())
            .filter(|i| slots[*i].busy_until <= now)
            .collect();
        let roll = rng.random_range(0..100);
        let mut count = |name: &'static str| *report.events.entry(name).or_default() += 1;
        // Never disturb the last healthy worker: the run checks safety, not a total outage.
        if roll < 12 || healthy.len() < 2 {
            if sink_busy_until <= now {
                let (fault, name) = match rng.random_range(0..3) {
                    0 => {
                        // An outage of every sink at once.
                        if let Some(r) = &real_sinks {
                            r.cut(true);
                        }
                        (SinkFault::Unavailable, "sink_outage")
                    }
                    1 => (SinkFault::Slow(Duration::from_millis(1500)), "slow_sink"),
                    // Requests keep being processed after the client hung up,
                    // for up to 10 s: past the sink's 2 s timeout too, which
                    // breaks the contract's one promise. A voluntary release
                    // waits only that timeout, so an old owner's batch can
                    // land after the new owner's; the sink checks tokens, so
                    // it must be refused (counted), never applied.
                    _ => (
                        SinkFault::SlowAfterHangUp(Duration::from_millis(
                            rng.random_range(0..10_000),
                        )),
                        "sink_processing_after_hang_up",
                    ),
                };
                bed.sink_proxy.set(fault);
                sink_busy_until = now + Duration::from_secs(4);
                pending.push((sink_busy_until, Restore::SinkPass));
                count(name);
            }
            continue;
        }
        if roll < 20 {
            // Replace a stream: delete it and create it again under the same
            // name. That is a new stream (a new identity): the feed starts
            // again at its first sequence number (no checkpoint carries
            // over, so `{last_seq}` is empty), and its tokens start above
            // every earlier one (the tombstone's + 1), so the sink keeps
            // accepting it and the verifier tells the two apart by token.
            let name = &names[rng.random_range(0..names.len())];
            let key = bed.key(name);
            if bed
                .store
                .delete_stream(&key, Duration::from_secs(20))
                .await?
                == DeleteOutcome::Deleted
            {
                let tombstone = bed.store.get(&key).await?;
                let floor = tombstone.map_or(0, |t| t.lease_counter) + 1;
                recreations += 1;
                bed.apply_spec(name, &bed.spec(name), 1 + i64::from(recreations) * 10)
                    .await?;
                identity_floors.entry(name.clone()).or_default().push(floor);
                count("replaced_with_a_new_identity");
            }
            continue;
        }
        let i = healthy[rng.random_range(0..healthy.len())];
        let slot = &mut slots[i];
        match roll {
            20..=31 => {
                if let Some(p) = &slot.process {
                    p.signal(Signal::SIGKILL)?;
                }
                slot.busy_until = now + Duration::from_secs(2);
                pending.push((slot.busy_until, Restore::Restart(i)));
                count("sigkill");
            }
            32..=35 => {
                // A crash, then its worker item disappears (as a TTL or a
                // person would remove it): the roster must still find its
                // streams. Only for a worker id no other slot shares.
                let incarnation = slot.process.as_ref().and(
                    bed.store
                        .fleet()
                        .await?
                        .workers
                        .into_iter()
                        .find(|w| {
                            w.state == WorkerState::Live
                                && w.incarnation.worker_id() == slot.id
                                && slot.id != DUPLICATE_ID
                        })
                        .map(|w| w.incarnation),
                );
                if let Some(p) = &slot.process {
                    p.signal(Signal::SIGKILL)?;
                }
                if let Some(incarnation) = incarnation {
                    crate::store::raw_client()
                        .await
                        .delete_item()
                        .table_name(bed.store.table())
                        .key("Pk", AttributeValue::S(incarnation.pk()))
                        .send()
                        .await?;
                    count("sigkill_and_worker_item_removed");
                } else {
                    count("sigkill");
                }
                slot.busy_until = now + Duration::from_secs(2);
                pending.push((slot.busy_until, Restore::Restart(i)));
            }
            36..=45 => {
                if let Some(p) = &slot.process {
                    p.signal(Signal::SIGSTOP)?;
                }
                slot.busy_until = now + hold;
                pending.push((slot.busy_until, Restore::Continue(i)));
                count("sigstop_beyond_lease");
            }
            46..=55 => {
                slot.proxy.set(DynamoFault::Blackhole);
                slot.busy_until = now + hold;
                pending.push((slot.busy_until, Restore::StorePass(i)));
                count("dynamodb_cut");
            }
            56..=61 => {
                slot.proxy.set(DynamoFault::Throttle(0.5));
                slot.busy_until = now + Duration::from_secs(5);
                pending.push((slot.busy_until, Restore::StorePass(i)));
                count("dynamodb_throttle_50pct");
            }
            62..=65 => {
                // The next write lands but its answer is lost.
                slot.proxy.set(DynamoFault::LoseNextWriteAnswer);
                slot.busy_until = now + Duration::from_secs(3);
                pending.push((slot.busy_until, Restore::StorePass(i)));
                count("dynamodb_write_answer_lost");
            }
            66..=69 => {
                // Writes land at once; their answers arrive late.
                slot.proxy
                    .set(DynamoFault::DelayAnswers(Duration::from_millis(800)));
                slot.busy_until = now + Duration::from_secs(5);
                pending.push((slot.busy_until, Restore::StorePass(i)));
                count("dynamodb_answers_late");
            }
            70..=79 => {
                // SIGTERM while DynamoDB answers slowly and the sink is slow.
                slot.proxy
                    .set(DynamoFault::Slow(Duration::from_millis(1500)));
                if sink_busy_until <= now {
                    bed.sink_proxy
                        .set(SinkFault::Slow(Duration::from_millis(1500)));
                    sink_busy_until = now + Duration::from_secs(6);
                    pending.push((sink_busy_until, Restore::SinkPass));
                }
                if let Some(p) = &slot.process {
                    p.signal(Signal::SIGTERM)?;
                }
                slot.busy_until = now + Duration::from_secs(8);
                pending.push((now + Duration::from_secs(7), Restore::StorePass(i)));
                pending.push((slot.busy_until, Restore::Restart(i)));
                count("sigterm_in_brownout_with_slow_sink");
            }
            80..=89 => {
                // A brownout on one worker while another restarts: streams are
                // handed over (rebalancing) through the browned-out worker.
                slot.proxy
                    .set(DynamoFault::Slow(Duration::from_millis(1200)));
                slot.busy_until = now + Duration::from_secs(6);
                pending.push((slot.busy_until, Restore::StorePass(i)));
                if let Some(j) = healthy.iter().copied().find(|j| *j != i) {
                    let other = &mut slots[j];
                    if let Some(p) = &other.process {
                        p.signal(Signal::SIGTERM)?;
                    }
                    other.busy_until = now + Duration::from_secs(6);
                    pending.push((now + Duration::from_secs(3), Restore::Restart(j)));
                }
                count("handoff_in_brownout");
            }
            _ => {
                slot.proxy.shift_date(if rng.random_bool(0.5) {
                    SKEW_SECONDS
                } else {
                    -SKEW_SECONDS
                });
                slot.busy_until = now + Duration::from_secs(6);
                pending.push((slot.busy_until, Restore::Unskew(i)));
                count("skewed_clock");
            }
        }
    }

    // Everything restored: the fleet must settle with every stream connected once.
    let settle_limit = cfg.lease * 3 + Duration::from_secs(15);
    let settle_started = Instant::now();
    while !bed.connected_once(&names) {
        if settle_started.elapsed() > settle_limit {
            let open = bed.upstream.open_sessions();
            let views = bed.views().await;
            let stuck: Vec<String> = names
                .iter()
                .filter(|n| open.get(*n) != Some(&1))
                .map(|n| {
                    let v = views.iter().find(|v| &v.record.key.name == n);
                    format!(
                        "{n}: open {:?}, owner {:?}, holder {:?}, desired {:?}, status {:?}",
                        open.get(n),
                        v.and_then(|v| v.owner.clone()),
                        v.and_then(|v| v.record.holder.clone()),
                        v.map(|v| v.record.desired_state),
                        v.and_then(|v| v.record.status.clone())
                    )
                })
                .collect();
            anyhow::bail!(
                "the fleet did not settle within {settle_limit:?} after the chaos ended (logs in {}):\n{}",
                bed.log_dir.display(),
                stuck.join("\n")
            );
        }
        sampler.tick().await;
        sample(bed, &names, &mut ownerless_run, &mut report);
    }
    report.settle_s = settle_started.elapsed().as_secs_f64();
    report.duration_s = started.elapsed().as_secs_f64();
    report.throttled_requests = slots.iter().map(|s| s.proxy.throttled()).sum();
    for slot in &slots {
        if let Some(p) = &slot.process {
            let _ = p.signal(Signal::SIGTERM);
        }
    }
    for slot in &mut slots {
        if let Some(p) = slot.process.as_mut() {
            let _ = p.wait(Duration::from_secs(15)).await;
        }
    }
    report.overlapping_sessions = bed.overlaps(&watched);
    if let Some(r) = &real_sinks {
        r.check(bed, &mut report).await?;
    }
    // Keyed by identity: a replaced stream's new feed starts again, and a
    // new identity that inherited its predecessor's checkpoint would skip
    // its own beginning (a gap here), while one keyed by name alone would
    // see the old identity's numbers fill it.
    for n in &names {
        let floors = identity_floors.get(n).map(Vec::as_slice).unwrap_or(&[]);
        let log = bed.log(n);
        report.sequence_gaps += log
            .gaps_by_identity(bed.first_seq, floors)
            .iter()
            .map(Vec::len)
            .sum::<usize>();
        report.duplicates += log.duplicates_by_identity(floors);
        report.identities += floors.len() + 1;
    }
    report.stale_deliveries = bed.stale(&names);
    report.stale_refused = bed.sink.refused_stale();
    report.delivered = bed.delivered(&names);
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
