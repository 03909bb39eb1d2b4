//! Garbage collection of items whose resource is gone (a finalizer stripped
//! by hand, the skip-cleanup annotation, resources deleted while no operator
//! ran). Only the leader collects, only items its own installation wrote, only
//! in the namespaces it watches, and only after the resource has been missing
//! for the whole grace (confirmed by a direct read, not only the cache): an
//! item is stopped and deleted (a tombstone keeps its fencing token; a live
//! owner is told and releases).

use super::reconcile::{Context, Error};
use crate::crd::StreamConnection;
use crate::lease::StreamRecord;
use kube::Api;
use kube::runtime::reflector::Store;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{Instant, sleep};
use tokio_util::sync::CancellationToken;

/// Passes happen this often relative to the grace, within these bounds.
const PASSES_PER_GRACE: u32 = 4;
const MIN_PASS_INTERVAL: Duration = Duration::from_secs(1);
const MAX_PASS_INTERVAL: Duration = Duration::from_secs(300);

pub(super) async fn run(
    ctx: Arc<Context>,
    readers: Vec<Store<StreamConnection>>,
    leading: CancellationToken,
) {
    for reader in &readers {
        tokio::select! {
            _ = leading.cancelled() => return,
            _ = reader.wait_until_ready() => {}
        }
    }
    let interval =
        (ctx.settings.gc_grace / PASSES_PER_GRACE).clamp(MIN_PASS_INTERVAL, MAX_PASS_INTERVAL);
    // Per key: when this leader first found its resource missing.
    let mut missing: HashMap<String, Instant> = HashMap::new();
    loop {
        if let Err(e) = pass(&ctx, &readers, &mut missing).await {
            tracing::warn!(error = %e, "garbage collection pass failed");
        }
        tokio::select! {
            _ = leading.cancelled() => return,
            _ = sleep(interval) => {}
        }
    }
}

async fn pass(
    ctx: &Context,
    readers: &[Store<StreamConnection>],
    missing: &mut HashMap<String, Instant>,
) -> Result<(), Error> {
    let present: HashSet<(String, String, String)> = known(readers)
        .iter()
        .filter_map(|o| {
            Some((
                o.metadata.namespace.clone()?,
                o.metadata.name.clone()?,
                o.metadata.uid.clone()?,
            ))
        })
        .collect();
    let found = ctx.store.list().await?;
    let mut candidates = HashSet::new();
    for record in found.records.iter().filter(|r| ours(ctx, r)) {
        let id = (
            record.key.namespace.clone(),
            record.key.name.clone(),
            record.uid.clone().unwrap_or_default(),
        );
        let key = record.key.to_string();
        if present.contains(&id) {
            continue;
        }
        candidates.insert(key.clone());
        let since = *missing.entry(key).or_insert_with(Instant::now);
        if since.elapsed() >= ctx.settings.gc_grace && gone(ctx, record).await? {
            collect(ctx, record).await?;
        }
    }
    missing.retain(|k, _| candidates.contains(k));
    Ok(())
}

/// Written by this installation's controller, in a namespace it watches.
fn ours(ctx: &Context, record: &StreamRecord) -> bool {
    record.uid.is_some()
        && record.installation.as_deref() == Some(ctx.settings.item_installation())
        && (ctx.settings.namespaces.is_empty()
            || ctx.settings.namespaces.contains(&record.key.namespace))
}

/// Confirms with the API server that no resource of this name and UID exists.
async fn gone(ctx: &Context, record: &StreamRecord) -> Result<bool, Error> {
    let api: Api<StreamConnection> = Api::namespaced(ctx.client.clone(), &record.key.namespace);
    let current = super::leader::absent_as_none(api.get(&record.key.name).await)?;
    Ok(current.is_none_or(|o| o.metadata.uid != record.uid))
}

async fn collect(ctx: &Context, record: &StreamRecord) -> Result<(), Error> {
    let alive = ctx.store.owner_alive(record).await?;
    ctx.store.tombstone(&record.key, alive, true).await?;
    ctx.metrics.items_collected.inc();
    tracing::warn!(
        stream = %record.key,
        grace = ?ctx.settings.gc_grace,
        "collected: its resource no longer exists (stopped and deleted from the lease table)"
    );
    Ok(())
}

/// Every resource the watches have seen, by namespace and name.
fn known(readers: &[Store<StreamConnection>]) -> Vec<Arc<StreamConnection>> {
    readers.iter().flat_map(|r| r.state()).collect()
}
