//! One held stream: runs its session while the worker's fence is open, writes
//! its status when it changes, follows the control plane's changes (new spec,
//! STOPPED, deletion), and releases it with the last acknowledged checkpoint
//! on handoff, STOPPED or shutdown. The session is a child task that never
//! outlives its holder (it is aborted when the holder's handle drops).

use super::provenance::Origin;
use super::registry::HeldStream;
use super::session::{SessionConfig, SessionControl, SessionDeps, SessionEnd, Sessions};
use crate::crd::{StreamConnectionSpec, stored};
use crate::lease::{
    DesiredState, OwnerWrite, Ownership, Phase, ReleaseReason, SessionStatus, StreamRecord,
};
use crate::worker::settings::{DRAIN_STOP_SHARE, STATUS_MIN_INTERVAL};
use crate::worker::shared::Shared;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep, sleep_until};

/// Retry delay of a release (or a re-read) DynamoDB did not answer.
const STORE_RETRY: Duration = Duration::from_millis(500);
/// Attempts of a release before the holder gives up and leaves the stream to
/// the audit (and, if the worker leaves, to takeover after a lease).
const RELEASE_ATTEMPTS: u32 = 6;

/// How a holder ended (the worker logs and counts these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HolderEnd {
    /// Released on purpose.
    Released(ReleaseReason),
    /// Not ours any more (deleted, or refused by the sink's fenced signal and
    /// taken by another owner); nothing more was delivered.
    Lost,
    /// The release could not be written; the stream stays owned in the table
    /// until the audit adopts it or the incarnation's items move.
    ReleaseFailed,
    /// Shutting down with a sink request out that the sink may still apply
    /// after the drain budget: not released, so the next owner takes the
    /// stream only when this worker's lease has lapsed.
    Withheld,
}

/// A running session; aborted when dropped.
struct Running {
    ctl: SessionControl,
    handle: JoinHandle<SessionEnd>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.ctl.abort.cancel();
        self.handle.abort();
    }
}

/// The record without its spec JSON, the parsed spec, and the JSON's digest.
fn parsed(
    mut record: StreamRecord,
) -> (StreamRecord, Result<Arc<StreamConnectionSpec>, String>, u64) {
    let spec = stored::decode(record.spec.as_deref(), &record.ws_url).map(Arc::new);
    let spec_digest = stored::fingerprint(record.spec.as_deref());
    record.spec = None;
    (record, spec, spec_digest)
}

pub(crate) struct Holder {
    ctx: Arc<Shared>,
    /// What a session runs (WebSocket sessions; the bench's own in-memory
    /// ones), and what it is given.
    sessions: Arc<dyn Sessions>,
    deps: Arc<SessionDeps>,
    /// Shared with the registry: one copy of the lease and the signals.
    held: Arc<HeldStream>,
    /// The stream item, without its spec JSON: the spec is kept parsed
    /// (shared with the session) and as a digest for noticing changes, so a
    /// held stream does not carry the same spec three times.
    record: StreamRecord,
    spec: Result<Arc<StreamConnectionSpec>, String>,
    spec_digest: u64,
    /// The last session failed permanently: wait for a new generation.
    failed: bool,
    last_status_write: Option<Instant>,
    /// One permit: at most one session of this stream exists at any moment,
    /// including one still being torn down (see `SessionConfig::turn`).
    one_session: Arc<tokio::sync::Semaphore>,
}

impl Holder {
    pub(crate) fn new(
        ctx: Arc<Shared>,
        sessions: Arc<dyn Sessions>,
        deps: Arc<SessionDeps>,
        held: Arc<HeldStream>,
        record: StreamRecord,
    ) -> Self {
        let (record, spec, spec_digest) = parsed(record);
        Self {
            ctx,
            sessions,
            deps,
            held,
            record,
            spec,
            spec_digest,
            failed: false,
            last_status_write: None,
            one_session: Arc::new(tokio::sync::Semaphore::new(1)),
        }
    }

