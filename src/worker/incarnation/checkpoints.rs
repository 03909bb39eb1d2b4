//! Packing checkpoints: every stream whose acknowledged sequence number is
//! ahead of its item goes into the worker's own items, written with each
//! heartbeat — shard 0 inside the worker item, further shards (when shard 0 is
//! full) in `CKPT#` items written only when they changed. A stream whose
//! checkpoint stood still for a few heartbeats is folded into its own item
//! once and leaves the packed set: idle streams cost nothing.
//!
//! DynamoDB bills a write by the size of the whole item, so shard 0 stays
//! small (the worker item is also what peers read) and one shard is written
//! per heartbeat however many entries changed in it.

use crate::lease::codec::checkpoint_size;
use crate::lease::{Checkpoint, StreamKey};
use crate::worker::stream::HeldStream;
use std::collections::HashMap;

/// Bytes of entries in the worker item: it stays under 4 KB, one read unit
/// for every peer that reads it, and a few write units per heartbeat.
pub(super) const SHARD0_BYTES: usize = 3 * 1024;
/// Bytes of entries in each further shard.
pub(super) const SHARD_BYTES: usize = 64 * 1024;
/// Heartbeats a checkpoint must stand still before it is folded into its item.
pub(super) const FOLD_AFTER_HEARTBEATS: u32 = 3;
/// Folds per heartbeat, so a fleet going quiet does not burst writes.
pub(super) const FOLDS_PER_HEARTBEAT: usize = 64;

/// One shard's entries.
pub(super) type Shard = Vec<(StreamKey, Checkpoint)>;

/// What one heartbeat writes.
#[derive(Debug, Default)]
pub(super) struct Packed {
    pub shard0: Shard,
    /// Shards 1.. that changed since they were last written: `(number, entries)`.
    pub changed_shards: Vec<(u32, Shard)>,
    /// Shards that existed and are no longer needed.
    pub stale_shards: Vec<u32>,
    /// How many shards exist after this heartbeat (shard 0 included).
    pub shard_count: u32,
    /// Streams whose checkpoint stood still: fold `seq` into their item.
    pub folds: Vec<(HeldStream, u64)>,
}

/// The packer's memory between heartbeats.
#[derive(Debug, Default)]
pub(super) struct Packer {
    /// Per stream: the last packed sequence number and for how many heartbeats.
    still: HashMap<StreamKey, (u64, u32)>,
    /// Shards 1.. as last written successfully.
    written: Vec<Shard>,
}

impl Packer {
    pub(super) fn pack(&mut self, held: &[HeldStream]) -> Packed {
        let mut entries: Vec<(StreamKey, Checkpoint, &HeldStream)> = held
            .iter()
            .filter_map(|h| {
                let seq = h.progress.unstored_checkpoint()?;
                Some((
                    h.lease.key.clone(),
                    Checkpoint {
                        seq,
                        token: h.lease.counter,
                    },
                    h,
                ))
            })
            .collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let mut folds = Vec::new();
        let mut still = HashMap::with_capacity(entries.len());
        for (key, c, h) in &entries {
            let beats = match self.still.get(key) {
                Some((seq, beats)) if *seq == c.seq => beats + 1,
                _ => 0,
            };
            if beats >= FOLD_AFTER_HEARTBEATS && folds.len() < FOLDS_PER_HEARTBEAT {
                folds.push(((*h).clone(), c.seq));
            }
            still.insert(key.clone(), (c.seq, beats));
        }
        self.still = still;
        let mut shards: Vec<Shard> = vec![Vec::new()];
        let mut size = 0;
        for (key, c, _) in entries {
            let entry_size = checkpoint_size(&key, &c);
            let limit = if shards.len() == 1 {
                SHARD0_BYTES
            } else {
                SHARD_BYTES
            };
            if size + entry_size > limit && !shards.last().is_some_and(Vec::is_empty) {
                shards.push(Vec::new());
                size = 0;
            }
            size += entry_size;
            if let Some(last) = shards.last_mut() {
                last.push((key, c));
            }
        }
        let shard0 = shards.remove(0);
        let changed_shards = shards
            .iter()
            .enumerate()
            .filter(|(i, s)| self.written.get(*i) != Some(s))
            .map(|(i, s)| (i as u32 + 1, s.clone()))
            .collect();
        let stale_shards = (shards.len()..self.written.len())
            .map(|i| i as u32 + 1)
            .collect();
        Packed {
            shard0,
            changed_shards,
            stale_shards,
            shard_count: 1 + shards.len() as u32,
            folds,
        }
    }

