//! The streams this incarnation holds, shared by the acquirer (which adds
//! them), the liveness task (which packs their checkpoints and routes inbox
//! changes to them) and the main loop (which removes them when their task ends).

use super::progress::StreamProgress;
use crate::lease::{Lease, StreamKey};
use crate::support::lock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
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
    /// Asks the holder to release the stream to another worker (through
    /// [`HeldStream::ask_handoff`], which also counts it out of the load).
    fn ask(&self) {
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
    released_at_ms: AtomicU64,
    /// [`IN_REGISTRY`] and [`LEAVING`], each set or cleared by one atomic
    /// step: the step that makes both true, or ends that, moves the
    /// registry's count of leaving streams. So [`Registry::staying`] is a
    /// subtraction, not a walk of every held stream (at 5,000 streams and
    /// several counts a pass, 3% of a simulated takeover's CPU).
    membership: AtomicU8,
    /// The count of leaving streams of the registry this stream went into.
    leaving_count: OnceLock<Arc<AtomicIsize>>,
}

/// [`HeldStream::membership`]: in the registry ...
const IN_REGISTRY: u8 = 1;
/// ... and out of the load (asked to hand over, or its release stamped).
const LEAVING: u8 = 2;

impl HeldStream {
    pub(crate) fn new(lease: Lease, progress: Arc<StreamProgress>) -> Self {
        Self {
            lease,
            progress,
            signals: HolderSignals::default(),
            released_at_ms: AtomicU64::new(0),
            membership: AtomicU8::new(0),
            leaving_count: OnceLock::new(),
        }
    }

    /// Asks the holder to hand the stream over; from now on it is out of
    /// the load fair share counts.
    pub(crate) fn ask_handoff(&self) {
        self.signals.handoff.ask();
        self.leave();
    }

    /// Not being handed over or released: the bit the registry's count
    /// follows, so a stream and the count never disagree on the rule.
    pub(crate) fn staying(&self) -> bool {
        self.membership.load(Ordering::SeqCst) & LEAVING == 0
    }

    /// Still in the load this worker publishes: not released yet.
    pub(crate) fn published(&self) -> bool {
        self.released_at_ms.load(Ordering::SeqCst) == 0
    }

