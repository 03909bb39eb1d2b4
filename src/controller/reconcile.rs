//! Reconciling one `StreamConnection`: mirror its spec into the lease table
//! (or refuse it with a reason), write its status from the table, and on
//! deletion release and tombstone its item behind the finalizer.

use super::resource_status;
use super::settings::{self, ControllerSettings};
use super::status_feed::{RESYNC, StatusFeed};
use crate::crd::{DesiredStateSpec, StreamConnection, StreamConnectionStatus};
use crate::lease::{
    LeaseStore, ResourceIdentity, StoreError, StreamKey, TombstoneOutcome, UpsertOutcome,
    UpsertRefusal,
};
use crate::metrics::ControllerMetrics;
use crate::support::lock;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::{Client, Resource, ResourceExt};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use thiserror::Error;
use tokio::time::Instant;

/// Finalizer that keeps a resource until its table item is gone.
pub const FINALIZER: &str = "tether.dev/lease-cleanup";
/// Field manager of the status written by server-side apply.
pub const FIELD_MANAGER: &str = "tether-controller";
/// How long deletion waits for the owner to release before deleting anyway
/// (the owner is told through its inbox, and releases).
pub const RELEASE_WAIT: Duration = Duration::from_secs(30);
/// Retry delay while waiting for a release.
const RELEASE_POLL: Duration = Duration::from_secs(1);
/// At most one Warning per resource this often for a retrying stream.
const WARNING_INTERVAL: Duration = Duration::from_secs(300);
/// Retry delay after a claim lost to a concurrent write.
const CLAIM_RETRY: Duration = Duration::from_millis(200);
/// First and largest retry delay after an error.
const ERROR_BACKOFF_FIRST: Duration = Duration::from_secs(2);
const ERROR_BACKOFF_MAX: Duration = Duration::from_secs(300);

#[derive(Debug, Error)]
pub enum Error {
    #[error("lease table: {0}")]
    Store(#[from] StoreError),
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("waiting for {owner} to release the stream")]
    WaitingForRelease { owner: String },
    #[error("resource has no namespace")]
    NoNamespace,
    #[error("finalizer: {0}")]
    Finalizer(String),
}

impl Error {
    /// A fixed label for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            Self::Store(e) => e.category(),
            Self::Kube(_) => "kubernetes_api",
            Self::WaitingForRelease { .. } => "waiting_for_release",
            Self::NoNamespace => "no_namespace",
            Self::Finalizer(_) => "finalizer",
        }
    }
}

/// Shared by every reconcile.
pub struct Context {
    pub client: Client,
    pub store: LeaseStore,
    pub recorder: Recorder,
    pub settings: ControllerSettings,
    pub metrics: Arc<ControllerMetrics>,
    /// Last status write per object, to rate-limit progress-only writes.
    last_write: Mutex<HashMap<String, Instant>>,
    /// Consecutive failures per object, for exponential backoff.
    failures: Mutex<HashMap<String, u32>>,
    /// Retry Warnings, per resource.
    warnings: Mutex<RateLimit>,
    /// Owner moves since the last summary (see `run::summarize_moves`).
    pub(super) moves: Mutex<MoveTally>,
    /// Resources another table holds, already reported.
    refused: Mutex<std::collections::HashSet<String>>,
    /// While leading on a table with the change index: status from what
    /// changed (`None`: each resource's item is read every refresh).
    feed: Mutex<Option<Arc<StatusFeed>>>,
}

impl Context {
    pub fn new(
        client: Client,
        store: LeaseStore,
        settings: ControllerSettings,
        metrics: Arc<ControllerMetrics>,
    ) -> Self {
        let reporter = Reporter {
            controller: "tether".into(),
            instance: Some(settings.instance.clone()),
        };
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            store,
            settings,
            metrics,
            last_write: Mutex::default(),
            failures: Mutex::default(),
            refused: Mutex::default(),
            warnings: Mutex::new(RateLimit::new(WARNING_INTERVAL)),
            moves: Mutex::default(),
            feed: Mutex::default(),
        }
    }

    /// The status feed this leadership reads, if any.
    pub(super) fn status_feed(&self) -> Option<Arc<StatusFeed>> {
        lock(&self.feed).clone()
    }

    pub(super) fn set_status_feed(&self, feed: Option<Arc<StatusFeed>>) {
        *lock(&self.feed) = feed;
    }
}

