//! Items as the protocol reads them: stream items, worker items, the packed
//! checkpoints, and the typed outcomes of every write.

use super::keys::{Incarnation, StreamKey};
use super::session_status::{ReleaseReason, SessionStatus};
use serde::Serialize;
use std::collections::BTreeMap;

/// `lease_expires_at_ms` of a stream owned under this protocol: 9999-12-31.
/// Ownership is proven by the owner's worker item, not by a per-stream expiry;
/// a version-1 worker reading this value sees a lease that never lapses, so it
/// never takes a stream a current worker holds (rolling upgrades stay safe).
pub const OWNED_EXPIRY_MS: u64 = 253_402_300_799_999;

/// Desired state of a stream as the control plane declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum DesiredState {
    Started,
    Stopped,
}

impl DesiredState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Started => "STARTED",
            Self::Stopped => "STOPPED",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "STARTED" => Some(Self::Started),
            "STOPPED" => Some(Self::Stopped),
            _ => None,
        }
    }
}

/// Who owns a stream, read from its item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ownership {
    /// Released or never owned (`lease_expires_at_ms = 0`).
    Free,
    /// Owned by a current worker incarnation, alive as long as its worker item is.
    Owned(Incarnation),
    /// Owned by a version-1 worker: a per-stream wall-clock lease.
    Legacy { owner: String, expires_at_ms: u64 },
}

/// One stream item as stored in the table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StreamRecord {
    pub key: StreamKey,
    pub desired_state: DesiredState,
    pub ws_url: String,
    /// The spec as stored: JSON text the store keeps opaque (its one codec
    /// is `crd::stored`); "changed" means the texts differ.
    pub spec: Option<String>,
    pub generation: i64,
    /// UID of the Kubernetes resource mirrored here (absent in standalone mode).
    pub uid: Option<String>,
    /// That resource's creation time (ms): a newer resource of the same name
    /// replaces the item, an older one never does.
    pub resource_created_ms: Option<u64>,
    /// The installation (operator release) whose controller wrote the item;
    /// another installation never takes it over.
    pub installation: Option<String>,
    /// Its partition in the `by_change` index (controller-mirrored items).
    pub change_shard: Option<String>,
    /// How many writes the item has had (0 before the change feed existed):
    /// a copy is current while no newer number was seen.
    pub change_seq: u64,
    pub lease_owner: Option<String>,
    pub lease_expires_at_ms: u64,
    /// The fencing token: +1 on every acquire, never lower for a stream name.
    pub lease_counter: u64,
    /// The checkpoint stored on the item, attribute `last_seq` (`None`:
    /// nothing acknowledged yet).
    /// While owned, the owner's packed checkpoints may be ahead of it.
    pub checkpoint: Option<u64>,
    /// The `by_holder` index partition the item is in.
    pub holder: Option<String>,
    pub released_at_ms: Option<u64>,
    pub release_reason: Option<ReleaseReason>,
    /// When the control plane first wrote the item (wall-clock ms).
    pub created_at_ms: Option<u64>,
    /// Set on a deleted stream's tombstone, which keeps `lease_counter`.
    pub deleted_at_ms: Option<u64>,
    /// The generation the owner's current session was started with.
    pub served_generation: Option<i64>,
    /// The requests the owner's current session has acted on (with its
    /// status; absent from owners of earlier releases).
    pub served_requests: Option<OwnerRequests>,
    pub status: Option<SessionStatus>,
    /// What the resource asks of its owner (annotations), acted on once per value.
    pub requests: OwnerRequests,
}

/// What a resource's annotations ask of the stream's owner. Each is acted on
/// once per value, by the owner holding the stream when the value changed: a
/// later owner finds the value already there when it acquires, so nothing is
/// repeated. Neither is part of the spec: asking changes no generation.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OwnerRequests {
    /// `tether.dev/reconnect`: close the session and open it again.
    pub reconnect: Option<String>,
    /// `tether.dev/move`: hand the stream to another worker.
    pub move_away: Option<String>,
}