    /// The holder's task. Every path that writes the store or stops a
    /// session is boxed: those futures (SDK calls, a session's teardown) are
    /// large and short-lived, and inline they would size the future every
    /// held stream keeps for its whole life. An `async` block, not an `async
    /// fn`: an async fn keeps its argument twice (as passed and as a local),
    /// which for a holder is 600 bytes per held stream.
    // Not an async fn on purpose (see above): clippy's suggestion would undo it.
    #[allow(clippy::manual_async_fn)]
    pub(crate) fn run(mut self) -> impl Future<Output = HolderEnd> + Send {
        async move {
            // The registry's handle, not copies of its signals and progress:
            // `self` is borrowed by the branches below.
            let held = Arc::clone(&self.held);
            let fence = self.deps.fence.clone();
            let mut session: Option<Running> = None;
            // Adopted by the audit or a resolved acquire while STOPPED (or
            // deleted): released, never served.
            if self.record.desired_state == DesiredState::Stopped {
                tracing::info!(stream = %self.record.key, "adopted a STOPPED stream: releasing it unserved");
                return Box::pin(self.release(&mut session, ReleaseReason::Stopped)).await;
            }
            loop {
                // Not when leaving: the loop's first branch releases next,
                // and a session started now would only be stopped again.
                if session.is_none() && !self.failed && !self.is_leaving() && fence.is_valid() {
                    // Waits only while the previous session is still being dropped.
                    if let Ok(turn) = self.one_session.clone().acquire_owned().await {
                        session = self.start_session(turn);
                    }
                }
                let due = self.status_due();
                let status_due = async move {
                    match due {
                        Some(at) => sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                let serving = session.is_some();
                let session_done = async {
                    match session.as_mut() {
                        Some(s) => (&mut s.handle).await.unwrap_or(SessionEnd::Aborted),
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    biased;
                    _ = held.signals.shutdown.cancelled() => return Box::pin(self.release(&mut session, ReleaseReason::Shutdown)).await,
                    () = held.signals.handoff.wait() => return Box::pin(self.release(&mut session, ReleaseReason::Rebalance)).await,
                    _ = fence.closed(), if serving => self.fence_session(&mut session),
                    _ = fence.open(), if !serving && !self.failed && !fence.is_valid() => {}
                    end = session_done => {
                        session = None;
                        if let Some(end) = Box::pin(self.session_ended(end, &mut session)).await {
                            return end;
                        }
                    }
                    _ = held.signals.changed.notified() => {
                        if let Some(end) = Box::pin(self.follow_change(&mut session)).await {
                            return end;
                        }
                    }
                    _ = held.progress.status_changed(), if due.is_none() => {}
                    _ = status_due => {
                        if let Some(end) = Box::pin(self.write_status(&mut session)).await {
                            return end;
                        }
                    }
                }
            }
        }
    }

    /// When a pending status change should be written, if one is pending.
    fn status_due(&self) -> Option<Instant> {
        if !self.held.progress.has_unwritten_status() || !self.deps.fence.is_valid() {
            return None;
        }
        Some(
            self.last_status_write
                .map_or_else(Instant::now, |t| t + STATUS_MIN_INTERVAL),
        )
    }

    fn start_session(&mut self, turn: tokio::sync::OwnedSemaphorePermit) -> Option<Running> {
        self.failed = false;
        let spec = match &self.spec {
            Ok(spec) => spec.clone(),
            Err(message) => {
                let message = message.clone();
                tracing::warn!(stream = %self.record.key, %message, "stream spec is invalid; not connecting");
                self.held.progress.update_status(|s| {
                    s.phase = Phase::Failed;
                    s.reason = Some("InvalidSpec".into());
                    s.message = Some(message);
                });
                self.failed = true;
                return None;
            }
        };
        let lease = &self.held.lease;
        let cfg = SessionConfig {
            key: lease.key.clone(),
            connection: lease.key.to_string(),
            worker: lease.owner.as_str().into(),
            token: lease.counter,
            spec,
            origin: Origin {
                uid: self.record.uid.clone(),
                installation: self.record.installation.clone(),
            },
            turn,
        };
        let ctl = SessionControl::default();
        let handle = self.sessions.start(
            cfg,
            self.held.progress.clone(),
            self.deps.clone(),
            ctl.clone(),
        );
        Some(Running { ctl, handle })
    }

    async fn session_ended(
        &mut self,
        end: SessionEnd,
        session: &mut Option<Running>,
    ) -> Option<HolderEnd> {
        let key = &self.held.lease.key;
        match end {
            SessionEnd::Failed(message) => {
                // Keep the stream so the fleet does not pass a broken one
                // around; a new generation retries it.
                tracing::warn!(stream = %key, %message, "stream failed permanently until its spec changes");
                self.failed = true;
                None
            }
            SessionEnd::SinkFenced => {
                self.ctx
                    .metrics
                    .leases_lost
                    .get_or_create(&[("reason", "sink_fenced")])
                    .inc();
                tracing::error!(stream = %key, token = self.held.lease.counter, "the sink refused this owner's token; releasing the stream");
                Some(self.release(session, ReleaseReason::Unwanted).await)
            }
            SessionEnd::Fenced => {
                self.ctx.metrics.self_fences.inc();
                None
            }
            // Not asked for: started again on the next turn.
            SessionEnd::Stopped | SessionEnd::Aborted => None,
        }
    }

    /// Re-reads the stream after the control plane changed it.
    async fn follow_change(&mut self, session: &mut Option<Running>) -> Option<HolderEnd> {
        let key = self.held.lease.key.clone();
        let current = loop {
            // Interrupted: the loop acts on the shutdown or handoff first.
            match self
                .store_call(session, Box::pin(self.ctx.store.reread(&key)))
                .await?
            {
                Ok(current) => break current,
                Err(e) => {
                    tracing::warn!(stream = %key, error = %e, "cannot re-read a changed stream; retrying");
                    tokio::select! {
                        _ = sleep(STORE_RETRY) => {}
                        () = self.leaving() => return None,
                    }
                }
            }
        };
        let ours = current.as_ref().is_some_and(|c| {
            c.ownership() == Ownership::Owned(self.held.lease.owner.clone())
                && c.lease_counter == self.held.lease.counter
        });
        let Some(current) = current.filter(|_| ours) else {
            tracing::warn!(stream = %key, "stream deleted or no longer ours; closing the session at once");
            *session = None;
            self.ctx
                .metrics
                .leases_lost
                .get_or_create(&[("reason", "taken_or_deleted")])
                .inc();
            return Some(HolderEnd::Lost);
        };
        if current.desired_state == DesiredState::Stopped {
            tracing::info!(stream = %key, deleted = current.is_tombstone(), "stream is STOPPED; closing and releasing");
            // Released next: its spec is not needed, parsed or kept.
            self.record = StreamRecord {
                spec: None,
                ..current
            };
            return Some(self.release(session, ReleaseReason::Stopped).await);
        }
        // Asked once per value: this owner acquired the stream with the
        // values then current, so only a change since is a request to it.
        if current.requests.move_away != self.record.requests.move_away {
            tracing::info!(stream = %key, request = ?current.requests.move_away, "asked to move: handing the stream to another worker");
            self.record.requests = current.requests.clone();
            return Some(self.release(session, ReleaseReason::Moved).await);
        }
        // A new spec, or a request to reconnect: the session starts again.
        let new_spec = current.generation != self.record.generation
            || current.ws_url != self.record.ws_url
            || stored::fingerprint(current.spec.as_deref()) != self.spec_digest;
        let reconnect = current.requests.reconnect != self.record.requests.reconnect;
        if new_spec || reconnect {
            if new_spec {
                tracing::info!(stream = %key, generation = current.generation, "new spec: restarting the session");
            } else {
                tracing::info!(stream = %key, request = ?current.requests.reconnect, "asked to reconnect: closing the session and opening it again");
            }
            if let Some(running) = session.take() {
                self.stop_session(running, self.ctx.settings.drain_timeout)
                    .await;
            }
            (self.record, self.spec, self.spec_digest) = parsed(current);
            self.failed = false;
            self.held
                .progress
                .update_status(|s| s.phase = Phase::Pending);
        }
        None
    }

    async fn write_status(&mut self, session: &mut Option<Running>) -> Option<HolderEnd> {
        let status = self.held.progress.take_status()?;
        self.last_status_write = Some(Instant::now());
        let write = self.ctx.store.write_status(
            &self.held.lease,
            &status,
            self.record.generation,
            &self.record.requests,
        );
        let Some(written) = self.store_call(session, Box::pin(write)).await else {
            // Interrupted by a shutdown or handoff: the release that follows
            // writes the status; this one is written again if it does not.
            self.held.progress.status_unwritten();
            return None;
        };
        match written {
            Ok(OwnerWrite::Done(())) => None,
            Ok(OwnerWrite::Lost) => {
                tracing::warn!(stream = %self.held.lease.key, "status write found the stream no longer ours; closing the session");
                *session = None;
                self.ctx
                    .metrics
                    .leases_lost
                    .get_or_create(&[("reason", "taken_or_deleted")])
                    .inc();
                Some(HolderEnd::Lost)
            }
            Err(e) => {
                tracing::debug!(stream = %self.held.lease.key, error = %e, "status write failed; retrying");
                self.held.progress.status_unwritten();
                None
            }
        }
    }

    /// Closes the session because the fence closed; it starts again once a
    /// renewal is confirmed.
    fn fence_session(&self, session: &mut Option<Running>) {
        *session = None;
        self.ctx.metrics.self_fences.inc();
        tracing::warn!(stream = %self.held.lease.key, "fence closed: session closed until a renewal is confirmed");
    }

    /// Awaits a store call without letting it hold up what the holder's loop
    /// would have acted on: the loop is not watching while it waits here, and
    /// the store may be the very thing that is unreachable (a call can take
    /// its whole deadline, seconds). So the fence is watched alongside and
    /// closes the session on time, and a shutdown or handoff ends the wait
    /// (`None`): the caller returns to the loop, which stops and releases at
    /// once. The abandoned call may still land; every owner write is
    /// conditional on this lease, so once the release has landed it cannot.
    /// The call comes boxed: an SDK request future is kilobytes, and held
    /// inline it would make every held stream's task that large for its
    /// whole life.
    async fn store_call<T>(
        &self,
        session: &mut Option<Running>,
        mut call: std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + '_>>,
    ) -> Option<T> {
        tokio::select! {
            biased;
            done = &mut call => return Some(done),
            () = self.leaving() => return None,
            _ = self.deps.fence.closed(), if session.is_some() => self.fence_session(session),
        }
        tokio::select! {
            biased;
            done = call => Some(done),
            () = self.leaving() => None,
        }
    }

    /// Whether this stream is to be released: shutdown or handoff was asked for.
    fn is_leaving(&self) -> bool {
        let signals = &self.held.signals;
        signals.shutdown.is_cancelled() || signals.handoff.asked()
    }

    /// Resolves once [`Self::is_leaving`] holds.
    async fn leaving(&self) {
        let signals = &self.held.signals;
        tokio::select! {
            _ = signals.shutdown.cancelled() => {}
            () = signals.handoff.wait() => {}
        }
    }

    /// Graceful: flush and close with a normal close frame, within `budget`
    /// and never past the fence (the fence itself, which renewals may move
    /// on meanwhile, not its deadline as it stood); then abort.
    async fn stop_session(&self, running: Running, budget: Duration) {
        running.ctl.stop.cancel();
        let mut running = running;
        let closed = tokio::select! {
            biased;
            _ = &mut running.handle => true,
            _ = sleep(budget) => false,
            () = self.deps.fence.closed() => false,
        };
        if !closed {
            tracing::warn!(stream = %self.held.lease.key, "session did not close in time; aborting it");
        }
        // Dropping aborts whatever is left.
    }

    /// Stops the session (bounded) and releases with the last acknowledged
    /// checkpoint. The release is always attempted.
    async fn release(&mut self, session: &mut Option<Running>, reason: ReleaseReason) -> HolderEnd {
        let key = self.held.lease.key.clone();
        let started = Instant::now();
        if let Some(running) = session.take() {
            let budget = self.ctx.settings.drain_timeout.mul_f64(DRAIN_STOP_SHARE);
            self.stop_session(running, budget).await;
        }
        // A request the session sent and never saw answered may still be
        // applied by the sink, and the next owner's batches must not come
        // before it (property 1b): release once it can no longer be applied.
        // Shutting down, past the drain budget, the lease lapses instead.
        if let Some(until) = self.held.progress.unsettled_until() {
            let drain_ends = started + self.ctx.settings.drain_timeout;
            if reason == ReleaseReason::Shutdown && until > drain_ends {
                self.ctx
                    .metrics
                    .releases
                    .get_or_create(&[("result", "withheld")])
                    .inc();
                tracing::warn!(stream = %key, "a sink request is still out past the drain budget: not releasing; the stream moves when this worker's lease lapses");
                return HolderEnd::Withheld;
            }
            tracing::info!(stream = %key, wait = ?until.saturating_duration_since(Instant::now()), "waiting until the sink can no longer apply a request still out, then releasing");
            sleep_until(until).await;
        }
        let checkpoint = self.held.progress.checkpoint();
        let (phase, why) = match reason {
            ReleaseReason::Stopped => (Phase::Stopped, None),
            ReleaseReason::Shutdown => (Phase::Pending, Some("OwnerShutdown")),
            ReleaseReason::Rebalance => (Phase::Pending, Some("Rebalancing")),
            ReleaseReason::Unwanted => (Phase::Pending, Some("Released")),
            ReleaseReason::Moved => (Phase::Pending, Some("Moving")),
        };
        let current = self.held.progress.status();
        let status = if current.phase == Phase::Failed && reason != ReleaseReason::Stopped {
            // Refused for good (a host, a sink, a spec): what the user must
            // fix outlives the owner that found it, instead of reading as a
            // routine hand-over until another worker fails it again.
            SessionStatus {
                connected_since_ms: None,
                ..current
            }
        } else {
            SessionStatus {
                phase,
                reason: why.map(Into::into),
                reconnects: current.reconnects,
                ..SessionStatus::default()
            }
        };
        let label = reason.as_str();
        // Out of the published load from now; the release says when.
        let released_at_ms = self.held.stamp_release(crate::lease::now_ms());
        for attempt in 0..RELEASE_ATTEMPTS {
            let result = Box::pin(self.ctx.store.release(
                &self.held.lease,
                reason,
                checkpoint,
                &status,
                self.record.desired_state,
                released_at_ms,
            ))
            .await;
            match result {
                Ok(OwnerWrite::Done(())) => {
                    self.ctx
                        .metrics
                        .releases
                        .get_or_create(&[("result", label)])
                        .inc();
                    if reason == ReleaseReason::Rebalance {
                        self.ctx.metrics.rebalance_handoffs.inc();
                    }
                    tracing::info!(stream = %key, checkpoint = ?checkpoint, reason = label, "released");
                    return HolderEnd::Released(reason);
                }
                Ok(OwnerWrite::Lost) => {
                    self.ctx
                        .metrics
                        .releases
                        .get_or_create(&[("result", "lost")])
                        .inc();
                    return HolderEnd::Lost;
                }
                Err(e) => {
                    self.ctx
                        .metrics
                        .releases
                        .get_or_create(&[("result", "error")])
                        .inc();
                    tracing::warn!(stream = %key, error = %e, attempt, "release failed; retrying");
                    sleep(STORE_RETRY).await;
                }
            }
        }
        HolderEnd::ReleaseFailed
    }
}
