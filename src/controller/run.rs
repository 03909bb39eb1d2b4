//! Running the controller: stand by until this replica leads its
//! installation, then watch the installation's resources (in the configured
//! namespaces, selected by label) and reconcile them, and collect orphaned
//! items, until leadership ends; then stand by again.

use super::gc;
use super::leader::{Election, Elector, LeadershipEnd};
use super::reconcile::{Context, error_policy, publish_on, reconcile};
use super::status_feed::{StatusFeed, Trigger};
use crate::crd::StreamConnection;
use futures::StreamExt;
use kube::runtime::controller::Controller;
use kube::runtime::events::EventType;
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Runs until `shutdown` fires. Returns early only if the controller stopped
/// on its own (the caller treats that as a failure).
pub async fn run(ctx: Arc<Context>, shutdown: CancellationToken) {
    let mut elector = Elector::new(
        ctx.client.clone(),
        Election {
            namespace: ctx.settings.leader_namespace.clone(),
            lease_name: ctx.settings.leader_lease_name(),
            identity: ctx.settings.instance.clone(),
            lease: ctx.settings.leader_lease,
        },
    );
    loop {
        if !elector.acquire(&shutdown).await {
            return;
        }
        tracing::info!(
            lease = %elector.election().lease_name,
            installation = %ctx.settings.installation,
            "leading: this replica reconciles the installation's resources"
        );
        ctx.metrics.leader.set(1);
        let leading = shutdown.child_token();
        let mut work = tokio::spawn(lead(ctx.clone(), leading.clone()));
        let end = tokio::select! {
            end = elector.hold(&shutdown) => Some(end),
            _ = &mut work => None,
        };
        leading.cancel();
        // A finished JoinHandle must not be polled again (it panics, and the
        // Lease would then never be released): wait only for running work.
        if end.is_some() {
            let _ = work.await;
        }
        ctx.metrics.leader.set(0);
        match end {
            Some(LeadershipEnd::Stopped) => {
                elector.release().await;
                return;
            }
            Some(LeadershipEnd::Lost) => {
                tracing::warn!("leadership lost: standing by");
            }
            None if shutdown.is_cancelled() => {
                elector.release().await;
                return;
            }
            None => {
                tracing::error!("the controller stopped on its own");
                elector.release().await;
                return;
            }
        }
    }
}

/// The leader's work: one controller per watched namespace (or one for all)
/// and the garbage collector, until `leading` is cancelled.
async fn lead(ctx: Arc<Context>, leading: CancellationToken) {
    let namespaces: Vec<Option<String>> = if ctx.settings.namespaces.is_empty() {
        vec![None]
    } else {
        ctx.settings.namespaces.iter().cloned().map(Some).collect()
    };
    // Status from the change feed when the table has its index (and no
    // version-1 worker, which stamps nothing, may still write); else each
    // resource's item is read every refresh.
    let feed = match ctx.store.describe().await {
        Ok(layout) if layout.change_index == Some(true) && !layout.legacy_index => {
            Some(Arc::new(StatusFeed::new(
                ctx.settings.item_installation(),
                ctx.settings.progress_interval,
            )))
        }
        Ok(_) => {
            tracing::warn!(
                "the table has no active change index (or a version-1 index): status is read per resource every refresh; `tether table create` adds the index"
            );
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot describe the table: status is read per resource every refresh");
            None
        }
    };
    ctx.set_status_feed(feed.clone());
    let mut triggers: Vec<Trigger> = Vec::new();
    let mut readers = Vec::new();
    let mut controllers = Vec::new();
    for namespace in namespaces {
        let api: Api<StreamConnection> = match &namespace {
            Some(ns) => Api::namespaced(ctx.client.clone(), ns),
            None => Api::all(ctx.client.clone()),
        };
        let (reader, writer) = reflector::store();
        let config = watcher::Config::default().labels(&ctx.settings.label_selector());
        let watched = watcher(api, config)
            .default_backoff()
            .reflect(writer)
            .applied_objects()
            .predicate_filter(worth_reconciling, Default::default());
        readers.push(reader.clone());
        let (asked, mut asks) = tokio::sync::mpsc::unbounded_channel();
        triggers.push((namespace.clone(), asked));
        controllers.push(
            Controller::for_stream(watched, reader)
                .reconcile_on(futures::stream::poll_fn(move |cx| asks.poll_recv(cx)))
                .graceful_shutdown_on(leading.clone().cancelled_owned())
                .run(reconcile, error_policy, ctx.clone())
                .boxed(),
        );
    }
    let reconciling = futures::stream::select_all(controllers).for_each(|result| async move {
        match result {
            Ok((obj, _)) => tracing::debug!(object = %obj, "reconciled"),
            Err(e) => tracing::debug!(error = %e, "reconcile error"),
        }
    });
    let following = async {
        if let Some(feed) = &feed {
            follow(&ctx, feed, &triggers, &leading).await;
        }
    };
    tokio::join!(
        reconciling,
        following,
        summarize_moves(&ctx, &leading),
        gc::run(ctx.clone(), readers, feed.is_some(), leading.clone())
    );
    ctx.set_status_feed(None);
}

