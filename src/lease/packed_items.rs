//! The items packed checkpoints live in besides the worker item: further
//! checkpoint shards (`CKPT#<incarnation>#<n>`, written when they change)
//! and slot pages (`SLOTS#<incarnation>#<n>`, written before any entry names
//! their slots); and reading all of a (dead) incarnation's checkpoints back.

use super::client::{ConditionFailed, LeaseStore};
use super::codec::{Item, attr, key_item, n, pk_of, s};
use super::error::StoreError;
use super::incarnations::{LIVE_ITEM_TTL, ttl};
use super::keys::Incarnation;
use super::packed::{packed_shard, resolve, slot_page, slot_page_value};
use super::record::{Checkpoints, PackedShard, SlotPage};
use super::update::Update;
use std::collections::HashMap;

impl LeaseStore {
    /// Writes checkpoint shard `shard` (≥ 1) of this incarnation.
    pub async fn write_checkpoint_shard(
        &self,
        me: &Incarnation,
        shard: u32,
        entries: &PackedShard,
    ) -> Result<(), StoreError> {
        let pk = me.checkpoint_pk(shard);
        self.put_own_item(
            "write_checkpoints",
            &pk,
            entries_item(entries),
            &Update::new(),
        )
        .await?
        .map_err(|c| c.unexpected("write_checkpoints"))
    }

    /// Writes slot page `page` of this incarnation, what its slots stand
    /// for, as this incarnation's page write number `write` (numbers only
    /// grow): a write of an earlier number that lands late, its first attempt
    /// delayed past a retry, never replaces it. `false` when a later write is
    /// there.
    pub async fn write_slot_page(
        &self,
        me: &Incarnation,
        page: u32,
        slots: &SlotPage,
        write: u64,
    ) -> Result<bool, StoreError> {
        let item = Item::from([
            (attr::SLOTS.to_string(), slot_page_value(slots)),
            (attr::PAGE_WRITE.to_string(), n(write)),
        ]);
        let mut not_later = Update::new();
        not_later.require("(attribute_not_exists(Pk) OR page_write <= :write)");
        not_later.value(":write", n(write));
        let pk = me.slot_page_pk(page);
        let out = self
            .put_own_item("write_slot_page", &pk, item, &not_later)
            .await?;
        Ok(out.is_ok())
    }

    /// Removes checkpoint shard `shard` (no longer needed).
    pub async fn delete_checkpoint_shard(
        &self,
        me: &Incarnation,
        shard: u32,
    ) -> Result<(), StoreError> {
        self.delete_item(
            "delete_checkpoints",
            &me.checkpoint_pk(shard),
            &Update::new(),
        )
        .await?
        .map_err(|c| c.unexpected("delete_checkpoints"))
    }

    /// Removes slot page `page` (none of its slots is in use) if it is
    /// still as page write `write` left it: a delete that lands late never
    /// removes a page written since.
    pub async fn delete_slot_page(
        &self,
        me: &Incarnation,
        page: u32,
        write: u64,
    ) -> Result<(), StoreError> {
        let mut unchanged = Update::new();
        unchanged.require("(attribute_not_exists(Pk) OR page_write = :write)");
        unchanged.value(":write", n(write));
        // A failed condition: a later write there is not this delete's to remove.
        let _ = self
            .delete_item("delete_slot_page", &me.slot_page_pk(page), &unchanged)
            .await?;
        Ok(())
    }

    /// Everything a (dead) incarnation checkpointed: shard 0 and the rest,
    /// slotted entries through its slot pages, strongly consistent, highest
    /// sequence per stream and token.
    ///
    /// The worker item first (it names the other items), then the rest in
    /// one batch per hundred: a survivor taking over a worker of 5,000
    /// streams read its ~80 items one after the other before its first
    /// acquire (`batch_get_checkpoints` counts the batches in the metrics,
    /// `get_unprocessed` the keys a batch left).
    pub async fn checkpoints_of(&self, who: &Incarnation) -> Result<Checkpoints, StoreError> {
        let Some(worker) = self.get_raw("get_worker", &who.pk()).await? else {
            return Ok(Checkpoints::new());
        };
        let record = super::codec::worker_record(&worker).map_err(|m| self.malformed(m))?;
        let shard_pks: Vec<String> = (1..record.checkpoint_shards.max(1))
            .map(|shard| who.checkpoint_pk(shard))
            .collect();
        let shard0 = packed_shard(&worker);
        // Slot pages are read with the shards (whether an entry in them is
        // slotted is only known once they are in, and a second round trip
        // would cost more than the pages), and not at all when shard 0 is
        // the only one and names no slot.
        let pages_wanted = !shard0.slotted.is_empty() || !shard_pks.is_empty();
        let page_pks: Vec<String> = record
            .slot_pages
            .iter()
            .filter(|_| pages_wanted)
            .map(|page| who.slot_page_pk(*page))
            .collect();
        let keys = shard_pks
            .iter()
            .chain(&page_pks)
            .map(|pk| key_item(pk))
            .collect();
        let mut items: HashMap<String, Item> = self
            .batch_get_consistent("batch_get_checkpoints", keys)
            .await?
            .into_iter()
            .filter_map(|item| Some((pk_of(&item)?.to_owned(), item)))
            .collect();
        let mut shards = vec![shard0];
        shards.extend(
            shard_pks
                .iter()
                .filter_map(|pk| items.remove(pk))
                .map(|item| packed_shard(&item)),
        );
        let mut slots = SlotPage::new();
        if shards.iter().any(|s| !s.slotted.is_empty()) {
            for item in page_pks.iter().filter_map(|pk| items.remove(pk)) {
                slots.extend(slot_page(&item));
            }
        }
        Ok(resolve(&shards, &slots))
    }

    /// Deletes what a DEAD or LEFT incarnation packed (its worker item is
    /// `forget_worker`'s).
    pub(super) async fn delete_packed_items(
        &self,
        who: &Incarnation,
        shards: u32,
        slot_pages: &[u32],
    ) -> Result<(), StoreError> {
        for shard in 1..shards.max(1) {
            self.delete_checkpoint_shard(who, shard).await?;
        }
        for page in slot_pages {
            self.delete_item("delete_slot_page", &who.slot_page_pk(*page), &Update::new())
                .await?
                .map_err(|c| c.unexpected("delete_slot_page"))?;
        }
        Ok(())
    }

    /// Puts one of this incarnation's own items (nobody else writes them),
    /// with its key and the TTL of a live worker's, under `guard`.
    async fn put_own_item(
        &self,
        operation: &'static str,
        pk: &str,
        mut item: Item,
        guard: &Update,
    ) -> Result<Result<(), ConditionFailed>, StoreError> {
        item.insert(attr::PK.to_string(), s(pk));
        item.insert(attr::EXPIRES_AT.to_string(), ttl(LIVE_ITEM_TTL));
        self.put_item(operation, item, guard).await
    }
}

/// The attributes of a shard's entries, in whichever forms it has.
pub(super) fn entries_item(entries: &PackedShard) -> Item {
    let mut item = Item::new();
    if let Some(v) = entries.named_value() {
        item.insert(attr::CHECKPOINTS.to_string(), v);
    }
    if let Some(v) = entries.slotted_value() {
        item.insert(attr::SLOTTED_CHECKPOINTS.to_string(), v);
    }
    item
}
