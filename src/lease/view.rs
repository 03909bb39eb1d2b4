//! Streams as people see them (`tether get`, the controller's status): the
//! stream item combined with its owner's worker item, which says whether the
//! owner is alive and holds the freshest checkpoint.

use super::client::LeaseStore;
use super::clock::now_ms;
use super::codec::Malformed;
use super::error::StoreError;
use super::keys::{Incarnation, StreamKey, worker_id_of};
use super::record::{Checkpoints, Ownership, StreamRecord, WorkerRecord, WorkerState};
use std::collections::HashMap;

/// Who owns a stream, as far as anyone can tell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnerView {
    /// The stored `lease_owner` (an incarnation, or a version-1 worker id).
    pub owner: String,
    pub worker_id: String,
    /// The owner is alive (LIVE worker item, or an unexpired version-1 lease).
    pub alive: bool,
    /// Until when the owner has proven itself (wall clock, informational;
    /// `None` before its first renewal).
    pub until_ms: Option<u64>,
    /// When the owner last renewed (its own wall clock; `None` for a
    /// version-1 lease, which has no heartbeat of its own).
    pub heartbeat_at_ms: Option<u64>,
}

/// A stream with its owner's view of it.
#[derive(Clone, Debug, PartialEq)]
pub struct StreamView {
    pub record: StreamRecord,
    pub owner: Option<OwnerView>,
    /// The freshest checkpoint: the item's, or the owner's packed one.
    pub checkpoint: Option<u64>,
}

impl StreamView {
    /// The live owner, if any.
    pub fn live_owner(&self) -> Option<&OwnerView> {
        self.owner.as_ref().filter(|o| o.alive)
    }
}

fn combine(
    record: StreamRecord,
    owners: &HashMap<Incarnation, (WorkerRecord, Checkpoints)>,
) -> StreamView {
    let now = now_ms();
    let (owner, packed) = match record.ownership() {
        Ownership::Free => (None, None),
        Ownership::Owned(inc) => {
            let found = owners.get(&inc);
            let alive = found.is_some_and(|(w, _)| w.state == WorkerState::Live);
            let packed = found
                .and_then(|(_, c)| c.get(&record.key))
                .filter(|c| c.token == record.lease_counter)
                .map(|c| c.seq);
            (
                Some(OwnerView {
                    worker_id: inc.worker_id().to_string(),
                    owner: inc.to_string(),
                    alive,
                    // A new incarnation's item has no lease end until its first renewal.
                    until_ms: found
                        .map(|(w, _)| w.alive_until_ms)
                        .filter(|&until| alive && until > 0),
                    heartbeat_at_ms: found.map(|(w, _)| w.heartbeat_at_ms).filter(|_| alive),
                }),
                packed,
            )
        }
        Ownership::Legacy {
            owner,
            expires_at_ms,
        } => (
            Some(OwnerView {
                worker_id: worker_id_of(&owner).to_string(),
                owner,
                alive: expires_at_ms > now,
                until_ms: Some(expires_at_ms),
                heartbeat_at_ms: None,
            }),
            None,
        ),
    };
    StreamView {
        checkpoint: record.checkpoint.max(packed),
        record,
        owner,
    }
}

/// Owners' worker items with their packed checkpoints, read once and used
/// for many streams (the controller's status reads them per owner, not per
/// stream).
#[derive(Clone, Debug, Default)]
pub struct Owners {
    workers: HashMap<Incarnation, (WorkerRecord, Checkpoints)>,
    /// Owners whose worker item is gone (they own nothing alive).
    gone: std::collections::HashSet<Incarnation>,
}

impl Owners {
    /// The stream as people see it, if its owner is in here (or it has none
    /// this snapshot could tell about).
    pub fn view(&self, record: &StreamRecord) -> Option<StreamView> {
        match record.ownership() {
            Ownership::Owned(inc)
                if !self.workers.contains_key(&inc) && !self.gone.contains(&inc) =>
            {
                None
            }
            _ => Some(combine(record.clone(), &self.workers)),
        }
    }

    /// Forgets `who`, so the next view of its streams reads it again.
    pub fn forget(&mut self, who: &Incarnation) {
        self.workers.remove(who);
        self.gone.remove(who);
    }

    /// Takes in what `other` knows (its entries win).
    pub fn merge(&mut self, other: Owners) {
        for inc in other.workers.keys().chain(other.gone.iter()) {
            self.workers.remove(inc);
            self.gone.remove(inc);
        }
        self.workers.extend(other.workers);
        self.gone.extend(other.gone);
    }
}

impl LeaseStore {
    /// Adds `record`'s owner to `owners` (its worker item and checkpoints,
    /// strongly consistent) unless it is there already.
    pub async fn add_owner(
        &self,
        owners: &mut Owners,
        record: &StreamRecord,
    ) -> Result<(), StoreError> {
        let mut found = self.owners_of(std::iter::once(record)).await?;
        if let Ownership::Owned(inc) = record.ownership() {
            match found.remove(&inc) {
                Some(entry) => {
                    owners.workers.insert(inc, entry);
                }
                // No item: the owner is gone (not alive), remembered as such.
                None => {
                    owners.gone.insert(inc);
                }
            }
        }
        Ok(())
    }

    async fn owners_of<'a>(
        &self,
        records: impl Iterator<Item = &'a StreamRecord>,
    ) -> Result<HashMap<Incarnation, (WorkerRecord, Checkpoints)>, StoreError> {
        let mut owners = HashMap::new();
        for record in records {
            if let Ownership::Owned(inc) = record.ownership()
                && !owners.contains_key(&inc)
                && let Some(worker) = self.worker(&inc).await?
            {
                let checkpoints = self.checkpoints_of(&inc).await?;
                owners.insert(inc, (worker, checkpoints));
            }
        }
        Ok(owners)
    }

    /// Every stream with its owner (a scan: for the CLI).
    pub async fn view_all(&self) -> Result<(Vec<StreamView>, Vec<Malformed>), StoreError> {
        let found = self.list().await?;
        let owners = self.owners_of(found.records.iter()).await?;
        let views = found
            .records
            .into_iter()
            .map(|r| combine(r, &owners))
            .collect();
        Ok((views, found.malformed))
    }

    /// One stream with its owner (tombstones are `None`).
    pub async fn view(&self, key: &StreamKey) -> Result<Option<StreamView>, StoreError> {
        let Some(record) = self.get(key).await?.filter(|r| !r.is_tombstone()) else {
            return Ok(None);
        };
        let owners = self.owners_of(std::iter::once(&record)).await?;
        Ok(Some(combine(record, &owners)))
    }

    /// Whether the owner of `record` is alive (LIVE worker item, or an
    /// unexpired version-1 lease); `false` for a free stream.
    pub async fn owner_alive(&self, record: &StreamRecord) -> Result<bool, StoreError> {
        Ok(match record.ownership() {
            Ownership::Free => false,
            Ownership::Owned(inc) => self
                .worker(&inc)
                .await?
                .is_some_and(|w| w.state == WorkerState::Live),
            Ownership::Legacy { expires_at_ms, .. } => expires_at_ms > now_ms(),
        })
    }
}
