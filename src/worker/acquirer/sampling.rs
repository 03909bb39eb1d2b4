//! Bounded reads of the partitions orphans sit in (the unowned shards, a
//! departed incarnation's shards): a pass reads about what it may take, not
//! the whole partition, from a random place in it.
//!
//! Why: reading every orphan every pass made a pass O(orphans) per worker,
//! so 100,000 new streams on 20 workers took minutes to acquire, reading two
//! million index items a round; and workers that read a partition from its
//! start all race for the same first items. So a read takes at most
//! [`read_limit`] items (what the pacing lets this worker take from one
//! partition in a second, no more than twice what it has room for) and starts
//! at a random key between the first and the last item seen there, wrapping around to the start: every item is still
//! reachable from any start, and a read that finds fewer than the limit has
//! seen the whole partition, exactly as before.
//!
//! Where the orphans left sit together in a partition's order (after a mass
//! creation, in a store that keeps names in order), workers starting at
//! random places still meet at the same first items after an emptied
//! stretch. So the read widens while this worker's acquires keep losing
//! races (doubling, up to [`MAX_WIDEN`] times, while more than a third were
//! taken by others) and narrows again as they stop.
//!
//! A bounded read is a hint like any read: what it misses is found by a later
//! pass, and every acquire is still one conditional write.

use super::pacing::PARTITION_WRITE_BUDGET;
use rand::Rng;
use std::collections::HashMap;

/// Fewest items a bounded read asks for, whatever the pacing: a few
/// workers racing for one partition still find some left.
const MIN_READ: usize = 32;
/// Most items one read of a partition takes at its narrowest.
const MAX_READ: usize = 2_000;
/// Most a read widens while acquires lose races.
const MAX_WIDEN: usize = 32;

/// Items one read of a partition takes, with `live` workers sharing each
/// partition's write budget and room for `room` more streams: what this
/// worker may take from it in a second (its pacing bucket holds a second's
/// worth), and no more than twice its room (streams it may not take: not
/// STARTED, just released by this worker).
///
/// It was twice the bucket, but a pass leaves a partition it read in
/// part at its first lost race (`pass::Contested`), after about 13 wins
/// when 18 workers took a dead peer's partitions over, so most of a double
/// read went unused, and the items read were the largest cost a takeover
/// had that a cold start did not. A read that keeps losing races widens
/// (`Spread::raced`), which is the slack racing workers need.
pub(super) fn read_limit(live: usize, room: usize) -> usize {
    let per_second = PARTITION_WRITE_BUDGET / live.max(1) as f64;
    (per_second.ceil() as usize)
        .min(room.saturating_mul(2))
        .clamp(MIN_READ, MAX_READ)
}

/// The first and last keys seen in one partition while it had more orphans
/// than one read takes.
#[derive(Clone, Debug, Default)]
pub(super) struct Bounds {
    first: Option<String>,
    last: Option<String>,
}

/// Per partition, where bounded reads pick their start; and how much wider
/// than [`read_limit`] they read.
pub(super) struct Spread {
    bounds: HashMap<String, Bounds>,
    widen: usize,
}

impl Default for Spread {
    fn default() -> Self {
        Self {
            bounds: HashMap::new(),
            widen: 1,
        }
    }
}

impl Spread {
    /// Notes how this pass's acquires went: `won`, `lost` to another
    /// worker that took the stream first, and `skipped` (left untried in a
    /// partition where this pass kept losing races: `Contested`). A pass that skipped any saw
    /// contention its few answered races understate, so it never narrows.
    pub(super) fn raced(&mut self, won: usize, lost: usize, skipped: usize) {
        if lost * 3 > (won + lost) {
            self.widen = (self.widen * 2).min(MAX_WIDEN);
        } else if lost * 10 <= won + lost && won + lost > 0 && skipped == 0 {
            self.widen = (self.widen / 2).max(1);
        }
    }

    /// `limit` as widened by lost races.
    pub(super) fn widened(&self, limit: usize) -> usize {
        limit.saturating_mul(self.widen)
    }

    /// Where the next read of `holder` starts: a random key between the
    /// first and last seen there, or its start when they are not known.
    pub(super) fn start(&self, holder: &str) -> Option<String> {
        let b = self.bounds.get(holder)?;
        between(b.first.as_deref()?, b.last.as_deref()?, &mut rand::rng())
    }

    /// Notes a read of `holder`; `true` when its last key should be looked up
    /// (the partition has more than one read takes and its end is unknown).
    pub(super) fn note(&mut self, holder: &str, complete: bool, first: Option<String>) -> bool {
        if complete {
            self.bounds.remove(holder);
            return false;
        }
        let b = self.bounds.entry(holder.to_string()).or_default();
        if first.is_some() {
            b.first = first;
        }
        b.last.is_none()
    }

    pub(super) fn set_last(&mut self, holder: &str, last: Option<String>) {
        if let Some(b) = self.bounds.get_mut(holder) {
            b.last = last;
        }
    }
}

