//! Fair share: how many streams this worker should hold, and how many it should
//! hand over, so that adding a worker actually moves load to it (which is what
//! makes an HPA on active connections per pod converge).
//!
//! Every worker publishes its held count in its membership item; the fair share
//! is `ceil((streams held by live workers + orphans) / live workers)`. A worker
//! below its share acquires first; one above it acquires only orphans nobody
//! else picked up for a while (availability beats balance) and hands its excess
//! over, a few at a time, by checkpoint + release — but only while some peer is
//! below its share, so a stable fleet never churns.

use crate::lease::Member;

/// What a worker knows about the fleet from the last membership query.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FleetView {
    pub members: Vec<Member>,
}

impl FleetView {
    /// Live workers, counting `me` even if its own item is not visible yet.
    pub fn live(&self, me: &str) -> usize {
        self.members.len() + usize::from(!self.members.iter().any(|m| m.id == me))
    }

    /// Streams held by the other workers at their last heartbeat.
    pub fn held_by_others(&self, me: &str) -> u64 {
        self.members
            .iter()
            .filter(|m| m.id != me)
            .map(|m| m.held)
            .sum()
    }

    /// Whether some other worker that heartbeated since `fresh_since_ms` holds
    /// fewer than `fair` streams. A crashed worker's item stays live until it
    /// lapses; handing streams to it would only interrupt them.
    pub fn peer_below(&self, me: &str, fair: u64, fresh_since_ms: u64) -> bool {
        self.members
            .iter()
            .any(|m| m.id != me && m.held < fair && m.heartbeat_at_ms >= fresh_since_ms)
    }

    /// Fair share given what this worker holds and the orphans it sees.
    pub fn fair_share(&self, me: &str, held: u64, orphans: u64) -> u64 {
        fair_share(self.held_by_others(me) + held + orphans, self.live(me))
    }
}

/// `ceil(streams / workers)`.
pub fn fair_share(streams: u64, workers: usize) -> u64 {
    streams.div_ceil(workers.max(1) as u64)
}

/// How many streams to hand over now: half the excess (rounded up), so a large
/// imbalance converges in a few steps without moving everything at once.
pub fn handoff_count(held: u64, fair: u64, peer_below: bool) -> u64 {
    if !peer_below || held <= fair {
        return 0;
    }
    (held - fair).div_ceil(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(held: &[(&str, u64)]) -> FleetView {
        FleetView {
            members: held
                .iter()
                .map(|(id, held)| Member {
                    id: id.to_string(),
                    held: *held,
                    heartbeat_at_ms: 1_000,
                })
                .collect(),
        }
    }

    #[test]
    fn a_new_worker_raises_nobody_s_share_but_lowers_the_busy_ones() {
        // Two workers with 15 each; a third joins with 0.
        let v = view(&[("a", 15), ("b", 15), ("c", 0)]);
        assert_eq!(v.fair_share("a", 15, 0), 10);
        assert_eq!(handoff_count(15, 10, v.peer_below("a", 10, 0)), 3);
        // Next step: 12 → hands 1; then 11 → hands 1; then stable at 10.
        assert_eq!(handoff_count(12, 10, true), 1);
        assert_eq!(handoff_count(11, 10, true), 1);
        assert_eq!(handoff_count(10, 10, true), 0);
    }

    #[test]
    fn a_stable_fleet_never_moves_anything() {
        let v = view(&[("a", 11), ("b", 11), ("c", 9)]);
        let fair = v.fair_share("a", 11, 0);
        assert_eq!(fair, 11);
        assert_eq!(handoff_count(11, fair, v.peer_below("a", fair, 0)), 0);
        // Even above fair share, nothing moves when no peer could take it.
        assert_eq!(handoff_count(12, 10, false), 0);
    }

    #[test]
    fn nothing_is_handed_to_a_worker_that_stopped_heartbeating() {
        // "c" crashed: its item is still live, but its last heartbeat is old.
        let mut v = view(&[("a", 12), ("c", 0)]);
        v.members[1].heartbeat_at_ms = 100;
        assert!(!v.peer_below("a", 6, 500));
        assert!(
            v.peer_below("a", 6, 50),
            "a fresh peer below its share gets streams"
        );
    }

    #[test]
    fn orphans_count_toward_the_share_and_a_missing_self_is_counted() {
        let v = view(&[("b", 10)]);
        assert_eq!(v.live("a"), 2);
        assert_eq!(v.fair_share("a", 0, 10), 10);
        assert_eq!(fair_share(0, 0), 0);
    }
}

/// Why a stream is without an owner, which decides who should take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Orphan {
    /// Its owner stopped renewing: it has already waited a whole lease.
    Crashed,
    /// Released by an owner that shut down, `age_ms` ago.
    Released { age_ms: u64 },
    /// Released by an owner to rebalance the fleet, `age_ms` ago.
    Rebalanced { age_ms: u64 },
    /// Never owned; created `age_ms` ago.
    New { age_ms: u64 },
}

