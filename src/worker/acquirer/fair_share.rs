//! Fair share, in one place: how many streams this worker should hold, which
//! orphans it takes, and how many it hands over, so that adding a worker
//! actually moves load to it (which is what makes an HPA on active connections
//! per pod converge).
//!
//! Every worker publishes its held count in its worker item; the fair share is
//! `ceil((streams held by live workers + orphans) / live workers)`. A worker
//! below its share acquires first; one above it acquires only orphans nobody
//! else picked up for a while (availability beats balance) and hands its excess
//! over by release — but only while some peer is below its share, so a stable
//! fleet never churns; and, when the ceiling would stop short of balance, about
//! as many more as the workers below the floor still lack.

use crate::lease::{Incarnation, ReleaseReason, StreamRecord};

/// A live peer as this worker last saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Peer {
    pub incarnation: Incarnation,
    pub held: u64,
    /// Its heartbeat moved recently (a crashed worker stays LIVE in the table
    /// until declared dead; handing streams to it would only interrupt them).
    pub progressing: bool,
    /// When it wrote the heartbeat that published `held`, on its own clock.
    pub published_at_ms: u64,
    /// Its release marker as read with `held` (when it last released
    /// streams, on its own clock).
    pub marked_released_at_ms: Option<u64>,
}

/// What this worker knows about its live peers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct FleetView {
    pub peers: Vec<Peer>,
}

impl FleetView {
    /// Workers counted for the share: this one and the progressing peers.
    pub(super) fn live(&self) -> usize {
        1 + self.peers.iter().filter(|p| p.progressing).count()
    }

    /// Fair share given what this worker holds and the orphans it sees.
    pub(super) fn fair_share(&self, held: u64, orphans: u64) -> u64 {
        fair_share(self.total(held) + orphans, self.live())
    }

    /// The floor of the mean, as [`Self::fair_share`] is its ceiling.
    pub(super) fn floor_share(&self, held: u64, orphans: u64) -> u64 {
        (self.total(held) + orphans) / self.live() as u64
    }

    /// Streams held by the counted workers, this one holding `held`, as
    /// last published (short by any stream in flight: see `peak_total`).
    pub(super) fn total(&self, held: u64) -> u64 {
        held + self
            .peers
            .iter()
            .filter(|p| p.progressing)
            .map(|p| p.held)
            .sum::<u64>()
    }

    /// Whether `orphan` is still in the count a peer last published: a
    /// counted peer released it after the heartbeat that published that
    /// count. Both times are the releaser's own clock. A taker that counted
    /// such a stream twice (in its releaser's load and as an orphan) would
    /// see a share above the true one and take streams meant for the worker
    /// they were handed to: a giver took back its peer's released streams
    /// right after handing its own over. Exact because a stream leaves the
    /// published load at its release stamp and a heartbeat is stamped before
    /// it counts (`HeldStream::stamp_release`); in the instant between those
    /// two it errs one too few, which only has the orphan wait out its grace.
    pub(super) fn still_counted(&self, orphan: &StreamRecord) -> bool {
        orphan
            .released_by()
            .is_some_and(|(owner, released_at)| self.publishes_release(owner, released_at))
    }

    /// Whether the counted peer `owner` still publishes a stream it released
    /// at `released_at` (its clock): its count's heartbeat is not after it.
    pub(super) fn publishes_release(&self, owner: &str, released_at: u64) -> bool {
        self.peers.iter().any(|p| {
            p.progressing && p.incarnation.as_str() == owner && released_at >= p.published_at_ms
        })
    }

    /// Whether no counted peer is known to publish more than it holds: none
    /// released streams at or after the heartbeat that published its count
    /// (its release marker against that heartbeat, both its own clock).
    /// A sum with such a count in it can be above the true total.
    pub(super) fn counts_settled(&self) -> bool {
        self.peers.iter().filter(|p| p.progressing).all(|p| {
            p.marked_released_at_ms
                .is_none_or(|marked| marked < p.published_at_ms)
        })
    }

