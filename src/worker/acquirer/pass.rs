//! The acquisition pass, every reconcile interval: read the fleet, watch
//! peers' heartbeats and declare the overdue ones dead, resolve acquires whose
//! answer was lost, find orphans (unowned partitions, dead incarnations'
//! partitions, version-1 leftovers during an upgrade), acquire up to the fair
//! share, hand excess over, and audit this incarnation's own partitions.
//!
//! A full pass reads O(workers + what it may take), never O(streams): one
//! fleet query, a few peers' items, and a bounded read of each unowned
//! partition (`sampling`) only when something was released (a peer's `released_at_ms` moved), orphans were seen recently, or
//! [`UNOWNED_SCAN_PERIOD`] passed. At steady state most passes are quiet
//! (`quiet`): they read the change counter and the watched peers, every
//! other pass.

use super::fair_share::{
    AcquirePolicy, FleetView, Orphan, classify_free, fair_share, handoff_count,
};
use super::overdue::Observer;
use crate::lease::{
    AcquireFrom, AcquireOutcome, Checkpoints, DesiredState, FleetEntry, HOLDER_SHARDS, Incarnation,
    Lease, Ownership, StoreError, StreamKey, StreamRecord, WorkerState, now_ms, unowned_holder,
};
use crate::worker::fence::Fence;
use crate::worker::settings::{
    EXTRA_HANDOFF_COOLDOWNS, HANDOFF_COOLDOWN_HEARTBEATS, PEAK_TOTAL_HEARTBEATS,
    REBALANCE_GRACE_INTERVALS, SHARE_GRACE_INTERVALS, UNOWNED_SCAN_PERIOD,
};
use crate::worker::shared::Shared;
use crate::worker::stream::StreamProgress;
use crate::worker::stream::{HeldStream, Registry};
use futures::StreamExt;
use rand::seq::SliceRandom;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// A departed incarnation this worker keeps an eye on (`departed`).
pub(super) struct Ended {
    pub(super) first_seen: Instant,
    /// Its partitions were found empty at least once.
    pub(super) emptied: bool,
    /// Its partitions found empty since (a bit per shard): not read again
    /// while others are still being emptied.
    pub(super) empty_shards: u32,
    /// Which of its partitions this worker reads next.
    pub(super) rotation: super::rotation::Rotation,
    pub(super) last_scan: Option<Instant>,
}

/// The LIVE incarnations of a fleet query.
pub(super) fn live_incarnations(workers: &[FleetEntry]) -> Vec<Incarnation> {
    workers
        .iter()
        .filter(|w| w.state == WorkerState::Live)
        .map(|w| w.incarnation.clone())
        .collect()
}
use tokio::sync::mpsc;
use tokio::time::Instant;

/// Acquires in flight at once.
const ACQUIRE_CONCURRENCY: usize = 16;
/// A stream acquired (or adopted) and ready to be served.
#[derive(Debug)]
pub(crate) struct Acquired {
    pub held: Arc<HeldStream>,
    pub record: StreamRecord,
}

/// A candidate orphan with how to take it.
pub(super) struct Candidate {
    pub(super) record: StreamRecord,
    pub(super) from: AcquireFrom,
    pub(super) orphan: Orphan,
    /// The index partition it is taken from (for pacing).
    pub(super) source: String,
}

/// Source partitions this pass leaves alone because its acquires there lose
/// races: another worker is taking the same streams right now, so the pass
/// tries none of its not yet started acquires there, and the partition's
/// next read finds what is left without what the other took. Each lost race
/// is a refused conditional write, billed and a request spent, and workers
/// meeting in one stretch lost more races than they won.
///
/// - A partition read in part (a bounded read): left after one lost race.
///   The read's random start fell where another worker's did (most often at
///   the first orphans after an emptied stretch), so the rest of the window
///   is the other worker's next tries too.
/// - A partition read whole: left only after [`WHOLE_READ_LOSSES`] lost races
///   there and more than a third of those answered. Every worker with room
///   sees the same orphans, one lost race says little of the rest (a stale
///   read or a counter the controller moved refuse too), and two workers
///   going through it in their own random orders lose a third of their
///   races only once each has tried about two thirds of it: a small fleet,
///   which reads every partition whole, takes a dead peer's streams about
///   as fast as before.
struct Contested<'a> {
    /// This pass's orphan partitions read in part (`Acquirer::partial_reads`).
    partial_reads: &'a HashSet<String>,
    /// Per source partition, acquires answered this pass: won, lost.
    answered: std::sync::Mutex<HashMap<String, (u32, u32)>>,
}

