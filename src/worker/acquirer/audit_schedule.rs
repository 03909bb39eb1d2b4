//! When the audit of a worker's own partitions is due, its tick (the
//! sweep's share) and the roster's look: see `audit` for why the audit
//! follows the change counter.

use super::quiet_state::{BUSY_AT_LEAST, BUSY_HEARTBEATS};
use crate::worker::settings::{AUDIT_HEARTBEATS, QUIET_AUDIT_HEARTBEATS};
use std::time::Duration;
use tokio::time::Instant;

/// When the audit, the sweep and the roster are next due.
#[derive(Debug)]
pub(super) struct AuditSchedule {
    /// Where the last tick's periods end (every [`AUDIT_HEARTBEATS`];
    /// [`QUIET_AUDIT_HEARTBEATS`] while taking over): the sweep.
    last_tick: Instant,
    /// The roster's last look (every [`AUDIT_HEARTBEATS`], taking over or
    /// not: it is the only way to find an incarnation whose worker item
    /// vanished, and costs one read).
    last_roster: Instant,
    /// Ticks so far: which share of the held streams the next sweep re-reads.
    ticks: u64,
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
    /// The sweep's turn numbers (one per period since the last tick), at a
    /// tick.
    pub(super) tick: Option<std::ops::RangeInclusive<u64>>,
    /// Look for enrolled incarnations the fleet does not list.
    pub(super) roster: bool,
}

impl AuditSchedule {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            last_tick: now,
            last_roster: now,
            ticks: 0,
            last_audit: now,
            owed: false,
        }
    }

    /// What is due at `now`: `requested` when a holder asked for an audit
    /// (its task ended), `moved_at` when this worker last saw the change
    /// counter move, `counter_covers` whether every writer moves it (not
    /// while a worker of an earlier release is LIVE or version 1's index
    /// exists: a rolling upgrade, when the counter cannot be waited for),
    /// `taking_over` while this worker's passes find orphans.
    ///
    /// While taking over, ticks (and the audits they bring) come every
    /// [`QUIET_AUDIT_HEARTBEATS`] instead of every [`AUDIT_HEARTBEATS`]:
    /// the counter then moves with every acquire, which is no sign of a lost
    /// notification, and a tick's work (a read of every held item's index
    /// entry, a share of the held items re-read) competes with the takeover
    /// for the store and the CPU: 7% of a failover's CPU with 100,000
    /// streams on 20 simulated workers. Nothing waits longer
    /// than a quiet worker's audit would, and a deferred tick carries the
    /// sweep's shares of every period it waited.
    pub(super) fn due(
        &mut self,
        now: Instant,
        heartbeat: Duration,
        requested: bool,
        moved_at: Option<Instant>,
        counter_covers: bool,
        taking_over: bool,
    ) -> AuditDue {
        let tick_heartbeats = if taking_over {
            QUIET_AUDIT_HEARTBEATS
        } else {
            AUDIT_HEARTBEATS
        };
        let period = heartbeat * AUDIT_HEARTBEATS;
        let since = now.duration_since(self.last_tick);
        // A deferred tick stands for every whole period it waited (the
        // rest counts towards the next): the sweep re-reads all their
        // shares, so its period holds whatever was deferred. No more than a
        // deferral makes: passes that stopped (a store down for minutes) do
        // not bring every held item's re-read at once when they resume.
        let tick = (since >= heartbeat * tick_heartbeats).then(|| {
            let most = QUIET_AUDIT_HEARTBEATS / AUDIT_HEARTBEATS;
            let whole = since.as_nanos() / period.as_nanos().max(1);
            let periods = whole.clamp(1, u128::from(most)) as u32;
            self.last_tick = if whole > u128::from(most) {
                now
            } else {
                self.last_tick + period * periods
            };
            let first = self.ticks + 1;
            self.ticks += u64::from(periods);
            first..=self.ticks
        });
        let roster = now.duration_since(self.last_roster) >= period;
        if roster {
            self.last_roster = now;
        }
        // A move seen within the index's lag before the last audit may not
        // have been in what it read: the next tick audits again.
        let lag = (heartbeat * BUSY_HEARTBEATS).max(BUSY_AT_LEAST);
        let moved = moved_at.is_some_and(|m| m + lag > self.last_audit);
        let quiet_due = now.duration_since(self.last_audit) >= heartbeat * QUIET_AUDIT_HEARTBEATS;
        let at_tick = tick.is_some() && (moved || self.owed || !counter_covers);
        let audit = requested || at_tick || quiet_due;
        if audit {
            self.last_audit = now;
            self.owed = false;
        }
        AuditDue {
            audit,
            tick,
            roster,
        }
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
    fn a_worker_taking_over_orphans_ticks_and_audits_as_seldom_as_a_quiet_one() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut s = AuditSchedule::new(t0);
        // The counter moves all the time (every acquire moves it).
        let mut ticks = Vec::new();
        let mut audits = Vec::new();
        let mut turns = Vec::new();
        let mut looks = 0;
        for quarter in 1..=4 * 150 {
            let now = t0 + Duration::from_millis(250 * quarter);
            let taking_over = now < at(100);
            let d = s.due(now, HEARTBEAT, false, Some(now), true, taking_over);
            if let Some(tick) = d.tick {
                ticks.push(now.duration_since(t0).as_secs());
                turns.extend(tick);
            }
            if d.audit {
                audits.push(now.duration_since(t0).as_secs());
            }
            looks += usize::from(d.roster);
        }
        // Every 64 s while taking over; from the first pass after it, the
        // periods' ends every 16 s again.
        assert_eq!(ticks, [64, 100, 112, 128, 144]);
        assert_eq!(audits, ticks, "the moving counter audits at every tick");
        // The sweep's turns of the deferred periods are not skipped: as
        // many as in 150 s of ticks every 16 s.
        assert_eq!(turns, (1..=9).collect::<Vec<u64>>());
        // The roster is looked at every 16 s throughout.
        assert_eq!(looks, 9);
        // A requested audit still runs at once.
        let mut s = AuditSchedule::new(t0);
        assert!(s.due(at(1), HEARTBEAT, true, None, true, true).audit);
        // Passes that stopped for ten minutes carry no more than a deferral,
        // and the next tick is a period after the pass that resumed.
        let d = s.due(at(600), HEARTBEAT, false, None, true, false);
        assert_eq!(d.tick, Some(1..=4));
        assert_eq!(
            s.due(at(615), HEARTBEAT, false, None, true, false).tick,
            None
        );
        assert_eq!(
            s.due(at(616), HEARTBEAT, false, None, true, false).tick,
            Some(5..=5)
        );
    }

    #[test]
    fn a_requested_audit_runs_at_once_and_ticks_keep_their_period() {
        let t0 = Instant::now();
        let mut s = AuditSchedule::new(t0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let d = s.due(at(1), HEARTBEAT, true, None, true, false);
        assert_eq!((d.audit, d.tick), (true, None));
        let d = s.due(at(16), HEARTBEAT, false, None, true, false);
        assert_eq!((d.audit, d.tick), (false, Some(1..=1)));
        let d = s.due(at(32), HEARTBEAT, false, None, true, false);
        assert_eq!((d.audit, d.tick), (false, Some(2..=2)));
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
