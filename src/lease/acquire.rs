//! Acquiring a stream: one conditional write, a compare-and-swap on the fencing
//! token from the state the acquirer observed.
//!
//! A lost condition is read back (strongly consistent): the item showing this
//! incarnation with exactly the token we wrote means a retry of an acquire that
//! had in fact landed. Incarnations are unique per process, so nobody else's
//! write can look like ours. An error (no answer at all) is returned as such:
//! the caller must resolve it later with [`LeaseStore::resolve_acquire`], never
//! leave it.

use super::client::{ConditionFailed, LeaseStore};
use super::clock::now_ms;
use super::codec::{attr, n, s, stream_record};
use super::error::StoreError;
use super::keys::Incarnation;
use super::record::{
    AcquireFrom, AcquireOutcome, DesiredState, Lease, OWNED_EXPIRY_MS, Ownership, StreamRecord,
};
use super::status::Phase;
use aws_sdk_dynamodb::types::{ReturnConsumedCapacity, ReturnValue};

/// An acquire whose checkpoint carry-over lost to a higher stored checkpoint is
/// retried once without it.
const MAX_ACQUIRE_ATTEMPTS: usize = 2;

impl LeaseStore {
    /// Takes `observed` (as read from the index) for `me`, from the state
    /// `from` describes.
    #[tracing::instrument(name = "lease.acquire", skip_all, fields(stream = %observed.key, token = observed.lease_counter + 1, worker = %me))]
    pub async fn acquire(
        &self,
        observed: &StreamRecord,
        from: &AcquireFrom,
        me: &Incarnation,
    ) -> Result<AcquireOutcome, StoreError> {
        let key = &observed.key;
        let pk = key.pk();
        let expected = observed.lease_counter;
        let mut carry = match from {
            AcquireFrom::Dead { checkpoint, .. } => *checkpoint,
            _ => None,
        };
        let counter_guard = if expected == 0 {
            "(attribute_not_exists(lease_counter) OR lease_counter = :c)"
        } else {
            "lease_counter = :c"
        };
        let from_guard = match from {
            AcquireFrom::Free => "(attribute_not_exists(#exp) OR #exp = :zero)",
            AcquireFrom::Dead { .. } | AcquireFrom::LegacyExpired { .. } => {
                "lease_owner = :prev AND #exp = :prev_exp"
            }
        };
        for _ in 0..MAX_ACQUIRE_ATTEMPTS {
            let mut condition = format!(
                "desired_state = :started AND attribute_not_exists(deleted_at_ms) AND {counter_guard} AND {from_guard}"
            );
            let mut update = String::from(
                "SET lease_owner = :me, #exp = :far, lease_counter = :next, holder = :holder, \
                 phase = :pending, acquired_at_ms = :now",
            );
            if carry.is_some() {
                condition.push_str(" AND (attribute_not_exists(last_seq) OR last_seq < :carry)");
                update.push_str(", last_seq = :carry");
            }
            update.push_str(
                " REMOVE status_reason, status_message, connected_since_ms, released_at_ms, release_reason",
            );
            let _turn = self.stream_write_turn().await;
            let result = self
                .call("acquire", Some(&pk), || {
                    let mut req = self
                        .client
                        .update_item()
                        .table_name(&self.table)
                        .key(attr::PK, s(&pk))
                        .update_expression(&update)
                        .condition_expression(&condition)
                        .expression_attribute_names("#exp", attr::LEASE_EXPIRES_AT_MS)
                        .expression_attribute_values(":started", s(DesiredState::Started.as_str()))
                        .expression_attribute_values(":c", n(expected))
                        .expression_attribute_values(":next", n(expected + 1))
                        .expression_attribute_values(":me", s(me.as_str()))
                        .expression_attribute_values(":far", n(OWNED_EXPIRY_MS))
                        .expression_attribute_values(":holder", s(me.holder_of(key)))
                        .expression_attribute_values(":pending", s(Phase::Pending.as_str()))
                        .expression_attribute_values(":now", n(now_ms()))
                        .return_values(ReturnValue::AllNew)
                        .return_consumed_capacity(ReturnConsumedCapacity::Indexes);
                    req = match from {
                        AcquireFrom::Free => req.expression_attribute_values(":zero", n(0)),
                        AcquireFrom::Dead { owner, .. } => req
                            .expression_attribute_values(":prev", s(owner.as_str()))
                            .expression_attribute_values(":prev_exp", n(OWNED_EXPIRY_MS)),
                        AcquireFrom::LegacyExpired {
                            owner,
                            expires_at_ms,
                        } => req
                            .expression_attribute_values(":prev", s(owner))
                            .expression_attribute_values(":prev_exp", n(*expires_at_ms)),
                    };
                    if let Some(seq) = carry {
                        req = req.expression_attribute_values(":carry", n(seq));
                    }
                    req.send()
                })
                .await?;
            let current = match result {
                Ok(out) => {
                    self.record_capacity("acquire", out.consumed_capacity());
                    let record = out
                        .attributes()
                        .map(stream_record)
                        .transpose()
                        .map_err(|m| self.malformed(m))?
                        .ok_or_else(|| StoreError::Rejected {
                            operation: "acquire",
                            detail: "the write returned no item".into(),
                        })?;
                    return Ok(acquired(me, record));
                }
                Err(ConditionFailed) => self.get(key).await?,
            };
            let Some(current) = current.filter(|c| !c.is_tombstone()) else {
                return Ok(AcquireOutcome::Gone);
            };
            if is_ours(&current, me, expected + 1) {
                return Ok(acquired(me, current));
            }
            if current.desired_state != DesiredState::Started {
                return Ok(AcquireOutcome::NotStarted);
            }
            // Still exactly as observed, only the stored checkpoint is at least
            // the one we carried: take it without the carry.
            let unchanged = current.lease_counter == expected
                && current.lease_owner == observed.lease_owner
                && current.lease_expires_at_ms == observed.lease_expires_at_ms;
            if carry.is_some() && unchanged && current.last_seq >= carry {
                carry = None;
                continue;
            }
            return Ok(AcquireOutcome::Taken {
                owner: current.lease_owner,
            });
        }
        Ok(AcquireOutcome::Taken {
            owner: observed.lease_owner.clone(),
        })
    }

    /// Settles an acquire that got no answer: reads the item and reports the
    /// lease if the write had landed (the item shows `me` with the token it
    /// would have written), `None` otherwise.
    pub async fn resolve_acquire(
        &self,
        key: &super::keys::StreamKey,
        expected: u64,
        me: &Incarnation,
    ) -> Result<Option<(Lease, StreamRecord)>, StoreError> {
        Ok(self
            .get(key)
            .await?
            .filter(|r| !r.is_tombstone() && is_ours(r, me, expected + 1))
            .map(|r| {
                let lease = Lease {
                    key: r.key.clone(),
                    owner: me.clone(),
                    counter: r.lease_counter,
                };
                (lease, r)
            }))
    }
}

fn is_ours(r: &StreamRecord, me: &Incarnation, counter: u64) -> bool {
    r.ownership() == Ownership::Owned(me.clone()) && r.lease_counter == counter
}

fn acquired(me: &Incarnation, record: StreamRecord) -> AcquireOutcome {
    AcquireOutcome::Acquired {
        lease: Lease {
            key: record.key.clone(),
            owner: me.clone(),
            counter: record.lease_counter,
        },
        record: Box::new(record),
    }
}
