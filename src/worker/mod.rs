//! The worker: finds orphaned streams, acquires them by conditional write, and
//! runs one task per owned stream (lease holder + session). On shutdown it stops
//! acquiring, drains every session, and releases every lease.

pub mod fence;
pub mod policy;
pub mod rebalance;
pub mod secrets;
pub mod session;
pub mod stream;
pub mod transport;

use crate::config::WorkerArgs;
use crate::http::Health;
use crate::lease::{AcquireOutcome, LeaseStore, StreamKey, now_ms};
use crate::metrics::WorkerMetrics;
use rand::Rng;
use rand::seq::SliceRandom;
use session::SessionDeps;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use stream::{StreamEnd, StreamSignals};
use tokio::task::{Id, JoinSet};
use tokio::time::{Instant, sleep_until, timeout};
use tokio_util::sync::CancellationToken;

/// Timeout of one sink HTTP request unless the spec sets its own.
const HTTP_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A worker at or above its fair share leaves streams that were released for
/// rebalancing this long to workers below it before taking them itself (so the
/// load goes to the new workers, and the releasing worker does not take it back).
const ORPHAN_GRACE_INTERVALS: u64 = 4;
/// A worker at or above its fair share leaves streams released on shutdown (or
/// never owned) this many reconcile intervals to workers below it.
const SHARE_GRACE_INTERVALS: u64 = 2;
/// Fraction of the reconcile interval used as jitter (±), so a fleet that started
/// together does not query and acquire in lockstep.
const RECONCILE_JITTER: f64 = 0.25;

/// Validated worker settings.
#[derive(Clone, Debug)]
pub struct WorkerSettings {
    pub worker_id: Arc<str>,
    pub lease_duration: Duration,
    pub heartbeat_interval: Duration,
    pub reconcile_interval: Duration,
    /// `lease_duration - max_clock_skew - fence_margin`.
    pub fence_window: Duration,
    pub max_connections: usize,
    pub drain_timeout: Duration,
    pub rebalance: bool,
    /// Extra trusted CA certificates for `wss://` upstreams.
    pub ca_file: Option<std::path::PathBuf>,
}

impl WorkerSettings {
    pub fn from_args(args: &WorkerArgs) -> Result<Self, String> {
        let WorkerArgs {
            worker_id,
            lease_duration,
            heartbeat_interval,
            reconcile_interval,
            max_clock_skew,
            fence_margin,
            max_connections,
            metrics_addr: _,
            drain_timeout,
            allow_hosts: _,
            no_rebalance,
            status_refresh: _,
            ca_file,
        } = args;
        if heartbeat_interval.is_zero() || reconcile_interval.is_zero() {
            return Err("--heartbeat-interval and --reconcile-interval must be positive".into());
        }
        let fence_window = fence::fence_window(
            *lease_duration,
            *max_clock_skew,
            *fence_margin,
            *heartbeat_interval,
        )?;
        Ok(Self {
            worker_id: worker_id.clone().unwrap_or_else(default_worker_id).into(),
            lease_duration: *lease_duration,
            heartbeat_interval: *heartbeat_interval,
            reconcile_interval: *reconcile_interval,
            fence_window,
            max_connections: *max_connections,
            drain_timeout: *drain_timeout,
            rebalance: !no_rebalance,
            ca_file: ca_file.clone(),
        })
    }
}

/// `$POD_NAME` in Kubernetes (unique per pod); elsewhere `<hostname>-<pid>`, so
/// two workers on one machine never share an identity.
pub fn default_worker_id() -> String {
    if let Ok(pod) = std::env::var("POD_NAME")
        && !pod.is_empty()
    {
        return pod;
    }
    let host = hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "tether".into());
    format!("{host}-{}", std::process::id())
}

/// Everything a worker's tasks share.
pub struct WorkerCtx {
    pub settings: WorkerSettings,
    pub store: LeaseStore,
    pub metrics: Arc<WorkerMetrics>,
    pub session_deps: SessionDeps,
}

impl WorkerCtx {
    pub fn new(
        settings: WorkerSettings,
        store: LeaseStore,
        metrics: Arc<WorkerMetrics>,
        policy: policy::HostPolicy,
        secrets: secrets::SecretSource,
    ) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .connect_timeout(HTTP_CONNECT_TIMEOUT)
            .pool_idle_timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| format!("cannot build the sink HTTP client: {e}"))?;
        Ok(Self {
            session_deps: SessionDeps {
                policy,
                tls: session::tls_config(settings.ca_file.as_deref())?,
                http,
                metrics: metrics.clone(),
                secrets,
            },
            settings,
            store,
            metrics,
        })
    }
}

struct Owned {
    key: StreamKey,
    signals: StreamSignals,
}

/// The worker's mutable state, owned by its main loop.
struct WorkerState {
    tasks: JoinSet<StreamEnd>,
    owned: HashMap<Id, Owned>,
    drain: CancellationToken,
    fleet: Option<rebalance::FleetView>,
    last_handoff: Option<Instant>,
}

