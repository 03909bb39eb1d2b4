//! Who tries a dead worker's last streams first: each stream's heir among
//! the workers taking streams (rendezvous hashing), the others once it has
//! had its turn.
//!
//! Why: a takeover reads a dead incarnation's partitions in turns, a few
//! workers to a partition, each taking what its pacing allows. While a
//! partition holds more streams than its readers in a pass may take
//! together, readers mostly pick different ones (in random order). Once
//! fewer are left, they try the same ones, so each stream is written by
//! several workers and all but one write is refused (billed, and as slow as
//! a won one): in the simulation of 100,000 streams the last fifth of a
//! 10,000-stream failover went at a third of the pace of the rest. So in
//! such a partition a worker tries the streams it is heir to at once, and
//! another's only after seeing it still there `defer` later: long enough
//! for the heir, which reads every partition within one rotation cycle, to
//! have taken it. A heir that
//! cannot (it is full, fenced, or just died) delays its streams by that
//! much, no more. Every acquire is still one conditional write; this only
//! chooses who tries first.

use crate::lease::{Incarnation, StreamKey};
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use tokio::time::Instant;

/// How many `defer`s a sighting is remembered for without being taken.
const FORGET_AFTER_DEFERS: u32 = 8;

/// The worker of `takers` that tries `key` first: the one whose hash with
/// the stream's key is highest. Every worker computes the same heir from the
/// same takers; one joining or leaving moves only the streams it is heir to.
pub(super) fn heir<'a>(key: &StreamKey, takers: &'a [Incarnation]) -> Option<&'a Incarnation> {
    let key = key.to_string();
    takers
        .iter()
        .max_by_key(|inc| (weight(&key, inc.as_str()), inc.as_str()))
}