/// Races lost in a partition read whole before a pass may leave it.
const WHOLE_READ_LOSSES: u32 = 2;

impl<'a> Contested<'a> {
    fn new(partial_reads: &'a HashSet<String>) -> Self {
        Self {
            partial_reads,
            answered: std::sync::Mutex::default(),
        }
    }

    /// Whether this pass leaves `source` alone.
    fn holds(&self, source: &str) -> bool {
        let Ok(answered) = self.answered.lock() else {
            return false;
        };
        let Some(&(won, lost)) = answered.get(source) else {
            return false;
        };
        if self.partial_reads.contains(source) {
            lost > 0
        } else {
            lost >= WHOLE_READ_LOSSES && lost * 3 > won + lost
        }
    }

    /// An acquire from `source` came back: `won`, or taken by another.
    fn answered(&self, source: &str, won: bool) {
        if let Ok(mut answered) = self.answered.lock() {
            let counts = answered.entry(source.to_string()).or_default();
            if won {
                counts.0 += 1;
            } else {
                counts.1 += 1;
            }
        }
    }
}

pub(crate) struct Acquirer {
    pub(super) ctx: Arc<Shared>,
    pub(super) me: Incarnation,
    pub(super) registry: Arc<Registry>,
    pub(super) out: mpsc::UnboundedSender<Acquired>,
    pub(super) observer: Observer,
    pub(super) view: FleetView,
    /// Acquires sent without an answer: key → the token they compared against.
    pub(super) pending: HashMap<StreamKey, u64>,
    /// Last state, `released_at_ms` and draining flag seen per worker.
    pub(super) markers: HashMap<Incarnation, (WorkerState, Option<u64>, bool)>,
    /// Dead incarnations' packed checkpoints, read once per takeover and
    /// shared with each pass that takes its streams (not copied: a busy
    /// dead owner's are thousands of entries).
    pub(super) dead_checkpoints: HashMap<Incarnation, Arc<Checkpoints>>,
    /// Departed incarnations still listed in the fleet.
    pub(super) ended: HashMap<Incarnation, Ended>,
    /// This incarnation's fence: nothing is acquired while it is closed.
    pub(super) fence: Arc<Fence>,
    pub(super) last_unowned_scan: Option<Instant>,
    /// Which unowned partitions this worker reads next, and how many more
    /// passes read them before the turn that began with a hint of new
    /// orphans has been through every one.
    pub(super) unowned_rotation: super::rotation::Rotation,
    pub(super) unowned_turns_left: u32,
    /// The last read of the unowned partitions found orphans.
    pub(super) unowned_seen: bool,
    /// The last pass found orphans anywhere.
    pub(super) orphans_seen: bool,
    pub(super) last_full_refresh: Option<Instant>,
    /// When the audit, the sweep and the roster's look are next due.
    pub(super) audit_schedule: super::audit_schedule::AuditSchedule,
    pub(super) last_handoff: Option<Instant>,
    /// When an extra stream (beyond the excess) was last handed over.
    pub(super) last_extra_handoff: Option<Instant>,
    /// When a peer was last seen releasing streams (its `released_at_ms`
    /// moved): the loads this worker sees are stale until it heartbeats.
    pub(super) last_peer_release: Option<Instant>,
    /// When this worker last acquired something.
    pub(super) last_acquired: Option<Instant>,
    pub(super) pacing: super::pacing::Pacing,
    /// Items reported as malformed already (one log line each).
    pub(super) reported: HashSet<String>,
    /// Whether version 1's index exists (a rolling upgrade is under way).
    pub(super) legacy_index: bool,
    /// Streams this worker took because their resource asked to move them:
    /// handed over for fair share only when nothing else can be, so a move
    /// is not undone by the rebalancing it causes.
    pub(super) moved_in: HashSet<StreamKey>,
    /// The change counter and what quiet passes remember.
    pub(super) quiet: super::quiet_state::QuietState,
    /// Streams chosen to hand over and when that was announced; released
    /// once peers had time to see the announcement (`release_deferred`).
    pub(super) deferred_handoff: Option<(Instant, Vec<Arc<HeldStream>>)>,
    /// Where bounded reads of orphan partitions start.
    pub(super) spread: super::sampling::Spread,
    /// Orphan partitions this pass read only in part (a bounded read that
    /// did not reach every item), emptied as each pass starts: see
    /// `Contested`.
    pub(super) partial_reads: HashSet<String>,
    /// The fleet's recent peak total, which handoffs are computed from.
    pub(super) peak_total: super::peak_total::PeakTotal,
    /// Streams taken that their releaser may still publish.
    pub(super) taken: super::peak_total::TakenFromPeers,
}

