//! When a watched peer's next renewal can first be read, so a quiet worker
//! reads each watched peer about twice per renewal, around when it lands,
//! instead of at every watch read.
//!
//! Why: reading two peers' items every 500 ms was most of a quiet worker's
//! read bill (eight reads of each peer per 4 s heartbeat), and it found a
//! renewal up to 500 ms late. A peer sends a renewal every heartbeat, timed
//! from its last send. So this worker keeps, on its own monotonic clock, a
//! lower bound on when the peer's last renewal landed, and reads next one
//! cadence after it: that read usually still shows the old version (a
//! *miss*), and it reads at every pass after that until the new one shows.
//! The last miss before a renewal showed is the new lower bound (the renewal
//! landed after it, and at or before the read that showed it), so the
//! estimate is set again at every renewal and does not drift, whatever the
//! clocks do.
//!
//! A read counts as a miss from when it was sent, and the read that first
//! showed a version counts as a miss for the next one. A stale eventually
//! consistent read (the last version after the next one landed) passes for
//! a miss and makes the estimate late by its staleness; the probe below
//! catches up on it.
//!
//! Two cases have no miss to go by. A peer first seen has no bound on its
//! last renewal: it is read at every pass until its next renewal shows,
//! which is then bracketed. A renewal that shows at the first read (it
//! landed early, or the estimate ran late) gives only an upper bound: the
//! estimate moves [`PROBE`] of a cadence earlier than forecast, so a later
//! read misses and brackets it again; an estimate running late is caught
//! up on that way.
//!
//! The cadence is the larger of the last two gaps between consecutive
//! stamps (`heartbeat_at_ms`, the peer's clock; only differences are used),
//! capped at this worker's heartbeat: a peer with a longer heartbeat is
//! read early and then every pass until it renews, never late.
//!
//! Only *when* to read is forecast. A death is still declared a whole lease
//! after the read that first showed the last version (`overdue`).

use std::time::Duration;
use tokio::time::Instant;

/// Shortest cadence believed from a peer's stamps.
const MIN_CADENCE: Duration = Duration::from_millis(100);
/// Most renewals a forecast reaches across.
const MAX_FORECAST_STEPS: u64 = 64;
/// After a renewal that showed at the first read, the estimate moves this
/// share of a cadence earlier than forecast (250 ms at 4 s).
const PROBE: u32 = 16;

/// What reads of one peer say about its next renewal.
#[derive(Clone, Debug)]
pub(super) struct Forecast {
    /// The stamp of the version last seen (the peer's wall clock; 0: a peer
    /// that does not stamp).
    sent_at_ms: u64,
    /// Time between two consecutive renewals, from their stamps: the
    /// larger of the last two such gaps, so one short gap (a renewal retried
    /// after an error that had landed) does not shorten it.
    cadence: Option<Duration>,
    /// The last such gap.
    last_step: Option<Duration>,
    /// At or before when the version last seen landed; `None` while unknown
    /// (first seen: read at every pass until the next renewal shows).
    landed: Option<Instant>,
    /// The last read since then that still showed that version.
    missed: Option<Instant>,
}

impl Forecast {
    /// A peer's version first read, by a read sent at `asked`: when that
    /// version landed is not known, the next one lands after `asked`.
    pub(super) fn first(sent_at_ms: u64, asked: Instant) -> Self {
        Self {
            sent_at_ms,
            cadence: None,
            last_step: None,
            landed: None,
            missed: Some(asked),
        }
    }

    /// A read sent at `asked` showed the version already seen: the next
    /// lands after `asked` (not after the answer came: a renewal may land
    /// while a slow read is under way).
    pub(super) fn missed(&mut self, asked: Instant) {
        self.missed = Some(asked);
    }

    /// A read at `now` showed a newer version, `moved` versions on, stamped
    /// `sent_at_ms`; `usual` is this worker's heartbeat.
    pub(super) fn renewed(&mut self, moved: u64, sent_at_ms: u64, now: Instant, usual: Duration) {
        let cadence = self.cadence(usual);
        // Past a few skipped renewals (or a corrupt version) the forecast
        // says nothing; the read's own time stands in.
        let forecast = self
            .landed
            .filter(|_| moved <= MAX_FORECAST_STEPS)
            .map(|l| l + cadence * moved as u32);
        self.landed = Some(match (self.missed.take(), forecast) {
            // It landed after the last read that did not show it.
            (Some(missed), _) => missed,
            // No read missed it: it landed at or before this one, maybe
            // earlier than forecast.
            (None, forecast) => {
                let at = forecast.map_or(now, |f| f.min(now));
                at.checked_sub(cadence / PROBE).unwrap_or(at)
            }
        });
        // Versions count attempts: only one step apart is one cadence.
        if moved == 1 && self.sent_at_ms > 0 && sent_at_ms > self.sent_at_ms {
            let step = Duration::from_millis(sent_at_ms - self.sent_at_ms).max(MIN_CADENCE);
            let before = self.last_step.replace(step).unwrap_or(step);
            self.cadence = Some(step.max(before));
        }
        self.sent_at_ms = sent_at_ms;
    }

