//! The fleet's total as a giver must count it: the most streams seen held
//! over the last few heartbeats, never the latest sum alone.
//!
//! A stream that moves leaves its giver's count at once (the giver's own) or
//! at the giver's next heartbeat (as its peers see it), but reaches its
//! taker's published count only at the taker's next heartbeat, and this
//! worker reads that at its next full refresh. In between, the sum of counts
//! is short by the streams in flight, the ceiling of the mean drops, and a
//! worker already at its share hands one more over, which the fleet then
//! hands back: 30 streams on three workers at 10/10/10, seen as
//! 10 + 10 + 5 while the newcomer's last five were unpublished, made a
//! worker at 10 compute a share of 9. A stream is missing from the sums only
//! from its release stamp until a taker acquires it and that taker's higher
//! count is read: a few passes and two heartbeats while the taker lives
//! (`PEAK_TOTAL_HEARTBEATS` says how long a window covers it). So the peak
//! over the window, sampled every pass (quiet and failed passes too), is at
//! least the true total unless streams kept moving, or a taker was slower,
//! through the whole window, and a giver does not hand over too many.
//!
//! A sum can also come out high: a giver's count read before its release
//! reached it, beside its taker's count read after. Kept in the peak, that
//! held a newcomer off for the whole window (the join bench's 2 → 3 took
//! 12.6 s against 4.6 s, the over-count left by the two workers' own
//! balancing just before). Such a sum is recognisable: the giver's release
//! marker is at or after the heartbeat that published its count (both its
//! own clock; `FleetView::counts_settled`). It still counts for the
//! decision it is seen at (a higher total only ever hands over fewer) but is
//! not kept. Streams deleted within the window leave a peak that is too
//! high too: a giver hands over fewer until it ages out.

use super::fair_share::FleetView;
use crate::lease::{StreamKey, StreamRecord};
use std::collections::{HashMap, VecDeque};
use std::time::Duration;
use tokio::time::Instant;

/// Streams this worker took from a live peer's release, with the releaser
/// and the release stamp: this worker counts them at once, the releaser
/// until its first heartbeat after the stamp. A sum taken in between has
/// them twice, and kept in the peak it held a newcomer off for the whole
/// window (the join bench's 2 → 3 took 28 s: this worker had just taken
/// streams in the two workers' own balancing, its view read before the
/// releaser's marker). They are taken out of the sum until the releaser's
/// count no longer has them.
#[derive(Debug, Default)]
pub(super) struct TakenFromPeers {
    taken: HashMap<StreamKey, (String, u64)>,
}

impl TakenFromPeers {
    /// Notes a stream acquired as `record` showed it (its last owner and
    /// release stamp, if it was released).
    pub(super) fn took(&mut self, record: &StreamRecord) {
        if let Some((owner, released_at)) = record.released_by() {
            let by = (owner.to_string(), released_at);
            self.taken.insert(record.key.clone(), by);
        }
    }

    /// How many of the streams taken, still held (`held`), `view` counts
    /// twice; forgets the rest.
    pub(super) fn counted_twice(
        &mut self,
        view: &FleetView,
        held: impl Fn(&StreamKey) -> bool,
    ) -> u64 {
        self.taken.retain(|key, (owner, released_at)| {
            held(key) && view.publishes_release(owner, *released_at)
        });
        self.taken.len() as u64
    }
}

/// Recent totals, newest last, each larger than every later one (the front
/// is the peak): at most one entry per distinct value still in the window.
#[derive(Debug, Default)]
pub(super) struct PeakTotal {
    seen: VecDeque<(Instant, u64)>,
}

