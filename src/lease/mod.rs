//! The lease store: who owns which stream, decided by DynamoDB conditional
//! writes, with liveness proven once per worker incarnation.
//!
//! Every write is a single conditional write, and every lost condition is a
//! typed outcome rather than an error: losing a race is the normal way a fleet
//! learns that somebody else owns a stream. Errors are reserved for things an
//! operator acts on (missing table, bad credentials, an endpoint that does not
//! answer) and for outcomes nobody saw (no answer), which callers resolve.
//!
//! One job per file: `client` (connection, retries, classification), `codec`
//! (items ⇄ records), `pages` (pagination), `admin` (table), `reads`,
//! `acquire`, `owner` (owner-guarded writes), `incarnations` (worker items),
//! `packed` (packed checkpoints as stored) and `packed_items` (the items
//! besides the worker's that hold them),
//! `changes` (the fleet's change counter) and `announcer` (its bumps coalesced),
//! `control` (control-plane writes), `clock` (skew measurement), `view`
//! (streams as people read them).

mod acquire;
mod admin;
mod announcer;
mod changes;
mod client;
pub mod clock;
pub mod codec;
mod control;
mod error;
mod incarnations;
mod keys;
mod owner;
mod packed;
mod packed_items;
mod pages;
mod reads;
mod record;
mod roster;
mod session_status;
mod update;
mod view;

pub use admin::{CHANGE_INDEX, HOLDER_INDEX, LEGACY_INDEX, TableChange, TableLayout};
pub use announcer::AfterBump;
pub use changes::CHANGES_PK;
pub use client::{
    Caller, LOCAL_CREDENTIALS, LeaseStore, StoreConfig, root_cause, validate_table_name,
};
pub use clock::{ClockGauge, OffsetBounds, now_ms};
pub use control::{DeleteOutcome, TombstoneOutcome};
pub use error::StoreError;
pub use incarnations::{RenewOutcome, Renewal, Watched, WorkerItems};
pub use keys::{
    CHECKPOINT_PK_PREFIX, FLEET_HOLDER, HOLDER_SHARDS, Incarnation, STREAM_PK_PREFIX, StreamKey,
    UNOWNED_HOLDER_PREFIX, WORKER_PK_PREFIX, unowned_holder, valid_worker_id, worker_id_of,
};
pub use packed::{SLOTS_PER_PAGE, named_size, page_of, slotted_size};
pub use reads::{Change, Found, Sample};
pub use record::{
    AcquireFrom, AcquireOutcome, Checkpoint, Checkpoints, DesiredState, DesiredStream, FleetEntry,
    InboxEntry, Lease, OWNED_EXPIRY_MS, OwnerRequests, OwnerWrite, Ownership, PackedShard,
    PodIdentity, ResourceIdentity, SlotEntry, SlotPage, StreamRecord, UpsertOutcome, UpsertRefusal,
    WorkerRecord, WorkerState,
};
pub use session_status::{Phase, ReleaseReason, SessionStatus};
pub use view::{OwnerView, Owners, StreamView};
