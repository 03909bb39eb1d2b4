//! Acquiring a stream: one conditional write, a compare-and-swap on the fencing
//! token from the state the acquirer observed.
//!
//! A lost condition comes back with the item as the condition saw it
//! (`ReturnValuesOnConditionCheckFailure`; read back, strongly consistent,
//! from a store that does not send it): the item showing this
//! incarnation with exactly the token we wrote means a retry of an acquire that
//! had in fact landed. Incarnations are unique per process, so nobody else's
//! write can look like ours. An error (no answer at all) is returned as such:
//! the caller must resolve it later with [`LeaseStore::resolve_acquire`], never
//! leave it.

use super::client::LeaseStore;
use super::clock::now_ms;
use super::codec::{attr, n, s, stream_record};
use super::error::StoreError;
use super::keys::Incarnation;
use super::record::{
    AcquireFrom, AcquireOutcome, DesiredState, Lease, OWNED_EXPIRY_MS, Ownership, StreamRecord,
};
use super::session_status::Phase;
use super::update::Update;
use aws_sdk_dynamodb::types::ReturnValue;

/// An acquire whose dead owner's checkpoint lost to a higher stored checkpoint is
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
        let mut dead_owner_checkpoint = match from {
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
            let mut update = Update::new();
            update.require("desired_state = :started AND attribute_not_exists(deleted_at_ms)");
            update.require(counter_guard);
            update.require(from_guard);
            update.name("#exp", attr::LEASE_EXPIRES_AT_MS);
            update.value(":started", s(DesiredState::Started.as_str()));
            update.value(":c", n(expected));
            match from {
                AcquireFrom::Free => update.value(":zero", n(0)),
                AcquireFrom::Dead { owner, .. } => {
                    update.value(":prev", s(owner.as_str()));
                    update.value(":prev_exp", n(OWNED_EXPIRY_MS));
                }
                AcquireFrom::LegacyExpired {
                    owner,
                    expires_at_ms,
                } => {
                    update.value(":prev", s(owner));
                    update.value(":prev_exp", n(*expires_at_ms));
                }
            }
            update.set(attr::LEASE_OWNER, ":me", s(me.as_str()));
            update.set("#exp", ":far", n(OWNED_EXPIRY_MS));
            update.set(attr::LEASE_COUNTER, ":next", n(expected + 1));
            update.set(attr::HOLDER, ":holder", s(me.holder_of(key)));
            update.set(attr::PHASE, ":pending", s(Phase::Pending.as_str()));
            update.set(attr::ACQUIRED_AT_MS, ":now", n(now_ms()));
            if let Some(seq) = dead_owner_checkpoint {
                update.set(attr::LAST_SEQ, ":dead_owner_checkpoint", n(seq));
                update.require(
                    "(attribute_not_exists(last_seq) OR last_seq < :dead_owner_checkpoint)",
                );
            }
            for stale in [
                attr::STATUS_REASON,
                attr::STATUS_MESSAGE,
                attr::CONNECTED_SINCE_MS,
                attr::RELEASED_AT_MS,
                attr::RELEASE_REASON,
                // The previous owner's: the new one writes its own with its
                // first status, and is not reminded of what it never saw.
                attr::SERVED_REQUESTS,
            ] {
                update.remove(stale);
            }
            let _turn = self.stream_write_turn().await;
            let result = self
                .update_item_or_current("acquire", &pk, &update, ReturnValue::AllNew)
                .await?;
            let current = match result {
                Ok(out) => {
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
                Err(refused) => self.current_after_refusal(key, refused.as_ref()).await?,
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
            // the one we carried: take it without the dead owner's checkpoint.
            let unchanged = current.lease_counter == expected
                && current.lease_owner == observed.lease_owner
                && current.lease_expires_at_ms == observed.lease_expires_at_ms;
            if dead_owner_checkpoint.is_some()
                && unchanged
                && current.checkpoint >= dead_owner_checkpoint
            {
                dead_owner_checkpoint = None;
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
