//! The store every subcommand opens: the table the flags name, or the
//! embedded DynamoDB server when `--embedded-store` asks for one.

use crate::config::StoreArgs;
use crate::embedded::EmbeddedStore;
use crate::lease::{Caller, LeaseStore, StoreConfig};
use crate::metrics::StoreMetrics;
use crate::support::RetryPolicy;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;

/// An open store, plus the embedded server behind it when one was asked for
/// (kept alive for as long as the store is used).
pub(super) struct OpenStore {
    pub store: LeaseStore,
    /// Never read: held so the server lives as long as the store is used.
    pub _embedded: Option<EmbeddedStore>,
}

/// Connects to the table the flags describe. With `--embedded-store` the
/// embedded store is started in-process and its table created; otherwise the
/// standard AWS configuration decides, and nothing is ever started silently.
pub(super) async fn open_store(
    args: &StoreArgs,
    caller: Caller,
    metrics: Arc<StoreMetrics>,
) -> anyhow::Result<OpenStore> {
    let embedded = match &args.embedded_store {
        Some(path) => Some(
            EmbeddedStore::start(
                Some(path.as_path()),
                SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            )
            .await?,
        ),
        None => None,
    };
    let mut cfg = match &embedded {
        Some(server) => StoreConfig::local(&args.table, server.endpoint()),
        None => StoreConfig::new(&args.table),
    };
    cfg.retry = RetryPolicy {
        deadline: args.store_call_deadline,
        ..RetryPolicy::default()
    };
    cfg.caller = Some(caller);
    let store = LeaseStore::connect(cfg, metrics).await?;
    // The embedded store starts empty; give it its table so local use needs no step.
    if embedded.is_some() {
        store.create_table().await?;
    }
    Ok(OpenStore {
        store,
        _embedded: embedded,
    })
}
