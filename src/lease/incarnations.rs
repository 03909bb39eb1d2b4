//! Worker items: one per process incarnation, renewed every heartbeat.
//!
//! Liveness is proven per worker, not per stream. A renewal bumps
//! `heartbeat_version` under the condition `worker_state = LIVE`; a peer that
//! has watched the version stand still for a whole lease (on its own monotonic
//! clock) marks the item DEAD under the condition that the version is still the
//! one it watched. Once DEAD an incarnation can never renew again, so its
//! streams can be moved without transactions. The same item carries the
//! worker's packed checkpoints (shard 0), its load for fair share, and an inbox
//! of streams the control plane changed.

use super::changes::{CHANGES_PK, changes_of};
use super::client::{ConditionFailed, LeaseStore};
use super::clock::now_ms;
use super::codec::{Item, Malformed, attr, fleet_entry, key_item, n, pk_of, s, worker_record};
use super::error::StoreError;
use super::keys::{FLEET_HOLDER, Incarnation, StreamKey};
use super::pages::PartitionQuery;
use super::record::{FleetEntry, InboxEntry, PackedShard, PodIdentity, WorkerRecord, WorkerState};
use super::update::Update;
use aws_sdk_dynamodb::types::{
    AttributeValue, KeysAndAttributes, ReturnConsumedCapacity, ReturnValue,
};
use std::time::Duration;

/// TTL of a live worker's item, refreshed by every renewal: long enough never
/// to lapse under a live worker, short enough that crashed ones disappear.
pub(super) const LIVE_ITEM_TTL: Duration = Duration::from_secs(24 * 3600);
/// TTL of a DEAD or LEFT worker's items (their checkpoints are needed only
/// until their streams have moved).
const ENDED_ITEM_TTL: Duration = Duration::from_secs(3600);
/// DynamoDB's BatchGetItem limit.
const BATCH_GET_LIMIT: usize = 100;
/// Retries of BatchGetItem's unprocessed keys ...
const BATCH_GET_ATTEMPTS: u32 = 5;
/// ... the first this long after the answer, each further one twice as
/// long (0.75 s in all).
const BATCH_GET_BACKOFF: Duration = Duration::from_millis(50);

pub(super) fn ttl(from_now: Duration) -> AttributeValue {
    n(now_ms() / 1000 + from_now.as_secs())
}

/// One renewal: what the worker reports and what it has handled.
#[derive(Debug, Default)]
pub struct Renewal<'a> {
    pub version: u64,
    /// When the renewal was made, this worker's wall clock (`heartbeat_at_ms`),
    /// taken before `held` was counted.
    pub at_ms: u64,
    /// The lease, for the informational `alive_until_ms` people read.
    pub lease_ms: u64,
    /// Streams held whose release is not stamped (the load fair share reads).
    pub held: u64,
    /// Checkpoint shard 0.
    pub shard0: &'a PackedShard,
    /// How many checkpoint shards exist in all (0: none, 1: only shard 0).
    pub checkpoint_shards: u32,
    /// The slot pages written so far (what slotted entries may name).
    pub slot_pages: &'a [u32],
    /// Inbox entries handled since the last renewal (their stored elements).
    pub handled: Vec<String>,
}

/// What a renewal found.
#[derive(Debug, PartialEq)]
pub enum RenewOutcome {
    /// Renewed; the inbox of streams the control plane changed.
    Renewed { changed: Vec<InboxEntry> },
    /// A peer declared this incarnation dead: everything it held has moved or
    /// will move. It must stop serving and start over as a new incarnation.
    Dead,
}

/// The keys of `who`'s worker items.
fn worker_keys(who: &[Incarnation]) -> Vec<Item> {
    who.iter().map(|w| key_item(&w.pk())).collect()
}

/// Worker records of `items`; unreadable ones are logged and skipped (a
/// peer's item that cannot be read is never taken for a death).
fn parse_workers(items: Vec<Item>) -> Vec<WorkerRecord> {
    items
        .iter()
        .filter_map(|item| match worker_record(item) {
            Ok(w) => Some(w),
            Err(m) => {
                tracing::debug!(pk = %m.pk, detail = %m.detail, "unreadable worker item");
                None
            }
        })
        .collect()
}

