//! Writes only the owner of a stream may make: session status, a checkpoint
//! folded into the item, and the release. Each is guarded by owner, token and
//! "still owned" (`lease_expires_at_ms` at the owned value), so nothing in
//! flight can touch a stream after it was released or taken: a release is final.

use super::client::LeaseStore;
use super::clock::now_ms;
use super::codec::{Item, attr, n, s, served_requests_value};
use super::error::StoreError;
use super::record::{
    DesiredState, Lease, OWNED_EXPIRY_MS, OwnerRequests, OwnerWrite, Ownership, StreamRecord,
};
use super::session_status::{ReleaseReason, SessionStatus};
use super::update::Update;
use aws_sdk_dynamodb::types::ReturnValue;

/// The ownership guard every owner write carries.
const OWNED: &str = "lease_owner = :me AND lease_counter = :c AND #exp = :far";

/// Attempts of a release whose secondary guards (desired state, checkpoint)
/// lost to a concurrent change while the stream was still ours.
const MAX_RELEASE_ATTEMPTS: usize = 3;

/// An update guarded by `lease`: this owner, this token, still owned.
fn owner_update(lease: &Lease) -> Update {
    let mut u = Update::new();
    u.require(OWNED);
    u.name("#exp", attr::LEASE_EXPIRES_AT_MS);
    u.value(":me", s(lease.owner.as_str()));
    u.value(":c", n(lease.counter));
    u.value(":far", n(OWNED_EXPIRY_MS));
    u
}

/// The session status, as every owner write that carries it writes it.
fn set_status(u: &mut Update, status: &SessionStatus) {
    u.set(attr::PHASE, ":phase", s(status.phase.as_str()));
    u.set(attr::RECONNECTS, ":reconnects", n(status.reconnects));
    // Absent values are written as empty strings / 0 rather than removed,
    // which keeps every status write one SET clause.
    u.set(
        attr::STATUS_REASON,
        ":reason",
        s(status.reason.clone().unwrap_or_default()),
    );
    u.set(
        attr::STATUS_MESSAGE,
        ":message",
        s(status.message.clone().unwrap_or_default()),
    );
    u.set(
        attr::CONNECTED_SINCE_MS,
        ":since",
        n(status.connected_since_ms.unwrap_or(0)),
    );
}

/// The checkpoint, never moved backwards.
fn set_checkpoint(u: &mut Update, seq: u64) {
    u.set(attr::LAST_SEQ, ":seq", n(seq));
    u.require("(attribute_not_exists(last_seq) OR last_seq <= :seq)");
}

/// A refused owner write, with the item its condition was checked against
/// when the store sent it.
struct Refused(Option<Box<Item>>);

/// What a failed owner write found when it read the item back.
enum Found {
    /// Still ours: only a secondary guard failed.
    StillOurs(Box<StreamRecord>),
    /// Released by us already (a retried release whose first attempt landed).
    ReleasedByUs,
    Lost,
}

impl LeaseStore {
    /// Sends an owner write once a stream-write turn is free. The update is
    /// built (`fill`) and the request made only then: a burst of holders
    /// waiting for the turns (a thousand sessions connecting at once all
    /// write their status) keeps a few bytes each while it waits, not the
    /// update's values and the SDK request (kilobytes), which in a burst
    /// set the worker's peak memory and, kept by the allocator, its resident
    /// size long after.
    async fn send_owner_update(
        &self,
        operation: &'static str,
        lease: &Lease,
        fill: impl FnOnce(&mut Update),
    ) -> Result<Result<(), Refused>, StoreError> {
        let _turn = self.stream_write_turn().await;
        let mut update = owner_update(lease);
        fill(&mut update);
        let out = Box::pin(self.update_item_or_current(
            operation,
            &lease.key.pk(),
            &update,
            ReturnValue::None,
        ))
        .await?;
        Ok(out.map(|_| ()).map_err(|item| Refused(item.map(Box::new))))
    }