impl PeakTotal {
    /// Returns the larger of `total` (seen `now`) and the totals kept
    /// within `window` before it; keeps `total` when it is `settled` (no
    /// count in it is known to be above what its worker holds).
    pub(super) fn observe(
        &mut self,
        now: Instant,
        total: u64,
        settled: bool,
        window: Duration,
    ) -> u64 {
        while self
            .seen
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > window)
        {
            self.seen.pop_front();
        }
        if settled {
            while self.seen.back().is_some_and(|(_, t)| *t <= total) {
                self.seen.pop_back();
            }
            self.seen.push_back((now, total));
        }
        self.seen.front().map_or(total, |(_, t)| total.max(*t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::acquirer::fair_share::{FleetView, fair_share, handoff_count};

    fn view(held: &[u64]) -> FleetView {
        FleetView::of_loads(held)
    }

    /// What a worker hands over holding `held` with `peers` in view, the
    /// share computed from `total`.
    fn handoff(peers: &FleetView, held: u64, total: u64) -> u64 {
        let fair = fair_share(total, peers.live());
        handoff_count(held, fair, peers.peer_below(fair))
    }

    /// The interleaving a CI run caught: 30 streams, a newcomer joins two
    /// workers at 15. Both hand 5 over; 1.5 s later this worker holds 10, its
    /// peer has published 10, and the newcomer only the first 5 it took.
    /// Summed, that is 25, a share of 9, and a stream handed over that the
    /// fleet then moved back; with the peak, the share stays 10.
    #[test]
    fn a_worker_at_its_share_hands_nothing_over_while_a_taker_s_count_lags() {
        let start = Instant::now();
        let window = Duration::from_secs(3);
        let mut peak = PeakTotal::default();
        let joined = view(&[15, 0]);
        let total = peak.observe(start, joined.total(15), true, window);
        assert_eq!(handoff(&joined, 15, total), 5);
        let lagging = view(&[10, 5]);
        let later = start + Duration::from_millis(1_500);
        assert_eq!(
            handoff(&lagging, 10, lagging.total(10)),
            1,
            "the latest sum alone over-gives"
        );
        let total = peak.observe(later, lagging.total(10), true, window);
        assert_eq!(total, 30);
        assert_eq!(handoff(&lagging, 10, total), 0);
        // Once the newcomer's count is read, the sum is whole again.
        let settled = view(&[10, 10]);
        let total = peak.observe(later + window * 2, settled.total(10), true, window);
        assert_eq!(handoff(&settled, 10, total), 0);
    }

    /// What the join bench caught: two workers had just balanced (the peer
    /// released 15 of its 30; this worker took them and published 15) when
    /// a newcomer joined. Read before its release reached its count, the
    /// peer still showed 30: a sum of 45, kept, gave a share of 15 and no
    /// handoff for the whole window. Recognised by the peer's release marker
    /// being after its count's heartbeat, it is used for that one decision
    /// only.
    #[test]
    fn a_sum_with_a_count_above_its_worker_s_holding_is_not_kept() {
        let start = Instant::now();
        let window = Duration::from_secs(16);
        let mut peak = PeakTotal::default();
        let mut stale = view(&[30]);
        stale.peers[0].published_at_ms = 1_000;
        stale.peers[0].marked_released_at_ms = Some(1_500);
        assert!(!stale.counts_settled());
        let total = peak.observe(start, stale.total(15), stale.counts_settled(), window);
        assert_eq!(total, 45, "a higher total is used for the decision at hand");
        assert_eq!(handoff(&stale, 15, total), 0);
        let mut fresh = view(&[15, 0]);
        fresh.peers[0].published_at_ms = 2_000;
        fresh.peers[0].marked_released_at_ms = Some(1_500);
        assert!(fresh.counts_settled());
        let later = start + Duration::from_secs(1);
        let total = peak.observe(later, fresh.total(15), fresh.counts_settled(), window);
        assert_eq!(total, 30);
        assert_eq!(handoff(&fresh, 15, total), 5);
        // A silent peer's marker does not matter: its count is not in the sum.
        stale.peers[0].progressing = false;
        assert!(stale.counts_settled());
    }

    /// Streams this worker took are out of the sum while their releaser's
    /// count still has them, and forgotten once it does not, or once they
    /// are no longer held.
    #[test]
    fn a_stream_taken_from_a_peer_is_counted_once() {
        use crate::lease::{Incarnation, ReleaseReason};
        let releaser = Incarnation::new("b");
        let released = |name: &str| StreamRecord {
            lease_owner: Some(releaser.to_string()),
            release_reason: Some(ReleaseReason::Rebalance),
            released_at_ms: Some(1_500),
            ..StreamRecord::for_test(StreamKey::new("ns", name))
        };
        let mut taken = TakenFromPeers::default();
        taken.took(&released("s1"));
        taken.took(&released("s2"));
        taken.took(&StreamRecord::for_test(StreamKey::new("ns", "new")));
        let mut stale = view(&[15]);
        stale.peers[0].incarnation = releaser.clone();
        stale.peers[0].published_at_ms = 1_000;
        // This worker holds 17 of them with the two; the releaser still shows 15.
        assert_eq!(taken.counted_twice(&stale, |_| true), 2);
        assert_eq!(stale.total(17) - 2, 30);
        // s2 was handed on meanwhile: not held, not counted, forgotten.
        let only_s1 = |k: &StreamKey| k.name == "s1";
        assert_eq!(taken.counted_twice(&stale, only_s1), 1);
        let mut fresh = stale.clone();
        fresh.peers[0].published_at_ms = 2_000;
        assert_eq!(taken.counted_twice(&fresh, |_| true), 0);
        assert_eq!(taken.counted_twice(&stale, |_| true), 0, "forgotten");
    }

    #[test]
    fn the_peak_lasts_the_window_and_a_larger_total_replaces_it_at_once() {
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let window = Duration::from_secs(3);
        let mut peak = PeakTotal::default();
        assert_eq!(peak.observe(at(0), 30, true, window), 30);
        // Streams in flight: the sum dips, the peak holds.
        assert_eq!(peak.observe(at(1_000), 25, true, window), 30);
        assert_eq!(peak.observe(at(2_000), 27, true, window), 30);
        assert_eq!(peak.observe(at(3_000), 26, true, window), 30);
        // The 30 left the window: the largest since then (27, at 2 s).
        assert_eq!(peak.observe(at(3_001), 26, true, window), 27);
        assert_eq!(peak.observe(at(5_001), 26, true, window), 26);
        // New streams count at once.
        assert_eq!(peak.observe(at(5_002), 40, true, window), 40);
        assert_eq!(peak.seen.len(), 1);
    }
}
