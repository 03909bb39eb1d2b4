//! Watching peers' heartbeats on this worker's monotonic clock.
//!
//! A peer is overdue when its `heartbeat_version` has not moved for a whole
//! lease since this worker first saw that version. The peer fenced itself
//! `fence_margin` before that (its fence runs from when it *sent* the renewal,
//! which is before anyone could read it), so declaring it dead then is safe
//! whatever the wall clocks say. The declaration is a conditional write on the
//! version watched, so a renewal that lands first wins.
//!
//! It also says when a quiet worker next reads a watched peer: just after its
//! next renewal lands, by the peer's own stamps (`renewal_forecast`).

use super::renewal_forecast::Forecast;
use crate::lease::{Incarnation, WorkerRecord};
use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;

/// The soonest a quiet worker wakes again for a watched peer's read.
const EARLIEST_WAKE: Duration = Duration::from_millis(25);

#[derive(Clone, Debug)]
struct Seen {
    version: u64,
    since: Instant,
    forecast: Forecast,
}

/// Versions seen per peer, and since when.
#[derive(Debug)]
pub(super) struct Observer {
    lease: Duration,
    /// This worker's heartbeat: a peer's cadence until its stamps tell.
    heartbeat: Duration,
    seen: HashMap<Incarnation, Seen>,
}

impl Observer {
    pub(super) fn new(lease: Duration, heartbeat: Duration) -> Self {
        Self {
            lease,
            heartbeat,
            seen: HashMap::new(),
        }
    }

    /// Records a read of a peer's item sent at `asked` and answered at
    /// `now`: a version first shown counts from `now` (it was surely sent
    /// before), a version shown again bounds the next from `asked`.
    pub(super) fn observe(&mut self, peer: &WorkerRecord, asked: Instant, now: Instant) {
        let Some(seen) = self.seen.get_mut(&peer.incarnation) else {
            let seen = Seen {
                version: peer.heartbeat_version,
                since: now,
                forecast: Forecast::first(peer.heartbeat_at_ms, asked),
            };
            self.seen.insert(peer.incarnation.clone(), seen);
            return;
        };
        match peer.heartbeat_version.cmp(&seen.version) {
            std::cmp::Ordering::Greater => {
                let moved = peer.heartbeat_version - seen.version;
                let sent = peer.heartbeat_at_ms;
                seen.forecast.renewed(moved, sent, now, self.heartbeat);
                seen.version = peer.heartbeat_version;
                seen.since = now;
            }
            // A stale read (an older version) counts as a miss: it says
            // nothing of the version, and the next read comes a retry later.
            std::cmp::Ordering::Equal | std::cmp::Ordering::Less => seen.forecast.missed(asked),
        }
    }

    /// Whether a quiet pass should read `peer` now: never read, or its next
    /// renewal should have landed (and, until it shows, a retry after each
    /// read that did not show it).
    pub(super) fn due(&self, peer: &Incarnation, now: Instant) -> bool {
        self.seen.get(peer).is_none_or(|s| {
            s.forecast
                .next_read_at(self.heartbeat)
                .is_none_or(|at| now >= at)
        })
    }

    /// When one of `peers` (each read before) is next due: a quiet worker
    /// wakes for it rather than waiting for its next pass. A read that fell
    /// due while a pass was busy is due [`EARLIEST_WAKE`] after `now` (the
    /// end of that pass), so no schedule can make a worker spin.
    pub(super) fn next_due(&self, peers: &[Incarnation], now: Instant) -> Option<Instant> {
        peers
            .iter()
            .filter_map(|p| self.seen.get(p))
            .filter_map(|s| s.forecast.next_read_at(self.heartbeat))
            .map(|at| at.max(now + EARLIEST_WAKE))
            .min()
    }

    /// Peers whose version stood still for a whole lease, with that version.
    pub(super) fn overdue(&self, now: Instant) -> Vec<(Incarnation, u64)> {
        self.seen
            .iter()
            .filter(|(_, s)| now.duration_since(s.since) >= self.lease)
            .map(|(inc, s)| (inc.clone(), s.version))
            .collect()
    }

    /// Whether a peer's version moved within `within` (a new peer counts as
    /// moving until it has been watched that long).
    pub(super) fn progressing(&self, peer: &Incarnation, now: Instant, within: Duration) -> bool {
        self.seen
            .get(peer)
            .is_none_or(|s| now.duration_since(s.since) < within)
    }

    /// Forgets peers that are no longer LIVE.
    pub(super) fn retain(&mut self, live: impl Fn(&Incarnation) -> bool) {
        self.seen.retain(|inc, _| live(inc));
    }
}