    /// How long a stream released to rebalance waits for a worker below its
    /// share before one at its share (or its releaser) takes it: `passes_ms`,
    /// or a lease while a live peer is below `fair`, as the stream was
    /// released for that peer. A newcomer slower than four passes (a loaded
    /// machine) lost streams released for it to the workers that had just
    /// let them go, and they moved again. Within a lease a live peer takes
    /// them or is no longer counted as live; one that cannot (its connection
    /// limit) costs each such stream a lease, at the extra handoff's rate.
    pub(super) fn rebalance_grace_ms(&self, fair: u64, passes_ms: u64, lease_ms: u64) -> u64 {
        if self.peer_below(fair) {
            passes_ms.max(lease_ms)
        } else {
            passes_ms
        }
    }

    /// Whether some progressing peer holds fewer than `fair` streams.
    pub(super) fn peer_below(&self, fair: u64) -> bool {
        self.peers.iter().any(|p| p.progressing && p.held < fair)
    }

    /// Whether every counted worker, this one holding `held`, is within the
    /// floor and the ceiling of the mean: nothing for fair share to move.
    pub(super) fn balanced(&self, held: u64) -> bool {
        let progressing = || self.peers.iter().filter(|p| p.progressing);
        let total = held + progressing().map(|p| p.held).sum::<u64>();
        let live = self.live() as u64;
        let (floor, ceiling) = (total / live, total.div_ceil(live));
        std::iter::once(held)
            .chain(progressing().map(|p| p.held))
            .all(|h| (floor..=ceiling).contains(&h))
    }

    /// One more stream to hand over, beyond the excess over the fair share
    /// (the ceiling), when the fleet would otherwise stop short of balance:
    /// 30 streams on 4 workers settle at 8/8/8/6 by the ceiling alone, as
    /// nobody holds more than 8, though a balanced fleet holds 7 or 8 each.
    /// When peers below the floor lack more than the whole fleet's excess
    /// will give them, the first `lacking` of the workers at or above the
    /// ceiling each hand one more over, in an order every worker computes
    /// alike from the same loads: the most loaded first (their excess is
    /// going anyway), then by incarnation. So exactly as many move as are
    /// lacking, whether the givers decide together or one after another
    /// (one that has already given is no longer above the ceiling, and the
    /// next in line sees what is still lacking). Each used to roll, with
    /// probability `lacking / givers`: a newcomer joining three workers
    /// missed its last stream in (2/3)³ of joins, and waited for it a
    /// cooldown later. Releasing one each would move a stream per worker in
    /// a large fleet to fill one newcomer. A stream released too many (loads
    /// seen differently) is taken by a worker below the ceiling, which every
    /// releaser then is: nothing goes above it. `total` is the fleet's total
    /// as a giver counts it (`peak_total`); `me` is this worker, holding
    /// `held`.
    pub(super) fn extra_handoff(&self, me: &Incarnation, held: u64, total: u64) -> u64 {
        let progressing = || self.peers.iter().filter(|p| p.progressing);
        let live = self.live() as u64;
        let (floor, ceiling) = (total / live, total.div_ceil(live));
        if floor == ceiling || held < ceiling {
            return 0;
        }
        let below_floor: u64 = progressing().map(|p| floor.saturating_sub(p.held)).sum();
        let excess: u64 = held.saturating_sub(ceiling)
            + progressing()
                .map(|p| p.held.saturating_sub(ceiling))
                .sum::<u64>();
        let lacking = below_floor.saturating_sub(excess);
        let ahead = progressing()
            .filter(|p| p.held >= ceiling)
            .filter(|p| p.held > held || (p.held == held && p.incarnation < *me))
            .count() as u64;
        u64::from(ahead < lacking)
    }
}

/// `ceil(streams / workers)`.
pub(super) fn fair_share(streams: u64, workers: usize) -> u64 {
    streams.div_ceil(workers.max(1) as u64)
}

