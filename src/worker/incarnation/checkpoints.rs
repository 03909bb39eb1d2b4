//! Packing checkpoints: every stream whose acknowledged sequence number is
//! ahead of its item goes into the worker's own items, written with each
//! heartbeat — shard 0 inside the worker item, further shards (when shard 0 is
//! full) in `CKPT#` items written only when they changed. A stream whose
//! checkpoint stood still for a few heartbeats is folded into its own item
//! once and leaves the packed set: idle streams cost nothing.
//!
//! DynamoDB bills a write by the size of the whole item, so shard 0 stays
//! small (the worker item is also what peers read) and one shard is written
//! per heartbeat however many entries changed in it. An entry goes by slot
//! (3–4 bytes, `slot_book`) once its slot's page is written and every LIVE
//! peer reads slotted entries; by name (~30 bytes) otherwise.

use super::slot_book::{PageWrite, SlotBook};
use crate::lease::{Checkpoint, PackedShard, StreamKey, named_size, slotted_size};
use crate::worker::stream::HeldStream;
use std::collections::HashMap;
use std::sync::Arc;
use tokio::time::Instant;

/// Bytes of entries in the worker item while every peer reads slotted
/// entries: the item stays within 1 KB, one write unit per heartbeat.
pub(super) const SHARD0_SLOTTED_BYTES: usize = 512;
/// Bytes of entries in the worker item while they go by name: it stays
/// under 4 KB, one read unit for every peer that reads it.
pub(super) const SHARD0_BYTES: usize = 3 * 1024;
/// Bytes of entries in each further shard.
pub(super) const SHARD_BYTES: usize = 64 * 1024;
/// Heartbeats a checkpoint must stand still before it is folded into its item.
pub(super) const FOLD_AFTER_HEARTBEATS: u32 = 3;
/// Folds per heartbeat, so a fleet going quiet does not burst writes.
pub(super) const FOLDS_PER_HEARTBEAT: usize = 64;

/// What one heartbeat writes.
#[derive(Debug, Default)]
pub(super) struct Packed {
    pub shard0: PackedShard,
    /// Shards 1.. that changed since they were last written: `(number, entries)`.
    pub changed_shards: Vec<(u32, PackedShard)>,
    /// Shards that existed and are no longer needed.
    pub stale_shards: Vec<u32>,
    /// How many shards exist after this heartbeat (shard 0 included).
    pub shard_count: u32,
    /// Streams whose checkpoint stood still: fold `seq` into their item.
    pub folds: Vec<(Arc<HeldStream>, u64)>,
    /// Slot pages to write (new or changed slots, or a refresh).
    pub pages_to_write: Vec<PageWrite>,
    /// Slot pages no slot in use lives in, with the write that left each.
    pub pages_to_delete: Vec<(u32, u64)>,
    /// The slot pages written, which this heartbeat's entries may name.
    pub slot_pages: Vec<u32>,
}

/// One entry, in the form it is packed in.
enum Entry {
    Named(Checkpoint),
    Slotted(u64, i64),
}

impl Entry {
    fn size(&self, key: &StreamKey) -> usize {
        match self {
            Entry::Named(c) => named_size(key, c),
            Entry::Slotted(slot, delta) => slotted_size(*slot, *delta),
        }
    }
}

/// The packer's memory between heartbeats.
#[derive(Debug, Default)]
pub(super) struct Packer {
    /// Per stream: the last packed sequence number and for how many heartbeats.
    still: HashMap<StreamKey, (u64, u32)>,
    /// Shards 1.. as last written successfully.
    written: Vec<PackedShard>,
    slots: SlotBook,
}