    /// Records that shard `number` (≥ 1) now holds `entries`.
    pub(super) fn written(&mut self, number: u32, entries: Shard) {
        let i = number as usize - 1;
        if self.written.len() <= i {
            self.written.resize(i + 1, Vec::new());
        }
        self.written[i] = entries;
    }

    /// Records that shards from `count` on no longer exist.
    pub(super) fn truncated(&mut self, count: u32) {
        self.written.truncate(count.saturating_sub(1) as usize);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::{Incarnation, Lease};
    use crate::worker::stream::StreamProgress;
    use std::sync::Arc;

    fn held(name: &str, acked: Option<u64>, persisted: Option<u64>) -> HeldStream {
        let progress = StreamProgress::new(acked, persisted);
        HeldStream {
            lease: Lease {
                key: StreamKey::new("ns", name),
                owner: Incarnation::new("w"),
                counter: 7,
            },
            progress: Arc::new(progress),
            signals: Default::default(),
        }
    }

    #[test]
    fn only_streams_ahead_of_their_item_are_packed_and_still_ones_are_folded() {
        let streams = vec![
            held("a", Some(5), Some(5)),
            held("b", Some(9), Some(3)),
            held("c", None, None),
        ];
        let mut p = Packer::default();
        let first = p.pack(&streams);
        assert_eq!(
            first.shard0,
            vec![(StreamKey::new("ns", "b"), Checkpoint { seq: 9, token: 7 })]
        );
        assert_eq!(first.shard_count, 1);
        assert!(first.folds.is_empty());
        for _ in 0..FOLD_AFTER_HEARTBEATS - 1 {
            assert!(p.pack(&streams).folds.is_empty());
        }
        let folded = p.pack(&streams);
        assert_eq!(folded.folds.len(), 1);
        assert_eq!(folded.folds[0].1, 9);
        // It moved again: the wait starts over.
        streams[1].progress.ack(10);
        assert!(p.pack(&streams).folds.is_empty());
    }

    #[test]
    fn many_streams_spill_into_further_shards_written_only_when_changed() {
        let streams: Vec<HeldStream> = (0..2000)
            .map(|i| held(&format!("stream-{i:05}"), Some(1_000_000 + i), None))
            .collect();
        let mut p = Packer::default();
        let packed = p.pack(&streams);
        let size: usize = packed
            .shard0
            .iter()
            .map(|(k, c)| checkpoint_size(k, c))
            .sum();
        assert!(size <= SHARD0_BYTES && size > SHARD0_BYTES - 100, "{size}");
        assert_eq!(packed.shard_count, 2);
        assert_eq!(packed.changed_shards.len(), 1);
        let (n, entries) = packed.changed_shards[0].clone();
        p.written(n, entries);
        assert!(
            p.pack(&streams).changed_shards.is_empty(),
            "unchanged shards are not rewritten"
        );
        streams[1999].progress.ack(5_000_000);
        assert_eq!(p.pack(&streams).changed_shards.len(), 1);
        let few = &streams[..10];
        let shrunk = p.pack(few);
        assert_eq!(shrunk.shard_count, 1);
        assert_eq!(shrunk.stale_shards, vec![1]);
    }
}