fn object_key(obj: &StreamConnection) -> String {
    format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any())
}

/// Reconciles one resource, measured.
pub async fn reconcile(obj: Arc<StreamConnection>, ctx: Arc<Context>) -> Result<Action, Error> {
    let metrics = ctx.metrics.clone();
    metrics.reconciles_in_flight.inc();
    let started = Instant::now();
    let result = reconcile_unmeasured(obj, ctx).await;
    metrics.reconciles_in_flight.dec();
    metrics
        .reconcile_seconds
        .0
        .observe(started.elapsed().as_secs_f64());
    let outcome = match &result {
        Ok(_) => "ok",
        Err(e) => {
            metrics
                .reconcile_errors
                .get_or_create(&[("category", e.category())])
                .inc();
            "error"
        }
    };
    metrics
        .reconciles
        .get_or_create(&[("result", outcome)])
        .inc();
    result
}

async fn reconcile_unmeasured(
    obj: Arc<StreamConnection>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    // The watch selects by label already; a resource relabelled to another
    // installation is left to it (its finalizer included).
    if !ctx.settings.claims(obj.labels()) {
        return Ok(Action::await_change());
    }
    // Mirrored into another table by another installation: not ours to
    // mirror or report on, and its finalizer is that one's to remove. An
    // item this installation mirrored before the claim moved is stopped and
    // deleted here, so the stream never runs from both tables.
    if let Some(table) = obj.annotations().get(settings::TABLE_ANNOTATION)
        && *table != ctx.store.identity()
    {
        refuse_claimed(&ctx, &obj, table).await;
        let key = StreamKey::new(obj.namespace().unwrap_or_default(), obj.name_any());
        return cleanup_item(&key, &obj, &ctx).await;
    }
    let namespace = obj.namespace().ok_or(Error::NoNamespace)?;
    let api: Api<StreamConnection> = Api::namespaced(ctx.client.clone(), &namespace);
    let result = finalizer(&api, FINALIZER, obj, |event| async {
        match event {
            Finalizer::Apply(obj) => apply(&obj, &ctx).await,
            Finalizer::Cleanup(obj) => cleanup(&obj, &ctx).await,
        }
    })
    .await;
    match result {
        Ok(action) => Ok(action),
        Err(
            kube::runtime::finalizer::Error::ApplyFailed(e)
            | kube::runtime::finalizer::Error::CleanupFailed(e),
        ) => Err(e),
        Err(e) => Err(Error::Finalizer(e.to_string())),
    }
}

/// The resource's identity, so the table can tell resources of one name apart
/// and installations sharing a table never take each other's items.
fn resource_of(obj: &StreamConnection, installation: &str) -> Option<ResourceIdentity> {
    let uid = obj.metadata.uid.clone()?;
    let created_ms = obj
        .metadata
        .creation_timestamp
        .as_ref()
        .map_or(0, |t| t.0.as_millisecond().max(0) as u64);
    Some(ResourceIdentity {
        uid,
        created_ms,
        installation: installation.to_string(),
    })
}

/// Says once per resource (per process) that another installation's table
/// holds it.
async fn refuse_claimed(ctx: &Context, obj: &StreamConnection, table: &str) {
    if !lock(&ctx.refused).insert(object_key(obj)) {
        return;
    }
    let message = format!(
        "mirrored into lease table '{table}' by another installation; this one (table '{}') leaves it alone. \
         To move it, stop it, point the {} annotation at the other table, and start it again",
        ctx.store.identity(),
        settings::TABLE_ANNOTATION
    );
    tracing::warn!(object = %object_key(obj), %table, "{message}");
    publish(
        ctx,
        obj,
        EventType::Warning,
        "ClaimedElsewhere",
        &message,
        "Mirror",
    )
    .await;
}

