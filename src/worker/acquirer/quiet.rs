//! Quiet passes: at steady state a worker reads the fleet's change counter
//! and the peers it watches, in one request every other pass, instead of
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
//! reads the counter and the watched peers every [`WATCH_PERIOD`].
//!
//! Reads only ever decide *when* to look: every ownership change is still a
//! conditional write, so a quiet pass can delay a pickup and never cause an
//! overlap.

use super::overdue::successors;
use super::pass::{Acquirer, live_incarnations};
use crate::lease::{FleetEntry, StoreError, WorkerState};
use std::time::Duration;
use tokio::time::Instant;

/// How often a quiet worker reads the change counter and its watched peers:
/// what a change waits before quiet peers see it (a drain's releases, a new
/// stream), and how late a watched peer's renewal is first seen (so how
/// much later than a lease of silence its death is declared).
pub(super) const WATCH_PERIOD: Duration = Duration::from_millis(500);
/// Longest time between two full passes.
pub(super) const FULL_PASS_PERIOD: Duration = Duration::from_secs(30);
/// Passes stay full this many heartbeats after the counter moved ...
pub(super) const BUSY_HEARTBEATS: u32 = 2;
/// ... and at least this long (the index's lag does not shrink with the heartbeat).
pub(super) const BUSY_AT_LEAST: Duration = Duration::from_secs(5);
/// A worker that decided to hand streams over to rebalance announces it and
/// waits this long before releasing them, so quiet peers are making full
/// passes when the streams land: one watch read and a pass.
pub(super) const ANNOUNCE_AHEAD: Duration = Duration::from_millis(750);
/// Peers each worker watches (the ring successors): every worker is watched
/// by this many others.
pub(super) const WATCHED_PEERS: usize = 2;

/// What quiet passes need to remember.
#[derive(Debug, Default)]
pub(super) struct QuietState {
    /// The change counter as last read.
    changes: Option<u64>,
    /// When the counter was last seen to move (or first read).
    moved_at: Option<Instant>,
    last_watch: Option<Instant>,
    /// When the next full pass is due at the latest (jittered, so a fleet
    /// that went quiet together does not query together).
    full_due: Option<Instant>,
    /// This worker announced that it takes streams (after its first full pass).
    announced_start: bool,
    /// Every LIVE peer of the last full refresh moves the counter.
    peers_announce: bool,
    /// The fleet as the last full pass read it.
    pub(super) fleet: Vec<FleetEntry>,
}

impl QuietState {
    /// Records a read of the counter; `true` when it moved.
    pub(super) fn saw(&mut self, changes: u64, now: Instant) -> bool {
        let moved = self.changes != Some(changes);
        if moved {
            self.changes = Some(changes);
            self.moved_at = Some(now);
        }
        self.last_watch = Some(now);
        moved
    }

    /// Records a full pass over `fleet`; `true` the first time (the worker
    /// then announces that it takes streams).
    pub(super) fn full_pass(&mut self, fleet: Vec<FleetEntry>, now: Instant) -> bool {
        self.fleet = fleet;
        self.full_due = Some(now + crate::worker::settings::jittered(FULL_PASS_PERIOD));
        !std::mem::replace(&mut self.announced_start, true)
    }

    /// Records whether every LIVE peer of `fleet` but `me` moves the counter,
    /// by the items just read: a LIVE peer whose item was not read counts as
    /// one that does not.
    pub(super) fn set_peers_announce(
        &mut self,
        fleet: &[FleetEntry],
        me: &crate::lease::Incarnation,
        read: &[crate::lease::WorkerRecord],
    ) {
        self.peers_announce = fleet
            .iter()
            .filter(|w| w.state == WorkerState::Live && w.incarnation != *me)
            .all(|w| {
                read.iter()
                    .any(|r| r.incarnation == w.incarnation && r.announces_changes)
            });
    }
}

impl Acquirer {
    /// Whether this pass may be quiet (see the module's documentation).
    pub(super) fn may_stay_quiet(&self, now: Instant) -> bool {
        let q = &self.quiet;
        let heartbeat = self.ctx.settings.heartbeat_interval;
        let busy = (heartbeat * BUSY_HEARTBEATS).max(BUSY_AT_LEAST);
        let recent = |t: Option<Instant>, within: Duration| {
            t.is_some_and(|t| now.duration_since(t) < within)
        };
        let staying = self.registry.staying() as u64;
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
            && (!self.ctx.settings.rebalance || self.view.balanced(staying))
    }

    /// A quiet pass: reads the counter and the watched peers when due; `true`
    /// when what it read calls for a full pass.
    pub(super) async fn quiet_pass(&mut self, now: Instant) -> Result<bool, StoreError> {
        let live = live_incarnations(&self.quiet.fleet);
        let watched = successors(&self.me, &live, WATCHED_PEERS);
        if self
            .quiet
            .last_watch
            .is_some_and(|t| now.duration_since(t) < WATCH_PERIOD)
        {
            return Ok(false);
        }
        let read = self.ctx.store.watch(&watched).await?;
        let now = Instant::now();
        for r in &read.workers {
            self.observer.observe(r, now);
        }
        let moved = self.quiet.saw(read.changes, now);
        // Only the watched peers are read here: the others' versions are
        // as old as the last full pass, and are their own watchers' to judge.
        let trouble = read.workers.len() < watched.len()
            || read.workers.iter().any(|r| r.state != WorkerState::Live)
            || self
                .observer
                .overdue(now)
                .iter()
                .any(|(p, _)| watched.contains(p));
        Ok(moved || trouble)
    }
}