/// Classifies an orphan from its item.
pub fn classify(r: &crate::lease::StreamRecord, now_ms: u64) -> Orphan {
    let since = |t: Option<u64>| t.map_or(u64::MAX, |t| now_ms.saturating_sub(t));
    if r.lease_expires_at_ms > 0 {
        return Orphan::Crashed;
    }
    if r.lease_owner.is_none() {
        return Orphan::New {
            age_ms: since(r.created_at_ms),
        };
    }
    let age_ms = since(r.released_at_ms);
    let reason = r.status.as_ref().and_then(|s| s.reason.as_deref());
    if reason == Some(super::stream::RELEASED_FOR_REBALANCING) {
        Orphan::Rebalanced { age_ms }
    } else {
        Orphan::Released { age_ms }
    }
}

/// Which orphans this worker takes in one reconcile pass.
///
/// Below its fair share a worker takes anything, up to the share. Beyond it:
/// crashed streams at once (availability first: they have waited a lease
/// already); streams released on shutdown or never owned once `share_grace_ms`
/// has given the workers below their share a chance; streams released for
/// rebalancing only after `rebalance_grace_ms`, so they land on the new worker
/// and not back where they came from.
#[derive(Clone, Copy, Debug)]
pub struct AcquirePolicy {
    /// Streams still wanted to reach the fair share; `None` without a fleet view.
    pub below_share: Option<u64>,
    pub share_grace_ms: u64,
    pub rebalance_grace_ms: u64,
}

impl AcquirePolicy {
    pub fn allows(&self, orphan: Orphan) -> bool {
        if self.below_share.is_none_or(|n| n > 0) {
            return true;
        }
        match orphan {
            Orphan::Crashed => true,
            Orphan::Released { age_ms } | Orphan::New { age_ms } => age_ms >= self.share_grace_ms,
            Orphan::Rebalanced { age_ms } => age_ms >= self.rebalance_grace_ms,
        }
    }

    /// Counts an acquired stream toward the fair share.
    pub fn acquired(&mut self) {
        if let Some(n) = self.below_share.as_mut() {
            *n = n.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod policy_tests {
    use super::*;

    fn policy(below: Option<u64>) -> AcquirePolicy {
        AcquirePolicy {
            below_share: below,
            share_grace_ms: 1000,
            rebalance_grace_ms: 2000,
        }
    }

    #[test]
    fn below_the_share_anything_goes_until_the_share_is_reached() {
        let mut p = policy(Some(1));
        assert!(p.allows(Orphan::Rebalanced { age_ms: 0 }));
        p.acquired();
        assert!(!p.allows(Orphan::Rebalanced { age_ms: 0 }));
        assert!(!p.allows(Orphan::New { age_ms: 10 }));
        assert!(
            p.allows(Orphan::Crashed),
            "crashed streams are never left waiting"
        );
    }

    #[test]
    fn at_the_share_released_streams_wait_their_grace() {
        let p = policy(Some(0));
        assert!(!p.allows(Orphan::Released { age_ms: 999 }));
        assert!(p.allows(Orphan::Released { age_ms: 1000 }));
        assert!(!p.allows(Orphan::Rebalanced { age_ms: 1999 }));
        assert!(p.allows(Orphan::Rebalanced { age_ms: 2000 }));
        assert!(
            policy(None).allows(Orphan::Rebalanced { age_ms: 0 }),
            "no fleet view: take all"
        );
    }
}
