//! The Kubernetes controller: mirrors each `StreamConnection` into the lease
//! table and writes its status back. It never touches lease fields; workers do.
//!
//! Per resource: validate → mirror (generation-guarded upsert, no write when
//! the item already matches) → status (at once when phase, owner or
//! conditions change; progress fields at a bounded rate). On deletion
//! (finalizer): mark STOPPED, wait (bounded) for the owner to release, delete
//! the item, remove the finalizer. One replica per installation reconciles
//! (leader election, `leader.rs`); the mirror stays idempotent and guarded by
//! UID, generation and installation, so an overlap of two leaders is harmless.

mod gc;
mod leader;
mod reconcile;
mod resource_status;
mod run;
mod settings;
mod status_feed;

pub use reconcile::{
    Context, Error, FIELD_MANAGER, FINALIZER, RELEASE_WAIT, check_crd, error_policy, reconcile,
};
pub use run::run;
pub use settings::ControllerSettings;
