//! Control-plane writes (the controller, `tether apply`, `tether delete`): the
//! desired state of a stream, and its deletion as a tombstone.
//!
//! Every write is optimistic on the item as just read (generation, resource
//! UID, token, ownership), so a lagging writer can neither resurrect a deleted
//! stream nor overwrite a newer resource's item; on a conflict it reads again.
//! These writes never change who owns a stream: they tell the owner instead
//! (its inbox), and the owner acts.

use super::client::LeaseStore;
use super::clock::now_ms;
use super::codec::{attr, n, s};
use super::error::StoreError;
use super::keys::{StreamKey, UNOWNED_HOLDER_PREFIX};
use super::record::{
    DesiredState, DesiredStream, Ownership, StreamRecord, UpsertOutcome, UpsertRefusal,
};
use super::update::Update;
use aws_sdk_dynamodb::types::ReturnValue;

/// Attempts of a control-plane write that keeps meeting concurrent changes.
const MAX_CONTROL_ATTEMPTS: usize = 5;
/// Session-status attributes a re-created stream starts without.
const STATUS_ATTRIBUTES: [&str; 7] = [
    attr::PHASE,
    attr::STATUS_REASON,
    attr::STATUS_MESSAGE,
    attr::CONNECTED_SINCE_MS,
    attr::RECONNECTS,
    attr::SERVED_GENERATION,
    attr::SERVED_REQUESTS,
];

/// Result of [`LeaseStore::delete_stream`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeleteOutcome {
    Deleted,
    NotFound,
    /// STOPPED, but the owner did not release it within the wait.
    StillOwned {
        owner: String,
    },
}

/// Result of [`LeaseStore::tombstone`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TombstoneOutcome {
    Deleted,
    NotFound,
    /// A live owner still holds it (mark it STOPPED and wait, or force).
    StillOwned {
        owner: String,
    },
}

/// A write conditioned on the item being as read (or on it not existing).
fn guarded_on(current: Option<&StreamRecord>) -> Update {
    let mut g = Update::new();
    g.name("#gen", attr::GENERATION);
    g.name("#exp", attr::LEASE_EXPIRES_AT_MS);
    match current {
        None => g.require("attribute_not_exists(Pk)"),
        Some(c) => {
            g.require("attribute_exists(Pk)");
            g.require_equal_or_zero("#gen", ":g0", c.generation.max(0) as u64);
            g.require_equal_or_zero("#exp", ":e0", c.lease_expires_at_ms);
            g.require_equal_or_zero(attr::LEASE_COUNTER, ":c0", c.lease_counter);
            g.require_equal_or_absent(attr::UID, ":u0", c.uid.as_ref().map(s));
            g.require_equal_or_absent(attr::INSTALLATION, ":i0", c.installation.as_ref().map(s));
            g.require_equal_or_absent(attr::DELETED_AT_MS, ":d0", c.deleted_at_ms.map(n));
            g.require_equal_or_absent(
                attr::DESIRED_STATE,
                ":ds0",
                Some(s(c.desired_state.as_str())),
            );
        }
    }
    g
}

/// What the index partition of a free or stopped stream should be.
fn holder_for(key: &StreamKey, desired: DesiredState, ownership: &Ownership) -> Option<String> {
    match (ownership, desired) {
        (Ownership::Free, DesiredState::Started) => Some(key.unowned_holder()),
        _ => None,
    }
}

/// Whether the item already says everything `desired` says.
fn matches(current: &StreamRecord, desired: &DesiredStream) -> bool {
    let free_holder_ok = match current.ownership() {
        Ownership::Free => {
            current.holder == holder_for(&current.key, current.desired_state, &Ownership::Free)
        }
        _ => true,
    };
    !current.is_tombstone()
        && current.desired_state == desired.desired_state
        && current.ws_url == desired.ws_url
        && current.spec.as_deref() == Some(desired.spec.as_str())
        && current.generation == desired.generation
        && current.uid == desired.resource.as_ref().map(|r| r.uid.clone())
        && current.installation.as_deref().unwrap_or_default()
            == desired
                .resource
                .as_ref()
                .map_or("", |r| r.installation.as_str())
        && current.requests == desired.requests
        && current.change_shard == desired.change_shard()
        && free_holder_ok
}

