//! Status from what changed, not from polling every resource.
//!
//! Every write to a stream item is stamped (`changed_at_ms` on the store's
//! clock, `change_seq`) by the lease store's one write builder, and a
//! mirrored item carries its installation's `change_shard`, so the
//! `by_change` index lists this installation's streams by when they last
//! changed. Each pass (every `--status-refresh`) the leader reads:
//!
//! - the index's entries changed since its last pass (minus a look-back for
//!   the index's lag): one small query per shard, whatever the number of
//!   resources; an entry whose `change_seq` it has not seen yet asks for
//!   that resource's reconcile;
//! - the fleet (one query of the worker items' index partition): a worker
//!   whose state changed (LIVE → DRAINING, DEAD, LEFT, gone) is read again
//!   by the pass and the resources it owns are reconciled;
//! - every `--status-progress-interval`, every owner's worker item and
//!   checkpoints (one read per owner and checkpoint shard, by the pass), and
//!   every cached resource is reconciled from them (progress fields).
//!
//! A reconcile computes the status from the cached item and owner, reading
//! only what is newer than its copy. So steady-state reads are O(changes +
//! workers), not O(resources / refresh). Safety nets: an item is re-read when
//! the spec it must mirror differs from the cached one, and after [`RESYNC`]
//! whatever happened.

use crate::crd::StreamConnection;
use crate::lease::{
    DesiredStream, Incarnation, LeaseStore, Owners, Ownership, StoreError, StreamKey, StreamRecord,
    StreamView, WorkerState,
};
use crate::support::lock;
use kube::runtime::reflector::ObjectRef;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;
use tokio::time::Instant;

/// How far before its last pass a pass looks for changes: room for writers'
/// clocks behind the controller's and for the index's propagation.
pub(super) const LOOK_BACK: Duration = Duration::from_secs(30);
/// A cached item is read again after this long, changed or not.
pub(super) const RESYNC: Duration = Duration::from_secs(30 * 60);

/// Where a resource's reconcile is asked for: the controller watching its
/// namespace (`None`: the one watching every namespace).
pub(super) type Trigger = (Option<String>, UnboundedSender<ObjectRef<StreamConnection>>);

struct Cached {
    record: StreamRecord,
    read_at: Instant,
}

#[derive(Default)]
struct Feed {
    /// Each stream's item as last read.
    items: HashMap<StreamKey, Cached>,
    /// Owners' worker items and checkpoints as last read.
    owners: Owners,
    /// The `change_seq` of each stream the feed has seen.
    seen: HashMap<StreamKey, u64>,
    /// Each worker's state at the last pass.
    fleet: HashMap<Incarnation, (WorkerState, bool)>,
    /// Wall clock at the start of the last pass that read the index.
    since_ms: u64,
    /// Moves whenever a pass changes what is known of owners: a reconcile's
    /// read of an owner started before is not kept.
    owners_epoch: u64,
    progress_at: Option<Instant>,
}

/// The leader's view of the table for status (one per leadership).
pub(super) struct StatusFeed {
    installation: String,
    progress_interval: Duration,
    feed: Mutex<Feed>,
}

impl StatusFeed {
    pub(super) fn new(installation: &str, progress_interval: Duration) -> Self {
        Self {
            installation: installation.to_string(),
            progress_interval,
            feed: Mutex::default(),
        }
    }

    /// The stream as the status shows it: from the cache when it is fresh
    /// and already mirrors `desired`, else read (and cached). `None` for a
    /// missing item or a tombstone.
    pub(super) async fn view(
        &self,
        store: &LeaseStore,
        key: &StreamKey,
        desired: &DesiredStream,
    ) -> Result<Option<StreamView>, StoreError> {
        let cached = {
            let feed = lock(&self.feed);
            // Current only if no newer write was listed since it was read,
            // whenever this read and that listing happened.
            let newest = feed.seen.get(key).copied().unwrap_or(0);
            feed.items
                .get(key)
                .filter(|c| c.record.change_seq >= newest)
                .filter(|c| c.read_at.elapsed() < RESYNC)
                .filter(|c| LeaseStore::mirrors(&c.record, desired))
                .map(|c| c.record.clone())
        };
        let record = match cached {
            Some(r) => r,
            None => {
                let Some(r) = store.get(key).await? else {
                    self.forget(key);
                    return Ok(None);
                };
                lock(&self.feed).items.insert(
                    key.clone(),
                    Cached {
                        record: r.clone(),
                        read_at: Instant::now(),
                    },
                );
                r
            }
        };
        if record.is_tombstone() {
            return Ok(None);
        }
        let epoch = {
            let feed = lock(&self.feed);
            if let Some(view) = feed.owners.view(&record) {
                return Ok(Some(view));
            }
            feed.owners_epoch
        };
        // This owner alone, read now; kept only if no pass changed what is
        // known of owners meanwhile (it may have seen this one die).
        let mut read = Owners::default();
        store.add_owner(&mut read, &record).await?;
        let view = read.view(&record);
        let mut feed = lock(&self.feed);
        if feed.owners_epoch == epoch {
            feed.owners.merge(read);
        }
        Ok(view)
    }