/// How many streams to hand over now: the whole excess over the fair share.
/// Moving it all at once cannot overshoot: the fair share is the ceiling of
/// the mean, so the fleet's excess never exceeds what the workers below it
/// lack, and those take released streams first. (Half the excess at a time,
/// as before, took three rounds two heartbeats apart for a worker joining
/// two, ~22 s.) Connect pacing still spreads the new sessions.
pub(super) fn handoff_count(held: u64, fair: u64, peer_below: bool) -> u64 {
    if !peer_below || held <= fair {
        return 0;
    }
    held - fair
}

/// Why a stream is without an owner, which decides who should take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Orphan {
    /// Its owner died: it has already waited a whole lease.
    Crashed,
    /// Released by an owner that shut down, `age_ms` ago.
    Released { age_ms: u64 },
    /// Released by an owner to rebalance the fleet, `age_ms` ago.
    /// `by_me` when this incarnation released it.
    Rebalanced { by_me: bool, age_ms: u64 },
    /// Released because the resource asked for another worker, `age_ms` ago;
    /// `by_me` when this incarnation released it.
    Moved { by_me: bool, age_ms: u64 },
    /// Never owned; created `age_ms` ago.
    New { age_ms: u64 },
}

/// Classifies a free stream from its (index) item, as seen by `me`. Ages
/// compare wall clocks of different machines, which is fine for a grace
/// period and never for safety.
pub(super) fn classify_free(r: &StreamRecord, now_ms: u64, me: &Incarnation) -> Orphan {
    let since = |t: Option<u64>| t.map_or(u64::MAX, |t| now_ms.saturating_sub(t));
    if r.lease_owner.is_none() {
        return Orphan::New {
            age_ms: since(r.created_at_ms),
        };
    }
    let age_ms = since(r.released_at_ms);
    let by_me = r.lease_owner.as_deref() == Some(me.as_str());
    match r.release_reason {
        Some(ReleaseReason::Rebalance) => Orphan::Rebalanced { by_me, age_ms },
        Some(ReleaseReason::Moved) => Orphan::Moved { by_me, age_ms },
        _ => Orphan::Released { age_ms },
    }
}

/// Which orphans this worker takes in one pass.
///
/// Below its fair share a worker takes anything, up to the share. Beyond it:
/// crashed streams at once; streams released on shutdown or never owned once
/// `share_grace_ms` gave the workers below their share a chance; streams
/// released for rebalancing only after `rebalance_grace_ms`, so they land on
/// the new worker and not back where they came from.
#[derive(Clone, Copy, Debug)]
pub(super) struct AcquirePolicy {
    /// Streams still wanted to reach the fair share; `None` without fair share.
    pub below_share: Option<u64>,
    /// While a live peer is below the floor of the mean: streams this worker
    /// still wants to reach that floor (`None` when no peer is below it).
    /// Streams let go to rebalance go to the workers below the floor first,
    /// for `floor_grace_ms`: the one that handed the extra stream over is
    /// left at the floor, under the ceiling, and took a stream another giver
    /// released for the newcomer, which then waited for a second round
    /// (`floor_share`).
    pub floor_first: Option<u64>,
    /// How long a worker at the floor leaves such a stream: a few passes,
    /// not the rebalance grace (a lease while a peer is below the share). A
    /// peer held below the floor by its own connection limit takes none of
    /// them, and each would wait a lease without an owner.
    pub floor_grace_ms: u64,
    pub share_grace_ms: u64,
    pub rebalance_grace_ms: u64,
}

