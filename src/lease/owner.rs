//! Writes only the owner of a stream may make: session status, a checkpoint
//! folded into the item, and the release. Each is guarded by owner, token and
//! "still owned" (`lease_expires_at_ms` at the owned value), so nothing in
//! flight can touch a stream after it was released or taken: a release is final.

use super::client::{ConditionFailed, LeaseStore};
use super::clock::now_ms;
use super::codec::{attr, n, s};
use super::error::StoreError;
use super::record::{DesiredState, Lease, OWNED_EXPIRY_MS, OwnerWrite, Ownership, StreamRecord};
use super::status::{ReleaseReason, SessionStatus};
use aws_sdk_dynamodb::types::{AttributeValue, ReturnConsumedCapacity};

/// The ownership guard every owner write carries.
const OWNED: &str = "lease_owner = :me AND lease_counter = :c AND #exp = :far";

/// Attempts of a release whose secondary guards (desired state, checkpoint)
/// lost to a concurrent change while the stream was still ours.
const MAX_RELEASE_ATTEMPTS: usize = 3;

/// An owner-guarded update under construction.
struct OwnerUpdate {
    set: Vec<String>,
    remove: Vec<&'static str>,
    condition: String,
    values: Vec<(&'static str, AttributeValue)>,
}

impl OwnerUpdate {
    fn new() -> Self {
        Self {
            set: Vec::new(),
            remove: Vec::new(),
            condition: OWNED.to_string(),
            values: Vec::new(),
        }
    }

    fn set(&mut self, attribute: &str, placeholder: &'static str, value: AttributeValue) {
        self.assign(format!("{attribute} = {placeholder}"), placeholder, value);
    }

    fn assign(&mut self, clause: String, placeholder: &'static str, value: AttributeValue) {
        self.set.push(clause);
        self.values.push((placeholder, value));
    }

    fn status(&mut self, status: &SessionStatus) {
        self.set(attr::PHASE, ":phase", s(status.phase.as_str()));
        self.set(attr::RECONNECTS, ":reconnects", n(status.reconnects));
        // Absent values are written as empty strings / 0 rather than removed,
        // which keeps every status write one SET clause.
        self.set(
            attr::STATUS_REASON,
            ":reason",
            s(status.reason.clone().unwrap_or_default()),
        );
        self.set(
            attr::STATUS_MESSAGE,
            ":message",
            s(status.message.clone().unwrap_or_default()),
        );
        self.set(
            attr::CONNECTED_SINCE_MS,
            ":since",
            n(status.connected_since_ms.unwrap_or(0)),
        );
    }

    fn checkpoint(&mut self, seq: u64) {
        self.set(attr::LAST_SEQ, ":seq", n(seq));
        self.condition
            .push_str(" AND (attribute_not_exists(last_seq) OR last_seq <= :seq)");
    }

    fn expression(&self) -> String {
        let mut e = format!("SET {}", self.set.join(", "));
        if !self.remove.is_empty() {
            e.push_str(&format!(" REMOVE {}", self.remove.join(", ")));
        }
        e
    }
}

/// What a failed owner write found when it read the item back.
enum Found {
    /// Still ours: only a secondary guard failed.
    StillOurs(Box<StreamRecord>),
    /// Released by us already (a retried release whose first attempt landed).
    ReleasedByUs,
    Lost,
}

impl LeaseStore {
    async fn owner_update(
        &self,
        operation: &'static str,
        lease: &Lease,
        update: &OwnerUpdate,
    ) -> Result<Result<(), ConditionFailed>, StoreError> {
        let pk = lease.key.pk();
        let expression = update.expression();
        let _turn = self.stream_write_turn().await;
        let out = self
            .call(operation, Some(&pk), || {
                let mut req = self
                    .client
                    .update_item()
                    .table_name(&self.table)
                    .key(attr::PK, s(&pk))
                    .update_expression(&expression)
                    .condition_expression(&update.condition)
                    .expression_attribute_names("#exp", attr::LEASE_EXPIRES_AT_MS)
                    .expression_attribute_values(":me", s(lease.owner.as_str()))
                    .expression_attribute_values(":c", n(lease.counter))
                    .expression_attribute_values(":far", n(OWNED_EXPIRY_MS))
                    .return_consumed_capacity(ReturnConsumedCapacity::Indexes);
                for (name, value) in &update.values {
                    req = req.expression_attribute_values(*name, value.clone());
                }
                req.send()
            })
            .await?;
        Ok(out.map(|o| self.record_capacity(operation, o.consumed_capacity())))
    }

    async fn after_lost_condition(&self, lease: &Lease) -> Result<Found, StoreError> {
        let Some(current) = self.get(&lease.key).await? else {
            return Ok(Found::Lost);
        };
        let mine = current.lease_owner.as_deref() == Some(lease.owner.as_str())
            && current.lease_counter == lease.counter;
        Ok(match (mine, current.ownership()) {
            (true, Ownership::Owned(_)) => Found::StillOurs(Box::new(current)),
            (true, Ownership::Free) => Found::ReleasedByUs,
            _ => Found::Lost,
        })
    }