impl Acquirer {
    pub(crate) fn new(
        ctx: Arc<Shared>,
        me: Incarnation,
        registry: Arc<Registry>,
        out: mpsc::UnboundedSender<Acquired>,
        legacy_index: bool,
        fence: Arc<Fence>,
    ) -> Self {
        let lease = ctx.settings.lease_duration;
        let heartbeat = ctx.settings.heartbeat_interval;
        Self {
            ctx,
            me,
            registry,
            out,
            observer: Observer::new(lease, heartbeat),
            view: FleetView::default(),
            pending: HashMap::new(),
            markers: HashMap::new(),
            dead_checkpoints: HashMap::new(),
            ended: HashMap::new(),
            fence,
            last_unowned_scan: None,
            unowned_rotation: super::rotation::Rotation::default(),
            unowned_turns_left: 0,
            unowned_seen: true,
            orphans_seen: true,
            last_full_refresh: None,
            audit_schedule: super::audit_schedule::AuditSchedule::at_random_phase(
                Instant::now(),
                heartbeat,
            ),
            last_handoff: None,
            last_extra_handoff: None,
            last_peer_release: None,
            last_acquired: None,
            pacing: super::pacing::Pacing::default(),
            reported: HashSet::new(),
            legacy_index,
            moved_in: HashSet::new(),
            quiet: super::quiet_state::QuietState::default(),
            deferred_handoff: None,
            spread: super::sampling::Spread::default(),
            partial_reads: HashSet::new(),
            peak_total: super::peak_total::PeakTotal::default(),
            taken: super::peak_total::TakenFromPeers::default(),
        }
    }

    /// One pass, timed by kind. Errors are logged by the caller; the next
    /// pass starts over.
    pub(crate) async fn pass(&mut self) -> Result<(), StoreError> {
        let started = Instant::now();
        let result = self.pass_once().await;
        let kind = *result.as_ref().unwrap_or(&"failed");
        self.ctx
            .metrics
            .acquisition_pass_seconds
            .get_or_create(&[("kind", kind)])
            .observe(started.elapsed().as_secs_f64());
        result.map(|_| ())
    }