    /// Judges a refused owner write by the item its condition was checked
    /// against (the refusal carries it: no read, as for an acquire); read
    /// back, strongly consistent, only when it did not (no item, or a store
    /// that does not send it). The refusal's item may be older than a read
    /// would be, never newer, and each finding holds from then on: a token
    /// that is no longer ours never comes back, our own release stays done,
    /// and a stored checkpoint never moves backwards. Boxed by its callers:
    /// its read (an SDK request) is rare and would otherwise size every
    /// owner write while it waits for a turn.
    async fn after_lost_condition(
        &self,
        lease: &Lease,
        refused: Refused,
    ) -> Result<Found, StoreError> {
        let current = self
            .current_after_refusal(&lease.key, refused.0.as_deref())
            .await?;
        let Some(current) = current else {
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

    /// Writes the session status, with the generation the session runs and
    /// the requests it has acted on: a mirror that finds either behind what
    /// the item asks tells the owner again (`LeaseStore::remind_owner_behind`).
    pub async fn write_status(
        &self,
        lease: &Lease,
        status: &SessionStatus,
        served_generation: i64,
        served_requests: &OwnerRequests,
    ) -> Result<OwnerWrite<()>, StoreError> {
        let fill = |update: &mut Update| {
            set_status(update, status);
            update.set(attr::SERVED_GENERATION, ":served", n(served_generation));
            update.set(
                attr::SERVED_REQUESTS,
                ":served_requests",
                served_requests_value(served_requests),
            );
        };
        Ok(
            match self.send_owner_update("write_status", lease, fill).await? {
                Ok(()) => OwnerWrite::Done(()),
                Err(Refused(_)) => OwnerWrite::Lost,
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
        let fill = |update: &mut Update| set_checkpoint(update, seq);
        Ok(
            match self
                .send_owner_update("fold_checkpoint", lease, fill)
                .await?
            {
                Ok(()) => OwnerWrite::Done(()),
                Err(refused) => match Box::pin(self.after_lost_condition(lease, refused)).await? {
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
    /// `released_at_ms` is when the holder took the stream out of the load
    /// it publishes (`HeldStream::stamp_release`), so peers can tell whether
    /// that load still has it.
    #[tracing::instrument(name = "lease.release", skip_all, fields(stream = %lease.key, token = lease.counter, worker = %lease.owner, reason = reason.as_str()))]
    pub async fn release(
        &self,
        lease: &Lease,
        reason: ReleaseReason,
        checkpoint: Option<u64>,
        status: &SessionStatus,
        desired: DesiredState,
        released_at_ms: u64,
    ) -> Result<OwnerWrite<()>, StoreError> {
        let mut desired = desired;
        let mut checkpoint = checkpoint;
        for _ in 0..MAX_RELEASE_ATTEMPTS {
            let fill = |update: &mut Update| {
                set_status(update, status);
                // `#exp` is the name alias the ownership guard already uses.
                update.set("#exp", ":zero", n(0));
                update.set(attr::RELEASED_AT_MS, ":released", n(released_at_ms));
                update.set(attr::RELEASE_REASON, ":why", s(reason.as_str()));
                update.require("desired_state = :desired");
                update.value(":desired", s(desired.as_str()));
                match desired {
                    DesiredState::Started => {
                        update.set(attr::HOLDER, ":holder", s(lease.key.unowned_holder()))
                    }
                    DesiredState::Stopped => update.remove(attr::HOLDER),
                }
                if let Some(seq) = checkpoint {
                    set_checkpoint(update, seq);
                }
            };
            match self.send_owner_update("release", lease, fill).await? {
                Ok(()) => return Ok(OwnerWrite::Done(())),
                Err(refused) => match Box::pin(self.after_lost_condition(lease, refused)).await? {
                    Found::ReleasedByUs => return Ok(OwnerWrite::Done(())),
                    Found::Lost => return Ok(OwnerWrite::Lost),
                    Found::StillOurs(current) => {
                        desired = current.desired_state;
                        if current.checkpoint > checkpoint {
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
        let mut update = Update::new();
        update.set("#exp", ":zero", n(0));
        update.set(attr::RELEASED_AT_MS, ":now", n(now_ms()));
        update.remove(attr::HOLDER);
        update.require(
            "lease_owner = :prev AND lease_counter = :c AND #exp = :far AND desired_state = :stopped",
        );
        update.name("#exp", attr::LEASE_EXPIRES_AT_MS);
        update.value(
            ":prev",
            s(record.lease_owner.as_deref().unwrap_or_default()),
        );
        update.value(":c", n(record.lease_counter));
        update.value(":far", n(OWNED_EXPIRY_MS));
        update.value(":stopped", s(DesiredState::Stopped.as_str()));
        let out = self
            .update_item(
                "clear_dead_owner",
                &record.key.pk(),
                &update,
                ReturnValue::None,
            )
            .await?;
        Ok(out.is_ok())
    }
}