impl WorkerState {
    /// Streams held and not being handed over.
    fn held(&self) -> u64 {
        self.owned
            .values()
            .filter(|o| !o.signals.handoff.is_cancelled())
            .count() as u64
    }
}

/// Runs the worker until `shutdown` resolves, then drains (bounded by the drain
/// timeout) and returns.
pub async fn run(ctx: Arc<WorkerCtx>, health: Arc<Health>, shutdown: impl Future<Output = ()>) {
    let mut state = WorkerState {
        tasks: JoinSet::new(),
        owned: HashMap::new(),
        drain: CancellationToken::new(),
        fleet: None,
        last_handoff: None,
    };
    tokio::pin!(shutdown);
    let mut next_reconcile = Instant::now();
    let mut membership = tokio::time::interval(ctx.settings.heartbeat_interval);
    membership.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tracing::info!(worker = %ctx.settings.worker_id, table = ctx.store.table(), "worker started");
    health.set_ready(true);

    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(joined) = state.tasks.join_next_with_id(), if !state.tasks.is_empty() => {
                let (id, end) = match joined {
                    Ok((id, end)) => (id, Some(end)),
                    Err(e) => (e.id(), None),
                };
                if let Some(o) = state.owned.remove(&id) {
                    match end {
                        Some(end) => tracing::info!(stream = %o.key, ?end, "stream task ended"),
                        None => tracing::error!(stream = %o.key, "stream task panicked; its lease will lapse"),
                    }
                }
                ctx.metrics.leases_held.set(state.owned.len() as i64);
            }
            _ = membership.tick() => refresh_membership(&ctx, &mut state).await,
            _ = sleep_until(next_reconcile) => {
                reconcile(&ctx, &mut state).await;
                next_reconcile = Instant::now() + jittered(ctx.settings.reconcile_interval);
            }
        }
    }

    tracing::info!(
        streams = state.owned.len(),
        "shutting down: releasing every stream"
    );
    health.set_draining();
    // Leave the fleet first, so peers' fair share grows before our streams arrive.
    if let Err(e) = ctx.store.remove_member(&ctx.settings.worker_id).await {
        tracing::warn!(error = %e, "could not remove the membership item; it will lapse");
    }
    state.drain.cancel();
    let drained = timeout(ctx.settings.drain_timeout, async {
        while state.tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            left = state.tasks.len(),
            "drain timeout reached; remaining leases will lapse by themselves"
        );
        state.tasks.abort_all();
    }
    ctx.metrics.leases_held.set(0);
    tracing::info!("worker stopped");
}

/// Publishes our held count and reads everybody else's.
async fn refresh_membership(ctx: &WorkerCtx, state: &mut WorkerState) {
    let me = crate::lease::Member {
        id: ctx.settings.worker_id.to_string(),
        held: state.held(),
        heartbeat_at_ms: now_ms(),
    };
    let result = async {
        ctx.store
            .heartbeat_member(&me, ctx.settings.lease_duration)
            .await?;
        ctx.store.live_members(now_ms()).await
    }
    .await;
    match result {
        Ok(mut members) => {
            // A crashed worker's item stays live until it lapses (a lease later);
            // one silent for three heartbeats no longer counts toward fair share.
            let fresh_since = fresh_since(&ctx.settings);
            members.retain(|m| m.heartbeat_at_ms >= fresh_since);
            let view = rebalance::FleetView { members };
            ctx.metrics
                .live_workers
                .set(view.live(&ctx.settings.worker_id) as i64);
            state.fleet = Some(view);
        }
        Err(e) => {
            // Without a fleet view, acquire freely: availability beats balance.
            state.fleet = None;
            tracing::warn!(error = %e, "membership refresh failed");
        }
    }
}