/// What one watch read found: the change counter and the watched peers' items.
#[derive(Debug, Default)]
pub struct Watched {
    /// The change counter (0 before its first move), when it was asked for.
    pub changes: Option<u64>,
    pub workers: Vec<WorkerRecord>,
}

/// The fleet as the index shows it.
#[derive(Debug, Default)]
pub struct WorkerItems {
    pub workers: Vec<FleetEntry>,
    pub malformed: Vec<Malformed>,
}

impl LeaseStore {
    /// Writes a new incarnation's item (LIVE, version 0).
    pub async fn register(
        &self,
        me: &Incarnation,
        pod: Option<&PodIdentity>,
    ) -> Result<(), StoreError> {
        self.register_at(me, pod, None).await
    }

    /// [`LeaseStore::register`], with where peers poke this incarnation
    /// (`WorkerRecord::poke_addr`) when it has such an address.
    pub async fn register_at(
        &self,
        me: &Incarnation,
        pod: Option<&PodIdentity>,
        poke_addr: Option<std::net::SocketAddr>,
    ) -> Result<(), StoreError> {
        let pk = me.pk();
        let now = now_ms();
        let mut absent = Update::new();
        absent.require("attribute_not_exists(Pk)");
        let mut item = Item::from([
            (attr::PK.to_string(), s(&pk)),
            (attr::HOLDER.to_string(), s(FLEET_HOLDER)),
            (attr::INCARNATION.to_string(), s(me.as_str())),
            (
                attr::WORKER_STATE.to_string(),
                s(WorkerState::Live.as_str()),
            ),
            (attr::HEARTBEAT_VERSION.to_string(), n(0)),
            (attr::HEARTBEAT_AT_MS.to_string(), n(now)),
            (attr::CREATED_AT_MS.to_string(), n(now)),
            (attr::HELD.to_string(), n(0)),
            (
                attr::ANNOUNCES_CHANGES.to_string(),
                AttributeValue::Bool(true),
            ),
            (attr::READS_SLOTS.to_string(), AttributeValue::Bool(true)),
            // Every worker of this release pokes its peers (`worker::pokes`).
            (attr::POKES_PEERS.to_string(), AttributeValue::Bool(true)),
            (attr::EXPIRES_AT.to_string(), ttl(LIVE_ITEM_TTL)),
        ]);
        if let Some(addr) = poke_addr {
            item.insert(attr::POKE_ADDR.to_string(), s(addr.to_string()));
        }
        if let Some(pod) = pod {
            item.insert(attr::POD_UID.to_string(), s(&pod.uid));
            item.insert(attr::POD_CONTAINER.to_string(), s(&pod.container));
            item.insert(attr::RESTART_COUNT.to_string(), n(pod.restart_count));
        }
        match self.put_item("register", item, &absent).await? {
            Ok(()) => {}
            // A retry (here or by the caller, with a later clock) of a put
            // that landed: 64 random bits drawn by this process mean nobody
            // else writes this item, so it is ours. If a lease passed and it
            // was declared dead meanwhile, the first renewal finds out.
            Err(ConditionFailed) => match self.worker(me).await? {
                Some(w) if w.incarnation == *me => {}
                _ => {
                    return Err(StoreError::Rejected {
                        operation: "register",
                        detail: format!("incarnation {me} already exists"),
                    });
                }
            },
        }
        // After the item: an enrolled incarnation without an item is taken
        // for one whose item vanished, and declared dead. (No change is
        // announced here: the acquirer announces the newcomer after its
        // first full pass, when it takes streams.)
        self.enroll(me).await
    }

