//! The lease store against a real DynamoDB-compatible server (dynoxide by default,
//! dynalite when `TETHER_TEST_DYNAMODB_ENDPOINT` is set).

mod support;

use serde_json::json;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use tether::lease::{
    AcquireOutcome, DesiredState, DesiredStream, Lease, LeaseStore, OwnerWrite, StoreError,
    StreamKey, StreamRecord, UpsertOutcome, now_ms,
};
use tether::metrics::StoreMetrics;

const LONG: Duration = Duration::from_secs(60);

fn desired(name: &str, state: DesiredState, generation: i64) -> DesiredStream {
    DesiredStream {
        key: StreamKey::new("test", name),
        desired_state: state,
        ws_url: format!("ws://127.0.0.1:1/{name}?after={{last_seq}}"),
        spec: json!({"sink": {"log": {}}}),
        generation,
    }
}

async fn create(store: &LeaseStore, name: &str) -> StreamRecord {
    let d = desired(name, DesiredState::Started, 1);
    assert_eq!(
        store.upsert_desired(&d).await.unwrap(),
        UpsertOutcome::Applied
    );
    store.get(&d.key).await.unwrap().expect("item exists")
}

async fn acquire(store: &LeaseStore, observed: &StreamRecord, owner: &str, d: Duration) -> Lease {
    match store.acquire(observed, owner, d).await.unwrap() {
        AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!(
            "{owner} expected to acquire {}, got {other:?}",
            observed.key
        ),
    }
}