/// The owner to tell again about `record`'s spec or requests: one whose
/// session runs an earlier generation than the item holds, or has not acted
/// on the reconnect or move request the item carries.
/// A notification is lost when its writer stops between the item write and
/// the notification (a controller losing its leadership or crashing, a CLI
/// killed): the write is not repeated, since the item already matches, so
/// whoever mirrors the resource again (the next leader's first pass, a retry
/// after an error, `tether apply` run again) tells the owner instead. The
/// owner re-reads the item and acts only on what differs, so a needless
/// notification costs one read.
fn owner_behind(record: &StreamRecord) -> Option<Behind> {
    let generation_behind = record
        .served_generation
        .is_some_and(|served| served < record.generation);
    let requests_behind = record
        .served_requests
        .as_ref()
        .is_some_and(|served| *served != record.requests);
    // An owner that acted on STOPPED (or a deletion) released the stream:
    // one still holding it was not told, or is releasing it now.
    let stop_behind = record.desired_state == DesiredState::Stopped;
    match record.ownership() {
        Ownership::Owned(owner) if generation_behind || requests_behind || stop_behind => {
            Some(Behind {
                owner,
                stop: stop_behind,
            })
        }
        _ => None,
    }
}

/// An owner to remind, and whether of a STOPPED (or deleted) stream.
#[derive(Debug, PartialEq, Eq)]
struct Behind {
    owner: super::keys::Incarnation,
    stop: bool,
}

impl LeaseStore {
    /// Tells `record`'s owner again about its spec or requests when its
    /// session still runs an older generation or has not acted on a request
    /// ([`owner_behind`]): for whoever finds the item already mirrored.
    pub async fn remind_owner_behind(&self, record: &StreamRecord) -> Result<(), StoreError> {
        let Some(behind) = owner_behind(record) else {
            return Ok(());
        };
        let told = self.notify_owner(&behind.owner, &record.key).await;
        // The owner's audit follows the counter, and finds a STOPPED or
        // deleted stream in its partitions: a reminder of one, or one that
        // failed, moves the counter. A spec reminder that landed does not
        // (the audit cannot see specs; the owner reads its inbox).
        if behind.stop || told.is_err() {
            self.announce_change().await;
        }
        told
    }

    /// After a control write landed: tells its owner, if it has one, and
    /// moves the change counter whether or not the owner could be told (the
    /// owner's audit follows the counter, `acquirer::audit`); then reports
    /// the notification's error, if any.
    async fn tell_and_announce(
        &self,
        ownership: Ownership,
        key: &StreamKey,
    ) -> Result<(), StoreError> {
        let told = match ownership {
            Ownership::Owned(owner) => self.notify_owner(&owner, key).await,
            _ => Ok(()),
        };
        self.announce_change().await;
        told
    }

    /// Whether `record` already carries `desired` (and would be left
    /// unchanged by [`LeaseStore::upsert_desired`]): lets the controller skip
    /// the write, and its read, at steady state.
    pub fn mirrors(record: &StreamRecord, desired: &DesiredStream) -> bool {
        refusal(record, desired).is_none() && matches(record, desired)
    }