/// A random key between `lo` and `hi` inclusive (by bytes), or `None` when
/// there is no room between them or either is not printable ASCII: after
/// their common prefix, a byte between theirs, then at each place a byte no
/// lower than `lo`'s while the key still follows `lo`, and no higher than
/// `hi`'s while it still follows `hi` (ending where `hi` ends), so the key
/// never leaves the bounds. Stream keys share a shape, so this lands among
/// them; in a store that keeps a partition in hash order (DynamoDB) any such
/// key is a random place.
pub(super) fn between(lo: &str, hi: &str, rng: &mut impl Rng) -> Option<String> {
    // Printable only: a key is a DynamoDB string and may be logged.
    let printable = |k: &[u8]| k.iter().all(|b| (b'!'..=b'~').contains(b));
    let (lo, hi) = (lo.as_bytes(), hi.as_bytes());
    if lo >= hi || !printable(lo) || !printable(hi) {
        return None;
    }
    let common = lo.iter().zip(hi).take_while(|(a, b)| a == b).count();
    let mut out = Vec::with_capacity(lo.len().max(hi.len()).max(common + 8));
    let (mut on_lo, mut on_hi) = (true, true);
    for i in 0..out.capacity() {
        let high = match (on_hi, hi.get(i)) {
            (true, None) => break,
            (true, Some(&h)) => h,
            (false, _) => b'~',
        };
        let low = match (on_lo, lo.get(i)) {
            (true, Some(&l)) => l,
            _ => b'!',
        };
        let byte = rng.random_range(low..=high);
        on_lo &= lo.get(i) == Some(&byte);
        on_hi &= hi.get(i) == Some(&byte);
        out.push(byte);
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn random_keys_fall_between_the_bounds_and_spread_over_them() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (lo, hi) = ("STREAM#scale/s000000", "STREAM#scale/s099999");
        let mut tenths = [0usize; 10];
        for _ in 0..1_000 {
            let k = between(lo, hi, &mut rng).unwrap();
            assert!(k.as_str() >= lo && k.as_str() <= "STREAM#scale/s1", "{k}");
            assert!(k.is_ascii() && !k.contains(char::is_whitespace), "{k}");
            let digit = k.as_bytes()["STREAM#scale/s0".len()] - b'0';
            tenths[digit as usize] += 1;
        }
        assert!(
            tenths.iter().all(|&n| n > 50),
            "starts bunch up instead of spreading over the partition: {tenths:?}"
        );
    }

    #[test]
    fn reads_widen_while_acquires_lose_races_and_narrow_as_they_stop() {
        let mut spread = Spread::default();
        assert_eq!(spread.widened(80), 80);
        spread.raced(5, 5, 0);
        spread.raced(5, 5, 0);
        assert_eq!(spread.widened(80), 320);
        for _ in 0..10 {
            spread.raced(0, 8, 0);
        }
        assert_eq!(spread.widened(80), 80 * MAX_WIDEN);
        spread.raced(8, 1, 0);
        assert_eq!(
            spread.widened(80),
            80 * MAX_WIDEN,
            "a few lost races: as wide"
        );
        spread.raced(10, 1, 5);
        assert_eq!(
            spread.widened(80),
            80 * MAX_WIDEN,
            "acquires left untried in a contested partition: as wide"
        );
        spread.raced(10, 1, 0);
        assert_eq!(spread.widened(80), 80 * MAX_WIDEN / 2);
        spread.raced(0, 0, 0);
        assert_eq!(
            spread.widened(80),
            80 * MAX_WIDEN / 2,
            "no acquires: no news"
        );
    }

    #[test]
    fn a_random_key_never_leaves_its_bounds() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let pairs = [
            ("STREAM#a/a", "STREAM#a/z"),
            ("STREAM#a/a", "STREAM#a/b"),
            ("STREAM#a/az", "STREAM#a/b"),
            ("STREAM#a/y", "STREAM#a/z0"),
            ("a", "ab"),
            ("STREAM#scale/s000000", "STREAM#scale/s099999"),
        ];
        for (lo, hi) in pairs {
            for _ in 0..5_000 {
                let k = between(lo, hi, &mut rng).unwrap();
                assert!(
                    (lo..=hi).contains(&k.as_str()),
                    "{k} is outside {lo}..={hi}"
                );
            }
        }
    }

    #[test]
    fn no_start_without_room_between_the_bounds() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        assert_eq!(between("b", "a", &mut rng), None);
        assert_eq!(between("a", "a", &mut rng), None);
        assert_eq!(between("STREAM#é", "STREAM#z", &mut rng), None);
        assert!(between("a", "ab", &mut rng).is_some());
    }

    #[test]
    fn the_read_limit_follows_the_pacing_share_and_the_room_within_its_bounds() {
        assert_eq!(read_limit(1, usize::MAX), 800);
        assert_eq!(read_limit(20, usize::MAX), 40);
        assert_eq!(read_limit(4, 50), 100);
        assert_eq!(read_limit(4, 40), 80);
        assert_eq!(read_limit(4, 0), MIN_READ);
        assert_eq!(read_limit(1_000, usize::MAX), MIN_READ);
    }

    #[test]
    fn a_complete_read_forgets_the_bounds_and_a_partial_one_asks_for_the_end_once() {
        let mut spread = Spread::default();
        assert!(spread.note("UNOWNED#1", false, Some("STREAM#a/a".into())));
        assert_eq!(spread.start("UNOWNED#1"), None, "no end known yet");
        spread.set_last("UNOWNED#1", Some("STREAM#a/z".into()));
        assert!(!spread.note("UNOWNED#1", false, None));
        let start = spread.start("UNOWNED#1").unwrap();
        assert!(
            ("STREAM#a/a"..="STREAM#a/z").contains(&start.as_str()),
            "{start}"
        );
        assert!(!spread.note("UNOWNED#1", true, None));
        assert_eq!(spread.start("UNOWNED#1"), None);
    }
}