#[tokio::test]
async fn exactly_one_of_eight_racing_workers_wins_each_round() {
    let store = fresh_store().await;
    let mut record = create(&store, "race").await;
    for round in 0..50 {
        let mut tasks = Vec::new();
        for i in 0..8 {
            let store = store.clone();
            let observed = record.clone();
            tasks.push(tokio::spawn(async move {
                store.acquire(&observed, &format!("w{i}"), LONG).await
            }));
        }
        let mut winners = Vec::new();
        for task in tasks {
            match task.await.unwrap().unwrap() {
                AcquireOutcome::Acquired { lease, .. } => winners.push(lease),
                AcquireOutcome::Held { .. } => {}
                other => panic!("round {round}: unexpected {other:?}"),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: winners {winners:?}");
        let winner = &winners[0];
        let stored = store.get(&record.key).await.unwrap().unwrap();
        assert_eq!(stored.lease_owner.as_deref(), Some(winner.owner.as_str()));
        assert_eq!(
            stored.lease_counter,
            record.lease_counter + 1,
            "one bump per round"
        );
        assert!(!store.release(winner, None, None).await.unwrap().is_lost());
        record = store.get(&record.key).await.unwrap().unwrap();
    }
}

#[tokio::test]
async fn after_a_takeover_the_old_owner_loses_every_write_and_changes_nothing() {
    let store = fresh_store().await;
    let record = create(&store, "takeover").await;
    let old = acquire(&store, &record, "old", Duration::from_millis(50)).await;
    assert!(!store.checkpoint(&old, 5).await.unwrap().is_lost());
    tokio::time::sleep(Duration::from_millis(120)).await;

    let orphans = store.orphans(now_ms()).await.unwrap();
    let observed = orphans
        .iter()
        .find(|r| r.key == record.key)
        .expect("expired lease is an orphan");
    let new = acquire(&store, observed, "new", LONG).await;
    assert_eq!(new.counter, old.counter + 1);
    let before = store.get(&record.key).await.unwrap().unwrap();

    assert_eq!(
        store.renew(&old, LONG, Some(99), None).await.unwrap(),
        OwnerWrite::Lost
    );
    assert_eq!(store.checkpoint(&old, 100).await.unwrap(), OwnerWrite::Lost);
    assert_eq!(
        store.release(&old, Some(101), None).await.unwrap(),
        OwnerWrite::Lost
    );

    let after = store.get(&record.key).await.unwrap().unwrap();
    assert_eq!(before, after, "stale writes must change nothing");
    assert_eq!(after.lease_owner.as_deref(), Some("new"));
    assert_eq!(after.last_seq, Some(5));
}

#[tokio::test]
async fn release_frees_the_stream_at_once_and_last_seq_survives_release_and_takeover() {
    let store = fresh_store().await;
    let record = create(&store, "release").await;
    let first = acquire(&store, &record, "w1", LONG).await;
    assert_eq!(
        store.checkpoint(&first, 42).await.unwrap(),
        OwnerWrite::Done(42)
    );
    assert_eq!(
        store.release(&first, None, None).await.unwrap(),
        OwnerWrite::Done(())
    );

    let released = store.get(&record.key).await.unwrap().unwrap();
    assert_eq!(released.lease_expires_at_ms, 0);
    assert_eq!(released.last_seq, Some(42));
    assert!(
        store
            .orphans(now_ms())
            .await
            .unwrap()
            .iter()
            .any(|r| r.key == record.key)
    );

    // Acquirable immediately, not after the old lease would have lapsed.
    let second = acquire(&store, &released, "w2", Duration::from_millis(50)).await;
    let taken = store.get(&record.key).await.unwrap().unwrap();
    assert_eq!(taken.last_seq, Some(42));

    // Takeover after expiry keeps last_seq as well.
    tokio::time::sleep(Duration::from_millis(120)).await;
    let third = acquire(&store, &taken, "w3", LONG).await;
    assert_eq!(third.counter, second.counter + 1);
    assert_eq!(
        store.get(&record.key).await.unwrap().unwrap().last_seq,
        Some(42)
    );
}

#[tokio::test]
async fn checkpoints_never_move_last_seq_backwards() {
    let store = fresh_store().await;
    let record = create(&store, "mono").await;
    let lease = acquire(&store, &record, "w1", LONG).await;
    assert_eq!(
        store.checkpoint(&lease, 10).await.unwrap(),
        OwnerWrite::Done(10)
    );
    assert_eq!(
        store.checkpoint(&lease, 5).await.unwrap(),
        OwnerWrite::Done(10)
    );
    assert_eq!(
        store.checkpoint(&lease, 10).await.unwrap(),
        OwnerWrite::Done(10)
    );
    // A renewal carrying an older checkpoint still renews, without rewinding.
    let renewed = store.renew(&lease, LONG, Some(3), None).await.unwrap();
    assert!(matches!(renewed, OwnerWrite::Done(_)), "{renewed:?}");
    assert_eq!(
        store.get(&record.key).await.unwrap().unwrap().last_seq,
        Some(10)
    );
    // And a renewal carrying a newer one advances it in the same write.
    store.renew(&lease, LONG, Some(12), None).await.unwrap();
    assert_eq!(
        store.get(&record.key).await.unwrap().unwrap().last_seq,
        Some(12)
    );
    store.release(&lease, Some(7), None).await.unwrap();
    let released = store.get(&record.key).await.unwrap().unwrap();
    assert_eq!(
        (released.last_seq, released.lease_expires_at_ms),
        (Some(12), 0)
    );
}

#[tokio::test]
async fn orphans_are_exactly_the_expired_started_streams_across_pages() {
    // Page size 7 forces several pages for both the query and the scan.
    let store = fresh_store_paged(7).await;
    let mut expected = BTreeSet::new();
    for i in 0..30 {
        let record = create(&store, &format!("s{i:02}")).await;
        match i % 3 {
            // Held with a live lease: not an orphan.
            0 => {
                acquire(&store, &record, "holder", LONG).await;
            }
            // Held with a lease that lapses at once: an orphan.
            1 => {
                acquire(&store, &record, "crashed", Duration::from_millis(1)).await;
                expected.insert(record.key.clone());
            }
            // Never owned: an orphan.
            _ => {
                expected.insert(record.key.clone());
            }
        }
    }
    for i in 0..12 {
        let d = desired(&format!("stopped{i:02}"), DesiredState::Stopped, 1);
        store.upsert_desired(&d).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let orphans = store.orphans(now_ms()).await.unwrap();
    let got: BTreeSet<_> = orphans.iter().map(|r| r.key.clone()).collect();
    assert_eq!(got.len(), orphans.len(), "no duplicates across pages");
    assert_eq!(got, expected);
    assert!(
        orphans
            .iter()
            .all(|r| r.desired_state == DesiredState::Started)
    );
    assert_eq!(
        store.list().await.unwrap().len(),
        42,
        "scan pages through everything"
    );
}

#[tokio::test]
async fn control_plane_upsert_keeps_a_held_lease_and_ignores_older_generations() {
    let store = fresh_store().await;
    let record = create(&store, "mirror").await;
    let lease = acquire(&store, &record, "w1", LONG).await;
    store.checkpoint(&lease, 77).await.unwrap();
    let before = store.get(&record.key).await.unwrap().unwrap();

    let mut newer = desired("mirror", DesiredState::Stopped, 3);
    newer.ws_url = "ws://127.0.0.1:1/new".into();
    assert_eq!(
        store.upsert_desired(&newer).await.unwrap(),
        UpsertOutcome::Applied
    );
    let after = store.get(&record.key).await.unwrap().unwrap();
    assert_eq!(
        (
            &after.lease_owner,
            after.lease_expires_at_ms,
            after.lease_counter,
            after.last_seq
        ),
        (
            &before.lease_owner,
            before.lease_expires_at_ms,
            before.lease_counter,
            before.last_seq
        ),
        "the mirror never touches lease fields"
    );
    assert_eq!(
        (after.desired_state, after.generation),
        (DesiredState::Stopped, 3)
    );
    // The owner still renews (and learns the stream is STOPPED from the same write).
    match store.renew(&lease, LONG, None, None).await.unwrap() {
        OwnerWrite::Done((_, r)) => assert_eq!(r.desired_state, DesiredState::Stopped),
        OwnerWrite::Lost => panic!("renew after upsert must succeed"),
    }

    let older = desired("mirror", DesiredState::Started, 2);
    assert_eq!(
        store.upsert_desired(&older).await.unwrap(),
        UpsertOutcome::StaleGeneration { stored: 3 }
    );
    let kept = store.get(&record.key).await.unwrap().unwrap();
    assert_eq!(
        (kept.desired_state, kept.ws_url.as_str()),
        (DesiredState::Stopped, "ws://127.0.0.1:1/new")
    );
}

#[tokio::test]
async fn a_retried_acquire_that_had_succeeded_is_recognised_as_ours() {
    let store = fresh_store().await;
    let record = create(&store, "retry").await;
    let first = acquire(&store, &record, "w1", LONG).await;
    // Same observed item, as a retry after a lost response would send.
    let again = acquire(&store, &record, "w1", LONG).await;
    assert_eq!(again.counter, first.counter);
    // Somebody else with the same stale view is told who holds it.
    match store.acquire(&record, "w2", LONG).await.unwrap() {
        AcquireOutcome::Held { owner, .. } => assert_eq!(owner, "w1"),
        other => panic!("expected Held, got {other:?}"),
    }
}

#[tokio::test]
async fn stopped_or_deleted_streams_cannot_be_acquired_and_deletion_ends_the_lease() {
    let store = fresh_store().await;
    let record = create(&store, "gone").await;
    let lease = acquire(&store, &record, "w1", LONG).await;
    assert!(store.delete(&record.key).await.unwrap());
    assert_eq!(
        store.renew(&lease, LONG, None, None).await.unwrap(),
        OwnerWrite::Lost
    );
    assert_eq!(
        store.acquire(&record, "w2", LONG).await.unwrap(),
        AcquireOutcome::Gone
    );
    assert!(!store.delete(&record.key).await.unwrap());

    let stopped = desired("stopped", DesiredState::Stopped, 1);
    store.upsert_desired(&stopped).await.unwrap();
    let observed = store.get(&stopped.key).await.unwrap().unwrap();
    assert_eq!(
        store.acquire(&observed, "w1", LONG).await.unwrap(),
        AcquireOutcome::NotStarted
    );
}

#[tokio::test]
async fn bad_input_gives_a_typed_error_and_writes_nothing() {
    tether::install_crypto_provider();
    // Invalid table name: refused before any request.
    let err = LeaseStore::connect(support::store_config("no"), Arc::new(StoreMetrics::new()))
        .await
        .err()
        .expect("invalid name is refused");
    assert!(matches!(err, StoreError::InvalidTableName(_)), "{err}");

    // Unreachable endpoint: retried within the deadline, then a clear error.
    let mut cfg = support::store_config("tether-unreachable");
    cfg.endpoint = Some("http://127.0.0.1:1".into());
    cfg.retry.deadline = Duration::from_millis(300);
    let unreachable = LeaseStore::connect(cfg, Arc::new(StoreMetrics::new()))
        .await
        .unwrap();
    let err = unreachable
        .get(&StreamKey::new("a", "b"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Unreachable { .. }), "{err}");
    assert!(err.to_string().contains("127.0.0.1:1"), "{err}");

    // Missing table.
    let missing = LeaseStore::connect(
        support::store_config(&support::unique_table("missing")),
        Arc::new(StoreMetrics::new()),
    )
    .await
    .unwrap();
    let err = missing.check_table().await.unwrap_err();
    assert!(matches!(err, StoreError::TableNotFound { .. }), "{err}");

    // An item over 400 KB: rejected whole, whether new or existing.
    let store = fresh_store().await;
    let mut big = desired("big", DesiredState::Started, 1);
    big.spec = json!({ "padding": "x".repeat(410 * 1024) });
    let err = store.upsert_desired(&big).await.unwrap_err();
    assert!(matches!(err, StoreError::ItemTooLarge { .. }), "{err}");
    assert_eq!(store.get(&big.key).await.unwrap(), None, "nothing written");

    let existing = create(&store, "grows").await;
    let mut grown = desired("grows", DesiredState::Started, 2);
    grown.spec = big.spec.clone();
    let err = store.upsert_desired(&grown).await.unwrap_err();
    assert!(matches!(err, StoreError::ItemTooLarge { .. }), "{err}");
    assert_eq!(store.get(&existing.key).await.unwrap(), Some(existing));
}

#[tokio::test]
async fn table_create_is_idempotent() {
    let store = fresh_store().await;
    assert!(
        !store.create_table().await.unwrap(),
        "second create reports existing table"
    );
    store.check_table().await.unwrap();
}

async fn fresh_store() -> LeaseStore {
    support::fresh_store(None).await
}

async fn fresh_store_paged(page: i32) -> LeaseStore {
    support::fresh_store(Some(page)).await
}