    /// Mirrors desired state into the item, creating it if needed. Never
    /// touches lease fields or `last_seq` (a new item is created unowned, with
    /// `lease_expires_at_ms = 0`). Refuses an older generation of the same
    /// resource, an item of a newer resource, and a deleted resource.
    pub async fn upsert_desired(
        &self,
        desired: &DesiredStream,
    ) -> Result<UpsertOutcome, StoreError> {
        let key = &desired.key;
        // Whether a write of ours may have landed unanswered: a retry whose
        // condition then failed, and a re-read that finds the item as wanted,
        // is that write, and its owner must still be told.
        let mut wrote = false;
        for _ in 0..MAX_CONTROL_ATTEMPTS {
            let current = self.get(key).await?;
            if let Some(c) = &current {
                if let Some(refusal) = refusal(c, desired) {
                    return Ok(UpsertOutcome::Refused { reason: refusal });
                }
                if matches(c, desired) {
                    if !wrote {
                        self.remind_owner_behind(c).await?;
                        return Ok(UpsertOutcome::Unchanged);
                    }
                    self.tell_and_announce(c.ownership(), key).await?;
                    return Ok(UpsertOutcome::Applied);
                }
            }
            let ownership = current
                .as_ref()
                .map_or(Ownership::Free, StreamRecord::ownership);
            let mut g = guarded_on(current.as_ref());
            g.set("desired_state", ":d", s(desired.desired_state.as_str()));
            g.set("ws_url", ":u", s(&desired.ws_url));
            g.set("spec", ":spec", s(&desired.spec));
            g.set("#gen", ":g", n(desired.generation));
            for (attribute, placeholder, value, stored) in [
                (
                    attr::RECONNECT_REQUEST,
                    ":reconnect",
                    &desired.requests.reconnect,
                    current.as_ref().and_then(|c| c.requests.reconnect.as_ref()),
                ),
                (
                    attr::MOVE_REQUEST,
                    ":move",
                    &desired.requests.move_away,
                    current.as_ref().and_then(|c| c.requests.move_away.as_ref()),
                ),
            ] {
                match value {
                    Some(v) => g.set(attribute, placeholder, s(v)),
                    None if stored.is_some() => g.remove(attribute),
                    None => {}
                }
            }
            g.set_clause("#exp = if_not_exists(#exp, :zero)");
            g.value(":zero", n(0));
            let reviving = current.as_ref().is_some_and(StreamRecord::is_tombstone);
            let replacing = current.as_ref().is_some_and(|c| {
                c.uid.is_some() && c.uid != desired.resource.as_ref().map(|r| r.uid.clone())
            });
            // A new identity of an old name (property 2c): a new creation
            // (standalone identity is name + creation), a token above every
            // earlier one, and nothing of the old stream's progress. The
            // owner, if any, keeps the item but not at the token it holds:
            // every write of its old lease fails from here, it closes the
            // old session when told (or at its next audit), and it serves
            // the new stream afresh by adopting it at the new token; a dead
            // owner's packed checkpoint, kept under the old token, is never
            // carried over.
            let new_identity = reviving || replacing;
            if new_identity {
                g.set("created_at_ms", ":now", n(now_ms()));
                g.set_clause("lease_counter = if_not_exists(lease_counter, :zero) + :one");
                g.value(":one", n(1));
            } else {
                g.set_clause("created_at_ms = if_not_exists(created_at_ms, :now)");
                g.value(":now", n(now_ms()));
            }
            if let Some(r) = &desired.resource {
                g.set("uid", ":uid", s(&r.uid));
                g.set("resource_created_ms", ":rc", n(r.created_ms));
                // An empty attribute would read back as absent: none is written.
                if !r.installation.is_empty() {
                    g.set("installation", ":inst", s(&r.installation));
                }
            }
            if let Some(shard) = desired.change_shard() {
                g.set(attr::CHANGE_SHARD, ":cs", s(shard));
            }
            match holder_for(key, desired.desired_state, &ownership) {
                Some(h) => g.set("holder", ":h", s(h)),
                None if current
                    .as_ref()
                    .and_then(|c| c.holder.as_deref())
                    .is_some_and(|h| h.starts_with(UNOWNED_HOLDER_PREFIX)) =>
                {
                    g.remove(attr::HOLDER)
                }
                None => {}
            }
            if new_identity {
                // No checkpoint, no stale status.
                g.remove(attr::DELETED_AT_MS);
                g.remove(attr::LAST_SEQ);
                for a in STATUS_ATTRIBUTES {
                    g.remove(a);
                }
            }
            wrote = true;
            if self.guarded_write("upsert_desired", key, &g).await? {
                // A new or started stream is up for grabs: workers reading
                // the change counter look for it.
                self.tell_and_announce(ownership, key).await?;
                return Ok(UpsertOutcome::Applied);
            }
        }
        Err(StoreError::Rejected {
            operation: "upsert_desired",
            detail: format!("{key} kept changing while it was being written"),
        })
    }

