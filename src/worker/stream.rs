//! One owned stream: the task that holds its lease (renewals carrying the
//! checkpoint, the fence timer, STOPPED and spec changes, release) and runs its
//! session as a child task.

use super::WorkerCtx;
use super::fence::Fence;
use super::session::{self, SessionConfig, SessionControl, SessionEnd, SessionShared};
use crate::crd::StreamConnectionSpec;
use crate::lease::{DesiredState, Lease, OwnerWrite, SessionStatus, StreamKey, StreamRecord};
use std::sync::Arc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;

/// Status reason of a stream its owner released to rebalance the fleet; such
/// orphans are left to underloaded workers for a moment.
pub const RELEASED_FOR_REBALANCING: &str = "Rebalancing";
/// Status reason of a stream released because its owner shut down.
pub const RELEASED_FOR_SHUTDOWN: &str = "OwnerShutdown";

/// How a stream task ended (the worker only logs and counts these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// Released on purpose (shutdown, STOPPED, rebalance).
    Released,
    /// Somebody else took the lease, or the item was deleted.
    Lost,
    /// No renewal was confirmed in time; the session was closed unilaterally.
    Fenced,
}

/// Why a stream is being given up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseReason {
    Shutdown,
    Stopped,
    Rebalance,
}

/// Signals a running stream task can receive from the worker.
#[derive(Clone, Default)]
pub struct StreamSignals {
    /// Drain and release (graceful shutdown).
    pub shutdown: CancellationToken,
    /// Hand this stream over to another worker (fair-share rebalancing).
    pub handoff: CancellationToken,
}

struct RunningSession {
    ctl: SessionControl,
    handle: JoinHandle<SessionEnd>,
}

/// Parses the spec stored in the table. Falls back to a log sink with defaults
/// when the item carries no spec (items written by the seed carried only `ws_url`).
pub fn spec_of(record: &StreamRecord) -> Result<StreamConnectionSpec, String> {
    let mut value = record
        .spec
        .clone()
        .unwrap_or_else(|| serde_json::json!({"sink": {"log": {}}}));
    if let Some(obj) = value.as_object_mut() {
        obj.insert(
            "url".into(),
            serde_json::Value::String(record.ws_url.clone()),
        );
    }
    let spec: StreamConnectionSpec =
        serde_json::from_value(value).map_err(|e| format!("stored spec is invalid: {e}"))?;
    spec.validate().map_err(|errors| {
        errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    })?;
    Ok(spec)
}

