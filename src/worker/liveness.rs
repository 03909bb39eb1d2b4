//! The heartbeat: one renewal of the worker item per interval, carrying the
//! load, the packed checkpoints and the inbox acknowledgements; it moves the
//! fence on every confirmed renewal and routes inbox changes to holders. It
//! keeps running while the worker drains, so draining never outlives the fence
//! for lack of renewals.

use super::WorkerCtx;
use super::checkpoints::Packer;
use super::fence::Fence;
use super::registry::Registry;
use super::settings::RENEW_RETRY;
use crate::lease::{Incarnation, OwnerWrite, RenewOutcome, Renewal};
use std::sync::Arc;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

/// How the liveness task ended.
#[derive(Debug, PartialEq, Eq)]
pub enum LivenessEnd {
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

pub struct Liveness {
    pub ctx: Arc<WorkerCtx>,
    pub me: Incarnation,
    pub fence: Arc<Fence>,
    pub registry: Arc<Registry>,
    packer: Packer,
    version: u64,
    /// Inbox entries handled, to delete with the next renewal.
    handled: Vec<String>,
}

impl Liveness {
    pub fn new(
        ctx: Arc<WorkerCtx>,
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
        }
    }

    pub async fn run(mut self, stop: CancellationToken) -> LivenessEnd {
        let mut next = Instant::now() + self.ctx.settings.heartbeat_interval;
        loop {
            tokio::select! {
                _ = sleep_until(next) => {}
                _ = stop.cancelled() => return LivenessEnd::Stopped,
            }
            let sent = Instant::now();
            match self.beat(sent).await {
                Beat::Renewed => next = sent + self.ctx.settings.heartbeat_interval,
                Beat::Failed => next = Instant::now() + RENEW_RETRY,
                Beat::Dead => {
                    self.fence.revoke();
                    return LivenessEnd::Dead;
                }
            }
        }
    }

    async fn beat(&mut self, sent: Instant) -> Beat {
        let metrics = &self.ctx.metrics;
        self.version += 1;
        let held = self.registry.snapshot();
        let packed = self.packer.pack(&held);
        for (number, entries) in packed.changed_shards {
            let refs: Vec<_> = entries.iter().map(|(k, c)| (k, c)).collect();
            match self
                .ctx
                .store
                .write_checkpoint_shard(&self.me, number, &refs)
                .await
            {
                Ok(()) => self.packer.written(number, entries),
                Err(e) => {
                    tracing::warn!(error = %e, shard = number, "checkpoint shard not written")
                }
            }
        }
        let renewal = Renewal {
            version: self.version,
            lease_ms: self.ctx.settings.lease_duration.as_millis() as u64,
            held: self.registry.staying() as u64,
            checkpoints: packed.shard0.iter().map(|(k, c)| (k, c)).collect(),
            checkpoint_shards: packed.shard_count,
            handled: self.handled.clone(),
        };
        let outcome = Box::pin(self.ctx.store.renew(&self.me, &renewal)).await;
        match outcome {
            Ok(RenewOutcome::Renewed { changed }) => {
                metrics.renewals.get_or_create(&[("result", "ok")]).inc();
                self.fence.confirm(sent);
                self.handled = changed.iter().map(|e| e.raw.clone()).collect();
                for entry in &changed {
                    if let Some(h) = self.registry.get(&entry.key) {
                        h.signals.changed.notify_one();
                    }
                }
                for number in packed.stale_shards {
                    if self
                        .ctx
                        .store
                        .delete_checkpoint_shard(&self.me, number)
                        .await
                        .is_ok()
                    {
                        self.packer.truncated(number);
                    }
                }
                for (h, seq) in packed.folds {
                    match self.ctx.store.fold_checkpoint(&h.lease, seq).await {
                        Ok(OwnerWrite::Done(())) => h.progress.mark_persisted(seq),
                        Ok(OwnerWrite::Lost) => {}
                        Err(e) => {
                            tracing::debug!(stream = %h.lease.key, error = %e, "checkpoint fold failed")
                        }
                    }
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