impl AcquirePolicy {
    pub(super) fn allows(&self, orphan: Orphan) -> bool {
        // A stream asked to move goes to anyone but the worker that let it
        // go, whatever the shares; nor does a stream let go to rebalance go
        // straight back (its releaser may be below the share right after:
        // the extra handoff leaves it one under the ceiling). The releaser
        // takes it back only when nobody else did (a fleet of one), after the
        // rebalance grace.
        match orphan {
            Orphan::Moved {
                by_me: true,
                age_ms,
            }
            | Orphan::Rebalanced {
                by_me: true,
                age_ms,
            } => return age_ms >= self.rebalance_grace_ms,
            Orphan::Moved { by_me: false, .. } => return true,
            _ => {}
        }
        if let (Orphan::Rebalanced { age_ms, .. }, Some(0)) = (orphan, self.floor_first)
            && age_ms < self.floor_grace_ms
        {
            return false;
        }
        if self.below_share.is_none_or(|n| n > 0) {
            return true;
        }
        match orphan {
            Orphan::Crashed => true,
            Orphan::Released { age_ms } | Orphan::New { age_ms } => age_ms >= self.share_grace_ms,
            Orphan::Rebalanced { age_ms, .. } => age_ms >= self.rebalance_grace_ms,
            Orphan::Moved { .. } => true,
        }
    }

    /// Counts a stream this pass is about to acquire toward the fair share.
    pub(super) fn take(&mut self) {
        if let Some(n) = self.floor_first.as_mut() {
            *n = n.saturating_sub(1);
        }
        if let Some(n) = self.below_share.as_mut() {
            *n = n.saturating_sub(1);
        }
    }
}

#[cfg(test)]
impl FleetView {
    /// Progressing peers holding `held`, published at time 0.
    pub(super) fn of_loads(held: &[u64]) -> Self {
        Self::of_workers(held.iter().enumerate().map(|(i, h)| (format!("p{i}"), *h)))
    }