impl Packer {
    /// Packs `held` for one heartbeat: by slot where `slotted` (every LIVE
    /// peer reads slotted entries) and the stream's slot is written, by name
    /// otherwise.
    pub(super) fn pack(&mut self, held: &[Arc<HeldStream>], slotted: bool, now: Instant) -> Packed {
        if !self.slots.is_empty() {
            let keys: std::collections::HashSet<&StreamKey> =
                held.iter().map(|h| &h.lease.key).collect();
            self.slots.retain(|k| keys.contains(k));
        }
        let mut entries: Vec<(StreamKey, Entry, u64, &Arc<HeldStream>)> = held
            .iter()
            .filter_map(|h| {
                let seq = h.progress.unstored_checkpoint()?;
                let key = &h.lease.key;
                let token = h.lease.counter;
                let entry = match slotted.then(|| self.slots.entry(key, token, seq)).flatten() {
                    Some((slot, delta)) => Entry::Slotted(slot, delta),
                    None => Entry::Named(Checkpoint { seq, token }),
                };
                Some((key.clone(), entry, seq, h))
            })
            .collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let mut folds = Vec::new();
        let mut still = HashMap::with_capacity(entries.len());
        for (key, _, seq, h) in &entries {
            let beats = match self.still.get(key) {
                Some((last, beats)) if last == seq => beats + 1,
                _ => 0,
            };
            if beats >= FOLD_AFTER_HEARTBEATS && folds.len() < FOLDS_PER_HEARTBEAT {
                folds.push(((*h).clone(), *seq));
            }
            still.insert(key.clone(), (*seq, beats));
        }
        self.still = still;
        let mut shards: Vec<PackedShard> = vec![PackedShard::default()];
        let mut size = 0;
        for (key, entry, _, _) in entries {
            let entry_size = entry.size(&key);
            let limit = match (shards.len(), slotted) {
                (1, true) => SHARD0_SLOTTED_BYTES,
                (1, false) => SHARD0_BYTES,
                _ => SHARD_BYTES,
            };
            if size + entry_size > limit && !shards.last().is_some_and(PackedShard::is_empty) {
                shards.push(PackedShard::default());
                size = 0;
            }
            size += entry_size;
            if let Some(last) = shards.last_mut() {
                match entry {
                    Entry::Named(c) => last.named.push((key, c)),
                    Entry::Slotted(slot, delta) => last.slotted.push((slot, delta)),
                }
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
        let (pages_to_write, pages_to_delete) = self.slots.page_work(now);
        Packed {
            shard0,
            changed_shards,
            stale_shards,
            shard_count: 1 + shards.len() as u32,
            folds,
            pages_to_write,
            pages_to_delete,
            slot_pages: self.slots.written_pages(),
        }
    }

    /// Records that shard `number` (≥ 1) now holds `entries`.
    pub(super) fn written(&mut self, number: u32, entries: PackedShard) {
        let i = number as usize - 1;
        if self.written.len() <= i {
            self.written.resize(i + 1, PackedShard::default());
        }
        self.written[i] = entries;
    }

    /// Records that shards from `count` on no longer exist.
    pub(super) fn truncated(&mut self, count: u32) {
        self.written.truncate(count.saturating_sub(1) as usize);
    }

    /// Records that a slot page write landed (sent at `at`).
    pub(super) fn page_written(&mut self, done: PageWrite, at: Instant) {
        self.slots.page_written(done, at);
    }

    /// Records that slot page `number` no longer exists.
    pub(super) fn page_deleted(&mut self, number: u32) {
        self.slots.page_deleted(number);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::{Incarnation, Lease};
    use crate::worker::stream::StreamProgress;

    fn now() -> Instant {
        Instant::now()
    }

    fn held(name: &str, acked: Option<u64>, persisted: Option<u64>) -> Arc<HeldStream> {
        let progress = StreamProgress::new(acked, persisted);
        Arc::new(HeldStream::new(
            Lease {
                key: StreamKey::new("ns", name),
                owner: Incarnation::new("w"),
                counter: 7,
            },
            Arc::new(progress),
        ))
    }

    #[test]
    fn only_streams_ahead_of_their_item_are_packed_and_still_ones_are_folded() {
        let streams = vec![
            held("a", Some(5), Some(5)),
            held("b", Some(9), Some(3)),
            held("c", None, None),
        ];
        let mut p = Packer::default();
        let first = p.pack(&streams, false, now());
        assert_eq!(
            first.shard0.named,
            vec![(StreamKey::new("ns", "b"), Checkpoint { seq: 9, token: 7 })]
        );
        assert_eq!(first.shard_count, 1);
        assert!(first.folds.is_empty());
        for _ in 0..FOLD_AFTER_HEARTBEATS - 1 {
            assert!(p.pack(&streams, false, now()).folds.is_empty());
        }
        let folded = p.pack(&streams, false, now());
        assert_eq!(folded.folds.len(), 1);
        assert_eq!(folded.folds[0].1, 9);
        // It moved again: the wait starts over.
        streams[1].progress.ack(10);
        assert!(p.pack(&streams, false, now()).folds.is_empty());
    }

    #[test]
    fn many_streams_spill_into_further_shards_written_only_when_changed() {
        let streams: Vec<Arc<HeldStream>> = (0..2000)
            .map(|i| held(&format!("stream-{i:05}"), Some(1_000_000 + i), None))
            .collect();
        let mut p = Packer::default();
        let packed = p.pack(&streams, false, now());
        let size: usize = packed
            .shard0
            .named
            .iter()
            .map(|(k, c)| named_size(k, c))
            .sum();
        assert!(size <= SHARD0_BYTES && size > SHARD0_BYTES - 100, "{size}");
        assert_eq!(packed.shard_count, 2);
        assert_eq!(packed.changed_shards.len(), 1);
        let (n, entries) = packed.changed_shards[0].clone();
        p.written(n, entries);
        assert!(
            p.pack(&streams, false, now()).changed_shards.is_empty(),
            "unchanged shards are not rewritten"
        );
        streams[1999].progress.ack(5_000_000);
        assert_eq!(p.pack(&streams, false, now()).changed_shards.len(), 1);
        let few = &streams[..10];
        let shrunk = p.pack(few, false, now());
        assert_eq!(shrunk.shard_count, 1);
        assert_eq!(shrunk.stale_shards, vec![1]);
    }

    #[test]
    fn busy_streams_go_by_slot_once_their_page_is_written_and_fit_the_worker_item() {
        let streams: Vec<Arc<HeldStream>> = (0..100)
            .map(|i| held(&format!("busy-stream-{i:03}"), Some(500 + i), None))
            .collect();
        let mut p = Packer::default();
        let first = p.pack(&streams, true, now());
        assert!(first.shard0.slotted.is_empty(), "no page is written yet");
        assert!(first.shard_count > 1, "by name they do not fit 512 bytes");
        assert!(first.slot_pages.is_empty());
        for w in first.pages_to_write {
            p.page_written(w, now());
        }
        for (n, entries) in first.changed_shards {
            p.written(n, entries);
        }
        for (i, s) in streams.iter().enumerate() {
            s.progress.ack(600 + i as u64);
        }
        let second = p.pack(&streams, true, now());
        assert_eq!(second.shard0.slotted.len(), 100);
        assert!(second.shard0.named.is_empty());
        assert_eq!(second.shard_count, 1);
        assert_eq!(second.stale_shards, vec![1]);
        assert_eq!(second.slot_pages, vec![0]);
        let size: usize = second
            .shard0
            .slotted
            .iter()
            .map(|(s, d)| slotted_size(*s, *d))
            .sum();
        assert!(size <= SHARD0_SLOTTED_BYTES, "{size}");
        // Peers that do not read slots: everything by name again.
        let legacy = p.pack(&streams, false, now());
        assert!(legacy.shard0.slotted.is_empty());
        assert!(!legacy.shard0.named.is_empty());
    }
}
