//! The audit: this incarnation's own partitions read back, so a lost
//! notification or a lost answer is repaired level-triggered; with it the
//! rolling re-read of held items (the sweep) and the look for enrolled
//! incarnations whose worker item vanished.
//!
//! Why the audit follows the change counter: its 8 index queries were a
//! fifth of a quiet worker's read bill (880 of 4,433 read units an hour at
//! 100 streams), and what it looks for is a write someone made. Every write
//! an owner should act on (a control write, a reminder, an acquisition, a
//! death) moves the counter once it landed, so a worker audits every
//! [`AUDIT_HEARTBEATS`] heartbeats while the counter moved since (or
//! shortly before) its last audit, and otherwise every
//! [`QUIET_AUDIT_HEARTBEATS`]. What waits for the longer period is a write
//! with neither its notification nor its bump (a person editing the table, a
//! writer of an earlier release, a writer that crashed between its write and
//! both), and for the last, whoever mirrors the resource next reminds the
//! owner sooner (`lease::owner_behind`). The sweep and the roster keep the
//! shorter period: they cost little, and they are what finds writes no one
//! announces.

use super::pass::Acquirer;
use super::quiet_state::{BUSY_AT_LEAST, BUSY_HEARTBEATS};
use crate::lease::{
    DesiredState, FleetEntry, Incarnation, Lease, Ownership, StoreError, StreamKey,
};
use crate::worker::settings::{AUDIT_HEARTBEATS, CONTROL_SWEEP_TICKS, QUIET_AUDIT_HEARTBEATS};
use std::collections::HashSet;
use std::time::Duration;
use tokio::time::Instant;

/// When the audit, the sweep and the roster are next due.
#[derive(Debug)]
pub(super) struct AuditSchedule {
    /// The last tick (every [`AUDIT_HEARTBEATS`]): the sweep and the roster.
    last_tick: Instant,
    /// Ticks so far: which share of the held streams the next sweep re-reads.
    ticks: u64,
    /// The last audit of the partitions.
    last_audit: Instant,
    /// An audit failed: the next tick audits again.
    owed: bool,
}

/// What a pass does of the audit's work.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct AuditDue {
    /// Read the partitions back.
    pub(super) audit: bool,
    /// The sweep's turn number and the roster's look, at a tick.
    pub(super) tick: Option<u64>,
}

impl AuditSchedule {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            last_tick: now,
            ticks: 0,
            last_audit: now,
            owed: false,
        }
    }

    /// What is due at `now`: `requested` when a holder asked for an audit
    /// (its task ended), `moved_at` when this worker last saw the change
    /// counter move, `counter_covers` whether every writer moves it (not
    /// while a worker of an earlier release is LIVE or version 1's index
    /// exists: a rolling upgrade, when the counter cannot be waited for).
    pub(super) fn due(
        &mut self,
        now: Instant,
        heartbeat: Duration,
        requested: bool,
        moved_at: Option<Instant>,
        counter_covers: bool,
    ) -> AuditDue {
        let tick = now.duration_since(self.last_tick) >= heartbeat * AUDIT_HEARTBEATS;
        let tick = tick.then(|| {
            self.last_tick = now;
            self.ticks += 1;
            self.ticks
        });
        // A move seen within the index's lag before the last audit may not
        // have been in what it read: the next tick audits again.
        let lag = (heartbeat * BUSY_HEARTBEATS).max(BUSY_AT_LEAST);
        let moved = moved_at.is_some_and(|m| m + lag > self.last_audit);
        let quiet_due = now.duration_since(self.last_audit) >= heartbeat * QUIET_AUDIT_HEARTBEATS;
        let at_tick = tick.is_some() && (moved || self.owed || !counter_covers);
        let audit = requested || at_tick || quiet_due;
        if audit {
            self.last_audit = now;
            self.owed = false;
        }
        AuditDue { audit, tick }
    }

    /// The audit just made failed: the next tick audits again (not every
    /// pass: a store that fails is not queried 8 times a pass).
    pub(super) fn failed(&mut self) {
        self.owed = true;
    }
}

