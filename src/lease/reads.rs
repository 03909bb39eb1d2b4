//! Reading streams: one item, all items (CLI), and the index partitions the
//! fleet queries: unowned streams, one incarnation's streams, version-1
//! orphans. A malformed item never fails a read: it is returned apart, so the
//! caller can report it and serve the rest.

use super::admin::{CHANGE_INDEX, HOLDER_INDEX, LEGACY_INDEX};
use super::client::LeaseStore;
use super::codec::{Malformed, attr, pk_of, s, stream_record};
use super::error::StoreError;
use super::keys::{
    CHANGE_SHARDS, HOLDER_SHARDS, Incarnation, STREAM_PK_PREFIX, StreamKey, change_shard,
    unowned_holder,
};
use super::pages::PartitionQuery;
use super::record::{DesiredState, StreamRecord};
use aws_sdk_dynamodb::types::ReturnConsumedCapacity;

/// A bounded read of one holder partition ([`LeaseStore::sample_holder`]).
#[derive(Debug, Default)]
pub struct Sample {
    pub found: Found,
    /// Every item of the partition was read (fewer than the limit were there).
    pub complete: bool,
    /// The first item from the partition's start, when the read went there.
    pub first: Option<String>,
}

/// Items read, and the ones that could not be.
#[derive(Debug, Default)]
pub struct Found {
    pub records: Vec<StreamRecord>,
    pub malformed: Vec<Malformed>,
}

impl Found {
    fn extend(&mut self, items: Vec<super::codec::Item>) {
        for item in items {
            match stream_record(&item) {
                Ok(r) => self.records.push(r),
                Err(m) => self.malformed.push(m),
            }
        }
    }
}

impl LeaseStore {
    /// One stream (tombstones included), strongly consistent.
    pub async fn get(&self, key: &StreamKey) -> Result<Option<StreamRecord>, StoreError> {
        self.get_as("get_item", key).await
    }

    /// The stream as a refused write's condition saw it: the item the
    /// refusal carried (`LeaseStore::update_item_or_current`), or, when it
    /// carried none (no item, or a store that does not send it), the item
    /// read back, strongly consistent. A refusal's item may be older than a
    /// read would be, never newer.
    pub(super) async fn current_after_refusal(
        &self,
        key: &StreamKey,
        refused: Option<&super::codec::Item>,
    ) -> Result<Option<StreamRecord>, StoreError> {
        match refused {
            Some(item) => stream_record(item).map(Some).map_err(|m| self.malformed(m)),
            None => self.get(key).await,
        }
    }

    /// [`LeaseStore::get`] by a holder re-reading the stream it holds (told
    /// of a change, or its turn in the audit's sweep): counted apart in the
    /// metrics, so the owners' re-reads and everyone else's reads (the
    /// controller's status among them) can each be seen.
    pub async fn reread(&self, key: &StreamKey) -> Result<Option<StreamRecord>, StoreError> {
        self.get_as("reread_item", key).await
    }

    async fn get_as(
        &self,
        operation: &'static str,
        key: &StreamKey,
    ) -> Result<Option<StreamRecord>, StoreError> {
        let pk = key.pk();
        let out = self
            .call_plain(operation, Some(&pk), || {
                self.client
                    .get_item()
                    .table_name(&self.table)
                    .key(attr::PK, s(&pk))
                    .consistent_read(true)
                    .return_consumed_capacity(ReturnConsumedCapacity::Total)
                    .send()
            })
            .await?;
        self.record_reads(operation, out.consumed_capacity());
        out.item()
            .map(|item| stream_record(item).map_err(|m| self.malformed(m)))
            .transpose()
    }

    /// Every stream that is not deleted, sorted by name (a scan: for the CLI).
    pub async fn list(&self) -> Result<Found, StoreError> {
        let mut found = Found::default();
        found.extend(self.scan_prefix("scan", STREAM_PK_PREFIX).await?);
        found.records.retain(|r| !r.is_tombstone());
        found.records.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(found)
    }

    /// STARTED streams nobody owns, in one `holder` shard. The items carry only
    /// what the index projects (no spec): enough to classify and acquire.
    pub async fn unowned(&self, shard: u32) -> Result<Found, StoreError> {
        let holder = unowned_holder(shard);
        let mut found = Found::default();
        found.extend(
            self.query_partition(PartitionQuery {
                operation: "query_unowned",
                index: HOLDER_INDEX,
                partition_attr: attr::HOLDER,
                partition: &holder,
                sort_below: None,
                sort_above: None,
            })
            .await?,
        );
        Ok(found)
    }