/// Holds one lease until it is released, lost or fenced.
pub async fn run(
    ctx: Arc<WorkerCtx>,
    lease: Lease,
    record: StreamRecord,
    acquired_at: Instant,
    signals: StreamSignals,
) -> StreamEnd {
    let key = lease.key.clone();
    let shared = Arc::new(SessionShared::new(
        Fence::new(ctx.settings.fence_window, acquired_at),
        record.last_seq.unwrap_or(0),
    ));
    let mut holder = Holder {
        ctx,
        lease,
        shared,
        written_seq: record.last_seq.unwrap_or(0),
        started_generation: record.generation,
        failed: false,
    };
    let mut session = holder.start_session(&record);
    // The item (with its spec as a JSON tree) is not needed any more; an idle
    // stream should not keep it.
    drop(record);
    let heartbeat_every = holder.ctx.settings.heartbeat_interval;
    let mut heartbeat = tokio::time::interval_at(Instant::now() + heartbeat_every, heartbeat_every);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_renewal = Instant::now();

    loop {
        let session_done = async {
            match session.as_mut() {
                Some(s) => (&mut s.handle).await.unwrap_or(SessionEnd::Aborted),
                None => std::future::pending().await,
            }
        };
        // A phase change (connected, backoff, failed) is written by an early
        // renewal, at most four times per heartbeat interval, so status is fresh
        // without a write per event.
        let early = last_renewal.elapsed() >= heartbeat_every / 4;
        tokio::select! {
            _ = heartbeat.tick() => {
                last_renewal = Instant::now();
                if let Some(end) = holder.heartbeat(&mut session).await {
                    return end;
                }
            }
            _ = holder.shared.phase_changed(), if early => {
                last_renewal = Instant::now();
                heartbeat.reset();
                if let Some(end) = holder.heartbeat(&mut session).await {
                    return end;
                }
            }
            _ = sleep_until(holder.shared.fence.deadline()) => {
                holder.ctx.metrics.self_fences.inc();
                holder.ctx.metrics.leases_lost.get_or_create(&[("reason", "fenced")]).inc();
                tracing::warn!(stream = %key, "no renewal confirmed in time; self-fencing (closing the session)");
                holder.abort(session).await;
                return StreamEnd::Fenced;
            }
            end = session_done => {
                session = None;
                match end {
                    SessionEnd::Failed(message) => {
                        // Keep the lease so the fleet does not pass a broken stream
                        // around; a spec change (new generation) retries it.
                        tracing::warn!(stream = %key, %message, "stream failed permanently until its spec changes");
                        holder.failed = true;
                    }
                    SessionEnd::SinkFenced => {
                        holder.ctx.metrics.leases_lost.get_or_create(&[("reason", "sink_fenced")]).inc();
                        tracing::warn!(stream = %key, "sink reports a newer owner; giving the stream up");
                        holder.shared.fence.revoke();
                        return StreamEnd::Lost;
                    }
                    SessionEnd::Fenced => {
                        holder.ctx.metrics.self_fences.inc();
                        holder.ctx.metrics.leases_lost.get_or_create(&[("reason", "fenced")]).inc();
                        return StreamEnd::Fenced;
                    }
                    SessionEnd::Stopped | SessionEnd::Aborted => {
                        // Not asked for: restart on the next heartbeat.
                        holder.failed = false;
                    }
                }
            }
            _ = signals.shutdown.cancelled() => return holder.release(session, ReleaseReason::Shutdown).await,
            _ = signals.handoff.cancelled() => return holder.release(session, ReleaseReason::Rebalance).await,
        }
    }
}

struct Holder {
    ctx: Arc<WorkerCtx>,
    lease: Lease,
    shared: Arc<SessionShared>,
    /// Highest checkpoint written to the table.
    written_seq: u64,
    /// Generation of the spec the current (or last) session was started with.
    started_generation: i64,
    /// The last session failed permanently; wait for a new generation.
    failed: bool,
}

impl Holder {
    /// One renewal, carrying the checkpoint and any status change. Returns how
    /// the stream ends if the renewal says it must (lost, STOPPED).
    async fn heartbeat(&mut self, session: &mut Option<RunningSession>) -> Option<StreamEnd> {
        let key = self.lease.key.clone();
        let sent_at = Instant::now();
        let checkpoint = self.shared.acked();
        let carry = (checkpoint > self.written_seq).then_some(checkpoint);
        let status = self.shared.take_status();
        // Never wait on DynamoDB past the fence: a renewal that has not answered
        // by then cannot make the lease safe to keep using.
        let renewal = tokio::time::timeout_at(
            self.shared.fence.deadline(),
            // Boxed: the SDK's request future is several KiB, and an idle
            // stream task should not carry it between renewals.
            Box::pin(self.ctx.store.renew(
                &self.lease,
                self.ctx.settings.lease_duration,
                carry,
                status.as_ref(),
            )),
        )
        .await
        .unwrap_or_else(|_| {
            Err(crate::lease::StoreError::Unreachable {
                endpoint: self.ctx.store.endpoint().to_string(),
                detail: "renewal still pending at the fence deadline".into(),
            })
        });
        match renewal {
            Ok(OwnerWrite::Done((lease, current))) => {
                self.ctx
                    .metrics
                    .renewals
                    .get_or_create(&[("result", "ok")])
                    .inc();
                self.shared.fence.confirm(sent_at);
                self.lease = lease;
                self.written_seq = self.written_seq.max(checkpoint);
                if current.desired_state == DesiredState::Stopped {
                    tracing::info!(stream = %key, "stream is STOPPED; closing and releasing");
                    return Some(self.release(session.take(), ReleaseReason::Stopped).await);
                }
                // A new spec, or a session that ended without a permanent
                // failure: (re)start it. A graceful stop flushes first.
                if current.generation != self.started_generation
                    || (session.is_none() && !self.failed)
                {
                    if let Some(old) = session.take() {
                        self.stop_session(old).await;
                    }
                    *session = self.start_session(&current);
                }
                None
            }
            Ok(OwnerWrite::Lost) => {
                self.ctx
                    .metrics
                    .renewals
                    .get_or_create(&[("result", "lost")])
                    .inc();
                self.ctx
                    .metrics
                    .leases_lost
                    .get_or_create(&[("reason", "taken_or_deleted")])
                    .inc();
                tracing::warn!(stream = %key, "lease lost (taken over or deleted); closing the session at once");
                self.abort(session.take()).await;
                Some(StreamEnd::Lost)
            }
            Err(e) => {
                self.ctx
                    .metrics
                    .renewals
                    .get_or_create(&[("result", "error")])
                    .inc();
                if status.is_some() {
                    self.shared.status_unwritten();
                }
                tracing::warn!(stream = %key, error = %e, "renewal failed; the fence closes if none succeeds in time");
                None
            }
        }
    }

