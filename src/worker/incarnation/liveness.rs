//! The heartbeat: one renewal of the worker item per interval, carrying the
//! load, the packed checkpoints and the inbox acknowledgements; it moves the
//! fence on every confirmed renewal and routes inbox changes to holders. It
//! keeps running while the worker drains, so draining never outlives the fence
//! for lack of renewals.
//!
//! The renewal is the only write on the heartbeat's critical path. What else
//! a heartbeat has to write (further checkpoint shards, stale shards to
//! delete, idle streams' checkpoints folded into their items) are chores run
//! beside the next heartbeats, one batch at a time: in a brownout, where every
//! call takes a second, they would otherwise push the next renewal past the
//! fence and a healthy worker would fence itself. A shard written after the
//! renewal that counts it can only be read as missing or older meanwhile,
//! which costs a takeover replayed messages, never a lost one.

use super::checkpoints::Packer;
use super::slot_book::PageWrite;
use crate::lease::{Incarnation, LeaseStore, OwnerWrite, PackedShard, RenewOutcome, Renewal};
use crate::worker::fence::{Fence, Sent};
use crate::worker::settings::RENEW_RETRY;
use crate::worker::shared::Shared;
use crate::worker::stream::{HeldStream, Registry};
use futures::FutureExt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

/// How the liveness task ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum LivenessEnd {
    /// Asked to stop (the worker left).
    Stopped,
    /// A peer declared this incarnation dead.
    Dead,
}

enum Beat {
    Renewed,
    Failed,
    Dead,
}

pub(crate) struct Liveness {
    pub ctx: Arc<Shared>,
    pub me: Incarnation,
    pub fence: Arc<Fence>,
    pub registry: Arc<Registry>,
    packer: Packer,
    version: u64,
    /// Inbox entries handled, to delete with the next renewal.
    handled: Vec<String>,
    /// The chores of an earlier heartbeat, still running beside this one.
    chores: Option<AbortOnDropHandle<ChoresDone>>,
    /// The load peers were last told about through the change counter.
    announced_held: Option<u64>,
}

/// What a heartbeat leaves to be written off its critical path.
struct Chores {
    pages_to_write: Vec<PageWrite>,
    changed_shards: Vec<(u32, PackedShard)>,
    stale_shards: Vec<u32>,
    pages_to_delete: Vec<(u32, u64)>,
    folds: Vec<(Arc<HeldStream>, u64)>,
}

/// What the chores wrote, for the packer's memory.
#[derive(Default)]
struct ChoresDone {
    written: Vec<(u32, PackedShard)>,
    truncated: Vec<u32>,
    pages_written: Vec<(PageWrite, Instant)>,
    pages_deleted: Vec<u32>,
}

impl Chores {
    async fn run(self, store: LeaseStore, me: Incarnation) -> ChoresDone {
        let mut done = ChoresDone::default();
        // Pages first: the next heartbeat's entries may name their slots
        // only once they are written (the packer learns it from `done`).
        for w in self.pages_to_write {
            let at = Instant::now();
            match store.write_slot_page(&me, w.number, &w.page, w.write).await {
                Ok(true) => done.pages_written.push((w, at)),
                Ok(false) => tracing::warn!(
                    page = w.number,
                    "slot page not written: a later write of it is there"
                ),
                Err(e) => tracing::warn!(error = %e, page = w.number, "slot page not written"),
            }
        }
        for (number, entries) in self.changed_shards {
            match store.write_checkpoint_shard(&me, number, &entries).await {
                Ok(()) => done.written.push((number, entries)),
                Err(e) => {
                    tracing::warn!(error = %e, shard = number, "checkpoint shard not written")
                }
            }
        }
        for number in self.stale_shards {
            if store.delete_checkpoint_shard(&me, number).await.is_ok() {
                done.truncated.push(number);
            }
        }
        for (number, write) in self.pages_to_delete {
            if store.delete_slot_page(&me, number, write).await.is_ok() {
                done.pages_deleted.push(number);
            }
        }
        for (h, seq) in self.folds {
            match store.fold_checkpoint(&h.lease, seq).await {
                Ok(OwnerWrite::Done(())) => h.progress.mark_stored(seq),
                Ok(OwnerWrite::Lost) => {}
                Err(e) => {
                    tracing::debug!(stream = %h.lease.key, error = %e, "checkpoint fold failed")
                }
            }
        }
        done
    }
}

