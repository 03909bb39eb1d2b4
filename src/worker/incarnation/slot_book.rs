//! Slots: the numbers this incarnation packs its streams' checkpoints under
//! (`lease::packed` says why that is safe), and the pages that say what each
//! stands for.
//!
//! The rules that make a slotted entry always true:
//!
//! - a slot is given once per incarnation (`next` only grows) and what it
//!   stands for (stream, token, base) never changes;
//! - an entry names a slot only once a page holding it was written (the
//!   chores report it; until then the stream is packed by name);
//! - a stream whose distance from its slot's base grows past [`REBASE_AT`],
//!   or whose slot's page has gone sparse, gets a new slot, and keeps the
//!   old one until the new one's page is written.
//!
//! A page that is lost, late or overwritten by an older write only makes a
//! takeover replay from the stream's own item.

use crate::lease::{SLOTS_PER_PAGE, SlotEntry, SlotPage, StreamKey, page_of};
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;
use tokio::time::Instant;

/// Distance from the base at which a stream moves to a new slot: entries
/// stay within 4 bytes however long a stream is held.
pub(super) const REBASE_AT: u64 = 1 << 20;
/// A busy stream whose slot's page holds fewer slots in use than this, and is
/// not the page new slots go to, moves to a new slot: pages emptied by
/// churn are deleted instead of each keeping a stream or two, so the
/// worker item lists a few pages, not one per stream.
pub(super) const SPARSE_BELOW: usize = (SLOTS_PER_PAGE / 8) as usize;
/// Pages are rewritten this often even when unchanged: their TTL (a day)
/// must not lapse under a live worker.
pub(super) const PAGE_REFRESH: Duration = Duration::from_secs(6 * 3600);

#[derive(Debug, Default)]
pub(super) struct SlotBook {
    /// The next slot to give.
    next: u64,
    /// Each held stream's slots, oldest first: the one its entries name, and
    /// possibly a newer one waiting for its page.
    streams: HashMap<StreamKey, Vec<u64>>,
    /// What every slot in use stands for.
    slots: BTreeMap<u64, SlotEntry>,
    /// The last page write number given (`lease::LeaseStore::write_slot_page`).
    writes: u64,
    /// Pages as last written, when, and as which write.
    written: BTreeMap<u32, Written>,
}

/// A page as last written.
#[derive(Debug)]
struct Written {
    page: SlotPage,
    at: Instant,
    write: u64,
}

/// A page to write, as page write number `write`.
#[derive(Debug)]
pub(super) struct PageWrite {
    pub number: u32,
    pub page: SlotPage,
    pub write: u64,
}

impl SlotBook {
    /// The slotted entry `(slot, delta)` for `seq` of the stream held under
    /// `token`; `None` while no slot of it is written (pack it by name).
    pub(super) fn entry(&mut self, key: &StreamKey, token: u64, seq: u64) -> Option<(u64, i64)> {
        let Self {
            next,
            streams,
            slots,
            written,
            ..
        } = self;
        let mine = streams.entry(key.clone()).or_default();
        // Slots of another token belong to an earlier lease of the stream.
        mine.retain(|s| {
            let same = slots.get(s).is_some_and(|e| e.token == token);
            if !same {
                slots.remove(s);
            }
            same
        });
        let is_written = |s: &u64| {
            written
                .get(&page_of(*s))
                .is_some_and(|w| w.page.get(s) == slots.get(s))
        };
        let usable = mine.iter().rposition(is_written);
        if let Some(i) = usable {
            // Older slots are no longer named by anything new.
            for s in mine.drain(..i) {
                slots.remove(&s);
            }
        }
        let usable = usable.map(|_| mine[0]);
        let delta = usable.and_then(|s| {
            let base = slots.get(&s)?.base;
            i64::try_from(i128::from(seq) - i128::from(base)).ok()
        });
        let waiting = mine.last().is_some_and(|s| Some(*s) != usable);
        let sparse = usable.is_some_and(|s| {
            let page = page_of(s);
            let first = u64::from(page) * SLOTS_PER_PAGE;
            page != page_of(*next)
                && slots.range(first..first + SLOTS_PER_PAGE).count() < SPARSE_BELOW
        });
        let far =
            usable.is_some() && (sparse || delta.is_none_or(|d| d.unsigned_abs() >= REBASE_AT));
        if mine.is_empty() || (far && !waiting) {
            let slot = *next;
            *next += 1;
            mine.push(slot);
            slots.insert(
                slot,
                SlotEntry {
                    key: key.clone(),
                    token,
                    base: seq,
                },
            );
        }
        usable.zip(delta)
    }