impl Acquirer {
    /// The audit when asked for or due, the sweep's share and a look for
    /// enrolled incarnations `workers` (the fleet) does not list at each tick.
    pub(super) async fn audit_if_due(
        &mut self,
        now: Instant,
        workers: &[FleetEntry],
    ) -> Result<(), StoreError> {
        let requested = self.registry.take_audit_request();
        let due = self.audit_schedule.due(
            now,
            self.ctx.settings.heartbeat_interval,
            requested,
            self.quiet.moved_at,
            self.quiet.peers_announce && !self.legacy_index,
        );
        // In memory only: a failing store does not skip a share.
        if let Some(tick) = due.tick {
            self.sweep(tick);
        }
        if due.audit
            && let Err(e) = self.audit().await
        {
            self.audit_schedule.failed();
            return Err(e);
        }
        if due.tick.is_some() {
            self.find_vanished(workers).await?;
        }
        Ok(())
    }

    /// Reconciles this incarnation's streams with the table, level-triggered:
    /// adopts what it owns but does not serve; has every held stream whose
    /// index entry shows a change the holder has not acted on (STOPPED,
    /// deleted, another token) re-read by its holder, and so every held
    /// stream no longer in its partitions (taken or re-created).
    async fn audit(&mut self) -> Result<usize, StoreError> {
        let found = self.ctx.store.held_by(&self.me).await?;
        let mut indexed = HashSet::new();
        let mut adopted = 0;
        for r in found.records {
            if r.ownership() != Ownership::Owned(self.me.clone()) {
                continue;
            }
            indexed.insert(r.key.clone());
            if let Some(held) = self.registry.get(&r.key) {
                if r.lease_counter != held.lease.counter
                    || r.desired_state != DesiredState::Started
                    || r.is_tombstone()
                {
                    held.signals.changed.notify_one();
                }
                continue;
            }
            // The index item lacks the spec: read the whole item.
            let Some(full) = self.ctx.store.get(&r.key).await? else {
                continue;
            };
            if full.ownership() != Ownership::Owned(self.me.clone())
                || self.registry.contains(&full.key)
            {
                continue;
            }
            self.pending.remove(&full.key);
            tracing::warn!(stream = %full.key, "owned but not served (an answer was lost or a task ended): serving it");
            self.ctx
                .metrics
                .acquires
                .get_or_create(&[("result", "adopted")])
                .inc();
            let lease = Lease {
                key: full.key.clone(),
                owner: self.me.clone(),
                counter: full.lease_counter,
            };
            self.adopt(lease, full, None);
            adopted += 1;
        }
        for held in self.registry.snapshot() {
            if !indexed.contains(&held.lease.key) {
                held.signals.changed.notify_one();
            }
        }
        Ok(adopted)
    }

    /// Specs are not in the index: a rolling share of the held streams is
    /// re-read by their holders at each tick, every held item once in
    /// [`CONTROL_SWEEP_TICKS`] ticks (the last resort for a spec written
    /// with no notification at all).
    fn sweep(&self, tick: u64) {
        for held in self.registry.snapshot() {
            if sweep_turn(&held.lease.key, tick) {
                held.signals.changed.notify_one();
            }
        }
    }

    /// Declares dead every enrolled incarnation the fleet does not list (its
    /// worker item is gone): its streams then move like any dead worker's
    /// (see `lease::roster`). A false alarm costs one failed conditional put.
    async fn find_vanished(&mut self, workers: &[FleetEntry]) -> Result<(), StoreError> {
        let listed: HashSet<&Incarnation> = workers.iter().map(|w| &w.incarnation).collect();
        for who in self.ctx.store.roster().await? {
            if who == self.me || listed.contains(&who) {
                continue;
            }
            if self.ctx.store.declare_vanished_dead(&who).await? {
                self.ctx.metrics.workers_declared_dead.inc();
                tracing::warn!(worker = %who, "an enrolled worker has no worker item (removed by TTL or by hand): declared dead, its streams move");
            }
        }
        Ok(())
    }
}