    fn start_session(&mut self, record: &StreamRecord) -> Option<RunningSession> {
        self.started_generation = record.generation;
        self.failed = false;
        let spec = match spec_of(record) {
            Ok(spec) => spec,
            Err(message) => {
                tracing::warn!(stream = %record.key, %message, "stream spec is invalid; not connecting");
                self.shared.update_status(|s| {
                    s.phase = "Failed".into();
                    s.reason = Some("InvalidSpec".into());
                    s.message = Some(message);
                });
                self.failed = true;
                return None;
            }
        };
        let cfg = SessionConfig {
            key: record.key.clone(),
            connection: record.key.to_string(),
            worker_id: self.ctx.settings.worker_id.clone(),
            token: self.lease.counter,
            url_template: record.ws_url.clone(),
            spec,
        };
        let ctl = SessionControl::default();
        let handle = tokio::spawn(session::run(
            cfg,
            self.shared.clone(),
            self.ctx.session_deps.clone(),
            ctl.clone(),
        ));
        Some(RunningSession { ctl, handle })
    }

    /// Graceful: flush, close with a normal close frame; bounded by the drain timeout.
    async fn stop_session(&self, mut session: RunningSession) {
        session.ctl.stop.cancel();
        if timeout(self.ctx.settings.drain_timeout, &mut session.handle)
            .await
            .is_err()
        {
            session.ctl.abort.cancel();
            let _ = session.handle.await;
        }
    }

    /// At once: revoke the fence first so nothing more is delivered.
    async fn abort(&self, session: Option<RunningSession>) {
        self.shared.fence.revoke();
        if let Some(session) = session {
            session.ctl.abort.cancel();
            let _ = session.handle.await;
        }
    }

    async fn release(&self, session: Option<RunningSession>, reason: ReleaseReason) -> StreamEnd {
        if let Some(session) = session {
            self.stop_session(session).await;
        }
        let key: &StreamKey = &self.lease.key;
        let checkpoint = self.shared.acked();
        let (phase, why) = match reason {
            ReleaseReason::Stopped => ("Stopped", None),
            ReleaseReason::Shutdown => ("Pending", Some(RELEASED_FOR_SHUTDOWN)),
            ReleaseReason::Rebalance => ("Pending", Some(RELEASED_FOR_REBALANCING)),
        };
        let status = SessionStatus {
            phase: phase.into(),
            reason: why.map(Into::into),
            reconnects: self.shared.status().reconnects,
            ..SessionStatus::default()
        };
        let label = match reason {
            ReleaseReason::Shutdown => "shutdown",
            ReleaseReason::Stopped => "stopped",
            ReleaseReason::Rebalance => "rebalance",
        };
        match Box::pin(
            self.ctx
                .store
                .release(&self.lease, Some(checkpoint), Some(&status)),
        )
        .await
        {
            Ok(OwnerWrite::Done(())) => {
                self.ctx
                    .metrics
                    .releases
                    .get_or_create(&[("result", label)])
                    .inc();
                if reason == ReleaseReason::Rebalance {
                    self.ctx.metrics.rebalance_handoffs.inc();
                }
                tracing::info!(stream = %key, checkpoint, reason = label, "lease released");
                StreamEnd::Released
            }
            Ok(OwnerWrite::Lost) => {
                self.ctx
                    .metrics
                    .releases
                    .get_or_create(&[("result", "lost")])
                    .inc();
                StreamEnd::Lost
            }
            Err(e) => {
                self.ctx
                    .metrics
                    .releases
                    .get_or_create(&[("result", "error")])
                    .inc();
                tracing::warn!(stream = %key, error = %e, "release failed; the lease will lapse by itself");
                StreamEnd::Released
            }
        }
    }
}