impl Liveness {
    pub(crate) fn new(
        ctx: Arc<Shared>,
        me: Incarnation,
        fence: Arc<Fence>,
        registry: Arc<Registry>,
    ) -> Self {
        Self {
            ctx,
            me,
            fence,
            registry,
            packer: Packer::default(),
            version: 0,
            handled: Vec::new(),
            chores: None,
            announced_held: None,
        }
    }

    /// Takes in what the last chores wrote; `true` when none are running.
    fn chores_finished(&mut self) -> bool {
        let Some(running) = &self.chores else {
            return true;
        };
        if !running.is_finished() {
            return false;
        }
        let done = self
            .chores
            .take()
            .and_then(|mut handle| (&mut handle).now_or_never())
            .and_then(Result::ok)
            .unwrap_or_default();
        for (number, entries) in done.written {
            self.packer.written(number, entries);
        }
        for number in done.truncated {
            self.packer.truncated(number);
        }
        for (write, at) in done.pages_written {
            self.packer.page_written(write, at);
        }
        for number in done.pages_deleted {
            self.packer.page_deleted(number);
        }
        true
    }

    pub(crate) async fn run(mut self, stop: CancellationToken) -> LivenessEnd {
        let mut next = Instant::now() + self.ctx.settings.heartbeat_interval;
        loop {
            tokio::select! {
                _ = sleep_until(next) => {}
                _ = stop.cancelled() => return LivenessEnd::Stopped,
            }
            let sent = Sent::now();
            match self.beat(sent).await {
                Beat::Renewed => next = sent.at() + self.ctx.settings.heartbeat_interval,
                Beat::Failed => next = Instant::now() + RENEW_RETRY,
                Beat::Dead => {
                    self.fence.revoke();
                    return LivenessEnd::Dead;
                }
            }
        }
    }

    async fn beat(&mut self, sent: Sent) -> Beat {
        let chores_idle = self.chores_finished();
        let metrics = &self.ctx.metrics;
        self.version += 1;
        // Stamped before the load is counted: a stream whose release is
        // stamped in between is out of the count and released after the
        // stamp, which peers read as still counted (one too few, never twice).
        let at_ms = crate::lease::now_ms();
        let held = self.registry.snapshot();
        let slotted = self.ctx.peers_read_slots.load(Ordering::Relaxed);
        let packed = self.packer.pack(&held, slotted, Instant::now());
        let renewal = Renewal {
            version: self.version,
            lease_ms: self.ctx.settings.lease_duration.as_millis() as u64,
            at_ms,
            held: self.registry.published() as u64,
            shard0: &packed.shard0,
            checkpoint_shards: packed.shard_count,
            slot_pages: &packed.slot_pages,
            handled: self.handled.clone(),
        };
        let outcome = Box::pin(self.ctx.store.renew(&self.me, &renewal)).await;
        match outcome {
            Ok(RenewOutcome::Renewed { changed }) => {
                metrics.renewals.get_or_create(&[("result", "ok")]).inc();
                self.fence.confirm(sent);
                // A load that changed is news for fair share: peers reading
                // the change counter refresh their view. Off the critical
                // path, like the chores.
                if self.announced_held != Some(renewal.held) {
                    self.announced_held = Some(renewal.held);
                    self.ctx.store.announce_change_soon();
                }
                self.handled = changed.iter().map(|e| e.raw.clone()).collect();
                for entry in &changed {
                    if let Some(h) = self.registry.get(&entry.key) {
                        h.signals.changed.notify_one();
                    }
                }
                // Still busy with earlier chores: these wait for a later
                // heartbeat (the packer offers them again).
                if chores_idle {
                    let chores = Chores {
                        pages_to_write: packed.pages_to_write,
                        changed_shards: packed.changed_shards,
                        stale_shards: packed.stale_shards,
                        pages_to_delete: packed.pages_to_delete,
                        folds: packed.folds,
                    };
                    self.chores = Some(AbortOnDropHandle::new(tokio::spawn(
                        chores.run(self.ctx.store.clone(), self.me.clone()),
                    )));
                }
                Beat::Renewed
            }
            Ok(RenewOutcome::Dead) => {
                metrics.renewals.get_or_create(&[("result", "dead")]).inc();
                tracing::error!(incarnation = %self.me, "this incarnation was declared dead by a peer; its streams have moved");
                Beat::Dead
            }
            Err(e) => {
                metrics.renewals.get_or_create(&[("result", "error")]).inc();
                tracing::warn!(error = %e, fenced_in = ?self.fence.deadline().map(|d| d.saturating_duration_since(Instant::now())), "renewal failed; retrying");
                Beat::Failed
            }
        }
    }
}