impl StreamRecord {
    /// A free, STARTED, never-owned item of `key` at token 1, for unit tests
    /// to change what they look at.
    #[cfg(test)]
    pub(crate) fn for_test(key: StreamKey) -> Self {
        Self {
            key,
            desired_state: DesiredState::Started,
            ws_url: "ws://x/".into(),
            spec: None,
            generation: 1,
            uid: None,
            resource_created_ms: None,
            installation: None,
            change_shard: None,
            change_seq: 0,
            lease_owner: None,
            lease_expires_at_ms: 0,
            lease_counter: 1,
            checkpoint: None,
            holder: None,
            released_at_ms: None,
            release_reason: None,
            created_at_ms: None,
            deleted_at_ms: None,
            served_generation: None,
            served_requests: None,
            status: None,
            requests: OwnerRequests::default(),
        }
    }

    pub fn ownership(&self) -> Ownership {
        match (&self.lease_owner, self.lease_expires_at_ms) {
            (_, 0) | (None, _) => Ownership::Free,
            (Some(owner), OWNED_EXPIRY_MS) => match Incarnation::parse(owner) {
                Some(inc) => Ownership::Owned(inc),
                None => Ownership::Legacy {
                    owner: owner.clone(),
                    expires_at_ms: OWNED_EXPIRY_MS,
                },
            },
            (Some(owner), expires_at_ms) => Ownership::Legacy {
                owner: owner.clone(),
                expires_at_ms,
            },
        }
    }

    /// The owner as the item alone tells it: a current incarnation, or a
    /// version-1 owner whose lease has not lapsed at `now_ms`. (Whether a
    /// current incarnation is alive is in its worker item.)
    pub fn owner(&self, now_ms: u64) -> Option<&str> {
        match (&self.lease_owner, self.ownership()) {
            (_, Ownership::Free) => None,
            (Some(o), Ownership::Owned(_)) => Some(o),
            (Some(o), Ownership::Legacy { expires_at_ms, .. }) if expires_at_ms > now_ms => Some(o),
            _ => None,
        }
    }

    pub fn is_tombstone(&self) -> bool {
        self.deleted_at_ms.is_some()
    }

    /// The worker that last released the stream and when, on that worker's
    /// clock (a release keeps `lease_owner` beside `released_at_ms`).
    pub fn released_by(&self) -> Option<(&str, u64)> {
        Some((self.lease_owner.as_deref()?, self.released_at_ms?))
    }
}

/// A worker incarnation's state in its item.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum WorkerState {
    /// Renewing (or about to be declared dead by a peer).
    Live,
    /// Declared dead by a peer: it can never renew again, and its streams move.
    Dead,
    /// Left gracefully after releasing everything.
    Left,
}

impl WorkerState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Live => "LIVE",
            Self::Dead => "DEAD",
            Self::Left => "LEFT",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Self::Live, Self::Dead, Self::Left]
            .into_iter()
            .find(|x| x.as_str() == s)
    }
}

/// Where a worker runs in Kubernetes: with it, a restarted container can prove
/// its predecessor in the same pod is gone (the kubelet restarted it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PodIdentity {
    pub uid: String,
    pub container: String,
    /// The container's restart count as the API server reported it at start.
    pub restart_count: u32,
}

/// One stream's packed checkpoint: the highest acknowledged sequence number
/// under the fencing token it was acknowledged with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Checkpoint {
    pub seq: u64,
    pub token: u64,
}

/// A worker's packed checkpoints, by stream.
pub type Checkpoints = BTreeMap<StreamKey, Checkpoint>;

/// One shard's packed entries, in both forms (`lease::packed`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PackedShard {
    pub named: Vec<(StreamKey, Checkpoint)>,
    /// `(slot, sequence number − the slot's base)`.
    pub slotted: Vec<(u64, i64)>,
}

/// What a slot stands for: written once in a slot page, never changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotEntry {
    pub key: StreamKey,
    pub token: u64,
    /// The sequence number entries count from.
    pub base: u64,
}