#[cfg(test)]
mod size_probe {
    /// Idle memory per stream is mostly the two tasks' future state: keep large,
    /// rare futures (SDK requests, TLS handshakes, HTTP deliveries) boxed so an
    /// idle stream does not carry them. (Measured before boxing: 9.7 + 11.8 KiB.)
    #[test]
    fn idle_stream_tasks_stay_small() {
        fn size<F: std::future::Future>(_: &F) -> usize {
            std::mem::size_of::<F>()
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let store = crate::lease::LeaseStore::connect(
                {
                    let mut c = crate::lease::StoreConfig::new("probe-table");
                    c.endpoint = Some("http://127.0.0.1:1".into());
                    c.static_credentials = Some(("a".into(), "b".into()));
                    c
                },
                std::sync::Arc::new(crate::metrics::StoreMetrics::new()),
            )
            .await
            .unwrap();
            let lease = crate::lease::Lease {
                key: crate::lease::StreamKey::new("a", "b"),
                owner: "w".into(),
                counter: 1,
                expires_at_ms: 0,
            };
            let renew = store.renew(&lease, std::time::Duration::from_secs(1), None, None);
            assert!(
                size(&renew) > 4096,
                "the SDK future is large, which is why it is boxed"
            );
            let ctx = std::sync::Arc::new(
                crate::worker::WorkerCtx::new(
                    crate::worker::WorkerSettings {
                        worker_id: "w".into(),
                        lease_duration: std::time::Duration::from_secs(20),
                        heartbeat_interval: std::time::Duration::from_secs(5),
                        reconcile_interval: std::time::Duration::from_secs(1),
                        fence_window: std::time::Duration::from_secs(17),
                        max_connections: 1,
                        drain_timeout: std::time::Duration::from_secs(1),
                        rebalance: true,
                        ca_file: None,
                    },
                    store.clone(),
                    std::sync::Arc::new(crate::metrics::WorkerMetrics::default()),
                    crate::worker::policy::HostPolicy::new(["*"]),
                    crate::worker::secrets::SecretSource::Standalone,
                )
                .unwrap(),
            );
            let record = crate::lease::StreamRecord {
                key: lease.key.clone(),
                desired_state: crate::lease::DesiredState::Started,
                ws_url: "ws://x/".into(),
                spec: None,
                generation: 1,
                lease_owner: None,
                lease_expires_at_ms: 0,
                lease_counter: 0,
                last_seq: None,
                released_at_ms: None,
                created_at_ms: None,
                status: None,
            };
            let holder = super::run(
                ctx.clone(),
                lease.clone(),
                record,
                tokio::time::Instant::now(),
                Default::default(),
            );
            assert!(
                size(&holder) <= 3 * 1024,
                "stream task future: {} bytes",
                size(&holder)
            );
            let shared = std::sync::Arc::new(crate::worker::session::SessionShared::new(
                crate::worker::fence::Fence::new(
                    std::time::Duration::from_secs(1),
                    tokio::time::Instant::now(),
                ),
                0,
            ));
            let session = crate::worker::session::run(
                crate::worker::session::SessionConfig {
                    key: lease.key.clone(),
                    connection: "a/b".into(),
                    worker_id: "w".into(),
                    token: 1,
                    url_template: "ws://x/".into(),
                    spec: crate::crd::StreamConnectionSpec::test("ws://x/"),
                },
                shared,
                ctx.session_deps.clone(),
                Default::default(),
            );
            assert!(
                size(&session) <= 3 * 1024,
                "session task future: {} bytes",
                size(&session)
            );
            let ws = std::mem::size_of::<
                tokio_tungstenite::WebSocketStream<crate::worker::transport::Transport>,
            >();
            assert!(
                ws <= 512,
                "a plain WebSocket must not carry TLS state inline: {ws} bytes"
            );
        });
    }
}