    /// Deletes a stream, keeping its fencing token in a tombstone (so a stream
    /// re-created under the same name continues from a higher token, and
    /// token-checking sinks keep accepting it). Refuses while a live owner
    /// holds it unless `force` (then the owner is told and releases).
    pub async fn tombstone(
        &self,
        key: &StreamKey,
        owner_alive: bool,
        force: bool,
    ) -> Result<TombstoneOutcome, StoreError> {
        // As in `upsert_desired`: a tombstone found after a write of ours
        // whose answer was lost is ours, and its owner must still be told.
        let mut wrote = false;
        for _ in 0..MAX_CONTROL_ATTEMPTS {
            let Some(current) = self.get(key).await? else {
                return Ok(TombstoneOutcome::NotFound);
            };
            if current.is_tombstone() {
                if !wrote {
                    // Deleted before: an owner still holding it is reminded.
                    self.remind_owner_behind(&current).await?;
                    return Ok(TombstoneOutcome::NotFound);
                }
                self.tell_and_announce(current.ownership(), key).await?;
                return Ok(TombstoneOutcome::Deleted);
            }
            let ownership = current.ownership();
            let owned = match &ownership {
                Ownership::Free => false,
                Ownership::Owned(_) => owner_alive,
                Ownership::Legacy { expires_at_ms, .. } => *expires_at_ms > now_ms(),
            };
            if owned && !force {
                return Ok(TombstoneOutcome::StillOwned {
                    owner: current.lease_owner.clone().unwrap_or_default(),
                });
            }
            let mut g = guarded_on(Some(&current));
            g.set("deleted_at_ms", ":deleted", n(now_ms()));
            g.set(
                "desired_state",
                ":stopped",
                s(DesiredState::Stopped.as_str()),
            );
            for a in [attr::WS_URL, attr::SPEC, attr::LAST_SEQ] {
                g.remove(a);
            }
            if ownership == Ownership::Free {
                g.remove(attr::HOLDER);
            }
            wrote = true;
            if self.guarded_write("tombstone", key, &g).await? {
                self.tell_and_announce(ownership, key).await?;
                return Ok(TombstoneOutcome::Deleted);
            }
        }
        Err(StoreError::Rejected {
            operation: "tombstone",
            detail: format!("{key} kept changing while it was being deleted"),
        })
    }

    /// Deletes a stream the safe way: marks it STOPPED (its owner is told and
    /// releases it), waits up to `wait` for the release (or for the owner to be
    /// dead), then leaves a tombstone. Standalone mode (no resource identity).
    pub async fn delete_stream(
        &self,
        key: &StreamKey,
        wait: std::time::Duration,
    ) -> Result<DeleteOutcome, StoreError> {
        const POLL: std::time::Duration = std::time::Duration::from_millis(250);
        let Some(current) = self.get(key).await?.filter(|r| !r.is_tombstone()) else {
            return Ok(DeleteOutcome::NotFound);
        };
        if current.desired_state != DesiredState::Stopped {
            // The stored text, with its desired state Stopped too (printed
            // back sorted, as the spec codec stores it).
            let mut spec = current.spec.clone().unwrap_or_default();
            if let Ok(mut value) = serde_json::from_str::<serde_json::Value>(&spec)
                && let Some(obj) = value.as_object_mut()
            {
                obj.insert("desiredState".into(), serde_json::json!("Stopped"));
                spec = value.to_string();
            }
            let stopped = DesiredStream {
                key: key.clone(),
                desired_state: DesiredState::Stopped,
                ws_url: current.ws_url.clone(),
                spec,
                generation: current.generation + 1,
                resource: None,
                requests: current.requests.clone(),
            };
            if let UpsertOutcome::Refused { reason } = self.upsert_desired(&stopped).await? {
                return Err(StoreError::Rejected {
                    operation: "delete",
                    detail: format!("cannot stop {key}: {reason:?}"),
                });
            }
        }
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let Some(record) = self.get(key).await?.filter(|r| !r.is_tombstone()) else {
                return Ok(DeleteOutcome::Deleted);
            };
            let alive = self.owner_alive(&record).await?;
            match self.tombstone(key, alive, false).await? {
                TombstoneOutcome::Deleted => return Ok(DeleteOutcome::Deleted),
                TombstoneOutcome::NotFound => return Ok(DeleteOutcome::NotFound),
                TombstoneOutcome::StillOwned { owner } => {
                    if tokio::time::Instant::now() >= deadline {
                        return Ok(DeleteOutcome::StillOwned { owner });
                    }
                    tokio::time::sleep(POLL).await;
                }
            }
        }
    }

    /// One optimistic write; `false` when the item changed since it was read.
    async fn guarded_write(
        &self,
        operation: &'static str,
        key: &StreamKey,
        g: &Update,
    ) -> Result<bool, StoreError> {
        let out = self
            .update_item(operation, &key.pk(), g, ReturnValue::None)
            .await?;
        Ok(out.is_ok())
    }
}

