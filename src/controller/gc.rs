//! Garbage collection of items whose resource is gone (a finalizer stripped
//! by hand, the skip-cleanup annotation, resources deleted while no operator
//! ran). Only the leader collects, only items its own installation wrote, only
//! in the namespaces it watches, and only after the resource has been missing
//! for the whole grace (confirmed by a direct read, not only the cache): an
//! item is stopped and deleted (a tombstone keeps its fencing token; a live
//! owner is told and releases).
//!
//! Listing: a leadership starts by scanning the table, and keeps scanning
//! while a scan finds items of this installation that the change index does
//! not list (mirrored before the index existed, by resources long gone, so
//! nothing mirrors them again); after that, on a table with the change
//! index, passes query this installation's partitions of it (tombstones are
//! told apart by the projected `deleted_at_ms`).

use super::reconcile::{Context, Error};
use crate::crd::StreamConnection;
use crate::lease::{StreamKey, StreamRecord};
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
    by_query: bool,
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
    // Scan until a scan finds none of this installation's items outside the
    // index (mirrored before it existed, by a resource long gone).
    let mut scan = true;
    loop {
        match pass(&ctx, &readers, &mut missing, by_query && !scan).await {
            Ok(unindexed) => scan = unindexed > 0 || !by_query,
            Err(e) => tracing::warn!(error = %e, "garbage collection pass failed"),
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
    by_query: bool,
) -> Result<usize, Error> {
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
    // (key, the resource UID that wrote it) of this installation's live
    // items, and how many of them the index does not list.
    let (listed, unindexed): (Vec<(StreamKey, Option<String>)>, usize) = if by_query {
        let changes = ctx
            .store
            .changes(ctx.settings.item_installation(), 0)
            .await?;
        let live = changes
            .into_iter()
            .filter(|c| !c.deleted)
            .map(|c| (c.key, c.uid))
            .collect();
        (live, 0)
    } else {
        let records: Vec<StreamRecord> = ctx
            .store
            .list()
            .await?
            .records
            .into_iter()
            .filter(|r| ours(ctx, r))
            .collect();
        let unindexed = records.iter().filter(|r| r.change_shard.is_none()).count();
        (
            records.into_iter().map(|r| (r.key, r.uid)).collect(),
            unindexed,
        )
    };
    let mut candidates = HashSet::new();
    for (stream, uid) in listed {
        let id = (
            stream.namespace.clone(),
            stream.name.clone(),
            uid.unwrap_or_default(),
        );
        let key = stream.to_string();
        if present.contains(&id) || !watched(ctx, &stream) {
            continue;
        }
        candidates.insert(key.clone());
        let since = *missing.entry(key).or_insert_with(Instant::now);
        if since.elapsed() < ctx.settings.gc_grace {
            continue;
        }
        // Read again: the listing may be an index's (eventually consistent).
        let Some(record) = ctx.store.get(&stream).await? else {
            continue;
        };
        if !record.is_tombstone() && ours(ctx, &record) && gone(ctx, &record).await? {
            collect(ctx, &record).await?;
        }
    }
    missing.retain(|k, _| candidates.contains(k));
    Ok(unindexed)
}

/// Written by this installation's controller, in a namespace it watches.
fn ours(ctx: &Context, record: &StreamRecord) -> bool {
    record.uid.is_some()
        && record.installation.as_deref() == Some(ctx.settings.item_installation())
        && watched(ctx, &record.key)
}

fn watched(ctx: &Context, key: &StreamKey) -> bool {
    ctx.settings.namespaces.is_empty() || ctx.settings.namespaces.contains(&key.namespace)
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