/// No entries (a renewal that packs nothing).
impl Default for &PackedShard {
    fn default() -> Self {
        static EMPTY: PackedShard = PackedShard {
            named: Vec::new(),
            slotted: Vec::new(),
        };
        &EMPTY
    }
}

/// One slot page: slots by number.
pub type SlotPage = BTreeMap<u64, SlotEntry>;

/// A worker incarnation's item.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerRecord {
    #[serde(skip)]
    pub incarnation: Incarnation,
    pub state: WorkerState,
    /// +1 on every renewal; peers declare the worker dead when it stops moving.
    pub heartbeat_version: u64,
    /// Wall-clock time of the last renewal (for people; the protocol does not
    /// compare it across machines).
    pub heartbeat_at_ms: u64,
    /// `heartbeat_at_ms` plus the lease (informational).
    pub alive_until_ms: u64,
    /// Streams held at the last renewal (fair share).
    pub held: u64,
    pub started_at_ms: u64,
    /// When it last released streams (peers look for orphans when it moves).
    pub released_at_ms: Option<u64>,
    pub pod: Option<PodIdentity>,
    /// How many checkpoint shards it wrote: shard 0 in this item (read by
    /// `LeaseStore::checkpoints_of`), more in `CKPT#` items.
    pub checkpoint_shards: u32,
    /// The slot pages its slotted entries name (`lease::packed`).
    #[serde(skip)]
    pub slot_pages: Vec<u32>,
    /// Streams the control plane changed since the owner last looked.
    #[serde(skip)]
    pub changed_streams: Vec<InboxEntry>,
    /// Whether it moves the change counter (workers of earlier releases do not).
    #[serde(skip)]
    pub announces_changes: bool,
    /// Whether it reads slotted checkpoints (workers of earlier releases do
    /// not: while one is LIVE, peers write theirs by name).
    #[serde(skip)]
    pub reads_slots: bool,
    /// Where peers tell it that the change counter moved (`POST /poke` on
    /// its metrics listener), when it gave one (`--advertise-ip`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub poke_addr: Option<std::net::SocketAddr>,
    /// Whether it pokes its peers after it moves the change counter
    /// (workers of earlier releases do not: while one is LIVE, peers read
    /// the counter every 500 ms).
    #[serde(skip)]
    pub pokes_peers: bool,
}

/// One inbox entry: a changed stream, with the nonce that makes each change
/// its own set element (so a change arriving while the owner handles an
/// earlier one is not deleted with it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InboxEntry {
    pub key: StreamKey,
    /// The stored element, `<namespace>/<name>#<nonce>`.
    pub raw: String,
}

impl InboxEntry {
    pub fn new(key: &StreamKey) -> Self {
        Self {
            raw: format!("{key}#{:08x}", rand::random::<u32>()),
            key: key.clone(),
        }
    }

    pub fn parse(raw: &str) -> Option<Self> {
        let (name, _nonce) = raw.split_once('#')?;
        Some(Self {
            key: StreamKey::parse(name)?,
            raw: raw.to_string(),
        })
    }
}

/// A worker as the fleet query (the index) shows it: no heartbeat details.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetEntry {
    pub incarnation: Incarnation,
    pub state: WorkerState,
    pub released_at_ms: Option<u64>,
    pub started_at_ms: Option<u64>,
    /// Shutting down: releasing everything, taking nothing.
    pub draining: bool,
}

/// A stream a worker holds: the fencing token is `counter`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    pub key: StreamKey,
    pub owner: Incarnation,
    pub counter: u64,
}

/// What an acquirer saw, which decides the acquire's condition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcquireFrom {
    /// Released or never owned.
    Free,
    /// Owned by an incarnation already marked DEAD; `checkpoint` is what its
    /// packed checkpoints held for this stream (carried into the item).
    Dead {
        owner: Incarnation,
        checkpoint: Option<u64>,
    },
    /// A version-1 lease that lapsed (by this worker's skew-corrected clock).
    LegacyExpired { owner: String, expires_at_ms: u64 },
}