    /// When the next renewal should have landed: one cadence after the last
    /// (`None`: at once).
    pub(super) fn next_read_at(&self, usual: Duration) -> Option<Instant> {
        self.landed.map(|l| l + self.cadence(usual))
    }

    fn cadence(&self, usual: Duration) -> Duration {
        self.cadence.map_or(usual, |c| c.min(usual))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEARTBEAT: Duration = Duration::from_secs(4);

    #[test]
    fn an_estimate_running_late_is_caught_up_on_without_a_miss() {
        // Version k lands at t0 + 4 s·k. A stale read 900 ms after version
        // 1 landed still showed version 0 and passed for a miss, so the
        // estimate runs 900 ms late, and each renewal after it shows at the
        // first read: the estimate moves earlier until a read misses again.
        let t0 = Instant::now();
        let lands = |k: u32| t0 + HEARTBEAT * k;
        let mut f = Forecast::first(0, lands(1) + Duration::from_millis(900));
        f.renewed(1, 4_000, lands(1) + Duration::from_secs(1), HEARTBEAT);
        for k in 2..10u32 {
            let read_at = f.next_read_at(HEARTBEAT).unwrap();
            if read_at < lands(k) {
                // 900 ms late, 250 ms earlier at each renewal shown at
                // once: four renewals (2 to 5) make up for it.
                assert!(k <= 6, "caught up only at renewal {k}");
                return;
            }
            f.renewed(1, 4_000 * u64::from(k), read_at, HEARTBEAT);
        }
        panic!("the estimate never came back before the renewals");
    }

    #[test]
    fn the_cadence_comes_from_consecutive_stamps_only_and_never_exceeds_the_heartbeat() {
        let t0 = Instant::now();
        let mut f = Forecast::first(10_000, t0);
        assert_eq!(f.next_read_at(HEARTBEAT), None, "first seen: read at once");
        f.renewed(1, 12_000, t0 + Duration::from_millis(100), HEARTBEAT);
        assert_eq!(
            f.next_read_at(HEARTBEAT),
            Some(t0 + Duration::from_secs(2)),
            "a peer renewing every 2 s is read 2 s after the last miss"
        );
        // A failed attempt between two renewals: the gap is not a cadence.
        let at = t0 + Duration::from_secs(3);
        f.missed(at);
        f.renewed(2, 13_000, at + Duration::from_millis(100), HEARTBEAT);
        assert_eq!(f.next_read_at(HEARTBEAT), Some(at + Duration::from_secs(2)));
        // One short gap (a renewal retried 600 ms after an error that had
        // landed) does not shorten it; two in a row do.
        let at = t0 + Duration::from_secs(4);
        f.missed(at);
        f.renewed(1, 13_600, at + Duration::from_millis(100), HEARTBEAT);
        assert_eq!(f.next_read_at(HEARTBEAT), Some(at + Duration::from_secs(2)));
        let at = t0 + Duration::from_secs(5);
        f.missed(at);
        f.renewed(1, 14_200, at + Duration::from_millis(100), HEARTBEAT);
        assert_eq!(
            f.next_read_at(HEARTBEAT),
            Some(at + Duration::from_millis(600))
        );
        // A peer whose stamps step an hour forward (or that renews every
        // hour): read one heartbeat on, early rather than late.
        let at = t0 + Duration::from_secs(6);
        f.missed(at);
        f.renewed(
            1,
            14_200 + 3_600_000,
            at + Duration::from_millis(100),
            HEARTBEAT,
        );
        assert_eq!(f.next_read_at(HEARTBEAT), Some(at + HEARTBEAT));
        // Renewals skipped past what a forecast reaches: the read's time
        // stands in, less the probe.
        let at = t0 + Duration::from_secs(7);
        f.renewed(MAX_FORECAST_STEPS + 1, 99_000_000, at, HEARTBEAT);
        assert_eq!(
            f.next_read_at(HEARTBEAT),
            Some(at - HEARTBEAT / PROBE + HEARTBEAT)
        );
    }
}