    /// Whether no stream has a slot (none was ever packed by slot, or all
    /// were forgotten): nothing for `retain` to look up.
    pub(super) fn is_empty(&self) -> bool {
        self.streams.is_empty()
    }

    /// Forgets the slots of streams no longer held.
    pub(super) fn retain(&mut self, held: impl Fn(&StreamKey) -> bool) {
        let Self { streams, slots, .. } = self;
        streams.retain(|key, mine| {
            let keep = held(key);
            if !keep {
                for s in mine.iter() {
                    slots.remove(s);
                }
            }
            keep
        });
    }

    /// The pages in use, as they should be.
    fn pages(&self) -> BTreeMap<u32, SlotPage> {
        let mut pages: BTreeMap<u32, SlotPage> = BTreeMap::new();
        for (slot, entry) in &self.slots {
            pages
                .entry(page_of(*slot))
                .or_default()
                .insert(*slot, entry.clone());
        }
        pages
    }

    /// The page writes due (pages changed since last written, or due for a
    /// refresh; each with a write number above every one given before) and
    /// the deletes due (written pages none of whose slots is in use any
    /// more, with the write that left each: a delete removes only that).
    pub(super) fn page_work(&mut self, now: Instant) -> (Vec<PageWrite>, Vec<(u32, u64)>) {
        let pages = self.pages();
        let deletes = self
            .written
            .iter()
            .filter(|(n, _)| !pages.contains_key(n))
            .map(|(n, w)| (*n, w.write))
            .collect();
        let due: Vec<(u32, SlotPage)> = pages
            .into_iter()
            .filter(|(n, page)| match self.written.get(n) {
                Some(w) => w.page != *page || now.duration_since(w.at) >= PAGE_REFRESH,
                None => true,
            })
            .collect();
        let writes = due
            .into_iter()
            .map(|(number, page)| {
                self.writes += 1;
                PageWrite {
                    number,
                    page,
                    write: self.writes,
                }
            })
            .collect();
        (writes, deletes)
    }

    /// The pages written (what entries may name), for the worker item.
    pub(super) fn written_pages(&self) -> Vec<u32> {
        self.written.keys().copied().collect()
    }

    pub(super) fn page_written(&mut self, done: PageWrite, at: Instant) {
        let PageWrite {
            number,
            page,
            write,
        } = done;
        self.written.insert(number, Written { page, at, write });
    }

