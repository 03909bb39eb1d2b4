//! How many connections the store client keeps once a burst is over. Alone
//! in its own test binary: it counts this process's connections to the
//! store, and another test running beside it would add its own.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use tether::lease::{DesiredState, LeaseStore, StreamKey, UpsertOutcome};
use tether::metrics::StoreMetrics;
use tether_testkit::bed::loopback;
use tether_testkit::proxy::FaultProxy;
use tether_testkit::store::{desired_stream, endpoint, store_config, unique_table};

/// Requests sent at once: reads do not wait for the stream-write turns, so
/// each opens a connection, as a burst of a worker's calls does.
const BURST: usize = 96;
/// What the client may keep idle: as many as the stream-write turns.
const KEPT: usize = 32;

/// Established connections from this process to `port` on loopback: the
/// client's ends (remote port `port`) of sockets this process holds.
fn connections_to(port: u16) -> usize {
    let mine: BTreeSet<String> = std::fs::read_dir("/proc/self/fd")
        .expect("list /proc/self/fd")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|target| {
            let t = target.to_string_lossy().to_string();
            Some(t.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
        })
        .collect();
    ["/proc/self/net/tcp", "/proc/self/net/tcp6"]
        .iter()
        .filter_map(|path| std::fs::read_to_string(path).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .filter(|row| {
            let f: Vec<&str> = row.split_whitespace().collect();
            let remote_port = f
                .get(2)
                .and_then(|r| r.rsplit_once(':'))
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            // State 01 is ESTABLISHED; field 9 is the socket's inode.
            remote_port == Some(port)
                && f.get(3) == Some(&"01")
                && f.get(9).is_some_and(|inode| mine.contains(*inode))
        })
        .count()
}

#[tokio::test]
async fn after_a_burst_the_store_client_keeps_no_more_idle_connections_than_write_turns() {
    tether::install_crypto_provider();
    // The store's traffic goes through a proxy that counts the connections
    // it accepts.
    let store_addr = endpoint().0.trim_start_matches("http://").parse().unwrap();
    let proxy = FaultProxy::start(loopback(), store_addr).await.unwrap();
    let mut cfg = store_config(&unique_table("t"));
    cfg.endpoint = Some(proxy.endpoint());
    let store = LeaseStore::connect(cfg, Arc::new(StoreMetrics::new()))
        .await
        .unwrap();
    store.create_table().await.unwrap();
    let key = StreamKey::new("test", "burst");
    let desired = desired_stream("burst", DesiredState::Started, 1);
    assert_eq!(
        store.upsert_desired(&desired).await.unwrap(),
        UpsertOutcome::Applied
    );
    let before = proxy.accepted();
    let reads = (0..BURST).map(|_| store.get(&key));
    for read in futures::future::join_all(reads).await {
        assert!(read.unwrap().is_some());
    }
    // Otherwise this test would show nothing.
    let opened = proxy.accepted() - before;
    assert!(
        opened > KEPT as u64,
        "the burst opened only {opened} connections; it must open more than {KEPT}"
    );
    // Connections over the limit are closed as they come back to the pool;
    // give the closes a moment to reach the socket table.
    let port = proxy.addr.port();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut open = connections_to(port);
    while open > KEPT && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        open = connections_to(port);
    }
    assert!(
        open <= KEPT,
        "after {BURST} requests at once ({opened} connections opened) the store client still holds {open} (at most {KEPT} are kept idle)"
    );
}