    /// One pass; what kind it was: `quiet`, `full`, or `skew` (it stopped
    /// at the clock check and acquired nothing).
    async fn pass_once(&mut self) -> Result<&'static str, StoreError> {
        let now = Instant::now();
        self.partial_reads.clear();
        // Every pass, quiet or failing ones too: the peak must cover the
        // whole window before a handoff, not only the passes that reach one.
        self.observe_total(now, self.registry.staying() as u64);
        // A quiet fleet's first full pass follows a change it read (the
        // counter moved: a stream created, released or asked to move, or a
        // peer in trouble): a hint of new orphans, like a peer's marker.
        let after_quiet = self.may_stay_quiet(now);
        if after_quiet && !self.quiet_pass(now).await? {
            let fleet = self.quiet.fleet.clone();
            return self.audit_if_due(now, &fleet).await.map(|()| "quiet");
        }
        self.release_deferred(now);
        let fleet = self.ctx.store.fleet().await?;
        for m in &fleet.malformed {
            self.report_malformed(&m.pk, &m.detail);
        }
        let scan_triggered = self.read_markers(&fleet.workers);
        self.watch_peers(&fleet.workers).await?;
        self.resolve_pending().await;
        if self.skew_exceeded() {
            return Ok("skew");
        }
        let mut candidates = Vec::new();
        let now = Instant::now();
        let per_pass = self.shards_per_pass();
        if scan_triggered || after_quiet {
            self.unowned_turns_left = super::rotation::Rotation::cycle(per_pass);
        }
        let scan_unowned = self.unowned_seen
            || self.unowned_turns_left > 0
            || self
                .last_unowned_scan
                .is_none_or(|t| now.duration_since(t) >= UNOWNED_SCAN_PERIOD);
        if scan_unowned {
            self.last_unowned_scan = Some(now);
            self.unowned_turns_left = self.unowned_turns_left.saturating_sub(1);
            let shards: Vec<u32> = (0..HOLDER_SHARDS).collect();
            let before = candidates.len();
            for shard in self.unowned_rotation.turn(&shards, per_pass) {
                let (found, _) = self.sample("query_unowned", &unowned_holder(shard)).await?;
                self.take_found(found, &mut candidates, |r| {
                    (r.desired_state == DesiredState::Started && r.ownership() == Ownership::Free)
                        .then_some(AcquireFrom::Free)
                });
            }
            self.unowned_seen = candidates.len() > before;
        }
        if self.legacy_index
            && let Some((found, store_now)) = self.legacy_orphans().await?
        {
            self.take_found(found, &mut candidates, |r| match r.ownership() {
                Ownership::Free => Some(AcquireFrom::Free),
                Ownership::Legacy {
                    owner,
                    expires_at_ms,
                } if expires_at_ms < store_now => Some(AcquireFrom::LegacyExpired {
                    owner,
                    expires_at_ms,
                }),
                _ => None,
            });
        }
        self.ended_candidates(&fleet.workers, &mut candidates)
            .await?;
        self.orphans_seen = !candidates.is_empty();
        self.ctx
            .metrics
            .streams_unowned
            .set(candidates.len() as i64);
        self.acquire(candidates).await;
        self.hand_over();
        self.audit_if_due(now, &fleet.workers).await?;
        if self.quiet.full_pass(fleet.workers, now) {
            // Ready to take streams: peers hand some over to a newcomer.
            self.ctx.store.announce_change().await;
        }
        Ok("full")
    }

    /// Notes each worker's state, release marker and draining flag; `true`
    /// when anything suggests new orphans (a release, a departure, a death,
    /// a worker starting to drain).
    fn read_markers(&mut self, workers: &[FleetEntry]) -> bool {
        let mut changed = false;
        let mut seen = HashMap::new();
        for w in workers {
            let now = (w.state, w.released_at_ms, w.draining);
            if w.incarnation != self.me {
                match self.markers.get(&w.incarnation) {
                    Some(before) if *before == now => {}
                    Some(before) => {
                        changed = true;
                        if before.1 != now.1 {
                            self.last_peer_release = Some(Instant::now());
                        }
                    }
                    None => changed = true,
                }
            }
            seen.insert(w.incarnation.clone(), now);
        }
        if seen.len() != self.markers.len() {
            changed = true;
        }
        self.markers = seen;
        changed
    }

    /// Version-1 orphans, with the store time they were judged against, while
    /// the table still has version 1's index. `None` once the index is gone:
    /// `tether table finish-upgrade` drops it while the workers that started
    /// during the upgrade keep running, and a query of a missing index fails
    /// every pass, so nothing released meanwhile would ever be acquired. On a
    /// failed query the table is described again; only an index that is
    /// really gone ends the version-1 takeover, any other error is the pass's.
    async fn legacy_orphans(&mut self) -> Result<Option<(crate::lease::Found, u64)>, StoreError> {
        let store_now = self.ctx.store.clock().store_now_at_least();
        match self.ctx.store.legacy_orphans(store_now).await {
            Ok(found) => Ok(Some((found, store_now))),
            Err(e) => {
                if self.ctx.store.check_table().await?.legacy_index {
                    return Err(e);
                }
                tracing::info!(
                    "version 1's index is gone (the upgrade was finished): no longer taking over version-1 leases"
                );
                self.legacy_index = false;
                Ok(None)
            }
        }
    }

    /// Settles acquires that got no answer: serve the ones that landed.
    async fn resolve_pending(&mut self) {
        let pending: Vec<(StreamKey, u64)> =
            self.pending.iter().map(|(k, c)| (k.clone(), *c)).collect();
        for (key, expected) in pending {
            match self
                .ctx
                .store
                .resolve_acquire(&key, expected, &self.me)
                .await
            {
                Ok(Some((lease, record))) => {
                    self.pending.remove(&key);
                    tracing::info!(stream = %key, "an acquire whose answer was lost had landed: serving it");
                    self.ctx
                        .metrics
                        .acquires
                        .get_or_create(&[("result", "resolved")])
                        .inc();
                    self.adopt(lease, record, None);
                }
                Ok(None) => {
                    self.pending.remove(&key);
                }
                Err(e) => tracing::debug!(stream = %key, error = %e, "acquire still unresolved"),
            }
        }
    }

    fn skew_exceeded(&self) -> bool {
        let bounds = self.ctx.store.clock().bounds();
        let exceeded = bounds.is_some_and(|b| b.exceeds(self.ctx.settings.max_clock_skew));
        if let Some(b) = bounds {
            self.ctx
                .metrics
                .clock_offset_seconds
                .set(b.midpoint() as f64 / 1000.0);
        }
        let was = self.ctx.metrics.clock_skew_exceeded.get() == 1;
        self.ctx
            .metrics
            .clock_skew_exceeded
            .set(i64::from(exceeded));
        if exceeded && !was {
            tracing::error!(offset = ?bounds, budget = ?self.ctx.settings.max_clock_skew, "this clock disagrees with DynamoDB's by more than --max-clock-skew: not acquiring until it is fixed");
        }
        exceeded
    }

    pub(super) fn take_found(
        &mut self,
        found: crate::lease::Found,
        candidates: &mut Vec<Candidate>,
        from: impl Fn(&StreamRecord) -> Option<AcquireFrom>,
    ) {
        for m in found.malformed {
            self.report_malformed(&m.pk, &m.detail);
        }
        let now = now_ms();
        for record in found.records {
            if record.is_tombstone() {
                continue;
            }
            if let Some(from) = from(&record) {
                let orphan = match from {
                    AcquireFrom::Free => classify_free(&record, now, &self.me),
                    _ => Orphan::Crashed,
                };
                let source = record
                    .holder
                    .clone()
                    .unwrap_or_else(|| record.key.unowned_holder());
                candidates.push(Candidate {
                    record,
                    from,
                    orphan,
                    source,
                });
            }
        }
    }

    fn report_malformed(&mut self, pk: &str, detail: &str) {
        self.ctx.metrics.malformed_items.inc();
        if self.reported.insert(pk.to_string()) {
            tracing::error!(
                item = pk,
                detail,
                "skipping a malformed item (fix or delete it; the rest are served)"
            );
        }
    }

    /// Acquires what the policy allows, concurrently, paced per source partition.
    async fn acquire(&mut self, candidates: Vec<Candidate>) {
        let held = self.registry.len();
        let capacity = self.ctx.settings.max_connections.saturating_sub(held);
        let mut seen = HashSet::new();
        let mut candidates: Vec<Candidate> = candidates
            .into_iter()
            .filter(|c| seen.insert(c.record.key.clone()))
            .filter(|c| {
                !self.registry.contains(&c.record.key) && !self.pending.contains_key(&c.record.key)
            })
            .collect();
        // A worker that cannot prove it is alive acquires nothing: a peer may
        // be about to declare it dead, and a stream it took then would be lost.
        if candidates.is_empty() || capacity == 0 || !self.fence.is_valid() {
            return;
        }
        // Workers racing for the same orphans try them in different orders.
        candidates.shuffle(&mut rand::rng());
        let staying = self.registry.staying() as u64;
        // Orphans in no published count (`FleetView::still_counted`).
        let uncounted = candidates
            .iter()
            .filter(|c| !self.view.still_counted(&c.record))
            .count() as u64;
        let fair = self
            .ctx
            .settings
            .rebalance
            .then(|| self.view.fair_share(staying, uncounted));
        let interval_ms = self.ctx.settings.reconcile_interval.as_millis() as u64;
        let passes_ms = interval_ms * u64::from(REBALANCE_GRACE_INTERVALS);
        let lease_ms = self.ctx.settings.lease_duration.as_millis() as u64;
        let floor = self
            .ctx
            .settings
            .rebalance
            .then(|| self.view.floor_share(staying, uncounted))
            .filter(|&floor| self.view.peer_below(floor));
        let mut policy = AcquirePolicy {
            below_share: fair.map(|f| f.saturating_sub(staying)),
            floor_first: floor.map(|f| f.saturating_sub(staying)),
            floor_grace_ms: passes_ms,
            share_grace_ms: interval_ms * u64::from(SHARE_GRACE_INTERVALS),
            rebalance_grace_ms: fair.map_or(passes_ms, |f| {
                self.view.rebalance_grace_ms(f, passes_ms, lease_ms)
            }),
        };
        let rate = super::pacing::PARTITION_WRITE_BUDGET / self.view.live() as f64;
        let mut chosen = Vec::new();
        for c in candidates {
            if chosen.len() >= capacity {
                break;
            }
            if policy.allows(c.orphan) && self.pacing.take(&c.source, rate) {
                policy.take();
                chosen.push(c);
            }
        }
        let store = &self.ctx.store;
        let me = &self.me;
        let fence = &self.fence;
        let contested = &Contested::new(&self.partial_reads);
        let results: Vec<(Candidate, Option<Result<AcquireOutcome, StoreError>>)> =
            futures::stream::iter(chosen)
                .map(|c| async move {
                    if contested.holds(&c.source) {
                        return (c, None);
                    }
                    // Never past the fence: an answer after it could not be acted on.
                    let r = tokio::select! {
                        r = Box::pin(store.acquire(&c.record, &c.from, me)) => r,
                        () = fence.closed() => Err(StoreError::Unreachable {
                            endpoint: store.endpoint().to_string(),
                            detail: "acquire still pending when the fence closed".into(),
                        }),
                    };
                    match &r {
                        Ok(AcquireOutcome::Acquired { .. }) => contested.answered(&c.source, true),
                        Ok(AcquireOutcome::Taken { .. }) => contested.answered(&c.source, false),
                        _ => {}
                    }
                    (c, Some(r))
                })
                .buffer_unordered(ACQUIRE_CONCURRENCY)
                .collect()
                .await;
        let (mut won, mut lost, mut skipped) = (0, 0, 0);
        for (c, result) in results {
            let label = match result {
                None => {
                    skipped += 1;
                    self.pacing.give_back(&c.source, rate);
                    "skipped"
                }
                Some(Ok(AcquireOutcome::Acquired { lease, record })) => {
                    won += 1;
                    self.record_takeover(&c);
                    let dead_owner_checkpoint = match &c.from {
                        AcquireFrom::Dead { checkpoint, .. } => *checkpoint,
                        _ => None,
                    };
                    tracing::info!(stream = %lease.key, token = lease.counter, from = ?c.orphan, "acquired");
                    self.last_acquired = Some(Instant::now());
                    self.taken.took(&c.record);
                    if matches!(c.orphan, Orphan::Moved { .. }) {
                        self.moved_in.insert(lease.key.clone());
                    }
                    self.adopt(lease, *record, dead_owner_checkpoint);
                    "acquired"
                }
                Some(Ok(AcquireOutcome::Taken { .. })) => {
                    lost += 1;
                    "taken"
                }
                Some(Ok(AcquireOutcome::NotStarted | AcquireOutcome::Gone)) => "unavailable",
                Some(Err(e)) => {
                    // No answer: it may have landed. Resolve it next pass.
                    tracing::warn!(stream = %c.record.key, error = %e, "acquire got no answer; resolving on the next pass");
                    self.pending
                        .insert(c.record.key.clone(), c.record.lease_counter);
                    "error"
                }
            };
            self.ctx
                .metrics
                .acquires
                .get_or_create(&[("result", label)])
                .inc();
        }
        self.spread.raced(won, lost, skipped);
    }

    fn record_takeover(&self, c: &Candidate) {
        let now = now_ms();
        match c.orphan {
            Orphan::Crashed => {}
            Orphan::Released { age_ms }
            | Orphan::Rebalanced { age_ms, .. }
            | Orphan::Moved { age_ms, .. }
                if age_ms != u64::MAX =>
            {
                self.ctx
                    .metrics
                    .handoff_seconds
                    .observe(age_ms as f64 / 1000.0);
            }
            _ => {}
        }
        if let AcquireFrom::LegacyExpired { expires_at_ms, .. } = c.from {
            self.ctx
                .metrics
                .failover_seconds
                .observe(now.saturating_sub(expires_at_ms) as f64 / 1000.0);
        }
    }

    /// Registers a stream this incarnation owns and hands it to the main loop.
    pub(super) fn adopt(
        &mut self,
        lease: Lease,
        record: StreamRecord,
        dead_owner_checkpoint: Option<u64>,
    ) {
        let checkpoint = record.checkpoint.max(dead_owner_checkpoint);
        let held = Arc::new(HeldStream::new(
            lease,
            Arc::new(StreamProgress::new(checkpoint, record.checkpoint)),
        ));
        self.registry.insert(held.clone());
        // The receiver only goes away when the worker stops; the stream then
        // stays in this incarnation's partitions for the final audit.
        let _ = self.out.send(Acquired { held, record });
    }

    /// Notes the fleet's total as this worker sees it now (its own
    /// `staying` streams and its view of the peers) and returns the recent
    /// peak.
    fn observe_total(&mut self, now: Instant, staying: u64) -> u64 {
        let window = self.ctx.settings.heartbeat_interval * PEAK_TOTAL_HEARTBEATS;
        let settled = self.view.counts_settled();
        let registry = &self.registry;
        let twice = self
            .taken
            .counted_twice(&self.view, |key| registry.contains(key));
        let total = self.view.total(staying).saturating_sub(twice);
        self.peak_total.observe(now, total, settled, window)
    }

    /// Above the fair share while a peer is below it: hand some streams over.
    fn hand_over(&mut self) {
        if !self.ctx.settings.rebalance {
            return;
        }
        // The fleet's total as a giver must count it (`peak_total`): never
        // short by streams in flight between two peers' heartbeats.
        let staying = self.registry.staying() as u64;
        let total = self.observe_total(Instant::now(), staying);
        // Peers publish their load once a heartbeat: right after streams moved
        // (orphans around, or this worker just took some), the counts are stale
        // and handing over would only move streams twice.
        let cooldown = self.ctx.settings.heartbeat_interval * HANDOFF_COOLDOWN_HEARTBEATS;
        let recent = |t: Option<Instant>| t.is_some_and(|t| t.elapsed() < cooldown);
        if self.orphans_seen
            || self.deferred_handoff.is_some()
            || recent(self.last_handoff)
            || recent(self.last_acquired)
        {
            return;
        }
        let fair = fair_share(total, self.view.live());
        let excess = handoff_count(staying, fair, self.view.peer_below(fair));
        // The extra stream is decided on together with this worker's own
        // excess (once per handoff, which has its cooldown); otherwise only
        // on loads no release has made stale (a peer's release moves its
        // marker at once, its load at its next heartbeat), so workers do not
        // decide again after someone else's extra stream already went, and
        // at most once per EXTRA_HANDOFF_COOLDOWNS cooldowns, so a peer that
        // stays below the floor whatever it is given (its own connection
        // limit) costs a stream move that rarely, not every pass.
        let settled = self.last_peer_release.is_none_or(|t| {
            t.elapsed()
                >= self.ctx.settings.heartbeat_interval + self.ctx.settings.reconcile_interval
        });
        let extra_due = excess > 0
            || (settled
                && self
                    .last_extra_handoff
                    .is_none_or(|t| t.elapsed() >= cooldown * EXTRA_HANDOFF_COOLDOWNS));
        let extra = if extra_due {
            self.view.extra_handoff(&self.me, staying, total)
        } else {
            0
        };
        if extra > 0 {
            self.last_extra_handoff = Some(Instant::now());
        }
        let count = excess + extra;
        if count == 0 {
            return;
        }
        let mut movable: Vec<Arc<HeldStream>> = self
            .registry
            .snapshot()
            .into_iter()
            .filter(|h| h.staying())
            .collect();
        movable.shuffle(&mut rand::rng());
        self.moved_in.retain(|k| self.registry.contains(k));
        // Streams moved here on request go last (a stable sort keeps the
        // shuffle among the rest).
        movable.sort_by_key(|h| self.moved_in.contains(&h.lease.key));
        let peers: Vec<(String, u64, bool)> = self
            .view
            .peers
            .iter()
            .map(|p| (p.incarnation.to_string(), p.held, p.progressing))
            .collect();
        tracing::info!(
            held = staying,
            fair,
            count,
            ?peers,
            "handing streams over to rebalance the fleet"
        );
        let chosen: Vec<Arc<HeldStream>> = movable.into_iter().take(count as usize).collect();
        // Announced ahead of the releases (the release marker follows them):
        // quiet peers are making full passes when the streams land, and take
        // them within a pass instead of at their next watch read.
        self.ctx.store.announce_change_soon();
        self.deferred_handoff = Some((Instant::now(), chosen));
    }

    /// Releases the streams chosen for a handoff once their announcement had
    /// time to reach quiet peers: [`super::quiet_state::ANNOUNCE_AHEAD`] (a
    /// read every 500 ms, or a poke, and a pass), or a heartbeat and a pass
    /// when a poke failed since (that peer reads the counter once a
    /// heartbeat).
    fn release_deferred(&mut self, now: Instant) {
        let settings = &self.ctx.settings;
        let unpoked = settings.heartbeat_interval + settings.reconcile_interval;
        let ready = |announced: Instant| {
            let ahead = if self.ctx.pokes.failed_since(announced) {
                unpoked.max(super::quiet_state::ANNOUNCE_AHEAD)
            } else {
                super::quiet_state::ANNOUNCE_AHEAD
            };
            now >= announced + ahead
        };
        let Some((_, chosen)) = self
            .deferred_handoff
            .take_if(|(announced, _)| ready(*announced))
        else {
            return;
        };
        // The cooldown runs from the releases: loads are stale until the
        // takers' next heartbeats, whenever the decision was made.
        self.last_handoff = Some(now);
        for h in chosen
            .iter()
            .filter(|h| self.registry.contains(&h.lease.key))
        {
            tracing::debug!(stream = %h.lease.key, "handing stream over");
            h.ask_handoff();
        }
    }

    /// Streams this incarnation owns in the table (for the final shutdown audit).
    pub(crate) async fn owned_in_table(&self) -> Result<Vec<StreamRecord>, StoreError> {
        let found = self.ctx.store.held_by(&self.me).await?;
        let mut owned = Vec::new();
        for r in found.records {
            if r.ownership() == Ownership::Owned(self.me.clone())
                && let Some(full) = self.ctx.store.get(&r.key).await?
                && full.ownership() == Ownership::Owned(self.me.clone())
            {
                owned.push(full);
            }
        }
        Ok(owned)
    }

    pub(crate) fn me(&self) -> &Incarnation {
        &self.me
    }
}

