//! The roster: every incarnation that may own streams, in one item that no
//! TTL and no cleanup removes while its streams may still be there.
//!
//! Streams of a dead incarnation are found through its worker item: peers
//! see it in the fleet, declare it dead and query its index partitions. A
//! worker item can disappear while its streams are still owned (the TTL of a
//! crashed worker's item after a fleet was down for a day, survivors unable to
//! take streams for an hour, someone deleting items by hand); the streams
//! would then be owned by an incarnation nobody can find. So every incarnation
//! also enrolls here, after its item is written, and leaves the roster only
//! when a peer forgets it (its partitions found empty). An enrolled
//! incarnation with no worker item is declared dead by *creating* its item as
//! DEAD (a conditional put that fails if the item exists): from then on it can
//! never renew or register, and its streams move like any dead worker's.

use super::client::{ConditionFailed, LeaseStore};
use super::clock::now_ms;
use super::codec::{Item, attr, n, s};
use super::error::StoreError;
use super::keys::{FLEET_HOLDER, Incarnation, ROSTER_PK};
use super::record::WorkerState;
use super::update::Update;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnConsumedCapacity, ReturnValue};

/// Whether an incarnation joins or leaves the roster.
enum RosterChange {
    Enroll,
    Unenroll,
}

impl LeaseStore {
    /// Adds `me` to the roster (idempotent).
    pub async fn enroll(&self, me: &Incarnation) -> Result<(), StoreError> {
        self.roster_update("enroll", RosterChange::Enroll, me).await
    }

    /// Removes a forgotten incarnation from the roster (idempotent).
    pub(super) async fn unenroll(&self, who: &Incarnation) -> Result<(), StoreError> {
        self.roster_update("unenroll", RosterChange::Unenroll, who)
            .await
    }

    async fn roster_update(
        &self,
        operation: &'static str,
        change: RosterChange,
        who: &Incarnation,
    ) -> Result<(), StoreError> {
        let mut update = Update::new();
        let who = AttributeValue::Ss(vec![who.as_str().to_string()]);
        match change {
            RosterChange::Enroll => update.add(attr::ROSTER, ":who", who),
            RosterChange::Unenroll => update.delete(attr::ROSTER, ":who", who),
        }
        self.update_item(operation, ROSTER_PK, &update, ReturnValue::None)
            .await?
            .map_err(|_| StoreError::Rejected {
                operation,
                detail: "an unconditioned roster write failed its condition".into(),
            })?;
        Ok(())
    }

    /// Every enrolled incarnation (eventually consistent: one just enrolled
    /// is found at the next read; nothing is decided on this read alone).
    pub async fn roster(&self) -> Result<Vec<Incarnation>, StoreError> {
        let out = self
            .call_plain("roster", Some(ROSTER_PK), || {
                self.client
                    .get_item()
                    .table_name(&self.table)
                    .key(attr::PK, s(ROSTER_PK))
                    .return_consumed_capacity(ReturnConsumedCapacity::Total)
                    .send()
            })
            .await?;
        self.record_reads("roster", out.consumed_capacity());
        Ok(out
            .item()
            .and_then(|item| item.get(attr::ROSTER))
            .and_then(|v| v.as_ss().ok())
            .map(|names| names.iter().filter_map(|n| Incarnation::parse(n)).collect())
            .unwrap_or_default())
    }

    /// Declares an enrolled incarnation that has no worker item dead, by
    /// creating its item as DEAD. `true` when this write did it; `false` when
    /// an item exists (it is alive, or already ended: the fleet shows it).
    pub async fn declare_vanished_dead(&self, who: &Incarnation) -> Result<bool, StoreError> {
        let now = now_ms();
        let mut absent = Update::new();
        absent.require("attribute_not_exists(Pk)");
        let item = Item::from([
            (attr::PK.to_string(), s(who.pk())),
            (attr::HOLDER.to_string(), s(FLEET_HOLDER)),
            (attr::INCARNATION.to_string(), s(who.as_str())),
            (
                attr::WORKER_STATE.to_string(),
                s(WorkerState::Dead.as_str()),
            ),
            (attr::HEARTBEAT_VERSION.to_string(), n(0)),
            (attr::HEARTBEAT_AT_MS.to_string(), n(0)),
            (attr::CREATED_AT_MS.to_string(), n(now)),
            (attr::HELD.to_string(), n(0)),
        ]);
        let out = self
            .put_item("declare_vanished_dead", item, &absent)
            .await?;
        Ok(match out {
            Ok(()) => {
                self.announce_change().await;
                true
            }
            Err(ConditionFailed) => false,
        })
    }
}