/// How often the leader sums up owner moves in one event.
const MOVES_SUMMARY_INTERVAL: Duration = Duration::from_secs(30);

/// One Normal `OwnersMoved` event on the leader's Lease per interval in
/// which streams changed owner (a count and the busiest new owners), instead
/// of an event per stream per move: a rolling restart of 10,000 streams is a
/// handful of events, and `kubectl get events -n <release namespace>` shows
/// it happened.
async fn summarize_moves(ctx: &Context, leading: &CancellationToken) {
    let lease = k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("coordination.k8s.io/v1".into()),
        kind: Some("Lease".into()),
        name: Some(ctx.settings.leader_lease_name()),
        namespace: Some(ctx.settings.leader_namespace.clone()),
        ..Default::default()
    };
    loop {
        // What was counted is said when leadership ends too (a rolling
        // restart usually replaces the leader as well).
        let ending = tokio::select! {
            _ = leading.cancelled() => true,
            _ = tokio::time::sleep(MOVES_SUMMARY_INTERVAL) => false,
        };
        let summary = crate::support::lock(&ctx.moves).take_summary();
        if let Some(note) = summary {
            publish_on(
                ctx,
                &lease,
                EventType::Normal,
                "OwnersMoved",
                &note,
                "Acquire",
            )
            .await;
        }
        if ending {
            return;
        }
    }
}

/// Reads the change feed every `--status-refresh` until leadership ends.
async fn follow(
    ctx: &Context,
    feed: &StatusFeed,
    triggers: &[Trigger],
    leading: &CancellationToken,
) {
    loop {
        match feed.pass(&ctx.store, triggers).await {
            Ok(asked) => tracing::debug!(asked, "status feed pass"),
            Err(e) => {
                tracing::warn!(error = %e, "status feed pass failed; the next one looks back further")
            }
        }
        tokio::select! {
            _ = leading.cancelled() => return,
            _ = tokio::time::sleep(ctx.settings.status_refresh) => {}
        }
    }
}

/// What a reconcile depends on, hashed: a status write by the controller
/// itself (or anything else that changes only `status` or the resource
/// version) does not trigger one. Status is refreshed by the requeue timer.
fn worth_reconciling(obj: &StreamConnection) -> Option<u64> {
    let mut h = DefaultHasher::new();
    obj.metadata.generation.hash(&mut h);
    obj.metadata.uid.hash(&mut h);
    obj.metadata.deletion_timestamp.is_some().hash(&mut h);
    obj.finalizers().hash(&mut h);
    obj.labels().hash(&mut h);
    let annotations = obj.annotations();
    for name in [
        super::settings::SKIP_CLEANUP_ANNOTATION,
        super::settings::TABLE_ANNOTATION,
        crate::mirror::RECONNECT_ANNOTATION,
        crate::mirror::MOVE_ANNOTATION,
    ] {
        annotations.get(name).hash(&mut h);
    }
    Some(h.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::{StreamConnectionSpec, StreamConnectionStatus};

    fn resource() -> StreamConnection {
        let spec: StreamConnectionSpec =
            serde_json::from_value(serde_json::json!({"url": "ws://x/y", "sink": {"log": {}}}))
                .unwrap();
        let mut obj = StreamConnection::new("s", spec);
        obj.metadata.generation = Some(1);
        obj.metadata.resource_version = Some("1".into());
        obj
    }

    #[test]
    fn a_status_write_does_not_trigger_a_reconcile_but_a_spec_or_deletion_does() {
        let base = resource();
        let mut status_only = base.clone();
        status_only.status = Some(StreamConnectionStatus {
            phase: Some("Connected".into()),
            ..StreamConnectionStatus::default()
        });
        status_only.metadata.resource_version = Some("2".into());
        assert_eq!(worth_reconciling(&base), worth_reconciling(&status_only));

        let mut spec_change = base.clone();
        spec_change.metadata.generation = Some(2);
        assert_ne!(worth_reconciling(&base), worth_reconciling(&spec_change));

        let mut deleting = base.clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            ));
        assert_ne!(worth_reconciling(&base), worth_reconciling(&deleting));

        let mut skip = base.clone();
        skip.metadata.annotations = Some(
            [(
                crate::controller::settings::SKIP_CLEANUP_ANNOTATION.to_string(),
                "true".to_string(),
            )]
            .into(),
        );
        assert_ne!(worth_reconciling(&base), worth_reconciling(&skip));
    }
}
