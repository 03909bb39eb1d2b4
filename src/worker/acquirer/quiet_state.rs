//! What quiet passes remember between passes (the change counter as last
//! read, when the fleet was last read in full, whether every peer announces
//! its changes) and the times they keep; the decisions are `quiet`'s.

use crate::lease::{FleetEntry, Incarnation, WorkerRecord, WorkerState};
use std::time::Duration;
use tokio::time::Instant;

/// How often a quiet worker reads the change counter: what a change waits
/// before quiet peers see it (a drain's releases, a new stream). Watched
/// peers are read on their own schedule (`renewal_forecast`). A worker its
/// peers poke reads it once a heartbeat instead (`worker::pokes`).
pub(super) const WATCH_PERIOD: Duration = Duration::from_millis(500);
/// Reads of the counter for pokes come at least this far apart, however
/// many pokes arrive.
pub(super) const POKE_READ_SPACING: Duration = Duration::from_secs(1);
/// After a read found a move no poke had announced, the counter is read
/// every [`WATCH_PERIOD`] for this long (pokes may not be arriving).
pub(super) const UNANNOUNCED_FALLBACK: Duration = Duration::from_secs(60);
/// Longest time between two full passes.
pub(super) const FULL_PASS_PERIOD: Duration = Duration::from_secs(30);
/// Passes stay full this many heartbeats after the counter moved ...
pub(super) const BUSY_HEARTBEATS: u32 = 2;
/// ... and at least this long (the index's lag does not shrink with the heartbeat).
pub(super) const BUSY_AT_LEAST: Duration = Duration::from_secs(5);
/// A worker that decided to hand streams over to rebalance announces it and
/// waits this long before releasing them, so quiet peers are making full
/// passes when the streams land: one watch read (or a poke) and a pass. A
/// heartbeat and a pass when a poke failed since (`pass::release_deferred`).
pub(super) const ANNOUNCE_AHEAD: Duration = Duration::from_millis(750);
/// Peers each worker watches (the ring successors): every worker is watched
/// by this many others. Two, so a worker and one of its watchers crashing
/// together (two pods of one node) are both found a lease after their last
/// renewals. With one, the other watcher found was the peer's new ring
/// predecessor, whose first read of its last version starts the lease: two
/// leases in all (6.3–6.7 s at a 3 s lease, measured by
/// `quiet_fleet::a_worker_and_its_watcher_crashing_together_are_both_found`),
/// past the contract's bound.
pub(super) const WATCHED_PEERS: usize = 2;

/// What quiet passes need to remember.
#[derive(Debug, Default)]
pub(super) struct QuietState {
    /// The change counter as last read.
    pub(super) changes: Option<u64>,
    /// When the counter was last seen to move (or first read).
    pub(super) moved_at: Option<Instant>,
    pub(super) last_watch: Option<Instant>,
    /// When the next full pass is due at the latest (jittered, so a fleet
    /// that went quiet together does not query together).
    pub(super) full_due: Option<Instant>,
    /// This worker announced that it takes streams (after its first full pass).
    announced_start: bool,
    /// Every LIVE peer of the last full refresh moves the counter.
    pub(super) peers_announce: bool,
    /// Every LIVE peer of the last full refresh pokes its peers after it
    /// moves the counter.
    pub(super) peers_poke: bool,
    /// When the counter was last read for a poke.
    pub(super) last_poke_read: Option<Instant>,
    /// When a quiet read last found a move that no poke had announced.
    pub(super) unannounced_at: Option<Instant>,
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
    /// and whether every one pokes its peers, by the items just read.
    pub(super) fn set_peers_announce(
        &mut self,
        fleet: &[FleetEntry],
        me: &Incarnation,
        read: &[WorkerRecord],
    ) {
        self.peers_announce = every_live_peer(fleet, me, read, |r| r.announces_changes);
        self.peers_poke = every_live_peer(fleet, me, read, |r| r.pokes_peers);
    }
}

/// Whether every LIVE peer of `fleet` but `me` has `trait_` by the items just
/// read: a LIVE peer whose item was not read counts as one that has not.
pub(super) fn every_live_peer(
    fleet: &[FleetEntry],
    me: &Incarnation,
    read: &[WorkerRecord],
    trait_: impl Fn(&WorkerRecord) -> bool,
) -> bool {
    fleet
        .iter()
        .filter(|w| w.state == WorkerState::Live && w.incarnation != *me)
        .all(|w| {
            read.iter()
                .any(|r| r.incarnation == w.incarnation && trait_(r))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::acquirer::overdue::tests::record;

    fn live(who: &Incarnation) -> FleetEntry {
        FleetEntry {
            incarnation: who.clone(),
            state: WorkerState::Live,
            released_at_ms: None,
            started_at_ms: None,
            draining: false,
        }
    }

    /// A LIVE peer of an earlier release (no `pokes_peers` on its item) or
    /// one whose item was not read: this worker cannot count on pokes and
    /// reads the counter as often as before; a DEAD one does not count.
    #[test]
    fn pokes_are_counted_on_only_while_every_live_peer_sends_them() {
        let (me, a, b) = (
            Incarnation::new("me"),
            Incarnation::new("a"),
            Incarnation::new("b"),
        );
        let fleet = vec![live(&me), live(&a), live(&b)];
        let mut q = QuietState::default();
        q.set_peers_announce(&fleet, &me, &[record(&a, 1), record(&b, 1)]);
        assert!(q.peers_poke);
        let earlier = WorkerRecord {
            pokes_peers: false,
            ..record(&b, 1)
        };
        q.set_peers_announce(&fleet, &me, &[record(&a, 1), earlier.clone()]);
        assert!(!q.peers_poke, "a peer of an earlier release pokes nobody");
        assert!(q.peers_announce, "it still moves the counter");
        q.set_peers_announce(&fleet, &me, &[record(&a, 1)]);
        assert!(!q.peers_poke, "a LIVE peer whose item was not read");
        let gone = vec![
            live(&me),
            live(&a),
            FleetEntry {
                state: WorkerState::Dead,
                ..live(&b)
            },
        ];
        q.set_peers_announce(&gone, &me, &[record(&a, 1), earlier]);
        assert!(q.peers_poke, "a DEAD peer pokes nobody, and need not");
    }
}
