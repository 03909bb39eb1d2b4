//! Quiet passes: at steady state a worker reads the fleet's change counter
//! every other pass and each peer it watches around its renewals, instead of
//! querying the fleet and the unowned partitions every pass.
//!
//! A pass is *full* (today's reads: fleet, peers, unowned partitions,
//! departed incarnations) while anything may need doing: the counter moved
//! within [`BUSY_HEARTBEATS`] heartbeats (the window covers the index's lag
//! behind the write that moved it, and the load changes a move causes), this
//! worker has orphans, unanswered acquires, departed incarnations to take
//! from, a recent handoff or acquire, the fleet is off its fair share, a
//! watched peer missed its renewal or is no longer LIVE, a peer of an earlier
//! release runs (it does not move the counter), or the last full pass is
//! [`FULL_PASS_PERIOD`] old (a bump lost with its writer, or a writer of an
//! earlier release, costs at most that). Otherwise the pass is *quiet*: it
//! reads the counter every [`WATCH_PERIOD`] (or, when peers poke this worker
//! after their changes, once a heartbeat and when poked; see
//! `worker::pokes`), and a watched peer just after its next renewal should
//! have landed, waking for it between passes, and a retry after each read
//! that did not show it (`renewal_forecast`): about 1.3 times per heartbeat
//! rather than at every watch read.
//!
//! Reads only ever decide *when* to look: every ownership change is still a
//! conditional write, so a quiet pass can delay a pickup and never cause an
//! overlap.

use super::overdue::successors;
use super::pass::{Acquirer, live_incarnations};
use super::quiet_state::{
    BUSY_AT_LEAST, BUSY_HEARTBEATS, POKE_READ_SPACING, UNANNOUNCED_FALLBACK, WATCH_PERIOD,
    WATCHED_PEERS,
};
use crate::lease::{Incarnation, StoreError, WorkerState};
use std::time::Duration;
use tokio::time::Instant;

impl Acquirer {
    /// How often the counter is read: every [`WATCH_PERIOD`], or once a
    /// heartbeat when peers poke this worker: it gave them an address, every
    /// LIVE peer pokes (a peer of an earlier release does not, so during a
    /// rolling upgrade the counter is read as before), and no read found a
    /// move that no poke had announced within [`UNANNOUNCED_FALLBACK`]
    /// (pokes that do not arrive: a network policy, a wrong address).
    fn watch_period(&self, now: Instant) -> Duration {
        let unannounced = self
            .quiet
            .unannounced_at
            .is_some_and(|t| now.duration_since(t) < UNANNOUNCED_FALLBACK);
        if self.ctx.settings.poke_addr.is_some() && self.quiet.peers_poke && !unannounced {
            self.ctx.settings.heartbeat_interval.max(WATCH_PERIOD)
        } else {
            WATCH_PERIOD
        }
    }

    /// Whether this pass may be quiet (see the module's documentation).
    pub(super) fn may_stay_quiet(&self, now: Instant) -> bool {
        let q = &self.quiet;
        let heartbeat = self.ctx.settings.heartbeat_interval;
        let busy = (heartbeat * BUSY_HEARTBEATS).max(BUSY_AT_LEAST);
        let recent = |t: Option<Instant>, within: Duration| {
            t.is_some_and(|t| now.duration_since(t) < within)
        };
        q.peers_announce
            && !self.legacy_index
            && q.changes.is_some()
            && !recent(q.moved_at, busy)
            && q.full_due.is_some_and(|due| now < due)
            && self.deferred_handoff.is_none()
            && !self.orphans_seen
            && self.pending.is_empty()
            && !self.ended_due(&q.fleet, now)
            && !recent(self.last_handoff, busy)
            && !recent(self.last_acquired, busy)
            && self.fence.is_valid()
            // Last: counting the staying streams walks every held one.
            && (!self.ctx.settings.rebalance
                || self.view.balanced(self.registry.staying() as u64))
    }

    /// When a quiet worker should run its next pass before the usual
    /// interval: a watched peer's read falls due (see `renewal_forecast`).
    /// `None` while passes are full (they read every watched peer anyway).
    pub(crate) fn next_watched_read(&self, now: Instant) -> Option<Instant> {
        if !self.may_stay_quiet(now) {
            return None;
        }
        self.observer.next_due(&self.watched_peers(), now)
    }

    /// The peers this worker watches: its ring successors in the fleet of
    /// the last full pass.
    fn watched_peers(&self) -> Vec<Incarnation> {
        let live = live_incarnations(&self.quiet.fleet);
        successors(&self.me, &live, WATCHED_PEERS)
    }

    /// A quiet pass: reads the counter every [`WATCH_PERIOD`] (once a
    /// heartbeat when peers poke this worker, and at once, strongly
    /// consistent, when one did) and each
    /// watched peer once its next renewal is due (see `renewal_forecast`),
    /// in one request when both are due; `true` when what it read calls for
    /// a full pass.
    pub(super) async fn quiet_pass(&mut self, now: Instant) -> Result<bool, StoreError> {
        // Taken before the read is sent: a poke arriving meanwhile is for a
        // later bump, and stays for the next pass. At most one such read a
        // second, whatever arrives (a moved counter keeps passes full for
        // seconds, so a real poke loses nothing by it).
        let poke_read_due = self
            .quiet
            .last_poke_read
            .is_none_or(|t| now.duration_since(t) >= POKE_READ_SPACING);
        if poke_read_due && self.ctx.pokes.take() {
            self.quiet.last_poke_read = Some(now);
            let changes = match self.ctx.store.changes_now().await {
                Ok(changes) => changes,
                Err(e) => {
                    // What it announced was not read: the next pass tries again.
                    self.ctx.pokes.ring_again();
                    return Err(e);
                }
            };
            if self.quiet.saw(changes, Instant::now()) {
                return Ok(true);
            }
        }
        let period = self.watch_period(now);
        let counter_due = self
            .quiet
            .last_watch
            .is_none_or(|t| now.duration_since(t) >= period);
        let watched = self.watched_peers();
        let due: Vec<Incarnation> = watched
            .iter()
            .filter(|p| self.observer.due(p, now))
            .cloned()
            .collect();
        if !counter_due && due.is_empty() {
            return Ok(false);
        }
        let read = self.read_watched(&due, counter_due).await?;
        let now = read.answered;
        if read.moved && !self.ctx.pokes.pending() {
            // No poke announced it (a poked read comes first, and none is
            // waiting for its turn): if that was a poke lost, read every
            // 500 ms for a while.
            self.quiet.unannounced_at = Some(now);
        }
        // Only the watched peers are judged here: the others' versions are
        // as old as the last full pass, and are their own watchers' to judge.
        // A watched peer not read now is not due, so not overdue either.
        let trouble = read.workers.len() < due.len()
            || read.workers.iter().any(|r| r.state != WorkerState::Live)
            || self
                .observer
                .overdue(now)
                .iter()
                .any(|(p, _)| watched.contains(p));
        Ok(read.moved || trouble)
    }
}
