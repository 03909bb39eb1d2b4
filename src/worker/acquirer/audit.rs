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
//! `AUDIT_HEARTBEATS` heartbeats (4) while the counter moved since (or
//! shortly before) its last audit, and otherwise every
//! `QUIET_AUDIT_HEARTBEATS` (16; `audit_schedule`). What waits for the
//! longer period is a write with neither its notification nor its bump (a
//! person editing the table, a writer of an earlier release, a writer that
//! crashed between its write and both), and for the last, whoever mirrors
//! the resource next reminds the owner sooner (`lease::owner_behind`). The
//! sweep and the roster keep the shorter period: they cost little, and they
//! are what finds writes no one announces.
//!
//! While a worker takes orphans over, its audit waits for the longer period
//! and the sweep's share waits for the takeover's end, at most three ticks
//! (`audit_schedule`); the roster keeps its tick.

use super::pass::Acquirer;
use crate::lease::{
    DesiredState, FleetEntry, Incarnation, Lease, Ownership, StoreError, StreamKey,
};
use crate::worker::settings::CONTROL_SWEEP_TICKS;
use std::collections::HashSet;
use tokio::time::Instant;

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
            self.taking_over(now),
        );
        // In memory only: a failing store does not skip a share.
        if let Some(share) = due.sweep {
            self.sweep(share);
        }
        if due.audit
            && let Err(e) = self.audit().await
        {
            self.audit_schedule.failed();
            return Err(e);
        }
        if due.tick {
            self.find_vanished(workers).await?;
        }
        Ok(())
    }

    /// Whether this worker is taking orphans over: its passes find them and
    /// it acquired within the last heartbeat (one at its connection limit,
    /// or whose peers take them all, is not: it audits as before).
    fn taking_over(&self, now: Instant) -> bool {
        let heartbeat = self.ctx.settings.heartbeat_interval;
        self.orphans_seen
            && self
                .last_acquired
                .is_some_and(|t| now.duration_since(t) < heartbeat)
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
    /// re-read by their holders at each tick (the share waits while this
    /// worker takes orphans over: `audit_schedule`), every held item once
    /// in [`CONTROL_SWEEP_TICKS`] shares (the last resort for a spec
    /// written with no notification at all).
    fn sweep(&self, share: u64) {
        for held in self.registry.snapshot() {
            if sweep_turn(&held.lease.key, share) {
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

/// Whether `key`'s item is re-read in share number `share`: each stream in
/// one share of every [`CONTROL_SWEEP_TICKS`], spread evenly.
fn sweep_turn(key: &StreamKey, share: u64) -> bool {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut hasher);
    hasher.finish() % CONTROL_SWEEP_TICKS == share % CONTROL_SWEEP_TICKS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_held_stream_has_its_sweep_turn_once_in_so_many_ticks() {
        let key = StreamKey::new("ns", "s");
        let turns = (0..CONTROL_SWEEP_TICKS * 3)
            .filter(|t| sweep_turn(&key, *t))
            .count();
        assert_eq!(turns, 3);
    }
}