    /// Progressing peers by worker name and load, published at time 0.
    pub(super) fn of_workers(loads: impl IntoIterator<Item = (String, u64)>) -> Self {
        Self {
            peers: loads
                .into_iter()
                .map(|(name, held)| Peer {
                    incarnation: Incarnation::new(&name),
                    held,
                    progressing: true,
                    published_at_ms: 0,
                    marked_released_at_ms: None,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(held: &[u64]) -> FleetView {
        FleetView::of_loads(held)
    }

    /// The extra handoff of worker `me` with the fleet's total as last
    /// published.
    fn extra(v: &FleetView, me: &str, held: u64) -> u64 {
        v.extra_handoff(&Incarnation::new(me), held, v.total(held))
    }

    /// Every worker's extra handoff when each decides from the same loads
    /// (`loads[i]` is worker `w{i}`'s): each sees the others as peers.
    fn extras_deciding_together(loads: &[u64]) -> Vec<u64> {
        (0..loads.len())
            .map(|me| {
                let peers = FleetView::of_workers(
                    loads
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| *i != me)
                        .map(|(i, &held)| (format!("w{i}"), held)),
                );
                extra(&peers, &format!("w{me}"), loads[me])
            })
            .collect()
    }

    #[test]
    fn a_fleet_is_balanced_when_everyone_is_within_the_floor_and_ceiling_of_the_mean() {
        // 30 on 4: 7 or 8 each.
        assert!(view(&[8, 7, 7]).balanced(8));
        assert!(!view(&[8, 8, 6]).balanced(8));
        assert!(!view(&[8, 8, 8]).balanced(6));
        // A newcomer at 0.
        assert!(!view(&[15, 0]).balanced(15));
        // Alone, or with nothing to hold.
        assert!(view(&[]).balanced(42));
        assert!(view(&[0, 0]).balanced(0));
        // A silent peer is not counted.
        let mut v = view(&[10, 0]);
        v.peers[1].progressing = false;
        assert!(v.balanced(10));
    }

    #[test]
    fn a_new_worker_raises_nobody_s_share_but_lowers_the_busy_ones() {
        // Two workers with 15 each; a third joins with 0.
        let v = view(&[15, 0]);
        assert_eq!(v.fair_share(15, 0), 10);
        assert_eq!(handoff_count(15, 10, v.peer_below(10)), 5);
        assert_eq!(handoff_count(12, 10, true), 2);
        assert_eq!(handoff_count(11, 10, true), 1);
        assert_eq!(handoff_count(10, 10, true), 0);
        // 30 over 3: the mean is whole, nothing beyond the excess.
        assert_eq!(extra(&v, "m", 15), 0);
    }

    #[test]
    fn a_fleet_stopped_short_of_balance_by_the_ceiling_moves_exactly_what_is_lacking() {
        // 30 streams, 4 workers: floor 7, ceiling 8. Three hold 10 and a
        // newcomer 0: the excess (3 × 2) leaves it 1 short of the floor, so
        // exactly one of the three hands one more over. With the roll this
        // replaced, none did in (2/3)³ of joins.
        assert_eq!(extras_deciding_together(&[10, 10, 10, 0]), [1, 0, 0, 0]);
        let joined = view(&[10, 10, 0]);
        assert_eq!(handoff_count(10, joined.fair_share(10, 0), true), 2);
        // Stopped at 8/8/8/6: one lacking, three at the ceiling.
        assert_eq!(extras_deciding_together(&[8, 8, 8, 6]), [1, 0, 0, 0]);
        let short = view(&[8, 8, 6]);
        assert_eq!(handoff_count(8, short.fair_share(8, 0), true), 0);
        // The most loaded go first: their excess is going anyway.
        assert_eq!(extras_deciding_together(&[8, 10, 8, 4]), [0, 1, 0, 0]);
        // Balanced (8/8/7/7): nothing, whoever asks.
        assert_eq!(extras_deciding_together(&[8, 8, 7, 7]), [0, 0, 0, 0]);
        // Below the ceiling itself: never a giver.
        assert_eq!(extra(&short, "m", 6), 0);
        // 25 over 4 at 7/7/7/4: two lacking, three givers: two of them.
        assert_eq!(extras_deciding_together(&[7, 7, 7, 4]), [1, 1, 0, 0]);
        // A hundred workers at 10 and a newcomer: 1,000 streams, floor 9,
        // ceiling 10, nobody above it; the newcomer lacks 9: nine move.
        let mut large = vec![10; 100];
        large.push(0);
        assert_eq!(extras_deciding_together(&large).iter().sum::<u64>(), 9);
    }

    /// The givers deciding one after another, each from loads that show the
    /// handoffs before it (the others wait while released streams are
    /// about): still exactly the lacking stream moves, whichever goes first.
    #[test]
    fn givers_deciding_one_after_another_move_exactly_what_is_lacking() {
        for order in [[0, 1, 2], [2, 1, 0], [1, 0, 2], [2, 0, 1]] {
            let mut loads = vec![10, 10, 10, 0];
            let mut extras = 0;
            for giver in order {
                let fair = 8;
                let more = extras_deciding_together(&loads)[giver];
                let count = handoff_count(loads[giver], fair, true) + more;
                extras += more;
                loads[giver] -= count;
                loads[3] += count;
            }
            assert_eq!(extras, 1, "order {order:?}: loads {loads:?}");
            assert_eq!(loads[3], 7, "order {order:?}");
        }
    }

    /// The interleaving a CI run's logs showed: two workers at 15, a
    /// newcomer. This worker handed 5 over and holds 10, the newcomer took
    /// and published them; the peer released 5 too (at 1,500 on its clock)
    /// but its last heartbeat (at 1,000) still publishes 15. Counted twice,
    /// those 5 made a share of 12 and this worker took 2 of the streams
    /// meant for the newcomer.
    #[test]
    fn a_released_stream_still_in_its_releaser_s_count_is_not_counted_twice() {
        let mut v = view(&[15, 5]);
        v.peers[0].incarnation = Incarnation::new("b");
        v.peers[0].published_at_ms = 1_000;
        let released_by = |owner: &Incarnation, at: u64| StreamRecord {
            lease_owner: Some(owner.to_string()),
            release_reason: Some(ReleaseReason::Rebalance),
            released_at_ms: Some(at),
            ..StreamRecord::for_test(crate::lease::StreamKey::new("ns", "s"))
        };
        let peer = v.peers[0].incarnation.clone();
        let orphans: Vec<StreamRecord> = (0..5).map(|_| released_by(&peer, 1_500)).collect();
        assert_eq!(v.fair_share(10, 5), 12, "counted twice");
        let uncounted = orphans.iter().filter(|o| !v.still_counted(o)).count() as u64;
        assert_eq!(v.fair_share(10, uncounted), 10);
        // Released before the heartbeat that published the count: an orphan.
        assert!(!v.still_counted(&released_by(&peer, 999)));
        // Another worker's (a departed one, not in view), a silent peer's,
        // or one never owned: in nobody's count.
        assert!(!v.still_counted(&released_by(&Incarnation::new("gone"), 1_500)));
        v.peers[0].progressing = false;
        assert!(!v.still_counted(&released_by(&peer, 1_500)));
        assert!(
            !v.still_counted(&StreamRecord::for_test(crate::lease::StreamKey::new(
                "ns", "new"
            )))
        );
    }

    #[test]
    fn a_stream_released_for_a_live_peer_below_its_share_waits_a_lease_for_it() {
        let newcomer = view(&[10, 0]);
        assert_eq!(newcomer.rebalance_grace_ms(10, 800, 3_000), 3_000);
        // Nobody below the share (or the one below is silent): the passes.
        assert_eq!(view(&[10, 10]).rebalance_grace_ms(10, 800, 3_000), 800);
        let mut silent = newcomer.clone();
        silent.peers[1].progressing = false;
        assert_eq!(silent.rebalance_grace_ms(10, 800, 3_000), 800);
    }

    #[test]
    fn a_stable_fleet_never_moves_anything() {
        let v = view(&[11, 9]);
        let fair = v.fair_share(11, 0);
        assert_eq!(fair, 11);
        assert_eq!(handoff_count(11, fair, v.peer_below(fair)), 0);
        assert_eq!(handoff_count(12, 10, false), 0);
    }

    #[test]
    fn a_silent_peer_neither_counts_nor_receives_streams() {
        let mut v = view(&[0]);
        v.peers[0].progressing = false;
        assert_eq!(v.live(), 1);
        assert_eq!(v.fair_share(12, 0), 12);
        assert!(!v.peer_below(6));
    }

    /// A stream asked to move: every other worker takes it at once, beyond
    /// its share too; the worker that let it go does not, even below its
    /// share, until the rebalance grace has passed (then it is the only one
    /// left to serve it).
    #[test]
    fn a_moved_stream_goes_to_anyone_but_the_worker_that_let_it_go() {
        let below = AcquirePolicy {
            below_share: Some(3),
            floor_first: None,
            floor_grace_ms: 500,
            share_grace_ms: 1000,
            rebalance_grace_ms: 2000,
        };
        let full = AcquirePolicy {
            below_share: Some(0),
            ..below
        };
        let mine = |age_ms| Orphan::Moved {
            by_me: true,
            age_ms,
        };
        let theirs = |age_ms| Orphan::Moved {
            by_me: false,
            age_ms,
        };
        assert!(full.allows(theirs(0)));
        assert!(below.allows(theirs(0)));
        assert!(!below.allows(mine(0)));
        assert!(!below.allows(mine(1999)));
        assert!(below.allows(mine(2000)));
        let me = Incarnation::new("a");
        let mut r = crate::lease::StreamRecord {
            lease_owner: Some(me.to_string()),
            release_reason: Some(ReleaseReason::Moved),
            released_at_ms: Some(1_000),
            ..crate::lease::StreamRecord::for_test(crate::lease::StreamKey::new("ns", "s"))
        };
        assert_eq!(classify_free(&r, 1_500, &me), mine(500));
        assert_eq!(
            classify_free(&r, 1_500, &Incarnation::new("b")),
            theirs(500)
        );
        r.release_reason = Some(ReleaseReason::Rebalance);
        assert_eq!(
            classify_free(&r, 1_500, &me),
            Orphan::Rebalanced {
                by_me: true,
                age_ms: 500
            }
        );
        assert_eq!(
            classify_free(&r, 1_500, &Incarnation::new("b")),
            Orphan::Rebalanced {
                by_me: false,
                age_ms: 500
            }
        );
    }

    #[test]
    fn a_stream_let_go_to_rebalance_does_not_go_straight_back() {
        let p = AcquirePolicy {
            below_share: Some(1),
            floor_first: None,
            floor_grace_ms: 500,
            share_grace_ms: 1000,
            rebalance_grace_ms: 2000,
        };
        let mine = |age_ms| Orphan::Rebalanced {
            by_me: true,
            age_ms,
        };
        assert!(!p.allows(mine(0)), "below the share, but it let it go");
        assert!(p.allows(mine(2000)), "nobody else took it");
        assert!(p.allows(Orphan::Rebalanced {
            by_me: false,
            age_ms: 0
        }));
    }

    #[test]
    fn below_the_share_anything_goes_until_the_share_is_reached() {
        let mut p = AcquirePolicy {
            below_share: Some(1),
            floor_first: None,
            floor_grace_ms: 500,
            share_grace_ms: 1000,
            rebalance_grace_ms: 2000,
        };
        assert!(p.allows(Orphan::Rebalanced {
            by_me: false,
            age_ms: 0
        }));
        p.take();
        assert!(!p.allows(Orphan::Rebalanced {
            by_me: false,
            age_ms: 0
        }));
        assert!(!p.allows(Orphan::New { age_ms: 10 }));
        assert!(p.allows(Orphan::Released { age_ms: 1000 }));
        assert!(!p.allows(Orphan::Rebalanced {
            by_me: false,
            age_ms: 1999
        }));
        assert!(
            p.allows(Orphan::Crashed),
            "crashed streams are never left waiting"
        );
    }

    /// 30 streams on four workers: floor 7, ceiling 8. The giver that handed
    /// the extra stream over holds 7, below the ceiling; the newcomer holds
    /// 5. A stream another giver let go to rebalance is left to the
    /// newcomer (the worker below the floor) for a few passes;
    /// with nobody below the floor it is taken at once, as before; and the
    /// newcomer takes it at once, until it reaches the floor.
    #[test]
    fn streams_let_go_to_rebalance_go_below_the_floor_first() {
        let theirs = |age_ms| Orphan::Rebalanced {
            by_me: false,
            age_ms,
        };
        let giver_view = view(&[8, 8, 5]);
        assert_eq!(giver_view.floor_share(7, 2), 7);
        assert_eq!(giver_view.fair_share(7, 2), 8);
        let giver = AcquirePolicy {
            below_share: Some(1),
            floor_first: Some(0),
            floor_grace_ms: 500,
            share_grace_ms: 1000,
            rebalance_grace_ms: 2000,
        };
        assert!(!giver.allows(theirs(0)), "left to the newcomer");
        assert!(!giver.allows(theirs(499)));
        assert!(
            giver.allows(theirs(500)),
            "nobody took it: a few passes, not the rebalance grace"
        );
        assert!(
            giver.allows(Orphan::Released { age_ms: 0 }),
            "only rebalanced streams wait"
        );
        assert!(giver.allows(Orphan::Crashed));
        let nobody_below_floor = AcquirePolicy {
            floor_first: None,
            ..giver
        };
        assert!(nobody_below_floor.allows(theirs(0)));
        let mut newcomer = AcquirePolicy {
            below_share: Some(3),
            floor_first: Some(2),
            ..giver
        };
        assert!(newcomer.allows(theirs(0)));
        newcomer.take();
        newcomer.take();
        assert!(!newcomer.allows(theirs(0)), "at the floor itself now");
    }
}
