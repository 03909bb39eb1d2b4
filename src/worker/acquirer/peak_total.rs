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
//! from its giver's lower count being read until its taker's higher one is:
//! at most two heartbeats while the taker lives. So the peak over a longer
//! window, sampled every pass (quiet and failed passes too), is at least the
//! true total unless streams kept moving through the whole window, and a
//! giver never hands over too many. A sum can also come out high (a taker's
//! new count read before its giver's, or streams deleted within the window):
//! that only makes a giver hand over fewer for the window.

use std::collections::VecDeque;
use std::time::Duration;
use tokio::time::Instant;

/// Recent totals, newest last, each larger than every later one (the front
/// is the peak): at most one entry per distinct value still in the window.
#[derive(Debug, Default)]
pub(super) struct PeakTotal {
    seen: VecDeque<(Instant, u64)>,
}

impl PeakTotal {
    /// Records `total` as seen `now` and returns the largest total seen
    /// within `window` before it (this one included).
    pub(super) fn observe(&mut self, now: Instant, total: u64, window: Duration) -> u64 {
        while self
            .seen
            .front()
            .is_some_and(|(at, _)| now.duration_since(*at) > window)
        {
            self.seen.pop_front();
        }
        while self.seen.back().is_some_and(|(_, t)| *t <= total) {
            self.seen.pop_back();
        }
        self.seen.push_back((now, total));
        self.seen.front().map_or(total, |(_, t)| *t)
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
        let total = peak.observe(start, joined.total(15), window);
        assert_eq!(handoff(&joined, 15, total), 5);
        let lagging = view(&[10, 5]);
        let later = start + Duration::from_millis(1_500);
        assert_eq!(
            handoff(&lagging, 10, lagging.total(10)),
            1,
            "the latest sum alone over-gives"
        );
        let total = peak.observe(later, lagging.total(10), window);
        assert_eq!(total, 30);
        assert_eq!(handoff(&lagging, 10, total), 0);
        // Once the newcomer's count is read, the sum is whole again.
        let settled = view(&[10, 10]);
        let total = peak.observe(later + window * 2, settled.total(10), window);
        assert_eq!(handoff(&settled, 10, total), 0);
    }

    #[test]
    fn the_peak_lasts_the_window_and_a_larger_total_replaces_it_at_once() {
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        let window = Duration::from_secs(3);
        let mut peak = PeakTotal::default();
        assert_eq!(peak.observe(at(0), 30, window), 30);
        // Streams in flight: the sum dips, the peak holds.
        assert_eq!(peak.observe(at(1_000), 25, window), 30);
        assert_eq!(peak.observe(at(2_000), 27, window), 30);
        assert_eq!(peak.observe(at(3_000), 26, window), 30);
        // The 30 left the window: the largest since then (27, at 2 s).
        assert_eq!(peak.observe(at(3_001), 26, window), 27);
        assert_eq!(peak.observe(at(5_001), 26, window), 26);
        // New streams count at once.
        assert_eq!(peak.observe(at(5_002), 40, window), 40);
        assert_eq!(peak.seen.len(), 1);
    }
}
