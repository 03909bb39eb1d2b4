//! The part of a worker every one of its tasks reads (the acquirer, the
//! liveness task, each holder): kept apart from the rest of the worker's
//! context so those tasks depend on it alone, not on the loop that runs them.

use super::settings::WorkerSettings;
use crate::lease::LeaseStore;
use crate::metrics::WorkerMetrics;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

/// Settings, store and metrics, shared by every task of every incarnation.
pub struct Shared {
    pub settings: WorkerSettings,
    pub store: LeaseStore,
    pub metrics: Arc<WorkerMetrics>,
    /// Every LIVE peer of the last full fleet read reads slotted checkpoints
    /// (set by the acquirer, read by the liveness task): until then, and
    /// while a worker of an earlier release is LIVE, checkpoints go by name,
    /// which every release reads.
    pub peers_read_slots: AtomicBool,
    /// Peers to poke after this process moves the change counter, and
    /// whether a peer poked this one.
    pub pokes: Arc<super::pokes::Pokes>,
}
