//! When a watched peer's next renewal can first be read, so a quiet worker
//! reads each watched peer about 1.3 times per renewal, just after it lands,
//! instead of at every watch read.
//!
//! Why: reading two peers' items every 500 ms was most of a quiet worker's
//! read bill (eight reads of each peer per 4 s heartbeat), and it found a
//! renewal up to 500 ms late. A peer sends a renewal every heartbeat, timed
//! from its last send. So this worker reads a peer one cadence after the
//! read that first showed its last renewal, on its own monotonic clock. The
//! quiet worker wakes for that read instead of waiting for its next pass
//! (`acquire_loop`). If the read still shows the old version (a *miss*),
//! the peer is read again [`RETRY_AFTER_MISS`] after it was sent (twice
//! that from the [`MISSES_BEFORE_BACKOFF`]th miss in a row), until the new
//! one shows. A renewal that shows at the first read (or after a miss older
//! than [`BRACKET`]) moves the next read [`PROBE`] of a cadence earlier than
//! forecast, so an estimate running late is caught up on, until a read
//! misses; the retry after a miss then brackets the landing within
//! [`BRACKET`].
//!
//! Until 0.4 the estimate was the last miss (a lower bound) and reads came
//! at passes (250 ms ± 25%): the read at the forecast came before the
//! renewal nearly every time, so each renewal cost about 1.8 reads, and was
//! first read up to a pass late (366 ms at worst in the model of
//! `overdue::tests`, 143 ms at the median). Now about 1.3 reads, 291 ms at
//! worst and 94 ms at the median in the same model.
//!
//! A read counts as a miss from when it was sent. A stale eventually
//! consistent read (the last version after the next one landed, or an older
//! version) passes for a miss; what it costs is a retry, and an estimate
//! late by up to a retry plus its staleness, caught up on by the probe (a
//! second in 25 renewals).
//!
//! A peer first seen has no bound on its last renewal: it is read as after
//! a miss until its next renewal shows.
//!
//! The cadence is the larger of the last two gaps between consecutive
//! stamps (`heartbeat_at_ms`, the peer's clock; only differences are used),
//! capped at this worker's heartbeat: a peer with a longer heartbeat is
//! read early and then as after misses until it renews, never late. So is
//! a dead peer until it is overdue, and every peer in a write brownout: no
//! faster than every pass, as until 0.4, once half a second late.
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
/// share of a cadence earlier than forecast (42 ms at 4 s).
const PROBE: u32 = 96;
/// After a read that still showed the last version, the next read this
/// long after it was sent (rather than at the next pass, 250 ms ± 25%).
pub(super) const RETRY_AFTER_MISS: Duration = Duration::from_millis(125);
/// From this many misses in a row, reads come twice [`RETRY_AFTER_MISS`]
/// apart (a pass, as until 0.4): a peer renewing late, dead, or with a
/// longer heartbeat than this worker's, and every watcher in a write
/// brownout, is not read faster than before.
const MISSES_BEFORE_BACKOFF: u32 = 4;
/// A read that showed a renewal brackets its landing with the last miss
/// only if that miss was this recent (a retry and a read's time); an older
/// miss (a read a heartbeat before, a retry that failed) is a lower bound
/// only.
const BRACKET: Duration = Duration::from_millis(250);

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
    /// When the version last seen was first shown, the upper end of when it
    /// landed (less the probe when no read missed it); `None` while unknown
    /// (first seen: read every [`RETRY_AFTER_MISS`] until the next renewal
    /// shows).
    landed: Option<Instant>,
    /// The last read since then that still showed that version.
    missed: Option<Instant>,
    /// Reads since then that still showed it.
    misses: u32,
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
            misses: 0,
        }
    }

    /// A read sent at `asked` showed the version already seen: the next
    /// lands after `asked` (not after the answer came: a renewal may land
    /// while a slow read is under way).
    pub(super) fn missed(&mut self, asked: Instant) {
        self.missed = Some(asked);
        self.misses += 1;
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
        self.misses = 0;
        self.landed = Some(match (self.missed.take(), forecast) {
            // It landed after the last read that did not show it, at most
            // [`BRACKET`] before this one: the next is read a cadence after
            // this read, when it has most likely landed.
            (Some(missed), _) if now.saturating_duration_since(missed) <= BRACKET => now,
            // No read missed it lately: it landed at or before this one (and
            // after that old miss), maybe earlier than forecast.
            (missed, forecast) => {
                let at = forecast.map_or(now, |f| f.min(now));
                let at = missed.map_or(at, |m| at.max(m));
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

    /// When to read next: one cadence after the last renewal was first
    /// shown, and, once a read missed it, [`RETRY_AFTER_MISS`] after that
    /// read (`None`: never read).
    pub(super) fn next_read_at(&self, usual: Duration) -> Option<Instant> {
        let forecast = self.landed.map(|l| l + self.cadence(usual));
        let retry = if self.misses >= MISSES_BEFORE_BACKOFF {
            RETRY_AFTER_MISS * 2
        } else {
            RETRY_AFTER_MISS
        };
        let retry = self.missed.map(|m| m + retry);
        match (forecast, retry) {
            (Some(f), Some(r)) => Some(f.max(r)),
            (f, r) => f.or(r),
        }
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
    fn a_renewal_is_read_a_cadence_after_the_last_showed_and_a_retry_after_each_miss() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut f = Forecast::first(0, t0);
        assert_eq!(f.next_read_at(HEARTBEAT), Some(t0 + RETRY_AFTER_MISS));
        f.missed(t0 + ms(125));
        assert_eq!(f.next_read_at(HEARTBEAT), Some(t0 + ms(250)));
        // Shown: the next renewal is read a cadence after this read.
        f.renewed(1, 4_000, t0 + ms(260), HEARTBEAT);
        let due = t0 + ms(260) + HEARTBEAT;
        assert_eq!(f.next_read_at(HEARTBEAT), Some(due));
        // Not renewed yet at that read: read again a retry after it.
        f.missed(due);
        assert_eq!(f.next_read_at(HEARTBEAT), Some(due + RETRY_AFTER_MISS));
        f.renewed(1, 8_000, due + ms(130), HEARTBEAT);
        let due = due + ms(130) + HEARTBEAT;
        assert_eq!(f.next_read_at(HEARTBEAT), Some(due));
        // Shown at the first read: the next read comes a probe earlier.
        f.renewed(1, 12_000, due, HEARTBEAT);
        assert_eq!(
            f.next_read_at(HEARTBEAT),
            Some(due + HEARTBEAT - HEARTBEAT / PROBE)
        );
    }

    #[test]
    fn an_estimate_running_late_is_caught_up_on_without_a_miss() {
        // Version k lands at t0 + 4 s·k. A stale read 900 ms after version
        // 1 landed still showed version 0 and passed for a miss, so the
        // estimate runs a second late, and each renewal after it shows at
        // the first read: the estimate moves earlier until a read misses.
        let t0 = Instant::now();
        let lands = |k: u32| t0 + HEARTBEAT * k;
        let mut f = Forecast::first(0, lands(1) + Duration::from_millis(900));
        f.renewed(1, 4_000, lands(1) + Duration::from_secs(1), HEARTBEAT);
        for k in 2..40u32 {
            let read_at = f.next_read_at(HEARTBEAT).unwrap();
            if read_at < lands(k) {
                // A second late, 42 ms earlier at each renewal shown at
                // once: 25 renewals (2 to 26) make up for it.
                assert!(k <= 27, "caught up only at renewal {k}");
                return;
            }
            f.renewed(1, 4_000 * u64::from(k), read_at, HEARTBEAT);
        }
        panic!("the estimate never came back before the renewals");
    }

    #[test]
    fn the_cadence_comes_from_consecutive_stamps_only_and_never_exceeds_the_heartbeat() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut f = Forecast::first(10_000, t0);
        f.renewed(1, 12_000, t0 + ms(100), HEARTBEAT);
        assert_eq!(
            f.next_read_at(HEARTBEAT),
            Some(t0 + ms(100) + Duration::from_secs(2)),
            "a peer renewing every 2 s is read 2 s after the read that showed it"
        );
        // A failed attempt between two renewals: the gap is not a cadence.
        let at = t0 + Duration::from_secs(3);
        f.missed(at);
        f.renewed(2, 13_000, at + ms(100), HEARTBEAT);
        assert_eq!(
            f.next_read_at(HEARTBEAT),
            Some(at + ms(100) + Duration::from_secs(2))
        );
        // One short gap (a renewal retried 600 ms after an error that had
        // landed) does not shorten it; two in a row do.
        let at = t0 + Duration::from_secs(4);
        f.missed(at);
        f.renewed(1, 13_600, at + ms(100), HEARTBEAT);
        assert_eq!(
            f.next_read_at(HEARTBEAT),
            Some(at + ms(100) + Duration::from_secs(2))
        );
        let at = t0 + Duration::from_secs(5);
        f.missed(at);
        f.renewed(1, 14_200, at + ms(100), HEARTBEAT);
        assert_eq!(f.next_read_at(HEARTBEAT), Some(at + ms(700)));
        // A peer whose stamps step an hour forward (or that renews every
        // hour): read one heartbeat on, early rather than late.
        let at = t0 + Duration::from_secs(6);
        f.missed(at);
        f.renewed(1, 14_200 + 3_600_000, at + ms(100), HEARTBEAT);
        assert_eq!(f.next_read_at(HEARTBEAT), Some(at + ms(100) + HEARTBEAT));
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
