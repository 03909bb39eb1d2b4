//! The part of a worker every one of its tasks reads (the acquirer, the
//! liveness task, each holder): kept apart from the rest of the worker's
//! context so those tasks depend on it alone, not on the loop that runs them.

use super::settings::WorkerSettings;
use crate::lease::LeaseStore;
use crate::metrics::WorkerMetrics;
use std::sync::Arc;

/// Settings, store and metrics, shared by every task of every incarnation.
pub struct Shared {
    pub settings: WorkerSettings,
    pub store: LeaseStore,
    pub metrics: Arc<WorkerMetrics>,
}
