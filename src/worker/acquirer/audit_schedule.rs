//! When the audit of a worker's own partitions is due, and its tick (the
//! sweep's share and the roster's look): see `audit` for why the audit
//! follows the change counter.

use super::quiet_state::{BUSY_AT_LEAST, BUSY_HEARTBEATS};
use crate::worker::settings::{AUDIT_HEARTBEATS, QUIET_AUDIT_HEARTBEATS};
use std::time::Duration;
use tokio::time::Instant;

/// When the audit, the sweep and the roster are next due.
#[derive(Debug)]
pub(super) struct AuditSchedule {
    /// The last tick (every [`AUDIT_HEARTBEATS`]): the sweep and the roster.
    last_tick: Instant,
    /// Shares swept so far: which share of the held streams the next
    /// sweep re-reads.
    shares: u64,
    /// Ticks in a row whose share waited for a takeover to end.
    shares_waited: u32,
    /// The last audit of the partitions.
    last_audit: Instant,
    /// An audit failed: the next tick audits again.
    owed: bool,
}

/// What a pass does of the audit's work.
#[derive(Debug)]
pub(super) struct AuditDue {
    /// Read the partitions back.
    pub(super) audit: bool,
    /// The roster's look, at a tick.
    pub(super) tick: bool,
    /// The sweep's share number, at a tick not spent taking over (or at
    /// the last of [`SWEEP_WAIT_TICKS`] in a row that were).
    pub(super) sweep: Option<u64>,
}

/// Most ticks in a row a takeover holds the sweep's share back: a worker
/// taking orphans over without end (streams that keep failing back to the
/// pool) still sweeps every fourth tick, so every held item is re-read
/// within four sweep cycles.
pub(super) const SWEEP_WAIT_TICKS: u32 = 4;

impl AuditSchedule {
    /// A schedule whose first tick is one tick period after `now`.
    pub(super) fn new(now: Instant) -> Self {
        Self {
            last_tick: now,
            shares: 0,
            shares_waited: 0,
            last_audit: now,
            owed: false,
        }
    }

    /// A schedule whose ticks fall at a random phase: workers started
    /// together (a cold start, a fleet rolled at once) would otherwise tick
    /// together for good, and each tick's sweep is a GetItem per 32nd held
    /// stream: 2,800 at once every 16 s with 100,000 streams on 20 workers.
    pub(super) fn at_random_phase(now: Instant, heartbeat: Duration) -> Self {
        let period = heartbeat * AUDIT_HEARTBEATS;
        let into = period.mul_f64(rand::random::<f64>());
        let mut schedule = Self::new(now);
        schedule.last_tick = now.checked_sub(into).unwrap_or(now);
        schedule
    }

