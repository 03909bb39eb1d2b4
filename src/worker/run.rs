//! The worker's main loop: one incarnation at a time registers its worker
//! item, starts the liveness and acquirer tasks and one holder task per held
//! stream, and on shutdown drains, releases, audits and leaves.

use super::acquirer::{Acquired, Acquirer};
use super::context::WorkerCtx;
use super::error::WorkerError;
use super::fence::{Fence, Sent};
use super::incarnation::{Liveness, LivenessEnd};
use super::stream::{Holder, HolderEnd, Registry, SessionDeps};
use crate::lease::{Incarnation, LeaseStore, OwnerWrite, ReleaseReason, SessionStatus, StoreError};
use crate::probes::Health;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Notify, mpsc};
use tokio::task::{Id, JoinSet};
use tokio::time::{Instant, sleep, sleep_until};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

/// Releases are announced (the worker item's `released_at_ms`) at most this
/// often, however many streams are released.
const RELEASE_MARKER_DEBOUNCE: Duration = Duration::from_millis(50);
/// How long the draining announcement may hold up the releases on SIGTERM
/// (it normally lands in milliseconds; in a brownout it must not delay them).
const DRAIN_ANNOUNCE_HEAD_START: Duration = Duration::from_millis(250);
/// Wait between registration attempts when DynamoDB does not answer at start.
const REGISTER_RETRY: Duration = Duration::from_secs(1);
/// Pause before a dead incarnation starts over (its streams are moving).
const RESTART_PAUSE: Duration = Duration::from_millis(500);

/// How an incarnation ended.
enum Ended {
    Shutdown,
    DeclaredDead,
}

type Shutdown<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// Runs the worker until `shutdown` resolves, then drains and returns.
pub async fn run(
    ctx: Arc<WorkerCtx>,
    health: Arc<Health>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), WorkerError> {
    let mut shutdown: Shutdown = Box::pin(shutdown);
    // A worker started while DynamoDB is busy or briefly unreachable waits
    // (not ready) instead of exiting; a missing table is still an error.
    let layout = loop {
        match ctx.shared.store.check_table().await {
            Ok(layout) => break layout,
            Err(e @ (StoreError::Unreachable { .. } | StoreError::Throttled { .. })) => {
                tracing::warn!(error = %e, "cannot read the table yet; retrying");
                tokio::select! {
                    _ = sleep(REGISTER_RETRY) => {}
                    _ = shutdown.as_mut() => return Ok(()),
                }
            }
            Err(e) => return Err(e.into()),
        }
    };
    if layout.legacy_index {
        tracing::info!(
            "version 1's index is present: also taking over version-1 leases (rolling upgrade)"
        );
    }
    loop {
        match incarnation(ctx.clone(), &health, layout.legacy_index, &mut shutdown).await? {
            Ended::Shutdown => {
                ctx.shared.pokes.settle().await;
                return Ok(());
            }
            Ended::DeclaredDead => {
                ctx.shared.metrics.incarnation_restarts.inc();
                health.set_ready(false);
                sleep(RESTART_PAUSE).await;
            }
        }
    }
}