    pub(super) fn page_deleted(&mut self, number: u32) {
        self.written.remove(&number);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_all(book: &mut SlotBook, at: Instant) {
        for w in book.page_work(at).0 {
            book.page_written(w, at);
        }
    }

    #[test]
    fn a_stream_is_named_until_its_page_is_written_then_slotted() {
        let mut book = SlotBook::default();
        let a = StreamKey::new("ns", "a");
        let now = Instant::now();
        assert_eq!(book.entry(&a, 3, 100), None);
        assert_eq!(book.entry(&a, 3, 105), None, "still not written");
        let pages = book.page_work(now).0;
        assert_eq!(pages.len(), 1);
        // Every write has a number above the last.
        let again = book.page_work(now).0;
        assert!(again[0].write > pages[0].write);
        assert_eq!(pages[0].page[&0].base, 100);
        write_all(&mut book, now);
        assert_eq!(book.entry(&a, 3, 107), Some((0, 7)));
        assert!(book.page_work(now).0.is_empty());
        assert_eq!(book.written_pages(), vec![0]);
        // Refreshed before the TTL can lapse.
        assert_eq!(book.page_work(now + PAGE_REFRESH).0.len(), 1);
    }

    #[test]
    fn slots_are_never_given_twice_and_a_new_token_gets_a_new_slot() {
        let mut book = SlotBook::default();
        let a = StreamKey::new("ns", "a");
        let b = StreamKey::new("ns", "b");
        let now = Instant::now();
        book.entry(&a, 1, 10);
        book.entry(&b, 1, 10);
        write_all(&mut book, now);
        assert_eq!(book.entry(&a, 1, 11), Some((0, 1)));
        // b is let go and taken again under a higher token.
        book.retain(|k| *k == a);
        assert_eq!(book.entry(&b, 2, 50), None);
        // a's lease changed too: its old slot is not named for the new token.
        assert_eq!(book.entry(&a, 2, 12), None);
        write_all(&mut book, now);
        assert_eq!(book.entry(&b, 2, 51), Some((2, 1)));
        assert_eq!(book.entry(&a, 2, 13), Some((3, 1)));
        assert!(book.page_work(now).1.is_empty(), "page 0 still holds slots");
    }

    #[test]
    fn a_far_stream_keeps_its_old_slot_until_the_new_page_is_written() {
        let mut book = SlotBook::default();
        let a = StreamKey::new("ns", "a");
        let now = Instant::now();
        book.entry(&a, 1, 0);
        write_all(&mut book, now);
        let far = REBASE_AT + 5;
        assert_eq!(book.entry(&a, 1, far), Some((0, far as i64)));
        // Until slot 1's page is written, slot 0 is named, and no third slot is given.
        assert_eq!(book.entry(&a, 1, far + 1), Some((0, far as i64 + 1)));
        write_all(&mut book, now);
        assert_eq!(book.entry(&a, 1, far + 2), Some((1, 2)));
        // Slot 0 is gone from the pages once the new one is named.
        let page = &book.page_work(now).0[0].page;
        assert_eq!(page.keys().copied().collect::<Vec<_>>(), vec![1]);
    }

    #[test]
    fn a_page_whose_slots_all_went_is_deleted_and_no_longer_listed() {
        let mut book = SlotBook::default();
        let now = Instant::now();
        let keys: Vec<StreamKey> = (0..=SLOTS_PER_PAGE)
            .map(|i| StreamKey::new("ns", format!("s{i}")))
            .collect();
        for k in &keys {
            book.entry(k, 1, 0);
        }
        write_all(&mut book, now);
        assert_eq!(book.written_pages(), vec![0, 1]);
        let last = keys.last().unwrap().clone();
        book.retain(|k| *k != last);
        assert_eq!(
            book.page_work(now)
                .1
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>(),
            vec![1]
        );
        book.page_deleted(1);
        assert_eq!(book.written_pages(), vec![0]);
    }

    #[test]
    fn streams_left_on_a_sparse_page_move_to_the_newest_and_the_old_page_goes() {
        let mut book = SlotBook::default();
        let now = Instant::now();
        let keys: Vec<StreamKey> = (0..SLOTS_PER_PAGE + 1)
            .map(|i| StreamKey::new("ns", format!("s{i}")))
            .collect();
        for k in &keys {
            book.entry(k, 1, 0);
        }
        write_all(&mut book, now);
        // Churn: all but two of page 0's streams go.
        let (stay, last) = (keys[0].clone(), keys[SLOTS_PER_PAGE as usize].clone());
        book.retain(|k| *k == stay || *k == keys[1] || *k == last);
        assert_eq!(
            book.entry(&stay, 1, 5),
            Some((0, 5)),
            "the old slot until the new is written"
        );
        assert_eq!(
            book.entry(&last, 1, 5),
            Some((SLOTS_PER_PAGE, 5)),
            "on the newest page: stays"
        );
        write_all(&mut book, now);
        let (slot, delta) = book.entry(&stay, 1, 6).unwrap();
        assert_eq!((page_of(slot), delta), (1, 1));
        book.entry(&keys[1], 1, 6);
        write_all(&mut book, now);
        book.entry(&keys[1], 1, 7);
        assert_eq!(
            book.page_work(now)
                .1
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>(),
            vec![0]
        );
    }
}