    /// Renews this incarnation: bumps the version, writes load and checkpoint
    /// shard 0, and returns the inbox. Fails only if it is no longer LIVE.
    #[tracing::instrument(name = "lease.renew", skip_all, fields(worker = %me))]
    pub async fn renew(
        &self,
        me: &Incarnation,
        renewal: &Renewal<'_>,
    ) -> Result<RenewOutcome, StoreError> {
        let pk = me.pk();
        let mut update = Update::new();
        update.set(attr::HEARTBEAT_VERSION, ":v", n(renewal.version));
        update.set(attr::HEARTBEAT_AT_MS, ":now", n(renewal.at_ms));
        update.set(
            attr::ALIVE_UNTIL_MS,
            ":until",
            n(renewal.at_ms + renewal.lease_ms),
        );
        update.set(attr::HELD, ":held", n(renewal.held));
        // Each attribute only while it has something: an absent one costs
        // nothing in every later write of the item.
        let mut set_or_remove =
            |name: &'static str, placeholder: &str, v: Option<AttributeValue>| match v {
                Some(v) => update.set(name, placeholder, v),
                None => update.remove(name),
            };
        set_or_remove(attr::CHECKPOINTS, ":ck", renewal.shard0.named_value());
        set_or_remove(
            attr::SLOTTED_CHECKPOINTS,
            ":slotted",
            renewal.shard0.slotted_value(),
        );
        set_or_remove(
            attr::SLOT_PAGES,
            ":pages",
            (!renewal.slot_pages.is_empty()).then(|| {
                AttributeValue::Ns(renewal.slot_pages.iter().map(u32::to_string).collect())
            }),
        );
        update.set(
            attr::CHECKPOINT_SHARDS,
            ":shards",
            n(renewal.checkpoint_shards),
        );
        update.set(attr::EXPIRES_AT, ":ttl", ttl(LIVE_ITEM_TTL));
        if !renewal.handled.is_empty() {
            update.delete(
                attr::CHANGED_STREAMS,
                ":handled",
                AttributeValue::Ss(renewal.handled.clone()),
            );
        }
        // Versions only grow: an earlier renewal's attempt that lands late
        // (its answer given up on) cannot move it back.
        update.require("worker_state = :live AND heartbeat_version < :v");
        update.value(":live", s(WorkerState::Live.as_str()));
        let out = self
            .update_item("renew", &pk, &update, ReturnValue::AllNew)
            .await?;
        match out {
            Ok(o) => {
                let changed = o
                    .attributes()
                    .map(worker_record)
                    .transpose()
                    .map_err(|m| self.malformed(m))?
                    .map(|w| w.changed_streams)
                    .unwrap_or_default();
                Ok(RenewOutcome::Renewed { changed })
            }
            // Not LIVE any more, or this very renewal landed and its answer
            // was lost (the retry then finds the version already there).
            Err(ConditionFailed) => Ok(match self.worker(me).await? {
                Some(w)
                    if w.state == WorkerState::Live && w.heartbeat_version >= renewal.version =>
                {
                    RenewOutcome::Renewed {
                        changed: w.changed_streams,
                    }
                }
                _ => RenewOutcome::Dead,
            }),
        }
    }

    /// Every worker item (the `WORKERS` index partition).
    pub async fn fleet(&self) -> Result<WorkerItems, StoreError> {
        let items = self
            .query_partition(PartitionQuery {
                operation: "query_fleet",
                index: super::admin::HOLDER_INDEX,
                partition_attr: attr::HOLDER,
                partition: FLEET_HOLDER,
                sort_below: None,
                sort_above: None,
            })
            .await?;
        let mut fleet = WorkerItems::default();
        for item in items {
            match fleet_entry(&item) {
                Ok(w) => fleet.workers.push(w),
                Err(m) => fleet.malformed.push(m),
            }
        }
        Ok(fleet)
    }

    /// One worker item, strongly consistent.
    pub async fn worker(&self, who: &Incarnation) -> Result<Option<WorkerRecord>, StoreError> {
        let item = self.get_raw("get_worker", &who.pk()).await?;
        item.map(|i| worker_record(&i).map_err(|m| self.malformed(m)))
            .transpose()
    }

    pub(super) async fn get_raw(
        &self,
        operation: &'static str,
        pk: &str,
    ) -> Result<Option<Item>, StoreError> {
        let out = self
            .call_plain(operation, Some(pk), || {
                self.client
                    .get_item()
                    .table_name(&self.table)
                    .key(attr::PK, s(pk))
                    .consistent_read(true)
                    .return_consumed_capacity(ReturnConsumedCapacity::Total)
                    .send()
            })
            .await?;
        self.record_reads(operation, out.consumed_capacity());
        Ok(out.item)
    }

    /// Several workers' items (eventually consistent: a stale read can only
    /// delay a death verdict, whose conditional write rechecks the version).
    pub async fn workers(&self, who: &[Incarnation]) -> Result<Vec<WorkerRecord>, StoreError> {
        let items = self
            .batch_get("batch_get_workers", worker_keys(who))
            .await?;
        Ok(parse_workers(items))
    }

    /// Several workers' items and, when `with_changes`, the change counter,
    /// in one request per hundred keys (eventually consistent, as
    /// [`LeaseStore::workers`]; a stale counter only delays a pickup until
    /// the next read). The counter read alone counts as `read_changes`.
    pub async fn watch(
        &self,
        who: &[Incarnation],
        with_changes: bool,
    ) -> Result<Watched, StoreError> {
        let mut keys = worker_keys(who);
        if with_changes {
            keys.push(key_item(CHANGES_PK));
        }
        let operation = if who.is_empty() {
            "read_changes"
        } else {
            "batch_get_workers"
        };
        let (counter, workers): (Vec<Item>, Vec<Item>) = self
            .batch_get(operation, keys)
            .await?
            .into_iter()
            .partition(|item| pk_of(item) == Some(CHANGES_PK));
        Ok(Watched {
            changes: with_changes.then(|| counter.first().map_or(0, changes_of)),
            workers: parse_workers(workers),
        })
    }

    /// Items by key, eventually consistent, unprocessed keys retried (a
    /// key still unprocessed after that is left out: callers of this read
    /// decide nothing on one item's absence).
    async fn batch_get(
        &self,
        operation: &'static str,
        keys: Vec<Item>,
    ) -> Result<Vec<Item>, StoreError> {
        Ok(self.batch_get_as(operation, keys, false).await?.0)
    }

    /// Items by key, strongly consistent, in one request per hundred keys
    /// instead of one each. Keys still unprocessed after the batch's
    /// retries are read one by one (`get_unprocessed`), under the store's
    /// retry policy like any read: nothing is missing from an answer, and
    /// a store that keeps throttling fails the read no sooner than others.
    pub(super) async fn batch_get_consistent(
        &self,
        operation: &'static str,
        keys: Vec<Item>,
    ) -> Result<Vec<Item>, StoreError> {
        let (mut found, left) = self.batch_get_as(operation, keys, true).await?;
        for key in left {
            let Some(pk) = pk_of(&key) else {
                continue;
            };
            found.extend(self.get_raw("get_unprocessed", pk).await?);
        }
        Ok(found)
    }

    /// Items by key, and the keys still unprocessed.
    async fn batch_get_as(
        &self,
        operation: &'static str,
        keys: Vec<Item>,
        consistent: bool,
    ) -> Result<(Vec<Item>, Vec<Item>), StoreError> {
        let mut found = Vec::new();
        let mut left = Vec::new();
        for chunk in keys.chunks(BATCH_GET_LIMIT) {
            let mut keys = chunk.to_vec();
            for attempt in 0..BATCH_GET_ATTEMPTS {
                if keys.is_empty() {
                    break;
                }
                if attempt > 0 {
                    // Unprocessed keys come back without an error (a
                    // throttled partition): the SDK's retries do not apply,
                    // so back off here as DynamoDB asks.
                    tokio::time::sleep(BATCH_GET_BACKOFF * (1 << (attempt - 1))).await;
                }
                let request = KeysAndAttributes::builder()
                    .set_keys(Some(keys.clone()))
                    .consistent_read(consistent)
                    .build()
                    .map_err(|e| StoreError::Rejected {
                        operation,
                        detail: e.to_string(),
                    })?;
                let out = self
                    .call_plain(operation, None, || {
                        self.client
                            .batch_get_item()
                            .request_items(&self.table, request.clone())
                            .return_consumed_capacity(ReturnConsumedCapacity::Total)
                            .send()
                    })
                    .await?;
                for c in out.consumed_capacity() {
                    self.record_reads(operation, Some(c));
                }
                found.extend(
                    out.responses
                        .and_then(|mut r| r.remove(&self.table))
                        .unwrap_or_default(),
                );
                keys = out
                    .unprocessed_keys
                    .and_then(|mut u| u.remove(&self.table))
                    .map(|k| k.keys)
                    .unwrap_or_default();
            }
            left.extend(keys);
        }
        Ok((found, left))
    }

    /// Marks `who` DEAD if its version is still `observed_version` and it is
    /// LIVE. Returns its state afterwards (DEAD whoever marked it).
    #[tracing::instrument(name = "lease.declare_dead", skip_all, fields(worker = %who, observed_version = observed_version))]
    pub async fn declare_dead(
        &self,
        who: &Incarnation,
        observed_version: u64,
    ) -> Result<Option<WorkerState>, StoreError> {
        let mut update = Update::new();
        update.set(attr::WORKER_STATE, ":dead", s(WorkerState::Dead.as_str()));
        update.set(attr::EXPIRES_AT, ":ttl", ttl(ENDED_ITEM_TTL));
        update.require("worker_state = :live AND heartbeat_version = :v");
        update.value(":live", s(WorkerState::Live.as_str()));
        update.value(":v", n(observed_version));
        let out = self
            .update_item("declare_dead", &who.pk(), &update, ReturnValue::None)
            .await?;
        let state = match out {
            Ok(_) => Some(WorkerState::Dead),
            Err(ConditionFailed) => self.worker(who).await?.map(|w| w.state),
        };
        // Whoever marked it. A marker that crashed before its bump leaves
        // the others to the takers' load bumps, or their next full pass.
        if state == Some(WorkerState::Dead) {
            self.announce_change().await;
        }
        Ok(state)
    }

    /// Marks DEAD the LIVE incarnations of an earlier container of this pod:
    /// the kubelet restarted the container, so that process is gone. Returns
    /// the incarnations marked.
    pub async fn declare_restarted_dead(
        &self,
        me: &Incarnation,
        pod: &PodIdentity,
        fleet: &[FleetEntry],
    ) -> Result<Vec<Incarnation>, StoreError> {
        let candidates: Vec<Incarnation> = fleet
            .iter()
            .filter(|w| w.state == WorkerState::Live && &w.incarnation != me)
            .map(|w| w.incarnation.clone())
            .collect();
        let mut marked = Vec::new();
        for w in self.workers(&candidates).await? {
            let Some(theirs) = &w.pod else { continue };
            if theirs.uid != pod.uid
                || theirs.container != pod.container
                || theirs.restart_count >= pod.restart_count
            {
                continue;
            }
            let mut update = Update::new();
            update.set(attr::WORKER_STATE, ":dead", s(WorkerState::Dead.as_str()));
            update.set(attr::EXPIRES_AT, ":ttl", ttl(ENDED_ITEM_TTL));
            update.require(
                "worker_state = :live AND pod_uid = :uid AND pod_container = :container AND restart_count < :restarts",
            );
            update.value(":live", s(WorkerState::Live.as_str()));
            update.value(":uid", s(&pod.uid));
            update.value(":container", s(&pod.container));
            update.value(":restarts", n(pod.restart_count));
            let out = self
                .update_item(
                    "declare_dead",
                    &w.incarnation.pk(),
                    &update,
                    ReturnValue::None,
                )
                .await?;
            if out.is_ok() {
                marked.push(w.incarnation.clone());
            }
        }
        if !marked.is_empty() {
            self.announce_change().await;
        }
        Ok(marked)
    }

    /// Records that this incarnation just released streams: the attribute is
    /// in the fleet query, so peers scan for orphans on their next pass.
    pub async fn mark_released(&self, me: &Incarnation) -> Result<(), StoreError> {
        self.stamp_live(me, "mark_released", attr::RELEASED_AT_MS)
            .await
    }

    /// Announces that this incarnation is draining: peers stop counting it in
    /// the fair share before its streams arrive, so they take them at once.
    pub async fn mark_draining(&self, me: &Incarnation) -> Result<(), StoreError> {
        self.stamp_live(me, "mark_draining", attr::DRAINING_AT_MS)
            .await
    }

    /// Sets `attribute` to now on this incarnation's item while it is LIVE
    /// (an announcement; a lost condition means it is not LIVE and is moot).
    async fn stamp_live(
        &self,
        me: &Incarnation,
        operation: &'static str,
        attribute: &'static str,
    ) -> Result<(), StoreError> {
        let mut update = Update::new();
        update.set("#stamp", ":now", n(now_ms()));
        update.name("#stamp", attribute);
        update.require("worker_state = :live");
        update.value(":live", s(WorkerState::Live.as_str()));
        // A lost condition means it is not LIVE: the announcement is moot.
        if self
            .update_item(operation, &me.pk(), &update, ReturnValue::None)
            .await?
            .is_ok()
        {
            self.announce_change().await;
        }
        Ok(())
    }

    /// Marks this incarnation LEFT after a graceful shutdown released everything.
    pub async fn leave(&self, me: &Incarnation) -> Result<(), StoreError> {
        let mut update = Update::new();
        update.set(attr::WORKER_STATE, ":left", s(WorkerState::Left.as_str()));
        update.set(attr::EXPIRES_AT, ":ttl", ttl(ENDED_ITEM_TTL));
        update.set(attr::HELD, ":zero", n(0));
        update.require("worker_state = :live");
        update.value(":live", s(WorkerState::Live.as_str()));
        self.update_item("leave", &me.pk(), &update, ReturnValue::None)
            .await?
            .map_err(|_| StoreError::Rejected {
                operation: "leave",
                detail: format!("{me} is no longer LIVE"),
            })?;
        self.announce_change().await;
        Ok(())
    }

    /// Deletes a DEAD or LEFT incarnation's items once it holds nothing
    /// (`record`: its worker item as last read, which names the others).
    pub async fn forget_worker(
        &self,
        who: &Incarnation,
        record: Option<&WorkerRecord>,
    ) -> Result<(), StoreError> {
        if let Some(r) = record {
            self.delete_packed_items(who, r.checkpoint_shards, &r.slot_pages)
                .await?;
        }
        let mut not_live = Update::new();
        not_live.require("worker_state <> :live");
        not_live.value(":live", s(WorkerState::Live.as_str()));
        let deleted = self
            .delete_item("forget_worker", &who.pk(), &not_live)
            .await?;
        // Off the roster only once its item is gone and it holds nothing.
        if deleted.is_ok() {
            self.unenroll(who).await?;
        }
        Ok(())
    }

    /// Tells `owner` that `key` changed (desired state, spec, deletion): it
    /// re-reads the stream after its next renewal. A dead or departed owner
    /// has nothing to be told.
    pub async fn notify_owner(
        &self,
        owner: &Incarnation,
        key: &StreamKey,
    ) -> Result<(), StoreError> {
        let mut update = Update::new();
        update.add(
            attr::CHANGED_STREAMS,
            ":k",
            AttributeValue::Ss(vec![InboxEntry::new(key).raw]),
        );
        // A dead or departed owner has nothing to be told.
        update.require("worker_state = :live");
        update.value(":live", s(WorkerState::Live.as_str()));
        self.update_item("notify_owner", &owner.pk(), &update, ReturnValue::None)
            .await?
            .ok();
        Ok(())
    }
}