    /// Forgets a stream whose resource is gone.
    pub(super) fn forget(&self, key: &StreamKey) {
        let mut feed = lock(&self.feed);
        feed.items.remove(key);
        feed.seen.remove(key);
    }

    /// One pass: what changed since the last one is dropped from the cache
    /// and its resources reconciled (through `triggers`).
    pub(super) async fn pass(
        &self,
        store: &LeaseStore,
        triggers: &[Trigger],
    ) -> Result<usize, StoreError> {
        // The store's clock, as the stamps are (a writer's clock that is off
        // does not hide its changes).
        let started_ms = store.clock().store_now_at_least();
        let since_ms = {
            let feed = lock(&self.feed);
            // The first pass reads every entry.
            (feed.since_ms > 0).then(|| {
                feed.since_ms
                    .saturating_sub(LOOK_BACK.as_millis() as u64)
                    .max(1)
            })
        };
        let changes = store
            .changes(&self.installation, since_ms.unwrap_or(0))
            .await?;
        let fleet = store.fleet().await?;
        let now: HashMap<Incarnation, (WorkerState, bool)> = fleet
            .workers
            .iter()
            .map(|w| (w.incarnation.clone(), (w.state, w.draining)))
            .collect();
        // Which owners to read again, and one stream of each to read it by:
        // every owner at the progress interval, else those whose state moved.
        let (moved, progress, samples) = {
            let feed = lock(&self.feed);
            let moved: HashSet<Incarnation> = feed
                .fleet
                .iter()
                .filter(|(inc, state)| now.get(inc) != Some(state))
                .map(|(inc, _)| inc.clone())
                .chain(now.keys().filter(|i| !feed.fleet.contains_key(*i)).cloned())
                .collect();
            let progress = feed
                .progress_at
                .is_none_or(|at| at.elapsed() >= self.progress_interval);
            let mut samples: HashMap<Incarnation, StreamRecord> = HashMap::new();
            for cached in feed.items.values() {
                if let Ownership::Owned(owner) = cached.record.ownership()
                    && (progress || moved.contains(&owner))
                {
                    samples
                        .entry(owner)
                        .or_insert_with(|| cached.record.clone());
                }
            }
            (moved, progress, samples)
        };
        // Read here, once per owner, not by each reconcile it would ask for.
        let mut read = Owners::default();
        for sample in samples.values() {
            store.add_owner(&mut read, sample).await?;
        }
        // Every read succeeded: now the pass counts (a failed one changes
        // nothing and the next looks back from the same point).
        let mut feed = lock(&self.feed);
        // Every change not seen yet asks for a reconcile, on the first pass
        // too: a reconcile that read the item before that change may still
        // be running, and caches what it read after this pass; only a
        // reconcile asked for now (run after it) reads the item again.
        let mut due: Vec<StreamKey> = Vec::new();
        for c in changes {
            let known = feed.seen.get(&c.key).copied();
            if known.is_some_and(|k| k >= c.change_seq) {
                continue;
            }
            feed.seen.insert(c.key.clone(), c.change_seq);
            due.push(c.key);
        }
        feed.owners_epoch += 1;
        if progress {
            feed.owners = read;
            feed.progress_at = Some(Instant::now());
        } else {
            for inc in &moved {
                feed.owners.forget(inc);
            }
            feed.owners.merge(read);
        }
        // At the progress interval every cached resource is looked at again
        // (no read: its copy and the fresh owners), free streams included, so
        // a status a former leader wrote late is put right within it.
        for (key, cached) in &feed.items {
            let owner_moved =
                matches!(cached.record.ownership(), Ownership::Owned(o) if moved.contains(&o));
            if progress || owner_moved {
                due.push(key.clone());
            }
        }
        feed.fleet = now;
        feed.since_ms = started_ms;
        drop(feed);
        due.sort();
        due.dedup();
        for key in &due {
            let reference = ObjectRef::new(&key.name).within(&key.namespace);
            for (namespace, sender) in triggers {
                if namespace.as_deref().is_none_or(|n| n == key.namespace) {
                    let _ = sender.send(reference.clone());
                }
            }
        }
        Ok(due.len())
    }
}