/// One pass: look for orphans, acquire up to the fair share (or capacity), and
/// hand excess streams over when a peer is below its share.
async fn reconcile(ctx: &Arc<WorkerCtx>, state: &mut WorkerState) {
    let capacity = ctx
        .settings
        .max_connections
        .saturating_sub(state.owned.len());
    let now = now_ms();
    let orphans = if capacity > 0 {
        match ctx.store.orphans(now).await {
            Ok(orphans) => orphans,
            Err(e) => {
                tracing::warn!(error = %e, "orphan query failed");
                return;
            }
        }
    } else {
        Vec::new()
    };
    let me = ctx.settings.worker_id.to_string();
    let held = state.held();
    // Without rebalancing there is no fair share at all: acquire greedily, as
    // the seed design did (and streams then stay where they land).
    let fair = state
        .fleet
        .as_ref()
        .filter(|_| ctx.settings.rebalance)
        .map(|f| f.fair_share(&me, held, orphans.len() as u64));
    let interval_ms = ctx.settings.reconcile_interval.as_millis() as u64;
    let mut policy = rebalance::AcquirePolicy {
        below_share: fair.map(|f| f.saturating_sub(held)),
        share_grace_ms: interval_ms * SHARE_GRACE_INTERVALS,
        rebalance_grace_ms: interval_ms * ORPHAN_GRACE_INTERVALS,
    };
    let mut budget = capacity;
    let held_keys: std::collections::HashSet<&StreamKey> =
        state.owned.values().map(|o| &o.key).collect();
    let mut candidates: Vec<_> = orphans
        .into_iter()
        .filter(|r| !held_keys.contains(&r.key))
        .collect();
    // Workers racing for the same orphans try them in different orders.
    candidates.shuffle(&mut rand::rng());
    for observed in candidates {
        if budget == 0 {
            break;
        }
        if !policy.allows(rebalance::classify(&observed, now)) {
            continue;
        }
        let sent_at = Instant::now();
        match ctx
            .store
            .acquire(
                &observed,
                &ctx.settings.worker_id,
                ctx.settings.lease_duration,
            )
            .await
        {
            Ok(AcquireOutcome::Acquired { lease, record }) => {
                ctx.metrics
                    .acquires
                    .get_or_create(&[("result", "acquired")])
                    .inc();
                record_takeover(ctx, &observed);
                tracing::info!(stream = %lease.key, token = lease.counter, last_seq = ?record.last_seq, "acquired");
                let signals = StreamSignals {
                    shutdown: state.drain.child_token(),
                    handoff: CancellationToken::new(),
                };
                let key = lease.key.clone();
                let handle = state.tasks.spawn(stream::run(
                    ctx.clone(),
                    lease,
                    *record,
                    sent_at,
                    signals.clone(),
                ));
                state.owned.insert(handle.id(), Owned { key, signals });
                ctx.metrics.leases_held.set(state.owned.len() as i64);
                budget -= 1;
                policy.acquired();
            }
            Ok(AcquireOutcome::Held { .. }) => {
                ctx.metrics
                    .acquires
                    .get_or_create(&[("result", "held")])
                    .inc();
            }
            Ok(AcquireOutcome::NotStarted | AcquireOutcome::Gone) => {
                ctx.metrics
                    .acquires
                    .get_or_create(&[("result", "unavailable")])
                    .inc();
            }
            Err(e) => {
                ctx.metrics
                    .acquires
                    .get_or_create(&[("result", "error")])
                    .inc();
                tracing::warn!(stream = %observed.key, error = %e, "acquire failed");
                break;
            }
        }
    }

    if let (true, Some(fair), Some(fleet)) = (ctx.settings.rebalance, fair, state.fleet.as_ref()) {
        let cooldown = ctx.settings.heartbeat_interval * 2;
        let cooled = state.last_handoff.is_none_or(|t| t.elapsed() >= cooldown);
        // A peer that has not heartbeated for three intervals is probably gone.
        let fresh_since = fresh_since(&ctx.settings);
        let count =
            rebalance::handoff_count(state.held(), fair, fleet.peer_below(&me, fair, fresh_since));
        if cooled && count > 0 {
            let mut movable: Vec<&Owned> = state
                .owned
                .values()
                .filter(|o| !o.signals.handoff.is_cancelled())
                .collect();
            movable.shuffle(&mut rand::rng());
            for o in movable.into_iter().take(count as usize) {
                tracing::info!(stream = %o.key, fair, "handing stream over to rebalance the fleet");
                o.signals.handoff.cancel();
            }
            state.last_handoff = Some(Instant::now());
        }
    }
}

/// How long the stream went without an owner, by how it lost the last one.
fn record_takeover(ctx: &WorkerCtx, observed: &crate::lease::StreamRecord) {
    let now = now_ms();
    if observed.lease_owner.is_none() {
        return;
    }
    if observed.lease_expires_at_ms > 0 {
        let secs = now.saturating_sub(observed.lease_expires_at_ms) as f64 / 1000.0;
        ctx.metrics.failover_seconds.observe(secs);
    } else if let Some(released) = observed.released_at_ms {
        let secs = now.saturating_sub(released) as f64 / 1000.0;
        ctx.metrics.handoff_seconds.observe(secs);
    }
}

/// Heartbeats a worker may miss before the fleet stops counting on it: its
/// membership item stays live until it lapses (a lease later), but a worker
/// silent this long is probably gone.
const MEMBER_SILENCE_HEARTBEATS: u32 = 3;

/// Membership heartbeats older than this (wall-clock ms) count as silent.
fn fresh_since(settings: &WorkerSettings) -> u64 {
    now_ms().saturating_sub(
        (settings.heartbeat_interval * MEMBER_SILENCE_HEARTBEATS).as_millis() as u64,
    )
}

fn jittered(interval: Duration) -> Duration {
    let factor = rand::rng().random_range((1.0 - RECONCILE_JITTER)..=(1.0 + RECONCILE_JITTER));
    interval.mul_f64(factor)
}
