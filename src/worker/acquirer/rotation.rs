//! Which of an orphan holder's partitions a pass reads: in a large fleet,
//! each worker reads a few of them per pass, in turn, instead of all.
//!
//! Why: orphans sit in [`HOLDER_SHARDS`] partitions per holder (the unowned
//! shards, each departed incarnation's shards). A pass that read every one
//! of them cost every worker sixteen queries a pass during a takeover (the
//! dead incarnation's eight and the unowned eight), so twenty workers sent
//! over a thousand queries a second, all of them at the same items, and lost
//! about as many acquires to each other as they won (a lost race is a
//! conditional write refused: a write unit spent for nothing). Reading
//! `per_pass(live)` partitions, about [`READERS_PER_SHARD`] workers read each
//! partition in a pass: a fleet of four or fewer still reads every partition
//! every pass (nothing changes for it), a fleet of twenty reads two each.
//!
//! Each worker's turn starts where its last one stopped, so it reads every
//! partition within `HOLDER_SHARDS / per_pass` passes whatever the others do:
//! a stream in any partition is found by every worker with room within that
//! many passes (a second at twenty workers), and by some worker sooner. The
//! cursor starts at a random shard, so workers' turns are spread. A read is a
//! hint like any read; every acquire is still one conditional write.

use crate::lease::HOLDER_SHARDS;
use rand::Rng;

/// About how many workers read each orphan partition in one pass, once the
/// fleet has more than this many workers per partition to spare.
const READERS_PER_SHARD: usize = 4;

/// Where a worker's turns through one holder's partitions stand.
#[derive(Clone, Debug)]
pub(super) struct Rotation {
    next: u32,
}

impl Default for Rotation {
    fn default() -> Self {
        Self {
            next: rand::rng().random_range(0..HOLDER_SHARDS),
        }
    }
}

impl Rotation {
    /// Partitions of one holder a pass reads with `live` workers sharing them.
    pub(super) fn per_pass(live: usize) -> usize {
        let shards = HOLDER_SHARDS as usize;
        (shards * READERS_PER_SHARD)
            .div_ceil(live.max(1))
            .clamp(1, shards)
    }

    /// Passes a worker takes to read every partition at `per_pass` a pass.
    pub(super) fn cycle(per_pass: usize) -> u32 {
        (HOLDER_SHARDS as usize).div_ceil(per_pass.max(1)) as u32
    }

    /// This pass's turn: `count` of the `remaining` shards (ascending; the
    /// ones still worth reading), from the first at or after where the last
    /// turn stopped, wrapping around. The next turn starts after them.
    pub(super) fn turn(&mut self, remaining: &[u32], count: usize) -> Vec<u32> {
        let start = remaining.iter().position(|&s| s >= self.next).unwrap_or(0);
        let picked: Vec<u32> = remaining
            .iter()
            .cycle()
            .skip(start)
            .take(count.min(remaining.len()))
            .copied()
            .collect();
        if let Some(&last) = picked.last() {
            self.next = (last + 1) % HOLDER_SHARDS;
        }
        picked
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn all() -> Vec<u32> {
        (0..HOLDER_SHARDS).collect()
    }

    #[test]
    fn small_fleets_read_every_partition_every_pass_and_large_ones_a_few() {
        for live in 1..=4 {
            assert_eq!(Rotation::per_pass(live), HOLDER_SHARDS as usize, "{live}");
        }
        assert_eq!(Rotation::per_pass(8), 4);
        assert_eq!(Rotation::per_pass(20), 2);
        assert_eq!(Rotation::per_pass(1_000), 1);
        assert_eq!(Rotation::per_pass(0), HOLDER_SHARDS as usize);
        // About READERS_PER_SHARD readers of each partition, never fewer.
        for live in 1..=200 {
            let readers = live * Rotation::per_pass(live) / HOLDER_SHARDS as usize;
            assert!(readers >= READERS_PER_SHARD.min(live), "{live}: {readers}");
        }
    }

    #[test]
    fn every_worker_reads_every_partition_within_one_cycle_from_any_start() {
        for count in 1..=HOLDER_SHARDS as usize {
            for start in 0..HOLDER_SHARDS {
                let mut rotation = Rotation { next: start };
                let mut seen = BTreeSet::new();
                for _ in 0..Rotation::cycle(count) {
                    let turn = rotation.turn(&all(), count);
                    assert_eq!(turn.len(), count);
                    seen.extend(turn);
                }
                assert_eq!(seen.len(), HOLDER_SHARDS as usize, "{count} from {start}");
            }
        }
    }

    #[test]
    fn a_turn_skips_partitions_found_empty_and_still_reaches_the_rest() {
        let mut rotation = Rotation { next: 6 };
        let remaining = [1, 3, 7];
        assert_eq!(rotation.turn(&remaining, 2), vec![7, 1]);
        assert_eq!(rotation.turn(&remaining, 2), vec![3, 7]);
        assert_eq!(rotation.turn(&remaining, 5), vec![1, 3, 7]);
        assert_eq!(rotation.turn(&[], 2), Vec::<u32>::new());
        // One left: every turn reads it.
        for _ in 0..3 {
            assert_eq!(rotation.turn(&[4], 1), vec![4]);
        }
    }
}