    /// Writes the session status (and the generation the session runs).
    pub async fn write_status(
        &self,
        lease: &Lease,
        status: &SessionStatus,
        served_generation: i64,
    ) -> Result<OwnerWrite<()>, StoreError> {
        let mut update = OwnerUpdate::new();
        update.status(status);
        update.set(attr::SERVED_GENERATION, ":served", n(served_generation));
        Ok(
            match self.owner_update("write_status", lease, &update).await? {
                Ok(()) => OwnerWrite::Done(()),
                Err(ConditionFailed) => OwnerWrite::Lost,
            },
        )
    }

    /// Persists `seq` as the stream's `last_seq` (never backwards): how an
    /// idle stream's checkpoint leaves its owner's packed checkpoints.
    #[tracing::instrument(name = "lease.checkpoint", skip_all, fields(stream = %lease.key, token = lease.counter, worker = %lease.owner, seq = seq))]
    pub async fn fold_checkpoint(
        &self,
        lease: &Lease,
        seq: u64,
    ) -> Result<OwnerWrite<()>, StoreError> {
        let mut update = OwnerUpdate::new();
        update.checkpoint(seq);
        Ok(
            match self.owner_update("fold_checkpoint", lease, &update).await? {
                Ok(()) => OwnerWrite::Done(()),
                Err(ConditionFailed) => match self.after_lost_condition(lease).await? {
                    // The stored checkpoint is already at or past `seq`.
                    Found::StillOurs(_) => OwnerWrite::Done(()),
                    Found::ReleasedByUs | Found::Lost => OwnerWrite::Lost,
                },
            },
        )
    }

    /// Gives the stream up at once: `lease_expires_at_ms = 0`, `last_seq`
    /// advanced to `checkpoint`, and back into an unowned partition if it is
    /// still STARTED, so a peer takes it within one orphan scan.
    #[tracing::instrument(name = "lease.release", skip_all, fields(stream = %lease.key, token = lease.counter, worker = %lease.owner, reason = reason.as_str()))]
    pub async fn release(
        &self,
        lease: &Lease,
        reason: ReleaseReason,
        checkpoint: Option<u64>,
        status: &SessionStatus,
        desired: DesiredState,
    ) -> Result<OwnerWrite<()>, StoreError> {
        let mut desired = desired;
        let mut checkpoint = checkpoint;
        for _ in 0..MAX_RELEASE_ATTEMPTS {
            let mut update = OwnerUpdate::new();
            update.status(status);
            // `#exp` is the name alias the ownership guard already uses.
            update.assign("#exp = :zero".into(), ":zero", n(0));
            update.set(attr::RELEASED_AT_MS, ":released", n(now_ms()));
            update.set(attr::RELEASE_REASON, ":why", s(reason.as_str()));
            update.condition.push_str(" AND desired_state = :desired");
            update.values.push((":desired", s(desired.as_str())));
            match desired {
                DesiredState::Started => {
                    update.set(attr::HOLDER, ":holder", s(lease.key.unowned_holder()))
                }
                DesiredState::Stopped => update.remove.push(attr::HOLDER),
            }
            if let Some(seq) = checkpoint {
                update.checkpoint(seq);
            }
            match self.owner_update("release", lease, &update).await? {
                Ok(()) => return Ok(OwnerWrite::Done(())),
                Err(ConditionFailed) => match self.after_lost_condition(lease).await? {
                    Found::ReleasedByUs => return Ok(OwnerWrite::Done(())),
                    Found::Lost => return Ok(OwnerWrite::Lost),
                    Found::StillOurs(current) => {
                        desired = current.desired_state;
                        if current.last_seq > checkpoint {
                            checkpoint = None;
                        }
                    }
                },
            }
        }
        Err(StoreError::Rejected {
            operation: "release",
            detail: format!("{} kept changing while it was being released", lease.key),
        })
    }

    /// Frees a STOPPED stream a dead incarnation still holds (nobody serves a
    /// STOPPED stream, so nobody would ever take it), emptying the dead
    /// incarnation's partitions.
    pub async fn clear_dead_owner(&self, record: &StreamRecord) -> Result<bool, StoreError> {
        let pk = record.key.pk();
        let owner = record.lease_owner.clone().unwrap_or_default();
        let out = self
            .call("clear_dead_owner", Some(&pk), || {
                self.client
                    .update_item()
                    .table_name(&self.table)
                    .key(attr::PK, s(&pk))
                    .update_expression("SET #exp = :zero, released_at_ms = :now REMOVE holder")
                    .condition_expression(
                        "lease_owner = :prev AND lease_counter = :c AND #exp = :far AND desired_state = :stopped",
                    )
                    .expression_attribute_names("#exp", attr::LEASE_EXPIRES_AT_MS)
                    .expression_attribute_values(":zero", n(0))
                    .expression_attribute_values(":now", n(now_ms()))
                    .expression_attribute_values(":prev", s(&owner))
                    .expression_attribute_values(":c", n(record.lease_counter))
                    .expression_attribute_values(":far", n(OWNED_EXPIRY_MS))
                    .expression_attribute_values(":stopped", s(DesiredState::Stopped.as_str()))
                    .send()
            })
            .await?;
        Ok(out.is_ok())
    }
}
