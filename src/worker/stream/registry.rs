//! The streams this incarnation holds, shared by the acquirer (which adds
//! them), the liveness task (which packs their checkpoints and routes inbox
//! changes to them) and the main loop (which removes them when their task ends).

use super::progress::StreamProgress;
use crate::lease::{Lease, StreamKey};
use crate::support::lock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Signals a holder can receive.
#[derive(Clone, Debug, Default)]
pub(crate) struct HolderSignals {
    /// Drain and release (graceful shutdown).
    pub shutdown: CancellationToken,
    /// Hand the stream over to another worker (fair share).
    pub handoff: Handoff,
    /// The control plane changed the stream: re-read it.
    pub changed: Arc<Notify>,
}

/// A request to hand one stream over. Whether it was asked is a flag of its
/// own beside the token the holder waits on: fair share counts every held
/// stream's answer several times a pass (5,000 streams, four passes a
/// second), and the token's own answer takes its lock each time. The two
/// are set together, only here, so they cannot disagree.
#[derive(Clone, Debug, Default)]
pub(crate) struct Handoff {
    asked: Arc<AtomicBool>,
    token: CancellationToken,
}

impl Handoff {
    /// Asks the holder to release the stream to another worker.
    pub(crate) fn ask(&self) {
        self.asked.store(true, Ordering::SeqCst);
        self.token.cancel();
    }

    pub(crate) fn asked(&self) -> bool {
        self.asked.load(Ordering::SeqCst)
    }

    /// Resolves once [`Self::ask`] was called.
    pub(crate) async fn wait(&self) {
        self.token.cancelled().await;
    }
}

/// One held stream, shared (`Arc`) by the registry and its holder task.
#[derive(Debug)]
pub(crate) struct HeldStream {
    pub lease: Lease,
    pub progress: Arc<StreamProgress>,
    pub signals: HolderSignals,
    /// When its release was stamped (this worker's wall clock, ms; 0 while
    /// none was): from then on it is out of the load this worker publishes,
    /// and the release carries the same time as `released_at_ms`, so a peer
    /// can tell from the two times alone whether a released stream is
    /// still in the load it last read (`FleetView::still_counted`).
    pub released_at_ms: AtomicU64,
}

impl HeldStream {
    /// Not being handed over or released.
    pub(crate) fn staying(&self) -> bool {
        !self.signals.handoff.asked() && self.published()
    }

    /// Still in the load this worker publishes: not released yet.
    pub(crate) fn published(&self) -> bool {
        self.released_at_ms.load(Ordering::SeqCst) == 0
    }

    /// Stamps the release at `now_ms` (the first stamp stays: a release
    /// retried carries the time the stream left the published load) and
    /// returns the stamp.
    pub(crate) fn stamp_release(&self, now_ms: u64) -> u64 {
        match self.released_at_ms.compare_exchange(
            0,
            now_ms.max(1),
            Ordering::SeqCst,
            Ordering::SeqCst,
        ) {
            Ok(_) => now_ms.max(1),
            Err(first) => first,
        }
    }
}

/// The streams held, each shared with its holder task: a snapshot (every
/// heartbeat packs one, every audit and sweep walks one) copies a pointer per
/// stream, not its key, owner and signals (three strings and two token
/// locks each: at 5,000 streams, a tenth of a takeover's allocations).
#[derive(Debug, Default)]
pub(crate) struct Registry {
    streams: Mutex<HashMap<StreamKey, Arc<HeldStream>>>,
    /// A holder found its stream owned by this incarnation at a token it
    /// does not hold (a re-created stream): audit at the next pass instead
    /// of the next scheduled one, so the new stream is adopted at once.
    audit_requested: AtomicBool,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<StreamKey, Arc<HeldStream>>> {
        lock(&self.streams)
    }

    pub(crate) fn insert(&self, held: Arc<HeldStream>) {
        self.lock().insert(held.lease.key.clone(), held);
    }

    pub(crate) fn remove(&self, key: &StreamKey) {
        self.lock().remove(key);
    }

    pub(crate) fn get(&self, key: &StreamKey) -> Option<Arc<HeldStream>> {
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

    /// Streams whose release was not stamped yet: the load a heartbeat
    /// publishes. Streams chosen for handoff stay in it until their release
    /// is stamped, so a peer never finds a stream both out of this load and
    /// released after the heartbeat that published it.
    pub(crate) fn published(&self) -> usize {
        self.lock().values().filter(|h| h.published()).count()
    }

    /// Asks the acquirer to audit this incarnation's streams at its next pass.
    pub(crate) fn request_audit(&self) {
        self.audit_requested.store(true, Ordering::SeqCst);
    }

    /// Whether an audit was asked for since the last call.
    pub(crate) fn take_audit_request(&self) -> bool {
        self.audit_requested.swap(false, Ordering::SeqCst)
    }

    pub(crate) fn snapshot(&self) -> Vec<Arc<HeldStream>> {
        self.lock().values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::Incarnation;

    fn held(name: &str) -> Arc<HeldStream> {
        Arc::new(HeldStream {
            lease: Lease {
                key: StreamKey::new("ns", name),
                owner: Incarnation::new("w"),
                counter: 1,
            },
            progress: Arc::new(StreamProgress::new(None, None)),
            signals: HolderSignals::default(),
            released_at_ms: Default::default(),
        })
    }

    /// The flag fair share counts and the wake-up the holder waits on come
    /// from one call, seen through every clone of the signals.
    #[tokio::test]
    async fn asking_for_a_handoff_is_counted_and_wakes_the_holder() {
        let a = held("a");
        let holders_copy = a.signals.handoff.clone();
        let waiting = tokio::spawn(async move { holders_copy.wait().await });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished() && !a.signals.handoff.asked());
        a.signals.handoff.ask();
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("the holder woke")
            .unwrap();
        assert!(a.signals.handoff.asked() && !a.staying());
    }

    /// A stream chosen for handoff leaves this worker's own count at once
    /// and the published load only when its release is stamped; the first
    /// stamp is the one a retried release carries.
    #[test]
    fn a_stream_leaves_the_published_load_at_its_release_stamp() {
        let registry = Registry::default();
        let (a, b) = (held("a"), held("b"));
        registry.insert(a.clone());
        registry.insert(b.clone());
        assert_eq!((registry.staying(), registry.published()), (2, 2));
        a.signals.handoff.ask();
        assert_eq!((registry.staying(), registry.published()), (1, 2));
        assert_eq!(a.stamp_release(5_000), 5_000);
        assert_eq!((registry.staying(), registry.published()), (1, 1));
        assert_eq!(
            a.stamp_release(6_000),
            5_000,
            "a retry keeps the first stamp"
        );
        // Released without a handoff (stopped, moved): out of both at once.
        assert_eq!(b.stamp_release(7_000), 7_000);
        assert_eq!((registry.staying(), registry.published()), (0, 0));
    }

    /// A snapshot (every heartbeat packs one) and a lookup hand out the
    /// registry's own handles, never copies of the lease and the signals.
    #[test]
    fn snapshots_and_lookups_share_the_held_stream_with_its_holder() {
        let registry = Registry::default();
        let holders = held("a");
        registry.insert(holders.clone());
        let snapshot = registry.snapshot();
        assert!(Arc::ptr_eq(&snapshot[0], &holders));
        let found = registry.get(&holders.lease.key).expect("held");
        assert!(Arc::ptr_eq(&found, &holders));
        assert_eq!(Arc::strong_count(&holders), 4);
        drop((snapshot, found));
        registry.remove(&holders.lease.key);
        assert_eq!(Arc::strong_count(&holders), 1, "only the holder's is left");
    }
}