/// The peers after `me` in the ring of live incarnations (sorted by id): the
/// ones this worker watches closely every pass, so every peer is watched by a
/// few others without every worker reading every peer each pass.
pub(super) fn successors(me: &Incarnation, live: &[Incarnation], count: usize) -> Vec<Incarnation> {
    let mut ring: Vec<&Incarnation> = live.iter().filter(|i| *i != me).collect();
    ring.sort();
    let start = ring.iter().position(|i| *i > me).unwrap_or(0);
    ring.iter()
        .cycle()
        .skip(start)
        .take(count.min(ring.len()))
        .map(|i| (*i).clone())
        .collect()
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::lease::WorkerState;

    /// A LIVE peer's item at `version`, of this release.
    pub(in crate::worker::acquirer) fn record(inc: &Incarnation, version: u64) -> WorkerRecord {
        WorkerRecord {
            announces_changes: true,
            incarnation: inc.clone(),
            state: WorkerState::Live,
            heartbeat_version: version,
            heartbeat_at_ms: 0,
            alive_until_ms: 0,
            held: 0,
            started_at_ms: 0,
            released_at_ms: None,
            pod: None,
            checkpoint_shards: 0,
            slot_pages: Vec::new(),
            reads_slots: true,
            changed_streams: Vec::new(),
            poke_addr: None,
            pokes_peers: true,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_is_overdue_only_after_a_whole_lease_without_progress() {
        let peer = Incarnation::new("p");
        let mut o = Observer::new(Duration::from_secs(8), Duration::from_secs(4));
        o.observe(&record(&peer, 3), Instant::now(), Instant::now());
        tokio::time::advance(Duration::from_secs(5)).await;
        o.observe(&record(&peer, 3), Instant::now(), Instant::now());
        assert!(o.overdue(Instant::now()).is_empty());
        // It renewed: the watch starts over from this read.
        o.observe(&record(&peer, 4), Instant::now(), Instant::now());
        tokio::time::advance(Duration::from_secs(7)).await;
        assert!(o.overdue(Instant::now()).is_empty());
        // A stale read of an older version does not reset or confuse it.
        o.observe(&record(&peer, 2), Instant::now(), Instant::now());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(o.overdue(Instant::now()), vec![(peer.clone(), 4)]);
        assert!(!o.progressing(&peer, Instant::now(), Duration::from_secs(4)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_watched_peer_is_read_when_its_next_renewal_is_due_and_again_after_each_miss() {
        use crate::worker::acquirer::renewal_forecast::RETRY_AFTER_MISS;
        let peer = Incarnation::new("p");
        let heartbeat = Duration::from_secs(4);
        let mut o = Observer::new(Duration::from_secs(8), heartbeat);
        let watched = [peer.clone()];
        assert!(o.due(&peer, Instant::now()), "a peer never read is due");
        o.observe(&record(&peer, 1), Instant::now(), Instant::now());
        // When version 1 landed is not known: read again a retry later.
        assert!(!o.due(&peer, Instant::now()));
        assert_eq!(
            o.next_due(&watched, Instant::now()),
            Some(Instant::now() + RETRY_AFTER_MISS)
        );
        tokio::time::advance(RETRY_AFTER_MISS).await;
        o.observe(&record(&peer, 1), Instant::now(), Instant::now());
        tokio::time::advance(RETRY_AFTER_MISS).await;
        o.observe(&record(&peer, 2), Instant::now(), Instant::now());
        let shown = Instant::now();
        // Version 3 is due a heartbeat after the read that showed version 2.
        assert!(!o.due(&peer, shown + heartbeat - Duration::from_millis(1)));
        assert!(o.due(&peer, shown + heartbeat));
        assert_eq!(o.next_due(&watched, shown), Some(shown + heartbeat));
        // Read then and not renewed yet: due again a retry after that read.
        tokio::time::advance(heartbeat).await;
        o.observe(&record(&peer, 2), Instant::now(), Instant::now());
        assert!(!o.due(
            &peer,
            Instant::now() + RETRY_AFTER_MISS - Duration::from_millis(1)
        ));
        assert!(o.due(&peer, Instant::now() + RETRY_AFTER_MISS));
        // The death verdict still runs a whole lease from the read that
        // first showed the last version.
        assert!(o.overdue(shown + Duration::from_millis(7_999)).is_empty());
        assert_eq!(
            o.overdue(shown + Duration::from_secs(8)),
            vec![(peer.clone(), 2)]
        );
    }

    /// A peer renewing every 4 s whose writes land 5–80 ms after they are
    /// sent, watched by passes every 250 ms ± 25% that read it when due, and
    /// by wake-ups at the time a read falls due between passes (as
    /// `acquire_loop` does); each read takes 2–40 ms and is served at a
    /// random point of it, and one in `stale_one_in` reads still shows the
    /// version before one that landed within the last second. Returns how
    /// late each renewal was first shown after it landed, and the reads made.
    fn simulate(renewals: u32, stale_one_in: u32, seed: u64) -> (Vec<Duration>, u32) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let heartbeat = Duration::from_secs(4);
        let peer = Incarnation::new("p");
        let mut o = Observer::new(Duration::from_secs(8), heartbeat);
        let start = Instant::now();
        let landed: Vec<Instant> = (0..=renewals)
            .map(|v| start + heartbeat * v + Duration::from_millis(rng.random_range(5..80)))
            .collect();
        let ms = |d: Duration| d.as_millis() as u64;
        let mut now = landed[0];
        let (mut shown, mut lateness, mut reads) = (0u32, Vec::new(), 0u32);
        let mut next_pass = now;
        let watched = [peer.clone()];
        while (shown as usize) < renewals as usize {
            if next_pass <= now {
                next_pass = now + Duration::from_millis(250).mul_f64(rng.random_range(0.75..1.25));
            }
            now = o
                .next_due(&watched, now)
                .map_or(next_pass, |due| due.min(next_pass));
            if !o.due(&peer, now) {
                continue;
            }
            reads += 1;
            let took = Duration::from_millis(rng.random_range(2..40));
            let served = now + took.mul_f64(rng.random_range(0.0..1.0));
            let answered = now + took;
            let newest = (0..=renewals).rev().find(|v| landed[*v as usize] <= served);
            let Some(mut version) = newest else { continue };
            let fresh = served - landed[version as usize] < Duration::from_secs(1);
            if version > 0 && fresh && rng.random_range(0..stale_one_in) == 0 {
                version -= 1;
            }
            let item = WorkerRecord {
                heartbeat_at_ms: 1_000_000 + ms(heartbeat * version),
                ..record(&peer, u64::from(version))
            };
            o.observe(&item, now, answered);
            if version > shown {
                lateness.push(answered - landed[version as usize]);
                shown = version;
            }
            now = answered;
        }
        (lateness, reads)
    }

    #[tokio::test(start_paused = true)]
    async fn each_renewal_is_first_read_within_a_retry_of_landing_about_1_4_times_per_renewal() {
        // A retry after a miss, the spread of write and read latency, and a
        // probe (until 0.4, reads at passes: 366 ms at worst, 1.8 reads
        // per renewal).
        let bound = Duration::from_millis(300);
        for seed in 0..20 {
            let (lateness, reads) = simulate(200, u32::MAX, seed);
            assert_eq!(lateness.len(), 200, "seed {seed}: a renewal was skipped");
            let worst = lateness.iter().max().unwrap();
            assert!(
                *worst <= bound,
                "seed {seed}: a renewal was first read {worst:?} after it landed"
            );
            assert!(reads <= 320, "seed {seed}: {reads} reads for 200 renewals");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn stale_reads_cost_a_renewal_a_pass_or_so_and_the_schedule_recovers() {
        // One read in ten stale (far more than DynamoDB's eventually
        // consistent reads): a stale read costs its renewal a pass, and,
        // passing for a miss, makes the estimate late by up to its staleness
        // (1 s here), which the probe then catches up on.
        let pass = Duration::from_millis(250).mul_f64(1.25);
        let spread = Duration::from_millis(75 + 40);
        for seed in 0..20 {
            let (mut lateness, reads) = simulate(200, 10, seed);
            lateness.sort();
            let (p90, worst) = (lateness[179], lateness[199]);
            assert!(p90 <= pass * 2 + spread, "seed {seed}: p90 {p90:?}");
            assert!(
                worst <= Duration::from_secs(1) + pass + spread,
                "seed {seed}: worst {worst:?}"
            );
            assert!(reads <= 320, "seed {seed}: {reads} reads for 200 renewals");
        }
    }

    #[test]
    fn every_peer_is_watched_by_its_predecessors_in_the_ring() {
        let ids: Vec<Incarnation> = (0..5)
            .map(|i| Incarnation::parse(&format!("w{i}~{i}")).unwrap())
            .collect();
        let watched = successors(&ids[4], &ids, 2);
        assert_eq!(
            watched,
            vec![ids[0].clone(), ids[1].clone()],
            "wraps around"
        );
        assert_eq!(
            successors(&ids[1], &ids, 2),
            vec![ids[2].clone(), ids[3].clone()]
        );
        assert_eq!(successors(&ids[0], &ids[..1], 2), Vec::<Incarnation>::new());
    }
}