impl Acquirer {
    /// Partitions of an orphan holder one pass reads (`rotation`): all of
    /// them for the whole reads of 0.4, which the benchmarks compare with.
    pub(super) fn shards_per_pass(&self) -> usize {
        if self.ctx.settings.read_orphans_whole {
            HOLDER_SHARDS as usize
        } else {
            super::rotation::Rotation::per_pass(self.view.live())
        }
    }

    /// A bounded read of one orphan partition (`sampling::read_limit` items from a
    /// random start); `complete` when it saw every item there.
    pub(super) async fn sample(
        &mut self,
        operation: &'static str,
        holder: &str,
    ) -> Result<(crate::lease::Found, bool), StoreError> {
        let limit = if self.ctx.settings.read_orphans_whole {
            usize::MAX
        } else {
            let room = (self.ctx.settings.max_connections).saturating_sub(self.registry.len());
            self.spread
                .widened(super::sampling::read_limit(self.view.live(), room))
        };
        let after = self.spread.start(holder);
        let sample = self
            .ctx
            .store
            .sample_holder(operation, holder, limit, after.as_deref())
            .await?;
        if !sample.complete {
            self.partial_reads.insert(holder.to_string());
        }
        if self.spread.note(holder, sample.complete, sample.first) {
            let last = self.ctx.store.last_in_holder(holder).await?;
            self.spread.set_last(holder, last);
        }
        Ok((sample.found, sample.complete))
    }
}
