//! A real DynamoDB-compatible server for every test binary.
//!
//! By default an embedded dynoxide server runs on `127.0.0.1:0` on its own
//! thread (so it outlives each test's runtime). Setting
//! `TETHER_TEST_DYNAMODB_ENDPOINT` points the same tests at another server,
//! e.g. dynalite in CI. With `TETHER_DYNAMODB_CALL_LOG` set, the embedded
//! store is reached through the call recorder (`call_log`).

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tether::embedded::EmbeddedStore;
use tether::lease::{DesiredState, DesiredStream, LeaseStore, StoreConfig, StreamKey};
use tether::metrics::StoreMetrics;
use tether::support::RetryPolicy;

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
                .thread_name(STORE_THREAD_NAME)
                .enable_all()
                .build()
                .expect("test runtime");
            rt.block_on(async move {
                let store = EmbeddedStore::start(None, SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
                    .await
                    .expect("embedded store starts");
                let endpoint = match std::env::var_os(crate::call_log::CALL_LOG_ENV) {
                    Some(dir) if !dir.is_empty() => crate::call_log::start(
                        SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
                        &store.endpoint(),
                        std::path::Path::new(&dir),
                    )
                    .await
                    .expect("the call recorder starts"),
                    _ => store.endpoint(),
                };
                tx.send(endpoint).expect("send endpoint");
                std::future::pending::<()>().await;
            });
        });
        rx.recv().expect("embedded store endpoint")
    });
    (ep.clone(), "dynoxide")
}

/// The embedded store's runtime threads' name (at most 15 bytes: what
/// `/proc` keeps of it).
pub const STORE_THREAD_NAME: &str = "embedded-store";

/// CPU seconds (user and system) this process's threads named `name` have
/// used ([`STORE_THREAD_NAME`], `capacity::MODEL_THREAD_NAME`), so a
/// benchmark can tell the simulated store's and the model's shares of the
/// machine from the simulated workers'. `None` off Linux.
pub fn threads_cpu_seconds(name: &str) -> Option<f64> {
    let mut total = 0.0;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let task = task.ok()?;
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.trim_end() != name {
            continue;
        }
        // A thread that ended meanwhile has nothing more to add.
        total += tether::process_metrics::stat_at(&task.path().join("stat"))
            .map_or(0.0, |s| s.cpu_seconds);
    }
    Some(total)
}

/// True when the tests run against an external server (dynalite in CI).
pub fn external() -> bool {
    endpoint().1 == "external"
}

/// A table name no other test uses.
pub fn unique_table(prefix: &str) -> String {
    format!("{prefix}-{:08x}", rand::random::<u32>())
}

/// Settings for a table on the server under test.
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
    let mut cfg = store_config(&unique_table("t"));
    cfg.page_size = page_size;
    let store = LeaseStore::connect(cfg, Arc::new(StoreMetrics::new()))
        .await
        .expect("store connects");
    store.create_table().await.expect("table is created");
    store
}

/// A fresh table as this release's predecessor made it: without the
/// `by_change` index, so the controller reads each resource's item every
/// refresh (the design before the change feed, for side-by-side figures).
pub async fn store_without_change_index() -> LeaseStore {
    let store = fresh_store(None).await;
    raw_client()
        .await
        .update_table()
        .table_name(store.table())
        .global_secondary_index_updates(
            aws_sdk_dynamodb::types::GlobalSecondaryIndexUpdate::builder()
                .delete(
                    aws_sdk_dynamodb::types::DeleteGlobalSecondaryIndexAction::builder()
                        .index_name(tether::lease::CHANGE_INDEX)
                        .build()
                        .expect("the index name is set"),
                )
                .build(),
        )
        .send()
        .await
        .expect("the change index is dropped");
    for _ in 0..100 {
        if store
            .describe()
            .await
            .expect("described")
            .change_index
            .is_none()
        {
            return store;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the change index was not dropped");
}

/// A plain DynamoDB client for the server under test, for writing items the
/// store never would (a version-1 table, hand-edited items).
pub async fn raw_client() -> aws_sdk_dynamodb::Client {
    let (id, secret) = tether::lease::LOCAL_CREDENTIALS;
    let conf = aws_sdk_dynamodb::config::Builder::new()
        .behavior_version(aws_sdk_dynamodb::config::BehaviorVersion::latest())
        .region(aws_sdk_dynamodb::config::Region::new("us-east-1"))
        .endpoint_url(endpoint().0)
        .credentials_provider(aws_credential_types::Credentials::new(
            id, secret, None, None, "test",
        ))
        .http_client(tether::support::aws_http_client())
        .build();
    aws_sdk_dynamodb::Client::from_conf(conf)
}

/// A stream `test/<name>` as the controller would mirror it: an upstream
/// nobody listens on and the log sink (for store tests, which never connect).
pub fn desired_stream(name: &str, state: DesiredState, generation: i64) -> DesiredStream {
    DesiredStream {
        key: StreamKey::new("test", name),
        desired_state: state,
        ws_url: format!("ws://127.0.0.1:1/{name}?after={{last_seq}}"),
        spec: serde_json::json!({"sink": {"log": {}}}).to_string(),
        generation,
        resource: None,
        requests: Default::default(),
    }
}