/// Whether `key`'s item is re-read at tick number `tick`: each stream at one
/// tick of every [`CONTROL_SWEEP_TICKS`], spread evenly.
fn sweep_turn(key: &StreamKey, tick: u64) -> bool {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut hasher);
    hasher.finish() % CONTROL_SWEEP_TICKS == tick % CONTROL_SWEEP_TICKS
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEARTBEAT: Duration = Duration::from_secs(4);

    /// Runs passes every 250 ms from `from` for `span`, the counter last
    /// seen moving at `moved_at`; returns when the partitions were audited.
    fn audits(
        schedule: &mut AuditSchedule,
        from: Instant,
        span: Duration,
        moved_at: Option<Instant>,
    ) -> Vec<Duration> {
        let mut at = Vec::new();
        let mut now = from;
        while now < from + span {
            if schedule.due(now, HEARTBEAT, false, moved_at, true).audit {
                at.push(now.duration_since(from));
            }
            now += Duration::from_millis(250);
        }
        at
    }

    #[test]
    fn a_quiet_worker_audits_every_sixteen_heartbeats_and_after_a_move_every_four() {
        let t0 = Instant::now();
        let mut s = AuditSchedule::new(t0);
        // The first read of the counter counts as a move: audits at the
        // first tick (16 s after it: past the index's lag, so only then).
        let first = audits(&mut s, t0, Duration::from_secs(60), Some(t0));
        assert_eq!(first, [Duration::from_secs(16)]);
        // Nothing moved since: the next audit 16 heartbeats after the last.
        let quiet = audits(
            &mut s,
            t0 + Duration::from_secs(60),
            Duration::from_secs(120),
            Some(t0),
        );
        assert_eq!(
            quiet,
            [Duration::from_secs(20), Duration::from_secs(84)],
            "64 s apart while the counter stands still"
        );
        // A move (ticks at 16 s, 32 s, ... from the start): the next tick
        // audits, and the one after as well when the move was within the
        // index's lag (5 s) before it.
        let t1 = t0 + Duration::from_secs(180);
        let after = audits(&mut s, t1, Duration::from_secs(40), Some(t1));
        assert_eq!(after, [Duration::from_secs(12)], "11 s after the move");
        let t2 = t0 + Duration::from_secs(220);
        let moved = t2 + Duration::from_secs(3);
        let after = audits(&mut s, t2, Duration::from_secs(40), Some(moved));
        assert_eq!(
            after,
            [Duration::from_secs(4), Duration::from_secs(20)],
            "1 s after the move, and a tick later"
        );
    }

    #[test]
    fn a_requested_audit_runs_at_once_and_ticks_keep_their_period() {
        let t0 = Instant::now();
        let mut s = AuditSchedule::new(t0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let d = s.due(at(1), HEARTBEAT, true, None, true);
        assert_eq!((d.audit, d.tick), (true, None));
        let d = s.due(at(16), HEARTBEAT, false, None, true);
        assert_eq!((d.audit, d.tick), (false, Some(1)));
        let d = s.due(at(32), HEARTBEAT, false, None, true);
        assert_eq!((d.audit, d.tick), (false, Some(2)));
    }

    #[test]
    fn a_failed_audit_is_owed_at_the_next_tick_and_an_upgrade_audits_every_tick() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut s = AuditSchedule::new(t0);
        assert!(s.due(at(1), HEARTBEAT, true, None, true).audit);
        s.failed();
        let d = s.due(at(2), HEARTBEAT, false, None, true);
        assert!(!d.audit, "not every pass");
        assert!(
            s.due(at(16), HEARTBEAT, false, None, true).audit,
            "at the next tick"
        );
        assert!(!s.due(at(32), HEARTBEAT, false, None, true).audit, "paid");
        // A writer of an earlier release does not move the counter.
        assert!(s.due(at(48), HEARTBEAT, false, None, false).audit);
    }

    #[test]
    fn every_held_stream_has_its_sweep_turn_once_in_so_many_ticks() {
        let key = StreamKey::new("ns", "s");
        let turns = (0..CONTROL_SWEEP_TICKS * 3)
            .filter(|t| sweep_turn(&key, *t))
            .count();
        assert_eq!(turns, 3);
    }
}
