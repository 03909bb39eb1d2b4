//! Table administration: create, check, and upgrade in place.
//!
//! The table has two indexes. `by_holder` (partition key `holder`): STARTED
//! streams nobody owns sit in `UNOWNED#<shard>`, a worker's streams in
//! `<incarnation>#<shard>`, worker items in `WORKERS`; an item moves between
//! partitions only when its ownership changes. `by_change` (`change_shard`,
//! `changed_at_ms`): an installation's streams by when they last changed, the
//! controller's change feed. Tables made by version 1 also
//! have `by_state` (`desired_state` / `lease_expires_at_ms`); it is kept while
//! version-1 workers may still run, and dropped by `tether table finish-upgrade`.

use super::client::LeaseStore;
use super::clock::now_ms;
use super::codec::{CHANGE_INDEX_ATTRIBUTES, HOLDER_INDEX_ATTRIBUTES, attr, n, s};
use super::error::StoreError;
use super::keys::STREAM_PK_PREFIX;
use super::record::{DesiredState, Ownership, StreamRecord};
use super::update::Update;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, CreateGlobalSecondaryIndexAction,
    DeleteGlobalSecondaryIndexAction, GlobalSecondaryIndex, GlobalSecondaryIndexUpdate,
    IndexStatus, KeySchemaElement, KeyType, Projection, ProjectionType, ProvisionedThroughput,
    ReturnValue, ScalarAttributeType, TableStatus, TimeToLiveSpecification,
};
use std::time::{Duration, Instant};

/// The index the protocol queries.
pub const HOLDER_INDEX: &str = "by_holder";
/// The controller's change feed (see [`IndexSpec::change`]).
pub const CHANGE_INDEX: &str = "by_change";
/// Version 1's index, kept during a rolling upgrade.
pub const LEGACY_INDEX: &str = "by_state";
/// How long `table create` waits for the table and its index to become ACTIVE.
const TABLE_ACTIVE_TIMEOUT: Duration = Duration::from_secs(600);
/// Poll interval while waiting for ACTIVE.
const TABLE_POLL: Duration = Duration::from_millis(200);
/// A version-1 lease counts as lapsed this long after its expiry (room for
/// the clocks of the version-1 writer and of whoever runs finish-upgrade).
const LEGACY_LAPSE_ALLOWANCE_MS: u64 = 5_000;
/// finish-upgrade waits at most this long for a version-1 lease to lapse
/// (version 1's default lease is 20 s).
const MAX_LEGACY_LAPSE_WAIT_MS: u64 = 60_000;

/// What `tether table create` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TableChange {
    Created,
    /// An existing version-1 table got the `by_holder` index.
    Upgraded,
    Unchanged,
}

/// Which indexes an existing table has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableLayout {
    pub active: bool,
    /// `by_holder`: `Some(active)` when present.
    pub holder_index: Option<bool>,
    /// `by_change`: `Some(active)` when present (tables made before it have
    /// none until `tether table create` adds it; the controller then polls).
    pub change_index: Option<bool>,
    /// `by_state` (version 1) is present.
    pub legacy_index: bool,
    /// `(read, write)` capacity units of a provisioned table; `None` on demand.
    pub provisioned: Option<(i64, i64)>,
}

fn key(name: &str, kind: KeyType) -> KeySchemaElement {
    KeySchemaElement::builder()
        .attribute_name(name)
        .key_type(kind)
        .build()
        .expect("both required fields are set")
}

fn def(name: &str, kind: ScalarAttributeType) -> AttributeDefinition {
    AttributeDefinition::builder()
        .attribute_name(name)
        .attribute_type(kind)
        .build()
        .expect("both required fields are set")
}

fn include(attributes: &[&str]) -> Projection {
    let mut p = Projection::builder().projection_type(ProjectionType::Include);
    for a in attributes {
        p = p.non_key_attributes(*a);
    }
    p.build()
}

/// One index of the table: its keys (with their types) and projection.
struct IndexSpec {
    name: &'static str,
    keys: Vec<(&'static str, KeyType, ScalarAttributeType)>,
    projection: Projection,
}

impl IndexSpec {
    /// The protocol's index: who holds what (see the module docs).
    fn holder() -> Self {
        Self {
            name: HOLDER_INDEX,
            keys: vec![(attr::HOLDER, KeyType::Hash, ScalarAttributeType::S)],
            projection: include(&HOLDER_INDEX_ATTRIBUTES),
        }
    }