/// Why `desired` must not overwrite `current`, if it must not.
fn refusal(current: &StreamRecord, desired: &DesiredStream) -> Option<UpsertRefusal> {
    let Some(resource) = &desired.resource else {
        // Standalone: generations only.
        return (!current.is_tombstone() && current.generation > desired.generation).then_some(
            UpsertRefusal::StaleGeneration {
                stored: current.generation,
            },
        );
    };
    if let Some(stored) = &current.installation
        && *stored != resource.installation
    {
        return Some(UpsertRefusal::OtherInstallation {
            stored: stored.clone(),
        });
    }
    match &current.uid {
        Some(uid) if *uid == resource.uid => {
            if current.is_tombstone() {
                Some(UpsertRefusal::Deleted)
            } else if current.generation > desired.generation {
                Some(UpsertRefusal::StaleGeneration {
                    stored: current.generation,
                })
            } else {
                None
            }
        }
        Some(uid) => {
            // Another resource of the same name wrote it: the newer one wins.
            let stored_created = current.resource_created_ms.unwrap_or(0);
            (stored_created >= resource.created_ms).then(|| UpsertRefusal::NewerResource {
                stored_uid: uid.clone(),
            })
        }
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::OwnerRequests;
    use crate::lease::{Incarnation, OWNED_EXPIRY_MS};

    fn owned_at(generation: i64, served: Option<i64>) -> (StreamRecord, Incarnation) {
        let owner = Incarnation::new("w");
        let record = StreamRecord {
            lease_owner: Some(owner.as_str().into()),
            lease_expires_at_ms: OWNED_EXPIRY_MS,
            generation,
            served_generation: served,
            ..StreamRecord::for_test(StreamKey::new("d", "s"))
        };
        (record, owner)
    }

    #[test]
    fn only_an_owner_serving_an_older_generation_is_told_again() {
        let (behind, owner) = owned_at(3, Some(2));
        assert_eq!(owner_behind(&behind), Some(Behind { owner, stop: false }));
        // Serving it, or nothing written yet (it read the item when it took it).
        assert_eq!(owner_behind(&owned_at(3, Some(3)).0), None);
        assert_eq!(owner_behind(&owned_at(3, None).0), None);
        // Nobody to tell.
        let free = StreamRecord {
            lease_expires_at_ms: 0,
            ..behind
        };
        assert_eq!(owner_behind(&free), None);
    }

    #[test]
    fn an_owner_still_holding_a_stopped_stream_is_told_again() {
        let (mut record, owner) = owned_at(3, Some(3));
        record.desired_state = DesiredState::Stopped;
        assert_eq!(owner_behind(&record), Some(Behind { owner, stop: true }));
        // Released: nobody to tell.
        record.lease_expires_at_ms = 0;
        assert_eq!(owner_behind(&record), None);
    }

    #[test]
    fn an_owner_whose_session_has_not_acted_on_a_request_is_told_again() {
        let (mut record, owner) = owned_at(3, Some(3));
        record.requests.reconnect = Some("r1".into());
        // An owner of an earlier release records nothing it served.
        assert_eq!(owner_behind(&record), None);
        record.served_requests = Some(OwnerRequests::default());
        let told = Some(Behind {
            owner: owner.clone(),
            stop: false,
        });
        assert_eq!(owner_behind(&record), told);
        record.served_requests = Some(record.requests.clone());
        assert_eq!(owner_behind(&record), None);
        record.requests.move_away = Some("m1".into());
        assert_eq!(owner_behind(&record), Some(Behind { owner, stop: false }));
    }
}
