//! Shared test support: a real DynamoDB-compatible server for every test binary.
//!
//! By default an embedded dynoxide server runs on `127.0.0.1:0` on its own thread
//! (so it outlives each test's runtime). Setting `TETHER_TEST_DYNAMODB_ENDPOINT`
//! points the same tests at another server, e.g. dynalite in CI.
#![allow(dead_code)]

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tether::embedded::EmbeddedStore;
use tether::lease::{LeaseStore, RetryPolicy, StoreConfig};
use tether::metrics::StoreMetrics;

static EMBEDDED: OnceLock<String> = OnceLock::new();

/// The endpoint under test and a label for messages.
pub fn endpoint() -> (String, &'static str) {
    if let Ok(ep) = std::env::var("TETHER_TEST_DYNAMODB_ENDPOINT")
        && !ep.is_empty()
    {
        return (ep, "external");
    }
    let ep = EMBEDDED.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("test runtime");
            rt.block_on(async move {
                let store = EmbeddedStore::start(None, SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
                    .await
                    .expect("embedded store starts");
                tx.send(store.endpoint()).expect("send endpoint");
                std::future::pending::<()>().await;
            });
        });
        rx.recv().expect("embedded store endpoint")
    });
    (ep.clone(), "dynoxide")
}

/// True when the tests run against an external server (dynalite in CI).
pub fn external() -> bool {
    endpoint().1 == "external"
}

/// A table name no other test uses.
pub fn unique_table(prefix: &str) -> String {
    format!("{prefix}-{:08x}", rand::random::<u32>())
}

pub fn store_config(table: &str) -> StoreConfig {
    let mut cfg = StoreConfig::local(table, endpoint().0);
    cfg.retry = RetryPolicy {
        deadline: Duration::from_secs(10),
        ..RetryPolicy::default()
    };
    cfg
}

/// A store on a fresh table of its own.
pub async fn fresh_store(page_size: Option<i32>) -> LeaseStore {
    tether::install_crypto_provider();
    let table = unique_table("t");
    let mut cfg = store_config(&table);
    cfg.page_size = page_size;
    let store = LeaseStore::connect(cfg, Arc::new(StoreMetrics::new()))
        .await
        .expect("store connects");
    store.create_table().await.expect("table is created");
    store
}

/// Polls `check` every 100 ms until it holds; panics after `limit` with `what`
/// and whatever `explain` returns (e.g. a process log).
pub async fn eventually_or<F, Fut>(
    limit: Duration,
    what: &str,
    mut check: F,
    explain: impl Fn() -> String,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting until {what}\n{}",
            explain()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// [`eventually_or`] without extra explanation.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    eventually_or(limit, what, check, String::new).await
}

/// Worker-process settings for `store`'s table with the fast test timings
/// (lease 3 s, heartbeat 0.5 s), logs under `logs`.
pub fn fleet(store: &LeaseStore, logs: &std::path::Path) -> tether::testkit::fleet::FleetConfig {
    tether::testkit::fleet::FleetConfig::fast(
        env!("CARGO_BIN_EXE_tether"),
        endpoint().0,
        store.table(),
        logs,
    )
}