    /// What is due at `now`: `requested` when a holder asked for an audit
    /// (its task ended), `moved_at` when this worker last saw the change
    /// counter move, `counter_covers` whether every writer moves it (not
    /// while a worker of an earlier release is LIVE or version 1's index
    /// exists: a rolling upgrade, when the counter cannot be waited for),
    /// `taking_over` while this worker takes orphans over.
    ///
    /// While taking over, the audit waits for [`QUIET_AUDIT_HEARTBEATS`]
    /// (or a holder's request): the counter then moves with every acquire,
    /// which is no sign of a lost notification, and an audit reads every
    /// held stream's index entry while the takeover needs the store and
    /// the CPU (7% of a failover's CPU with 100,000 streams on 20 simulated
    /// workers). The sweep's share waits too (up to [`SWEEP_WAIT_TICKS`]):
    /// it is a GetItem per 32nd held stream, 156 at 5,000 streams a worker,
    /// a sixth of a failover's requests with 100,000 streams. It is held
    /// back, not skipped: the next tick sweeps the share that waited, so
    /// the cycle stretches by the takeover and no two shares fall due
    /// together. The roster's look keeps the tick's period: one query.
    pub(super) fn due(
        &mut self,
        now: Instant,
        heartbeat: Duration,
        requested: bool,
        moved_at: Option<Instant>,
        counter_covers: bool,
        taking_over: bool,
    ) -> AuditDue {
        let tick = now.duration_since(self.last_tick) >= heartbeat * AUDIT_HEARTBEATS;
        if tick {
            self.last_tick = now;
        }
        let sweep = if !tick {
            None
        } else if taking_over && self.shares_waited + 1 < SWEEP_WAIT_TICKS {
            self.shares_waited += 1;
            None
        } else {
            self.shares_waited = 0;
            self.shares += 1;
            Some(self.shares)
        };
        // A move seen within the index's lag before the last audit may not
        // have been in what it read: the next tick audits again.
        let lag = (heartbeat * BUSY_HEARTBEATS).max(BUSY_AT_LEAST);
        let moved = moved_at.is_some_and(|m| m + lag > self.last_audit);
        let quiet_due = now.duration_since(self.last_audit) >= heartbeat * QUIET_AUDIT_HEARTBEATS;
        let at_tick = tick && !taking_over && (moved || self.owed || !counter_covers);
        let audit = requested || at_tick || quiet_due;
        if audit {
            self.last_audit = now;
            self.owed = false;
        }
        AuditDue { audit, tick, sweep }
    }

    /// The audit just made failed: the next tick audits again (not every
    /// pass: a store that fails is not queried 8 times a pass).
    pub(super) fn failed(&mut self) {
        self.owed = true;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEARTBEAT: Duration = Duration::from_secs(4);

    /// Runs passes every 250 ms from `from` for `span`, the counter last
    /// seen moving at `moved_at`; returns when the partitions were audited.
    fn audits(
        schedule: &mut AuditSchedule,
        from: Instant,
        span: Duration,
        moved_at: Option<Instant>,
    ) -> Vec<Duration> {
        let mut at = Vec::new();
        let mut now = from;
        while now < from + span {
            if schedule
                .due(now, HEARTBEAT, false, moved_at, true, false)
                .audit
            {
                at.push(now.duration_since(from));
            }
            now += Duration::from_millis(250);
        }
        at
    }

    #[test]
    fn a_quiet_worker_audits_every_sixteen_heartbeats_and_after_a_move_every_four() {
        let t0 = Instant::now();
        let mut s = AuditSchedule::new(t0);
        // The first read of the counter counts as a move: audits at the
        // first tick (16 s after it: past the index's lag, so only then).
        let first = audits(&mut s, t0, Duration::from_secs(60), Some(t0));
        assert_eq!(first, [Duration::from_secs(16)]);
        // Nothing moved since: the next audit 16 heartbeats after the last.
        let quiet = audits(
            &mut s,
            t0 + Duration::from_secs(60),
            Duration::from_secs(120),
            Some(t0),
        );
        assert_eq!(
            quiet,
            [Duration::from_secs(20), Duration::from_secs(84)],
            "64 s apart while the counter stands still"
        );
        // A move (ticks at 16 s, 32 s, ... from the start): the next tick
        // audits, and the one after as well when the move was within the
        // index's lag (5 s) before it.
        let t1 = t0 + Duration::from_secs(180);
        let after = audits(&mut s, t1, Duration::from_secs(40), Some(t1));
        assert_eq!(after, [Duration::from_secs(12)], "11 s after the move");
        let t2 = t0 + Duration::from_secs(220);
        let moved = t2 + Duration::from_secs(3);
        let after = audits(&mut s, t2, Duration::from_secs(40), Some(moved));
        assert_eq!(
            after,
            [Duration::from_secs(4), Duration::from_secs(20)],
            "1 s after the move, and a tick later"
        );
    }

    #[test]
    fn a_worker_taking_over_orphans_audits_as_seldom_as_a_quiet_one_and_holds_its_sweep_back() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut s = AuditSchedule::new(t0);
        // The counter moves all the time (every acquire moves it).
        let mut ticks = Vec::new();
        let mut sweeps = Vec::new();
        let mut audits = Vec::new();
        for quarter in 1..=4 * 150 {
            let now = t0 + Duration::from_millis(250 * quarter);
            let taking_over = now < at(100);
            let d = s.due(now, HEARTBEAT, false, Some(now), true, taking_over);
            if d.tick {
                ticks.push(now.duration_since(t0).as_secs());
            }
            if let Some(share) = d.sweep {
                sweeps.push((now.duration_since(t0).as_secs(), share));
            }
            if d.audit {
                audits.push(now.duration_since(t0).as_secs());
            }
        }
        // The roster's look every 16 s throughout.
        assert_eq!(ticks, (1..=9).map(|t| 16 * t).collect::<Vec<u64>>());
        // The sweep's shares wait while taking over, at most three ticks in
        // a row, and are then swept one a tick in order: none skipped, none
        // two at once.
        assert_eq!(sweeps, [(64, 1), (112, 2), (128, 3), (144, 4)]);
        // Audits every 64 s while taking over; from the first tick after
        // it, at every tick again.
        assert_eq!(audits, [64, 112, 128, 144]);
        // A requested audit still runs at once, and a failed one waits too.
        let mut s = AuditSchedule::new(t0);
        assert!(s.due(at(1), HEARTBEAT, true, None, true, true).audit);
        s.failed();
        assert!(!s.due(at(16), HEARTBEAT, false, None, true, true).audit);
        assert!(s.due(at(32), HEARTBEAT, false, None, true, false).audit);
    }