/// Result of an acquire.
#[derive(Clone, Debug, PartialEq)]
pub enum AcquireOutcome {
    /// We own it now; `record` is the item after the write.
    Acquired {
        lease: Lease,
        record: Box<StreamRecord>,
    },
    /// Somebody else got there first (or the item changed since we looked).
    Taken { owner: Option<String> },
    /// The stream is STOPPED: nobody should serve it.
    NotStarted,
    /// The item no longer exists (or is a tombstone).
    Gone,
}

/// Result of an owner-guarded write (status, checkpoint, release).
#[derive(Clone, Debug, PartialEq)]
pub enum OwnerWrite<T> {
    /// The write happened while we still owned the stream.
    Done(T),
    /// The stream is no longer ours (released, taken, deleted): nothing changed.
    Lost,
}

impl<T> OwnerWrite<T> {
    pub fn is_lost(&self) -> bool {
        matches!(self, Self::Lost)
    }
}

/// Desired state written by the control plane (controller or `tether apply`).
#[derive(Clone, Debug, PartialEq)]
pub struct DesiredStream {
    pub key: StreamKey,
    pub desired_state: DesiredState,
    pub ws_url: String,
    /// Encoded by `crd::stored::encode`.
    pub spec: String,
    pub generation: i64,
    /// The Kubernetes resource's UID and creation time (ms); `None` standalone.
    pub resource: Option<ResourceIdentity>,
    /// The resource's requests to its owner (none standalone).
    pub requests: OwnerRequests,
}

impl DesiredStream {
    /// Its `by_change` partition: only a resource's item has one (the
    /// controller reads its installation's changes; standalone has no
    /// controller).
    pub fn change_shard(&self) -> Option<String> {
        self.resource
            .as_ref()
            .map(|r| self.key.change_shard(&r.installation))
    }
}

/// Which Kubernetes resource a mirror write comes from. A newer resource
/// (created later) replaces an item left by an older one of the same name; an
/// older one never overwrites a newer one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceIdentity {
    pub uid: String,
    pub created_ms: u64,
    /// The installation mirroring it (`""` for the default installation).
    pub installation: String,
}

/// Result of a control-plane upsert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpsertOutcome {
    /// The item now carries this desired state.
    Applied,
    /// The item already carried it: nothing was written.
    Unchanged,
    /// Refused: the table holds a newer generation of the same resource, or an
    /// item from a newer resource of the same name, or a deleted resource.
    Refused { reason: UpsertRefusal },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UpsertRefusal {
    StaleGeneration {
        stored: i64,
    },
    NewerResource {
        stored_uid: String,
    },
    Deleted,
    /// Another installation (another operator release, or another cluster
    /// sharing the table) mirrors this name.
    OtherInstallation {
        stored: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(owner: Option<&str>, expires: u64) -> StreamRecord {
        StreamRecord {
            lease_owner: owner.map(Into::into),
            lease_expires_at_ms: expires,
            lease_counter: 3,
            checkpoint: Some(9),
            ..StreamRecord::for_test(StreamKey::new("d", "s"))
        }
    }

    #[test]
    fn ownership_is_read_from_owner_and_expiry() {
        let inc = Incarnation::new("w1");
        assert_eq!(record(Some("w1"), 0).ownership(), Ownership::Free);
        assert_eq!(
            record(Some(inc.as_str()), OWNED_EXPIRY_MS).ownership(),
            Ownership::Owned(inc.clone())
        );
        assert_eq!(
            record(Some("w1"), 100).ownership(),
            Ownership::Legacy {
                owner: "w1".into(),
                expires_at_ms: 100
            }
        );
        assert_eq!(record(Some("w1"), 100).owner(99), Some("w1"));
        assert_eq!(record(Some("w1"), 100).owner(100), None);
        assert_eq!(
            record(Some(inc.as_str()), OWNED_EXPIRY_MS).owner(u64::MAX - 1),
            Some(inc.as_str())
        );
    }
}