/// Registers a new incarnation, retrying while DynamoDB does not answer;
/// `false` when shutdown came first. In Kubernetes, also marks dead the
/// incarnations of this container's earlier runs (the kubelet's proof).
async fn register(
    ctx: &WorkerCtx,
    me: &Incarnation,
    shutdown: &mut Shutdown<'_>,
) -> Result<bool, WorkerError> {
    let pod = match &ctx.pod {
        Some(lookup) => lookup.identity().await,
        None => None,
    };
    loop {
        let poke_addr = ctx.shared.settings.poke_addr;
        match ctx
            .shared
            .store
            .register_at(me, pod.as_ref(), poke_addr)
            .await
        {
            Ok(()) => break,
            Err(e @ (StoreError::Unreachable { .. } | StoreError::Throttled { .. })) => {
                tracing::warn!(error = %e, "cannot register this worker yet; retrying");
                tokio::select! {
                    _ = sleep(REGISTER_RETRY) => {}
                    _ = shutdown.as_mut() => return Ok(false),
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    if let Some(pod) = &pod {
        // Only a shortcut: when it cannot be had, peers wait for the lease.
        match declare_predecessors_dead(ctx, me, pod).await {
            Ok(dead) => {
                for previous in dead {
                    ctx.shared.metrics.workers_declared_dead.inc();
                    tracing::info!(%previous, restarts = pod.restart_count, "this container restarted: its previous incarnation is gone, taking its streams back now");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot check for this container's previous incarnation; its streams move after the lease")
            }
        }
    }
    Ok(true)
}

/// Marks DEAD the incarnations of this container's earlier runs.
async fn declare_predecessors_dead(
    ctx: &WorkerCtx,
    me: &Incarnation,
    pod: &crate::lease::PodIdentity,
) -> Result<Vec<Incarnation>, StoreError> {
    let fleet = ctx.shared.store.fleet().await?;
    ctx.shared
        .store
        .declare_restarted_dead(me, pod, &fleet.workers)
        .await
}

async fn incarnation(
    ctx: Arc<WorkerCtx>,
    health: &Health,
    legacy_index: bool,
    shutdown: &mut Shutdown<'_>,
) -> Result<Ended, WorkerError> {
    let me = Incarnation::new(&ctx.shared.settings.worker_id);
    // The fence counts from before registration was sent.
    let before = Sent::now();
    if !register(&ctx, &me, shutdown).await? {
        return Ok(Ended::Shutdown);
    }
    let fence = Arc::new(Fence::new(ctx.shared.settings.fence_window, before));
    tracing::info!(incarnation = %me, table = ctx.shared.store.table(), "worker started");
    let registry = Arc::new(Registry::default());
    // One per incarnation, shared by every held stream and its sessions.
    let deps = Arc::new(SessionDeps {
        dialer: ctx.dialer.clone(),
        sinks: ctx.sinks.clone(),
        sink_policy: ctx.sink_policy.clone(),
        kinesis_streams: ctx.shared.settings.kinesis_streams.clone(),
        metrics: ctx.shared.metrics.clone(),
        fence: fence.clone(),
        provenance: ctx.provenance.clone(),
    });
    let stop_liveness = CancellationToken::new();
    // Every task of an incarnation is aborted when it is dropped: none outlives it.
    let mut liveness = AbortOnDropHandle::new(tokio::spawn(
        Liveness::new(
            ctx.shared.clone(),
            me.clone(),
            fence.clone(),
            registry.clone(),
        )
        .run(stop_liveness.clone()),
    ));
    let (acquired_tx, mut acquired_rx) = mpsc::unbounded_channel::<Acquired>();
    let stop_acquiring = CancellationToken::new();
    let mut acquirer = AbortOnDropHandle::new(tokio::spawn(acquire_loop(
        Acquirer::new(
            ctx.shared.clone(),
            me.clone(),
            registry.clone(),
            acquired_tx,
            legacy_index,
            fence.clone(),
        ),
        ctx.shared.settings.reconcile_interval,
        stop_acquiring.clone(),
    )));
    let released = Arc::new(Notify::new());
    let marker = AbortOnDropHandle::new(tokio::spawn(release_marker(
        ctx.shared.store.clone(),
        me.clone(),
        released.clone(),
    )));
    let mut tasks: JoinSet<HolderEnd> = JoinSet::new();
    let mut keys: HashMap<Id, crate::lease::StreamKey> = HashMap::new();
    health.set_ready(true);

    let ended = loop {
        tokio::select! {
            _ = shutdown.as_mut() => break Ended::Shutdown,
            Some(a) = acquired_rx.recv() => {
                let key = a.held.lease.key.clone();
                let handle = tasks.spawn(Holder::new(ctx.shared.clone(), ctx.sessions.clone(), deps.clone(), a.held, a.record).run());
                keys.insert(handle.id(), key);
                ctx.shared.metrics.active_connections.set(registry.len() as i64);
            }
            Some(joined) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                holder_ended(&ctx, &registry, &mut keys, &released, joined);
            }
            end = &mut liveness => match end {
                Ok(LivenessEnd::Dead) => break Ended::DeclaredDead,
                _ => return Err(WorkerError::TaskDied("liveness")),
            },
            _ = &mut acquirer => return Err(WorkerError::TaskDied("acquirer")),
        }
    };

    stop_acquiring.cancel();
    let acquirer = acquirer
        .await
        .map_err(|_| WorkerError::TaskDied("acquirer"))?;
    if let Ended::DeclaredDead = ended {
        // Everything has moved or is moving; nothing may be written for it.
        tasks.abort_all();
        while tasks.join_next().await.is_some() {}
        drop(marker);
        ctx.shared.metrics.active_connections.set(0);
        return Ok(Ended::DeclaredDead);
    }

    drain(
        &ctx, &me, health, &registry, &mut tasks, &mut keys, &released,
    )
    .await;
    drop(marker);
    let left = final_audit(&ctx, &registry, &acquirer).await;
    // Nothing needs the fence any more; a renewal racing the LEFT mark would
    // read as "declared dead". Streams left owned move when the lease lapses.
    stop_liveness.cancel();
    let _ = liveness.await;
    if left {
        match ctx.shared.store.leave(&me).await {
            Ok(()) => tracing::info!("left the fleet"),
            Err(e) => {
                tracing::warn!(error = %e, "could not mark this worker LEFT; peers will declare it dead after a lease")
            }
        }
    } else {
        tracing::warn!("some streams could not be released; peers take them over after a lease");
    }
    ctx.shared.metrics.active_connections.set(0);
    tracing::info!("worker stopped");
    Ok(Ended::Shutdown)
}

/// A holder ended: forget it, announce a release, count the end.
fn holder_ended(
    ctx: &WorkerCtx,
    registry: &Registry,
    keys: &mut HashMap<Id, crate::lease::StreamKey>,
    released: &Notify,
    joined: Result<(Id, HolderEnd), tokio::task::JoinError>,
) {
    let (id, end) = match joined {
        Ok((id, end)) => (id, Some(end)),
        Err(e) => (e.id(), None),
    };
    if let Some(key) = keys.remove(&id) {
        // A withheld stream stays listed: the final audit must leave it owned.
        if end != Some(HolderEnd::Withheld) {
            registry.remove(&key);
        }
        match end {
            Some(HolderEnd::Released(_)) => released.notify_one(),
            Some(HolderEnd::Withheld) => {
                tracing::info!(stream = %key, "holder ended, the stream withheld")
            }
            Some(end) => {
                // Lost may mean re-created under this very incarnation at a
                // new token; a failed release leaves it owned: either way
                // the audit, at the next pass, adopts what is still ours
                // (the periodic one may be 16 heartbeats away).
                registry.request_audit();
                tracing::info!(stream = %key, ?end, "holder ended")
            }
            None => {
                registry.request_audit();
                tracing::error!(stream = %key, "holder task panicked; the audit will serve the stream again")
            }
        }
    }
    ctx.shared
        .metrics
        .active_connections
        .set(registry.len() as i64);
}

/// Stops every session and releases every stream, within the drain timeout.
async fn drain(
    ctx: &WorkerCtx,
    me: &Incarnation,
    health: &Health,
    registry: &Registry,
    tasks: &mut JoinSet<HolderEnd>,
    keys: &mut HashMap<Id, crate::lease::StreamKey>,
    released: &Notify,
) {
    tracing::info!(
        streams = registry.len(),
        "shutting down: releasing every stream"
    );
    health.set_draining();
    // Peers stop counting this worker once they see the announcement, so its
    // streams are theirs at once. It gets a short head start; in a brownout it
    // keeps going alongside the releases instead of holding them up, so
    // SIGTERM is acted on within a second whatever the store does.
    let announce = ctx.shared.store.mark_draining(me);
    tokio::pin!(announce);
    let mut announced = tokio::time::timeout(DRAIN_ANNOUNCE_HEAD_START, &mut announce)
        .await
        .map(announced_draining)
        .is_ok();
    for h in registry.snapshot() {
        h.signals.shutdown.cancel();
    }
    let deadline = Instant::now() + ctx.shared.settings.drain_timeout;
    while !tasks.is_empty() {
        tokio::select! {
            Some(joined) = tasks.join_next_with_id() => holder_ended(ctx, registry, keys, released, joined),
            result = &mut announce, if !announced => {
                announced_draining(result);
                announced = true;
            }
            _ = sleep_until(deadline) => {
                tracing::warn!(left = tasks.len(), "drain timeout reached; releasing what is left directly");
                tasks.abort_all();
                while tasks.join_next().await.is_some() {}
                break;
            }
        }
    }
}

fn announced_draining(result: Result<(), StoreError>) {
    if let Err(e) = result {
        tracing::debug!(error = %e, "draining not announced");
    }
}

/// Releases anything this incarnation still owns in the table (holders that
/// timed out, acquires whose answer was lost). `true` when nothing is left.
async fn final_audit(ctx: &WorkerCtx, registry: &Registry, acquirer: &Acquirer) -> bool {
    let owned = match acquirer.owned_in_table().await {
        Ok(owned) => owned,
        Err(e) => {
            tracing::warn!(error = %e, "cannot audit this worker's streams");
            return false;
        }
    };
    let mut all_released = true;
    for record in owned {
        // A sink request still out: releasing now could let the next owner
        // deliver before it lands; the lease lapses instead.
        if registry
            .get(&record.key)
            .is_some_and(|h| h.progress.unsettled_until().is_some())
        {
            tracing::warn!(stream = %record.key, "a sink request is still out: not releasing; the stream moves when this worker's lease lapses");
            ctx.shared
                .metrics
                .releases
                .get_or_create(&[("result", "withheld")])
                .inc();
            all_released = false;
            continue;
        }
        let lease = crate::lease::Lease {
            key: record.key.clone(),
            owner: acquirer.me().clone(),
            counter: record.lease_counter,
        };
        let checkpoint = registry
            .get(&record.key)
            .and_then(|h| h.progress.checkpoint())
            .max(record.checkpoint);
        let status = SessionStatus {
            reason: Some("OwnerShutdown".into()),
            ..SessionStatus::default()
        };
        match ctx
            .shared
            .store
            .release(
                &lease,
                ReleaseReason::Shutdown,
                checkpoint,
                &status,
                record.desired_state,
                crate::lease::now_ms(),
            )
            .await
        {
            Ok(OwnerWrite::Done(())) | Ok(OwnerWrite::Lost) => {}
            Err(e) => {
                tracing::warn!(stream = %record.key, error = %e, "final release failed");
                all_released = false;
            }
        }
    }
    if let Err(e) = ctx.shared.store.mark_released(acquirer.me()).await {
        tracing::debug!(error = %e, "release marker not written");
    }
    all_released
}

/// The acquisition pass, every (jittered) reconcile interval, until stopped.
/// Returns the acquirer for the final audit.
async fn acquire_loop(
    mut acquirer: Acquirer,
    interval: Duration,
    stop: CancellationToken,
) -> Acquirer {
    let mut next = Instant::now();
    loop {
        tokio::select! {
            _ = sleep_until(next) => {}
            _ = stop.cancelled() => return acquirer,
        }
        let passed = tokio::select! {
            result = acquirer.pass() => match result {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "acquisition pass failed");
                    false
                }
            },
            // A pass cut short may leave an acquire whose answer is unknown:
            // the final audit releases it.
            _ = stop.cancelled() => return acquirer,
        };
        // A quiet worker reads a watched peer when its renewal is due, not
        // at the next pass after that (see `acquirer::renewal_forecast`);
        // after a failed pass, at the usual interval (a failing store is not
        // retried any faster).
        let now = Instant::now();
        let usual = now + super::settings::jittered(interval);
        next = match passed.then(|| acquirer.next_watched_read(now)).flatten() {
            Some(due) => due.min(usual),
            None => usual,
        };
    }
}

/// Announces releases (debounced): peers scan for orphans when it moves.
async fn release_marker(store: LeaseStore, me: Incarnation, released: Arc<Notify>) {
    loop {
        released.notified().await;
        sleep(RELEASE_MARKER_DEBOUNCE).await;
        if let Err(e) = store.mark_released(&me).await {
            tracing::debug!(error = %e, "release marker not written");
        }
    }
}