    /// The controller's change feed: one installation's streams by when they
    /// last changed, spread over [`super::keys::CHANGE_SHARDS`] partitions.
    fn change() -> Self {
        Self {
            name: CHANGE_INDEX,
            keys: vec![
                (attr::CHANGE_SHARD, KeyType::Hash, ScalarAttributeType::S),
                (attr::CHANGED_AT_MS, KeyType::Range, ScalarAttributeType::N),
            ],
            projection: include(&CHANGE_INDEX_ATTRIBUTES),
        }
    }

    fn key_schema(&self) -> Vec<KeySchemaElement> {
        self.keys
            .iter()
            .map(|(a, k, _)| key(a, k.clone()))
            .collect()
    }

    fn definitions(&self) -> Vec<AttributeDefinition> {
        self.keys
            .iter()
            .map(|(a, _, t)| def(a, t.clone()))
            .collect()
    }

    fn present(&self, layout: &TableLayout) -> Option<bool> {
        match self.name {
            HOLDER_INDEX => layout.holder_index,
            _ => layout.change_index,
        }
    }
}

impl LeaseStore {
    /// Creates the table with its indexes (on-demand billing) if missing,
    /// adds the indexes an older table lacks (one at a time, as DynamoDB
    /// requires), enables TTL for worker items, and waits until everything
    /// is ACTIVE.
    pub async fn create_table(&self) -> Result<TableChange, StoreError> {
        let specs = [IndexSpec::holder(), IndexSpec::change()];
        let mut change = match self.describe().await {
            Err(StoreError::TableNotFound { .. }) => {
                let mut definitions = vec![def(attr::PK, ScalarAttributeType::S)];
                let mut indexes = Vec::new();
                for spec in &specs {
                    definitions.extend(spec.definitions());
                    indexes.push(
                        GlobalSecondaryIndex::builder()
                            .index_name(spec.name)
                            .set_key_schema(Some(spec.key_schema()))
                            .projection(spec.projection.clone())
                            .build()
                            .expect("GSI fields are set"),
                    );
                }
                let created = self
                    .call_plain("create_table", None, || {
                        self.client
                            .create_table()
                            .table_name(&self.table)
                            .billing_mode(BillingMode::PayPerRequest)
                            .set_attribute_definitions(Some(definitions.clone()))
                            .key_schema(key(attr::PK, KeyType::Hash))
                            .set_global_secondary_indexes(Some(indexes.clone()))
                            .send()
                    })
                    .await;
                match created {
                    Ok(_) => TableChange::Created,
                    // Created concurrently by somebody else: fine.
                    Err(StoreError::Rejected { detail, .. })
                        if detail.starts_with("ResourceInUseException") =>
                    {
                        TableChange::Unchanged
                    }
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
            Ok(_) => TableChange::Unchanged,
        };
        if change != TableChange::Created {
            for spec in &specs {
                let layout = self.describe().await?;
                if spec.present(&layout).is_none() {
                    self.add_index(spec, &layout).await?;
                    change = TableChange::Upgraded;
                }
            }
        }
        self.wait_active(|l| {
            l.active && l.holder_index == Some(true) && l.change_index == Some(true)
        })
        .await?;
        self.enable_ttl().await;
        Ok(change)
    }

    /// Adds one index to an existing table and waits until it is ACTIVE.
    async fn add_index(&self, spec: &IndexSpec, layout: &TableLayout) -> Result<(), StoreError> {
        self.wait_active(|l| {
            l.active
                && [l.holder_index, l.change_index]
                    .iter()
                    .all(|i| *i != Some(false))
        })
        .await?;
        // A provisioned table's new index needs capacity of its own: it gets
        // the table's.
        let action = CreateGlobalSecondaryIndexAction::builder()
            .index_name(spec.name)
            .set_key_schema(Some(spec.key_schema()))
            .projection(spec.projection.clone())
            .set_provisioned_throughput(layout.provisioned.map(|(read, write)| {
                ProvisionedThroughput::builder()
                    .read_capacity_units(read)
                    .write_capacity_units(write)
                    .build()
                    .expect("both fields are set")
            }))
            .build()
            .expect("GSI fields are set");
        let send = |action: CreateGlobalSecondaryIndexAction| {
            let definitions = spec.definitions();
            self.call_plain("update_table", None, move || {
                self.client
                    .update_table()
                    .table_name(&self.table)
                    .set_attribute_definitions(Some(definitions.clone()))
                    .global_secondary_index_updates(
                        GlobalSecondaryIndexUpdate::builder()
                            .create(action.clone())
                            .build(),
                    )
                    .send()
            })
        };
        match send(action.clone()).await {
            // Some DynamoDB-compatible servers (dynalite) insist on capacity
            // even for an on-demand table's index.
            Err(StoreError::Rejected { detail, .. })
                if detail.contains("provisionedThroughput")
                    && action.provisioned_throughput().is_none() =>
            {
                let mut with_capacity = action;
                with_capacity.provisioned_throughput = Some(
                    ProvisionedThroughput::builder()
                        .read_capacity_units(1)
                        .write_capacity_units(1)
                        .build()
                        .expect("both fields are set"),
                );
                send(with_capacity).await?;
            }
            other => {
                other?;
            }
        }
        // DynamoDB lists a new index as CREATING at once; a server that
        // accepted the update but shows no index will never build it.
        tokio::time::sleep(TABLE_POLL).await;
        if spec.present(&self.describe().await?).is_none() {
            return Err(StoreError::Rejected {
                operation: "update_table",
                detail: format!(
                    "the server accepted adding index {} to '{}' but did not add it (this DynamoDB-compatible server cannot add indexes to existing tables)",
                    spec.name, self.table
                ),
            });
        }
        self.wait_active(|l| spec.present(l) == Some(true)).await
    }

    /// TTL on `expires_at` removes the items of workers that crashed long ago.
    /// Best effort: some DynamoDB-compatible servers lack TTL.
    async fn enable_ttl(&self) {
        let described = self
            .client
            .describe_time_to_live()
            .table_name(&self.table)
            .send()
            .await;
        let enabled = described
            .as_ref()
            .ok()
            .and_then(|d| d.time_to_live_description())
            .is_some_and(|t| {
                t.attribute_name() == Some(attr::EXPIRES_AT)
                    && matches!(
                        t.time_to_live_status(),
                        Some(
                            aws_sdk_dynamodb::types::TimeToLiveStatus::Enabled
                                | aws_sdk_dynamodb::types::TimeToLiveStatus::Enabling
                        )
                    )
            });
        if enabled {
            return;
        }
        let spec = TimeToLiveSpecification::builder()
            .attribute_name(attr::EXPIRES_AT)
            .enabled(true)
            .build()
            .expect("fields are set");
        if let Err(e) = self
            .client
            .update_time_to_live()
            .table_name(&self.table)
            .time_to_live_specification(spec)
            .send()
            .await
        {
            tracing::debug!(error = %super::client::root_cause(&e), "TTL not enabled on this server");
        }
    }

    /// Confirms the table exists and has the `by_holder` index, and reports
    /// whether version 1's index is still there.
    pub async fn check_table(&self) -> Result<TableLayout, StoreError> {
        let layout = self.describe().await?;
        if layout.holder_index.is_none() {
            return Err(StoreError::NeedsUpgrade {
                table: self.table.clone(),
            });
        }
        if !layout.active {
            tracing::warn!(table = %self.table, "table is not ACTIVE yet");
        }
        Ok(layout)
    }

    pub async fn describe(&self) -> Result<TableLayout, StoreError> {
        let out = self
            .call("describe_table", None, || {
                self.client.describe_table().table_name(&self.table).send()
            })
            .await?
            .map_err(|_| StoreError::TableNotFound {
                table: self.table.clone(),
            })?;
        let table = out.table();
        let indexes = table
            .map(|t| t.global_secondary_indexes())
            .unwrap_or_default();
        let index = |name: &str| {
            indexes
                .iter()
                .find(|g| g.index_name() == Some(name))
                // Some emulators omit the index status: treat it as ACTIVE.
                .map(|g| matches!(g.index_status(), None | Some(IndexStatus::Active)))
        };
        let on_demand = table
            .and_then(|t| t.billing_mode_summary())
            .and_then(|b| b.billing_mode())
            == Some(&BillingMode::PayPerRequest);
        let provisioned = table
            .and_then(|t| t.provisioned_throughput())
            .filter(|_| !on_demand)
            .map(|p| {
                (
                    p.read_capacity_units().unwrap_or(0).max(1),
                    p.write_capacity_units().unwrap_or(0).max(1),
                )
            });
        Ok(TableLayout {
            provisioned,
            active: table.and_then(|t| t.table_status()) == Some(&TableStatus::Active),
            holder_index: index(HOLDER_INDEX),
            change_index: index(CHANGE_INDEX),
            legacy_index: index(LEGACY_INDEX).is_some(),
        })
    }

    async fn wait_active(&self, ready: impl Fn(&TableLayout) -> bool) -> Result<(), StoreError> {
        let started = Instant::now();
        loop {
            let layout = self.describe().await?;
            if ready(&layout) {
                return Ok(());
            }
            if started.elapsed() > TABLE_ACTIVE_TIMEOUT {
                return Err(StoreError::Rejected {
                    operation: "create_table",
                    detail: format!("table '{}' did not become ACTIVE in time", self.table),
                });
            }
            tokio::time::sleep(TABLE_POLL).await;
        }
    }

    /// Ends a rolling upgrade from version 1: gives every free STARTED stream
    /// that lacks one its `holder` (version-1 writers never set it), frees the
    /// STARTED streams still under a version-1 lease once it has lapsed (after
    /// `by_state` is gone, nothing else would find them), then drops
    /// `by_state`. Run it only once no version-1 process uses the table.
    /// Returns how many items were given a holder. A scan: an administrative
    /// command.
    pub async fn finish_upgrade(&self) -> Result<usize, StoreError> {
        let layout = self.check_table().await?;
        let mut fixed = 0;
        for item in self.scan_prefix("scan", STREAM_PK_PREFIX).await? {
            let Ok(record) = super::codec::stream_record(&item) else {
                continue;
            };
            if let Ownership::Legacy {
                owner,
                expires_at_ms,
            } = record.ownership()
                && record.desired_state == DesiredState::Started
                && !record.is_tombstone()
            {
                fixed += usize::from(
                    self.free_lapsed_legacy(&record, &owner, expires_at_ms)
                        .await?,
                );
                continue;
            }
            let free = record.lease_expires_at_ms == 0;
            if record.holder.is_some()
                || !free
                || record.desired_state != DesiredState::Started
                || record.is_tombstone()
            {
                continue;
            }
            fixed += usize::from(
                self.index_as_unowned(&record, &UnownedGuard::Unindexed)
                    .await?,
            );
        }
        if layout.legacy_index {
            self.call_plain("update_table", None, || {
                self.client
                    .update_table()
                    .table_name(&self.table)
                    .global_secondary_index_updates(
                        GlobalSecondaryIndexUpdate::builder()
                            .delete(
                                DeleteGlobalSecondaryIndexAction::builder()
                                    .index_name(LEGACY_INDEX)
                                    .build()
                                    .expect("name is set"),
                            )
                            .build(),
                    )
                    .send()
            })
            .await?;
            self.wait_active(|l| !l.legacy_index).await?;
        }
        Ok(fixed)
    }

    /// Frees a STARTED stream under a version-1 lease once that lease has
    /// lapsed by this clock, with room for skew (no version-1 process runs
    /// any more, so it will not be renewed): expiry 0 and an unowned
    /// partition, under the condition that the lease is still the one read.
    async fn free_lapsed_legacy(
        &self,
        record: &StreamRecord,
        owner: &str,
        expires_at_ms: u64,
    ) -> Result<bool, StoreError> {
        let lapsed_at = expires_at_ms.saturating_add(LEGACY_LAPSE_ALLOWANCE_MS);
        let wait = lapsed_at.saturating_sub(now_ms());
        if wait > MAX_LEGACY_LAPSE_WAIT_MS {
            tracing::warn!(stream = %record.key, owner, "a version-1 lease runs on far ahead: left as it is (run finish-upgrade again once it has lapsed)");
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(wait)).await;
        self.index_as_unowned(
            record,
            &UnownedGuard::LapsedLegacy {
                owner,
                expires_at_ms,
            },
        )
        .await
    }

    /// Puts a STARTED stream into its unowned partition, free, under `guard`
    /// (the state finish-upgrade read); `true` when this write did it.
    async fn index_as_unowned(
        &self,
        record: &StreamRecord,
        guard: &UnownedGuard<'_>,
    ) -> Result<bool, StoreError> {
        let mut update = Update::new();
        update.set("#h", ":h", s(record.key.unowned_holder()));
        update.set("#e", ":zero", n(0));
        update.name("#h", attr::HOLDER);
        update.name("#e", attr::LEASE_EXPIRES_AT_MS);
        match guard {
            UnownedGuard::Unindexed => update.require("attribute_not_exists(#h) AND #e = :zero"),
            UnownedGuard::LapsedLegacy {
                owner,
                expires_at_ms,
            } => {
                update.require("lease_owner = :owner AND #e = :observed");
                update.value(":owner", s(*owner));
                update.value(":observed", n(*expires_at_ms));
            }
        }
        update.require("desired_state = :started");
        update.value(":started", s(DesiredState::Started.as_str()));
        let done = self
            .update_item(
                "finish_upgrade",
                &record.key.pk(),
                &update,
                ReturnValue::None,
            )
            .await?;
        Ok(done.is_ok())
    }
}

/// What `index_as_unowned` conditions on.
enum UnownedGuard<'a> {
    /// Free, and never given a `holder` (version 1 wrote it).
    Unindexed,
    /// Still under this version-1 lease, which has lapsed.
    LapsedLegacy { owner: &'a str, expires_at_ms: u64 },
}