/// Claims the resource for this table before anything is mirrored: a merge
/// patch conditioned on the resource version, so of two controllers racing
/// for an unclaimed resource exactly one succeeds. `false` when another
/// write came first (reconcile again and look).
async fn claim(obj: &StreamConnection, ctx: &Context) -> Result<bool, Error> {
    let api: Api<StreamConnection> =
        Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    let patch = serde_json::json!({
        "metadata": {
            "resourceVersion": obj.metadata.resource_version,
            "annotations": {settings::TABLE_ANNOTATION: ctx.store.identity()},
        }
    });
    match api
        .patch(
            &obj.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Claim → validate → mirror → status.
async fn apply(obj: &StreamConnection, ctx: &Context) -> Result<Action, Error> {
    if !obj.annotations().contains_key(settings::TABLE_ANNOTATION) && !claim(obj, ctx).await? {
        return Ok(Action::requeue(CLAIM_RETRY));
    }
    let key = StreamKey::new(obj.namespace().unwrap_or_default(), obj.name_any());
    lock(&ctx.failures).remove(&key.to_string());
    if let Err(errors) = obj.spec.validate_in_cluster() {
        let message = errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        let status = resource_status::compute(obj, None, Some(&message), None);
        if write_status(obj, ctx, status, true).await? {
            publish(
                ctx,
                obj,
                EventType::Warning,
                "InvalidSpec",
                &message,
                "Validate",
            )
            .await;
        }
        // Nothing to retry until the object changes.
        return Ok(Action::await_change());
    }
    let generation = obj.metadata.generation.unwrap_or(1);
    let mut desired = obj.spec.to_desired(
        key.clone(),
        generation,
        resource_of(obj, ctx.settings.item_installation()),
    );
    desired.requests = crate::mirror::requests_of(obj.annotations());
    // The status needs the item anyway: read it first (from the status
    // feed's cache when it has it), and write (a read and a conditional
    // write of its own) only when it does not match.
    let feed = ctx.status_feed();
    let read = |key: StreamKey| {
        let feed = feed.clone();
        let desired = &desired;
        async move {
            match feed {
                Some(f) => f.view(&ctx.store, &key, desired).await,
                None => ctx.store.view(&key).await,
            }
        }
    };
    let mut view = read(key.clone()).await?;
    let outcome = if let Some(v) = view
        .as_ref()
        .filter(|v| LeaseStore::mirrors(&v.record, &desired))
    {
        // Mirrored, but its owner still runs an older generation: the
        // notification may have been lost with the writer that owed it.
        ctx.store.remind_owner_behind(&v.record).await?;
        UpsertOutcome::Unchanged
    } else {
        // A copy that does not mirror `desired` is never served from the
        // feed's cache: the read after this write reads the item again.
        let outcome = ctx.store.upsert_desired(&desired).await?;
        if outcome == UpsertOutcome::Applied {
            view = read(key.clone()).await?;
        }
        outcome
    };
    let refused = match outcome {
        UpsertOutcome::Refused { reason } => Some(match reason {
            UpsertRefusal::StaleGeneration { stored } => format!(
                "the lease table holds generation {stored} of this resource, newer than {generation}; not overwritten"
            ),
            UpsertRefusal::NewerResource { stored_uid } => format!(
                "the lease table holds {key} for a newer resource (uid {stored_uid}); not overwritten"
            ),
            UpsertRefusal::Deleted => {
                "this resource was deleted from the lease table; not resurrected".to_string()
            }
            UpsertRefusal::OtherInstallation { stored } => format!(
                "the lease table holds {key} for installation '{stored}' (this is '{}'); not taken over",
                ctx.settings.item_installation()
            ),
        }),
        _ => None,
    };
    let status = resource_status::compute(obj, view.as_ref(), None, refused.as_deref());
    let previous = obj.status.clone();
    let significant = resource_status::significant_change(previous.as_ref(), &status);
    if write_status(obj, ctx, status.clone(), significant).await? {
        if let Some(message) = &refused {
            publish(
                ctx,
                obj,
                EventType::Warning,
                "MirrorRefused",
                message,
                "Mirror",
            )
            .await;
        }
        announce(ctx, obj, previous.as_ref(), &status).await;
    }
    // With the feed, changes ask for the reconcile; the timer is a safety net.
    Ok(Action::requeue(if feed.is_some() {
        RESYNC
    } else {
        ctx.settings.status_refresh
    }))
}

/// Mark STOPPED, wait for the release (bounded), delete the item (a tombstone
/// keeps the fencing token).
async fn cleanup(obj: &StreamConnection, ctx: &Context) -> Result<Action, Error> {
    let key = StreamKey::new(obj.namespace().unwrap_or_default(), obj.name_any());
    if obj
        .annotations()
        .get(settings::SKIP_CLEANUP_ANNOTATION)
        .is_some_and(|v| v == "true")
    {
        tracing::warn!(stream = %key, "cleanup skipped by annotation; the garbage collector deletes the item later");
        publish(
            ctx,
            obj,
            EventType::Warning,
            "CleanupSkipped",
            &format!(
                "{} is set: the finalizer is removed without touching the lease table; the item is stopped and deleted by the garbage collector once the table answers",
                settings::SKIP_CLEANUP_ANNOTATION
            ),
            "Cleanup",
        )
        .await;
        return Ok(Action::await_change());
    }
    match cleanup_item(&key, obj, ctx).await {
        Err(Error::Store(e)) => {
            cleanup_blocked(obj, ctx, &e).await;
            Err(Error::Store(e))
        }
        other => other,
    }
}

/// The table did not answer during deletion: say so in status and once in
/// an event, and keep retrying with backoff (the finalizer stays, so the
/// stream is never left running without its resource).
async fn cleanup_blocked(obj: &StreamConnection, ctx: &Context, e: &StoreError) {
    let message = format!(
        "cannot stop and delete the stream in the lease table ({e}); retrying with backoff. \
         To remove the resource anyway, annotate it {}=true (the item is collected later)",
        settings::SKIP_CLEANUP_ANNOTATION
    );
    let mut status = obj.status.clone().unwrap_or_default();
    let already = status
        .conditions
        .iter()
        .any(|c| c.type_ == resource_status::READY && c.reason == "CleanupBlocked");
    if already {
        return;
    }
    resource_status::set_ready(&mut status, false, "CleanupBlocked", &message);
    if write_status(obj, ctx, status, true).await.is_ok() {
        publish(
            ctx,
            obj,
            EventType::Warning,
            "CleanupBlocked",
            &message,
            "Cleanup",
        )
        .await;
    }
}

async fn cleanup_item(
    key: &StreamKey,
    obj: &StreamConnection,
    ctx: &Context,
) -> Result<Action, Error> {
    let key = key.clone();
    let Some(record) = ctx.store.get(&key).await?.filter(|r| !r.is_tombstone()) else {
        return Ok(Action::await_change());
    };
    // Another resource of this name owns the item now: leave it alone.
    if record.uid.is_some() && record.uid != obj.metadata.uid {
        return Ok(Action::await_change());
    }
    if record.desired_state != crate::lease::DesiredState::Stopped {
        let mut spec = obj.spec.clone();
        spec.desired_state = DesiredStateSpec::Stopped;
        let generation = obj.metadata.generation.unwrap_or(1).max(record.generation);
        let mut stopped = spec.to_desired(
            key.clone(),
            generation,
            resource_of(obj, ctx.settings.item_installation()),
        );
        stopped.requests = crate::mirror::requests_of(obj.annotations());
        ctx.store.upsert_desired(&stopped).await?;
    }
    let alive = ctx.store.owner_alive(&record).await?;
    let waited = obj
        .metadata
        .deletion_timestamp
        .as_ref()
        .map(|t| {
            let since = k8s_openapi::jiff::Timestamp::now().duration_since(t.0);
            Duration::try_from(since).unwrap_or_default()
        })
        .unwrap_or_default();
    let force = waited >= RELEASE_WAIT;
    match ctx.store.tombstone(&key, alive, force).await? {
        TombstoneOutcome::StillOwned { owner } => return Err(Error::WaitingForRelease { owner }),
        TombstoneOutcome::Deleted | TombstoneOutcome::NotFound => {}
    }
    if force && alive {
        tracing::warn!(stream = %key, "owner did not release in time; deleted anyway (the owner is told and stops)");
    }
    lock(&ctx.last_write).remove(&key.to_string());
    lock(&ctx.warnings).forget(&key.to_string());
    if let Some(f) = ctx.status_feed() {
        f.forget(&key);
    }
    publish(
        ctx,
        obj,
        EventType::Normal,
        "Deleted",
        "stream stopped and removed from the lease table",
        "Cleanup",
    )
    .await;
    Ok(Action::await_change())
}

/// Writes the status by server-side apply if it changed significantly, or if
/// progress fields are stale. Returns whether it wrote.
async fn write_status(
    obj: &StreamConnection,
    ctx: &Context,
    status: StreamConnectionStatus,
    significant: bool,
) -> Result<bool, Error> {
    let key = object_key(obj);
    let stale_progress = obj.status.as_ref() != Some(&status) && {
        let mut last = lock(&ctx.last_write);
        // A new leader counts from its start, so a hand-over is not a burst
        // of progress writes for every resource.
        let since = *last.entry(key.clone()).or_insert_with(Instant::now);
        since.elapsed() >= ctx.settings.progress_interval
    };
    if !significant && !stale_progress {
        return Ok(false);
    }
    let api: Api<StreamConnection> =
        Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    let patch = serde_json::json!({
        "apiVersion": "tether.dev/v1alpha1",
        "kind": "StreamConnection",
        "status": status,
    });
    api.patch_status(
        &obj.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await?;
    lock(&ctx.last_write).insert(key, Instant::now());
    let kind = if significant { "change" } else { "progress" };
    ctx.metrics
        .status_writes
        .get_or_create(&[("kind", kind)])
        .inc();
    Ok(true)
}

/// Events for ownership changes and failures.
async fn announce(
    ctx: &Context,
    obj: &StreamConnection,
    old: Option<&StreamConnectionStatus>,
    new: &StreamConnectionStatus,
) {
    // The first owner only: later moves (a rolling restart moves every
    // stream) are routine, shown in status and metrics, not as one event per
    // stream per move.
    let never_owned = old.is_none_or(|s| s.owner.is_none() && s.last_seq.is_none());
    if !never_owned
        && let Some(owner) = &new.owner
        && old.and_then(|s| s.owner.as_ref()) != Some(owner)
    {
        lock(&ctx.moves).count(owner);
    }
    if never_owned && let Some(owner) = &new.owner {
        publish(
            ctx,
            obj,
            EventType::Normal,
            "Acquired",
            &format!("acquired by {owner}"),
            "Acquire",
        )
        .await;
    }
    let old_phase = old.and_then(|s| s.phase.clone());
    let failed = Some(crate::lease::Phase::Failed.as_str());
    let ready = |s: &StreamConnectionStatus| {
        s.conditions
            .iter()
            .find(|c| c.type_ == resource_status::READY)
            .map(|c| (c.reason.clone(), c.message.clone()))
    };
    let (reason, message) = ready(new).unwrap_or_default();
    if new.phase.as_deref() == failed && old_phase.as_deref() != failed {
        publish(ctx, obj, EventType::Warning, "Failed", &message, "Connect").await;
    } else if ACTIONABLE_REASONS.contains(&reason.as_str())
        && old.and_then(ready).map(|(r, _)| r) != Some(reason.clone())
        && warning_due(ctx, obj)
    {
        // Still retrying, but only the user can fix it: said once, when it
        // starts, not when the stream is finally refused; a stream whose
        // reason flaps between two of these says so at most once per
        // WARNING_INTERVAL.
        publish(ctx, obj, EventType::Warning, &reason, &message, "Connect").await;
    }
}

/// Streams that changed owner, counted per new owner: summarised in one
/// event a while, instead of one event per stream per move.
#[derive(Default)]
pub(super) struct MoveTally {
    by_owner: HashMap<String, u64>,
}

impl MoveTally {
    fn count(&mut self, owner: &str) {
        *self.by_owner.entry(owner.to_string()).or_default() += 1;
    }

    /// The summary of what was counted (then forgotten), if anything was:
    /// `"12 streams changed owner: 7 to a, 5 to b"` (the three busiest).
    pub(super) fn take_summary(&mut self) -> Option<String> {
        let mut owners: Vec<(String, u64)> = self.by_owner.drain().collect();
        if owners.is_empty() {
            return None;
        }
        owners.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let total: u64 = owners.iter().map(|(_, n)| n).sum();
        let busiest: Vec<String> = owners
            .iter()
            .take(3)
            .map(|(o, n)| format!("{n} to {o}"))
            .collect();
        let rest = if owners.len() > 3 { ", …" } else { "" };
        let noun = if total == 1 { "stream" } else { "streams" };
        Some(format!(
            "{total} {noun} changed owner: {}{rest}",
            busiest.join(", ")
        ))
    }
}

/// Whether a retrying stream's Warning may be published now (and notes it).
fn warning_due(ctx: &Context, obj: &StreamConnection) -> bool {
    lock(&ctx.warnings).admit(&object_key(obj), Instant::now())
}

/// At most one event per key per interval.
pub(super) struct RateLimit {
    interval: Duration,
    last: HashMap<String, Instant>,
}

impl RateLimit {
    pub(super) fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: HashMap::new(),
        }
    }

    /// Whether `key` may have an event at `now` (if so, it is noted).
    pub(super) fn admit(&mut self, key: &str, now: Instant) -> bool {
        if self
            .last
            .get(key)
            .is_some_and(|at| now.duration_since(*at) < self.interval)
        {
            return false;
        }
        self.last.insert(key.to_string(), now);
        true
    }

    pub(super) fn forget(&mut self, key: &str) {
        self.last.remove(key);
    }
}

/// Ready reasons a stream retries on that only its user can fix (a missing
/// Secret, a refused host, a sink that is down, an unreachable upstream).
const ACTIONABLE_REASONS: [&str; 7] = [
    "HeaderUnavailable",
    "HostRefused",
    "TLSError",
    "HandshakeFailed",
    "ConnectFailed",
    "SinkUnavailable",
    "OriginUnverified",
];

async fn publish(
    ctx: &Context,
    obj: &StreamConnection,
    type_: EventType,
    reason: &str,
    note: &str,
    action: &str,
) {
    publish_on(ctx, &obj.object_ref(&()), type_, reason, note, action).await;
}

/// Publishes an event about any object (best effort: logged at debug).
pub(super) async fn publish_on(
    ctx: &Context,
    regarding: &k8s_openapi::api::core::v1::ObjectReference,
    type_: EventType,
    reason: &str,
    note: &str,
    action: &str,
) {
    let event = Event {
        type_,
        reason: reason.into(),
        note: Some(note.chars().take(1000).collect()),
        action: action.into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, regarding).await {
        tracing::debug!(error = %e, "could not publish an event");
    }
}

/// Requeue after an error: quickly while waiting for a release, with
/// exponential backoff otherwise.
pub fn error_policy(obj: Arc<StreamConnection>, error: &Error, ctx: Arc<Context>) -> Action {
    if let Error::WaitingForRelease { .. } = error {
        return Action::requeue(RELEASE_POLL);
    }
    let key = object_key(&obj);
    let attempt = {
        let mut failures = lock(&ctx.failures);
        let n = failures.entry(key.clone()).or_insert(0);
        *n = n.saturating_add(1);
        *n
    };
    let wait = crate::support::exponential(ERROR_BACKOFF_FIRST, ERROR_BACKOFF_MAX, attempt - 1);
    tracing::warn!(object = %key, error = %error, category = error.category(), retry_in = ?wait, "reconcile failed");
    Action::requeue(wait)
}

/// Checks the CRD is installed and readable; the process should exit if not.
/// Fails with one line saying what to do when StreamConnections cannot be
/// listed where this controller watches (`namespaces`; empty: everywhere),
/// which is also what its RBAC grants.
pub async fn check_crd(client: &Client, namespaces: &[String]) -> anyhow::Result<()> {
    let api: Api<StreamConnection> = match namespaces.first() {
        Some(namespace) => Api::namespaced(client.clone(), namespace),
        None => Api::all(client.clone()),
    };
    api.list(&ListParams::default().limit(1)).await.map_err(|e| {
        anyhow::anyhow!(
            "cannot list StreamConnections ({e}): is the CRD installed? `tether crd | kubectl apply -f -` \
             (or install the Helm chart with crds.enabled=true), and does the service account may list them?"
        )
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_moves_are_summarised_with_a_count_and_the_busiest_owners() {
        let mut tally = MoveTally::default();
        assert_eq!(tally.take_summary(), None);
        for owner in ["b", "a", "b", "c", "d", "b", "a"] {
            tally.count(owner);
        }
        assert_eq!(
            tally.take_summary().as_deref(),
            Some("7 streams changed owner: 3 to b, 2 to a, 1 to c, …")
        );
        assert_eq!(tally.take_summary(), None, "counted once");
        tally.count("a");
        assert_eq!(
            tally.take_summary().as_deref(),
            Some("1 stream changed owner: 1 to a")
        );
    }

    #[test]
    fn a_retry_warning_is_admitted_once_per_interval_per_resource() {
        let mut limit = RateLimit::new(Duration::from_secs(300));
        let start = Instant::now();
        assert!(limit.admit("ns/a", start));
        assert!(
            !limit.admit("ns/a", start + Duration::from_secs(10)),
            "a flap"
        );
        assert!(
            limit.admit("ns/b", start + Duration::from_secs(10)),
            "per resource"
        );
        assert!(limit.admit("ns/a", start + Duration::from_secs(300)));
        limit.forget("ns/b");
        assert!(
            limit.admit("ns/b", start + Duration::from_secs(11)),
            "a deleted resource starts over"
        );
    }
}
