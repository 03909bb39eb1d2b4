//! The streams this incarnation holds, shared by the acquirer (which adds
//! them), the liveness task (which packs their checkpoints and routes inbox
//! changes to them) and the main loop (which removes them when their task ends).

use super::progress::StreamProgress;
use crate::lease::{Lease, StreamKey};
use crate::support::lock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Signals a holder can receive.
#[derive(Clone, Debug, Default)]
pub(crate) struct HolderSignals {
    /// Drain and release (graceful shutdown).
    pub shutdown: CancellationToken,
    /// Hand the stream over to another worker (fair share).
    pub handoff: CancellationToken,
    /// The control plane changed the stream: re-read it.
    pub changed: Arc<Notify>,
}

/// One held stream.
#[derive(Clone, Debug)]
pub(crate) struct HeldStream {
    pub lease: Lease,
    pub progress: Arc<StreamProgress>,
    pub signals: HolderSignals,
}

impl HeldStream {
    /// Not being handed over.
    pub(crate) fn staying(&self) -> bool {
        !self.signals.handoff.is_cancelled()
    }
}

#[derive(Debug, Default)]
pub(crate) struct Registry {
    streams: Mutex<HashMap<StreamKey, HeldStream>>,
    /// A holder found its stream owned by this incarnation at a token it
    /// does not hold (a re-created stream): audit at the next pass instead
    /// of the next scheduled one, so the new stream is adopted at once.
    audit_requested: AtomicBool,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<StreamKey, HeldStream>> {
        lock(&self.streams)
    }

    pub(crate) fn insert(&self, held: HeldStream) {
        self.lock().insert(held.lease.key.clone(), held);
    }

    pub(crate) fn remove(&self, key: &StreamKey) {
        self.lock().remove(key);
    }

    pub(crate) fn get(&self, key: &StreamKey) -> Option<HeldStream> {
        self.lock().get(key).cloned()
    }

    pub(crate) fn contains(&self, key: &StreamKey) -> bool {
        self.lock().contains_key(key)
    }

    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }

    /// Streams held and not being handed over: the load fair share counts.
    pub(crate) fn staying(&self) -> usize {
        self.lock().values().filter(|h| h.staying()).count()
    }

    /// Asks the acquirer to audit this incarnation's streams at its next pass.
    pub(crate) fn request_audit(&self) {
        self.audit_requested.store(true, Ordering::SeqCst);
    }

    /// Whether an audit was asked for since the last call.
    pub(crate) fn take_audit_request(&self) -> bool {
        self.audit_requested.swap(false, Ordering::SeqCst)
    }

    pub(crate) fn snapshot(&self) -> Vec<HeldStream> {
        self.lock().values().cloned().collect()
    }
}