    /// At most `limit` items of the `holder` partition, read from just after
    /// the stream key `after` (a `Pk`, which need not exist) to the
    /// partition's end and on from its start: workers that read one partition
    /// from different places contend less for the same orphans, and a pass
    /// reads what it may take, not the whole partition (100,000 orphans on
    /// 20 workers read whole took minutes). The order within a partition is
    /// the store's (DynamoDB's is not by name); any start reaches every item.
    pub async fn sample_holder(
        &self,
        operation: &'static str,
        holder: &str,
        limit: usize,
        after: Option<&str>,
    ) -> Result<Sample, StoreError> {
        let query = || PartitionQuery {
            operation,
            index: HOLDER_INDEX,
            partition_attr: attr::HOLDER,
            partition: holder,
            sort_below: None,
            sort_above: None,
        };
        let start = after.map(|pk| {
            std::collections::HashMap::from([
                (attr::HOLDER.to_string(), s(holder)),
                (attr::PK.to_string(), s(pk)),
            ])
        });
        let (mut items, reached_end) = self
            .query_partition_from(query(), start, Some(limit))
            .await?;
        let mut sample = Sample::default();
        let mut complete = reached_end && after.is_none();
        if after.is_some() && reached_end && items.len() < limit {
            // Wrapped around: on from the start, until the limit or the first
            // item the first leg read (everything before it was read then).
            let read: std::collections::HashSet<String> = items
                .iter()
                .filter_map(|item| pk_of(item).map(str::to_owned))
                .collect();
            let (front, front_end) = self
                .query_partition_from(query(), None, Some(limit - items.len()))
                .await?;
            sample.first = front.first().and_then(pk_of).map(str::to_owned);
            let mut met = false;
            for item in front {
                if pk_of(&item).is_some_and(|pk| read.contains(pk)) {
                    met = true;
                } else {
                    items.push(item);
                }
            }
            complete = front_end || met;
        } else if after.is_none() {
            sample.first = items.first().and_then(pk_of).map(str::to_owned);
        }
        sample.found.extend(items);
        sample.complete = complete;
        Ok(sample)
    }

    /// The `Pk` of the last item of the `holder` partition in the store's
    /// order (one item read backwards): with the first, the range a bounded
    /// read picks its start from.
    pub async fn last_in_holder(&self, holder: &str) -> Result<Option<String>, StoreError> {
        let out = self
            .call_plain("query_holder_end", None, || {
                self.client
                    .query()
                    .table_name(&self.table)
                    .index_name(HOLDER_INDEX)
                    .key_condition_expression("#p = :p")
                    .expression_attribute_names("#p", attr::HOLDER)
                    .expression_attribute_values(":p", s(holder))
                    .scan_index_forward(false)
                    .limit(1)
                    .return_consumed_capacity(ReturnConsumedCapacity::Total)
                    .send()
            })
            .await?;
        self.record_reads("query_holder_end", out.consumed_capacity());
        Ok(out.items().first().and_then(pk_of).map(str::to_owned))
    }

    /// Every stream an incarnation holds, across its shards (index items).
    pub async fn held_by(&self, owner: &Incarnation) -> Result<Found, StoreError> {
        let mut found = Found::default();
        for shard in 0..HOLDER_SHARDS {
            let holder = owner.holder(shard);
            found.extend(
                self.query_partition(PartitionQuery {
                    operation: "query_held",
                    index: HOLDER_INDEX,
                    partition_attr: attr::HOLDER,
                    partition: &holder,
                    sort_below: None,
                    sort_above: None,
                })
                .await?,
            );
        }
        Ok(found)
    }

    /// STARTED streams version-1 workers left behind: released (expiry 0) or
    /// with a lapsed per-stream lease before `now_ms`. Only while `by_state`
    /// exists (a rolling upgrade); the acquire's condition decides.
    pub async fn legacy_orphans(&self, now_ms: u64) -> Result<Found, StoreError> {
        let mut found = Found::default();
        found.extend(
            self.query_partition(PartitionQuery {
                operation: "query_legacy",
                index: LEGACY_INDEX,
                partition_attr: attr::DESIRED_STATE,
                partition: DesiredState::Started.as_str(),
                sort_below: Some((attr::LEASE_EXPIRES_AT_MS, now_ms)),
                sort_above: None,
            })
            .await?,
        );
        Ok(found)
    }
}

/// One entry of the controller's change feed (the `by_change` index): a
/// stream item of an installation and when it last changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub key: StreamKey,
    /// The resource that wrote the item.
    pub uid: Option<String>,
    /// The writer's wall clock at the write.
    pub changed_at_ms: u64,
    /// How many writes the item has had (with the time, which change this is).
    pub change_seq: u64,
    /// A tombstone (its resource was deleted).
    pub deleted: bool,
}

fn change_of(item: &super::codec::Item) -> Option<Change> {
    let text = |a: &str| item.get(a).and_then(|v| v.as_s().ok()).cloned();
    let number = |a: &str| {
        item.get(a)
            .and_then(|v| v.as_n().ok())
            .and_then(|v| v.parse().ok())
    };
    Some(Change {
        key: StreamKey::from_pk(&text(attr::PK)?)?,
        uid: text(attr::UID),
        changed_at_ms: number(attr::CHANGED_AT_MS)?,
        change_seq: number(attr::CHANGE_SEQ).unwrap_or(0),
        deleted: item.contains_key(attr::DELETED_AT_MS),
    })
}

impl LeaseStore {
    /// `installation`'s streams that changed after `since_ms` (by their
    /// writers' clocks; `0`: all of them), from every change shard. One query
    /// per shard, each reading only the index's small entries: at steady
    /// state a few bytes, whatever the number of streams. Eventually
    /// consistent, so callers look back a little before their last pass.
    pub async fn changes(
        &self,
        installation: &str,
        since_ms: u64,
    ) -> Result<Vec<Change>, StoreError> {
        let mut changes = Vec::new();
        for shard in 0..CHANGE_SHARDS {
            let partition = change_shard(installation, shard);
            let items = self
                .query_partition(PartitionQuery {
                    operation: "query_changes",
                    index: CHANGE_INDEX,
                    partition_attr: attr::CHANGE_SHARD,
                    partition: &partition,
                    sort_below: None,
                    sort_above: (since_ms > 0).then_some((attr::CHANGED_AT_MS, since_ms)),
                })
                .await?;
            changes.extend(items.iter().filter_map(change_of));
        }
        Ok(changes)
    }
}