/// A stable hash of a stream and a worker: FNV-1a (64-bit) over both, then
/// MurmurHash3's finaliser so that names differing in their last bytes
/// still rank apart. Written out because every worker of every release
/// must compute the same heirs, which std's hasher does not promise.
fn weight(key: &str, taker: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in key.bytes().chain([0xff]).chain(taker.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    hash ^ (hash >> 33)
}

/// What [`Heirs`] needs to know of a candidate.
pub(super) trait Inheritance {
    /// The index partition it was read from.
    fn partition(&self) -> &str;
    /// Its stream, when it is a dead worker's whose heir is another worker.
    fn heir_elsewhere(&self) -> Option<&StreamKey>;
}

/// When this worker first saw each dead worker's stream it is not heir to.
#[derive(Default)]
pub(super) struct Heirs {
    first_seen: HashMap<StreamKey, Instant>,
}

impl Heirs {
    /// Drops from `candidates` the streams another worker is heir to
    /// ([`Inheritance::heir_elsewhere`]) in the partitions whose readers would
    /// try the same candidates (`tail(partition, candidates from it)`),
    /// until it has seen them waiting `defer`. Returns how many it dropped.
    pub(super) fn defer_to_heirs<C: Inheritance>(
        &mut self,
        candidates: &mut Vec<C>,
        tail: impl Fn(&str, usize) -> bool,
        defer: Duration,
        now: Instant,
    ) -> usize {
        let forget = defer * FORGET_AFTER_DEFERS;
        self.first_seen
            .retain(|_, seen| now.duration_since(*seen) < forget);
        let mut per_partition: HashMap<&str, usize> = HashMap::new();
        for c in candidates.iter() {
            *per_partition.entry(c.partition()).or_default() += 1;
        }
        let tails: HashSet<String> = per_partition
            .into_iter()
            .filter(|&(partition, count)| tail(partition, count))
            .map(|(partition, _)| partition.to_string())
            .collect();
        let before = candidates.len();
        candidates.retain(|c| {
            let Some(key) = c.heir_elsewhere() else {
                return true;
            };
            let seen = *self.first_seen.entry(key.clone()).or_insert(now);
            !tails.contains(c.partition()) || now.duration_since(seen) >= defer
        });
        before - candidates.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A candidate as `Heirs` sees it.
    struct Seen {
        key: StreamKey,
        partition: String,
        heir_elsewhere: bool,
    }

    impl Inheritance for Seen {
        fn partition(&self) -> &str {
            &self.partition
        }
        fn heir_elsewhere(&self) -> Option<&StreamKey> {
            self.heir_elsewhere.then_some(&self.key)
        }
    }

    /// A dead worker's stream `name` read from `partition`.
    fn candidate(name: &str, partition: &str, heir_elsewhere: bool) -> Seen {
        Seen {
            key: StreamKey::new("ns", name),
            partition: partition.to_string(),
            heir_elsewhere,
        }
    }

    fn names(candidates: &[Seen]) -> Vec<String> {
        candidates.iter().map(|c| c.key.to_string()).collect()
    }

    /// In a partition with fewer candidates than this worker may take, it
    /// tries its own at once and another's once it has waited `defer`; in
    /// one with more, everything, as before.
    #[tokio::test(start_paused = true)]
    async fn the_last_streams_of_a_partition_wait_for_their_heir_and_no_longer() {
        let defer = Duration::from_secs(1);
        let tail = |partition: &str, _count: usize| partition == "dead#1";
        let pass = || {
            vec![
                candidate("mine", "dead#1", false),
                candidate("theirs", "dead#1", true),
                candidate("theirs-in-bulk", "dead#2", true),
            ]
        };
        let mut heirs = Heirs::default();
        let mut now = pass();
        assert_eq!(
            heirs.defer_to_heirs(&mut now, tail, defer, Instant::now()),
            1
        );
        assert_eq!(names(&now), ["ns/mine", "ns/theirs-in-bulk"]);
        tokio::time::advance(defer / 2).await;
        let mut later = pass();
        heirs.defer_to_heirs(&mut later, tail, defer, Instant::now());
        assert_eq!(
            names(&later),
            ["ns/mine", "ns/theirs-in-bulk"],
            "still waiting"
        );
        tokio::time::advance(defer / 2).await;
        let mut after = pass();
        assert_eq!(
            heirs.defer_to_heirs(&mut after, tail, defer, Instant::now()),
            0
        );
        assert_eq!(names(&after), ["ns/mine", "ns/theirs", "ns/theirs-in-bulk"]);
    }

    #[test]
    fn which_partitions_are_tails_is_asked_with_their_candidate_counts() {
        let mut candidates = vec![
            candidate("a", "dead#1", true),
            candidate("b", "dead#1", true),
            candidate("c", "dead#2", true),
        ];
        let asked = std::cell::RefCell::new(Vec::new());
        Heirs::default().defer_to_heirs(
            &mut candidates,
            |partition, count| {
                asked.borrow_mut().push((partition.to_string(), count));
                count < 2
            },
            Duration::from_secs(1),
            Instant::now(),
        );
        let mut asked = asked.into_inner();
        asked.sort();
        assert_eq!(asked, [("dead#1".into(), 2), ("dead#2".into(), 1)]);
        assert_eq!(names(&candidates), ["ns/a", "ns/b"]);
    }

    fn takers(n: usize) -> Vec<Incarnation> {
        (0..n).map(|i| Incarnation::new(&format!("w{i}"))).collect()
    }

    #[test]
    fn every_stream_has_one_heir_and_the_heirs_are_spread() {
        let takers = takers(18);
        let mut per_heir: HashMap<&Incarnation, usize> = HashMap::new();
        for i in 0..18_000 {
            let key = StreamKey::new("ns", format!("s{i}"));
            let heir = heir(&key, &takers).expect("a heir");
            assert_eq!(
                Some(heir),
                super::heir(&key, &takers),
                "the same every time"
            );
            *per_heir.entry(heir).or_default() += 1;
        }
        assert_eq!(per_heir.len(), 18);
        for (inc, n) in per_heir {
            assert!((800..=1200).contains(&n), "{inc}: {n} of about 1,000");
        }
        assert_eq!(heir(&StreamKey::new("ns", "s"), &[]), None);
    }

    #[test]
    fn a_taker_leaving_moves_only_the_streams_it_was_heir_to() {
        let all = takers(10);
        let fewer: Vec<Incarnation> = all[1..].to_vec();
        for i in 0..2_000 {
            let key = StreamKey::new("ns", format!("s{i}"));
            let before = heir(&key, &all).unwrap();
            if before != &all[0] {
                assert_eq!(heir(&key, &fewer), Some(before), "{key}");
            }
        }
    }
}