    /// Stamps the release at `now_ms` (the first stamp stays: a release
    /// retried carries the time the stream left the published load) and
    /// returns the stamp.
    pub(crate) fn stamp_release(&self, now_ms: u64) -> u64 {
        self.leave();
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

    /// The stream leaves the load (idempotent).
    fn leave(&self) {
        if self.membership.fetch_or(LEAVING, Ordering::SeqCst) == IN_REGISTRY {
            self.count_leaving(1);
        }
    }

    /// The registry put the stream in (under its lock).
    fn entered(&self, leaving: &Arc<AtomicIsize>) {
        let first = self.leaving_count.set(leaving.clone()).is_ok();
        debug_assert!(
            first
                || self
                    .leaving_count
                    .get()
                    .is_some_and(|c| Arc::ptr_eq(c, leaving)),
            "a held stream belongs to one registry"
        );
        if self.membership.fetch_or(IN_REGISTRY, Ordering::SeqCst) == LEAVING {
            self.count_leaving(1);
        }
    }

    /// The registry took the stream out (under its lock).
    fn exited(&self) {
        if self.membership.fetch_and(!IN_REGISTRY, Ordering::SeqCst) == IN_REGISTRY | LEAVING {
            self.count_leaving(-1);
        }
    }

    fn count_leaving(&self, by: isize) {
        if let Some(count) = self.leaving_count.get() {
            count.fetch_add(by, Ordering::SeqCst);
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
    /// How many streams in `streams` are leaving (`HeldStream::membership`).
    leaving: Arc<AtomicIsize>,
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<StreamKey, Arc<HeldStream>>> {
        lock(&self.streams)
    }

    pub(crate) fn insert(&self, held: Arc<HeldStream>) {
        let mut streams = self.lock();
        held.entered(&self.leaving);
        if let Some(replaced) = streams.insert(held.lease.key.clone(), held.clone())
            && !Arc::ptr_eq(&replaced, &held)
        {
            replaced.exited();
        }
    }

    pub(crate) fn remove(&self, key: &StreamKey) {
        if let Some(removed) = self.lock().remove(key) {
            removed.exited();
        }
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
    /// Exact once each stream's change has landed; read while one is
    /// leaving and being removed at once, it can be one over for that
    /// moment (the removal's step may come before the leave's count).
    pub(crate) fn staying(&self) -> usize {
        let held = self.lock().len();
        held.saturating_sub(self.leaving.load(Ordering::SeqCst).max(0) as usize)
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
        Arc::new(HeldStream::new(
            Lease {
                key: StreamKey::new("ns", name),
                owner: Incarnation::new("w"),
                counter: 1,
            },
            Arc::new(StreamProgress::new(None, None)),
        ))
    }

    /// The walk the count replaced: what `staying` must always agree with.
    fn staying_by_walking(registry: &Registry) -> usize {
        registry.snapshot().iter().filter(|h| h.staying()).count()
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
        a.ask_handoff();
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
        a.ask_handoff();
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

    /// The count agrees with a walk of the held streams through every
    /// order of the steps that change it: a stream asked to hand over and
    /// then stamped, stamped first, removed after leaving, asked after its
    /// removal (not in the registry: not counted), and replaced under its
    /// key by a new acquire while the old one was leaving.
    #[test]
    fn the_staying_count_agrees_with_a_walk_whatever_the_order_of_steps() {
        let registry = Registry::default();
        let check = |registry: &Registry| {
            assert_eq!(registry.staying(), staying_by_walking(registry));
        };
        let (a, b, c, d) = (held("a"), held("b"), held("c"), held("d"));
        for h in [&a, &b, &c, &d] {
            registry.insert(h.clone());
        }
        check(&registry);
        a.ask_handoff();
        a.stamp_release(1);
        b.stamp_release(2);
        b.ask_handoff();
        check(&registry);
        assert_eq!(registry.staying(), 2);
        registry.remove(&a.lease.key);
        check(&registry);
        registry.remove(&c.lease.key);
        c.ask_handoff();
        check(&registry);
        assert_eq!(registry.staying(), 1, "d alone");
        let b_again = held("b");
        registry.insert(b_again.clone());
        check(&registry);
        assert_eq!(registry.staying(), 2, "d and the new b");
        b.stamp_release(3);
        registry.remove(&b.lease.key);
        registry.remove(&d.lease.key);
        check(&registry);
        assert_eq!(registry.staying(), 0);
    }

    /// Threads asking, stamping, removing and inserting at once (the
    /// acquirer, holders and the main loop do): once they are done the
    /// count agrees with a walk, and while they run it never counts more
    /// streams than there are keys.
    #[test]
    fn the_staying_count_is_exact_after_concurrent_changes() {
        use rand::Rng;
        for round in 0..20 {
            let registry = Arc::new(Registry::default());
            let streams: Vec<Arc<HeldStream>> =
                (0..64).map(|i| held(&format!("s{round}-{i}"))).collect();
            for h in &streams {
                registry.insert(h.clone());
            }
            let threads: Vec<_> = (0..4)
                .map(|_| {
                    let registry = registry.clone();
                    let streams = streams.clone();
                    std::thread::spawn(move || {
                        let mut rng = rand::rng();
                        for _ in 0..2_000 {
                            let h = &streams[rng.random_range(0..streams.len())];
                            match rng.random_range(0..5) {
                                0 => h.ask_handoff(),
                                1 => {
                                    h.stamp_release(1);
                                }
                                2 => registry.remove(&h.lease.key),
                                3 => registry.insert(held(&h.lease.key.name)),
                                _ => assert!(registry.staying() <= streams.len()),
                            }
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            assert_eq!(registry.staying(), staying_by_walking(&registry));
        }
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