    #[test]
    fn workers_started_together_tick_at_phases_spread_over_the_period() {
        let t0 = Instant::now() + Duration::from_secs(60);
        let period = HEARTBEAT * AUDIT_HEARTBEATS;
        let mut first_ticks = std::collections::BTreeSet::new();
        for _ in 0..40 {
            let mut s = AuditSchedule::at_random_phase(t0, HEARTBEAT);
            let mut now = t0;
            let first = loop {
                now += Duration::from_millis(250);
                if s.due(now, HEARTBEAT, false, None, true, false).tick {
                    break now.duration_since(t0);
                }
            };
            assert!(first <= period, "never later than a period: {first:?}");
            first_ticks.insert(first.as_secs());
        }
        // 40 schedules over 16 whole seconds: all together would be one.
        assert!(
            first_ticks.len() >= 8,
            "first ticks spread over the period: {first_ticks:?}"
        );
    }

    #[test]
    fn a_requested_audit_runs_at_once_and_ticks_keep_their_period() {
        let t0 = Instant::now();
        let mut s = AuditSchedule::new(t0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let d = s.due(at(1), HEARTBEAT, true, None, true, false);
        assert_eq!((d.audit, d.tick, d.sweep), (true, false, None));
        let d = s.due(at(16), HEARTBEAT, false, None, true, false);
        assert_eq!((d.audit, d.tick, d.sweep), (false, true, Some(1)));
        let d = s.due(at(32), HEARTBEAT, false, None, true, false);
        assert_eq!((d.audit, d.tick, d.sweep), (false, true, Some(2)));
    }

    #[test]
    fn a_failed_audit_is_owed_at_the_next_tick_and_an_upgrade_audits_every_tick() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut s = AuditSchedule::new(t0);
        assert!(s.due(at(1), HEARTBEAT, true, None, true, false).audit);
        s.failed();
        let d = s.due(at(2), HEARTBEAT, false, None, true, false);
        assert!(!d.audit, "not every pass");
        assert!(
            s.due(at(16), HEARTBEAT, false, None, true, false).audit,
            "at the next tick"
        );
        assert!(
            !s.due(at(32), HEARTBEAT, false, None, true, false).audit,
            "paid"
        );
        // A writer of an earlier release does not move the counter.
        assert!(s.due(at(48), HEARTBEAT, false, None, false, false).audit);
    }
}
