//! The lease store against a real DynamoDB-compatible server (dynoxide by
//! default, dynalite when `TETHER_TEST_DYNAMODB_ENDPOINT` is set): every
//! conditional write of the protocol, each race it must win or lose cleanly.

use aws_sdk_dynamodb::types::AttributeValue;
use serde_json::json;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;
use tether::lease::{
    AcquireFrom, AcquireOutcome, Checkpoint, DeleteOutcome, DesiredState, HOLDER_SHARDS,
    Incarnation, Lease, LeaseStore, OwnerWrite, Ownership, PackedShard, PodIdentity, ReleaseReason,
    RenewOutcome, Renewal, ResourceIdentity, SessionStatus, SlotEntry, SlotPage, StoreError,
    StreamKey, StreamRecord, TableChange, TombstoneOutcome, UpsertOutcome, UpsertRefusal,
    WorkerState,
};
use tether::metrics::StoreMetrics;
use tether_testkit::store::{
    desired_stream as desired, fresh_store, raw_client, store_config, unique_table,
};

async fn create(store: &LeaseStore, name: &str) -> StreamRecord {
    let d = desired(name, DesiredState::Started, 1);
    assert_eq!(
        store.upsert_desired(&d).await.unwrap(),
        UpsertOutcome::Applied
    );
    store.get(&d.key).await.unwrap().expect("item exists")
}

async fn worker(store: &LeaseStore, id: &str) -> Incarnation {
    let me = Incarnation::new(id);
    store.register(&me, None).await.unwrap();
    me
}

async fn acquire(store: &LeaseStore, observed: &StreamRecord, me: &Incarnation) -> Lease {
    match store
        .acquire(observed, &AcquireFrom::Free, me)
        .await
        .unwrap()
    {
        AcquireOutcome::Acquired { lease, .. } => lease,
        other => panic!("{me} expected to acquire {}, got {other:?}", observed.key),
    }
}

/// `loser`, acquiring from the observation `winner` acquired from, learns
/// that `winner` took it; `winner` retrying that acquire (as after a lost
/// answer) is recognised as the owner, with the lease it `won`.
async fn lost_to_and_retried(
    store: &LeaseStore,
    observed: &StreamRecord,
    loser: &Incarnation,
    winner: &Incarnation,
    won: &Lease,
) {
    match store
        .acquire(observed, &AcquireFrom::Free, loser)
        .await
        .unwrap()
    {
        AcquireOutcome::Taken { owner } => assert_eq!(owner.as_deref(), Some(winner.as_str())),
        other => panic!("{loser} must lose to {winner}, got {other:?}"),
    }
    match store
        .acquire(observed, &AcquireFrom::Free, winner)
        .await
        .unwrap()
    {
        AcquireOutcome::Acquired { lease, .. } => assert_eq!(&lease, won),
        other => panic!("a retried acquire that landed is ours, got {other:?}"),
    }
}

fn renewal(version: u64) -> Renewal<'static> {
    Renewal {
        version,
        at_ms: tether::lease::now_ms(),
        lease_ms: 8000,
        ..Renewal::default()
    }
}

/// What an owner write keeps while it waits for one of the store's
/// stream-write turns: a thousand sessions connecting at once all write
/// their status, and whatever the queued writes hold sets the worker's peak
/// memory, which the allocator then keeps as resident size. The request (an
/// SDK future of kilobytes) and the update's values are made only once the
/// turn is held; before that a write is its arguments and its place in the
/// queue.
#[tokio::test]
async fn an_owner_write_waiting_for_its_turn_holds_no_request() {
    const SMALL: usize = 1024;
    let store = fresh_store(None).await;
    let me = worker(&store, "w").await;
    let record = create(&store, "s").await;
    let lease = acquire(&store, &record, &me).await;
    let status = SessionStatus::default();
    let served = Default::default();
    let write = store.write_status(&lease, &status, 1, &served);
    let fold = store.fold_checkpoint(&lease, 5);
    let release = store.release(
        &lease,
        ReleaseReason::Stopped,
        Some(6),
        &status,
        DesiredState::Started,
        tether::lease::now_ms(),
    );
    let sizes = [
        ("write_status", std::mem::size_of_val(&write)),
        ("fold_checkpoint", std::mem::size_of_val(&fold)),
        ("release", std::mem::size_of_val(&release)),
    ];
    for (call, size) in sizes {
        assert!(
            size <= SMALL,
            "a queued {call} keeps {size} bytes (at most {SMALL}): it holds its request while it waits"
        );
    }
    // And they still do their work, in order.
    assert_eq!(write.await.unwrap(), OwnerWrite::Done(()));
    assert_eq!(fold.await.unwrap(), OwnerWrite::Done(()));
    assert_eq!(release.await.unwrap(), OwnerWrite::Done(()));
    let stored = store.get(&record.key).await.unwrap().expect("item exists");
    assert_eq!(stored.checkpoint, Some(6));
    assert_eq!(stored.ownership(), Ownership::Free);
}

#[tokio::test]
async fn exactly_one_of_eight_racing_workers_wins_each_round() {
    let store = fresh_store(None).await;
    let mut record = create(&store, "race").await;
    let mut workers = Vec::new();
    for i in 0..8 {
        workers.push(worker(&store, &format!("w{i}")).await);
    }
    for round in 0..30 {
        let mut tasks = Vec::new();
        for w in &workers {
            let (store, observed, w) = (store.clone(), record.clone(), w.clone());
            tasks.push(tokio::spawn(async move {
                store.acquire(&observed, &AcquireFrom::Free, &w).await
            }));
        }
        let mut winners = Vec::new();
        for task in tasks {
            match task.await.unwrap().unwrap() {
                AcquireOutcome::Acquired { lease, .. } => winners.push(lease),
                AcquireOutcome::Taken { .. } => {}
                other => panic!("round {round}: unexpected {other:?}"),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: winners {winners:?}");
        let stored = store.get(&record.key).await.unwrap().unwrap();
        assert_eq!(
            stored.ownership(),
            Ownership::Owned(winners[0].owner.clone())
        );
        assert_eq!(
            stored.lease_counter,
            record.lease_counter + 1,
            "one bump per round"
        );
        assert_eq!(stored.holder, Some(winners[0].owner.holder_of(&record.key)));
        let released = store
            .release(
                &winners[0],
                ReleaseReason::Rebalance,
                None,
                &SessionStatus::default(),
                DesiredState::Started,
                tether::lease::now_ms(),
            )
            .await
            .unwrap();
        assert_eq!(released, OwnerWrite::Done(()));
        record = store.get(&record.key).await.unwrap().unwrap();
    }
}

#[tokio::test]
async fn two_processes_started_with_one_worker_id_are_two_owners() {
    let store = fresh_store(None).await;
    let record = create(&store, "twins").await;
    // Same --worker-id, two processes: two incarnations.
    let a = worker(&store, "pod-0").await;
    let b = worker(&store, "pod-0").await;
    assert_ne!(a, b);
    let first = acquire(&store, &record, &a).await;
    // b, from the same observation, must not mistake a's write for its own;
    // a retrying the acquire whose answer it lost is recognised as the owner.
    lost_to_and_retried(&store, &record, &b, &a, &first).await;
    // The twin's owner writes all fail.
    let twin_lease = Lease {
        owner: b.clone(),
        ..first.clone()
    };
    let status = SessionStatus::default();
    assert_eq!(
        store
            .write_status(&twin_lease, &status, 1, &Default::default())
            .await
            .unwrap(),
        OwnerWrite::Lost
    );
    assert_eq!(
        store.fold_checkpoint(&twin_lease, 9).await.unwrap(),
        OwnerWrite::Lost
    );
    assert_eq!(
        store
            .release(
                &twin_lease,
                ReleaseReason::Shutdown,
                None,
                &status,
                DesiredState::Started,
                tether::lease::now_ms(),
            )
            .await
            .unwrap(),
        OwnerWrite::Lost
    );
    assert_eq!(
        store.get(&record.key).await.unwrap().unwrap().ownership(),
        Ownership::Owned(a)
    );
}

/// A worker that loses an acquire race learns who won from the refusal
/// itself (the item as the condition saw it), not from a read afterwards: at
/// a mass takeover, lost races are a third of the acquires, and each read was
/// a request and a read unit more. A store that does not send the item
/// (dynalite) is read instead, with the same outcome.
#[tokio::test]
async fn a_lost_acquire_learns_the_winner_from_the_refusal_without_a_read() {
    let store = fresh_store(None).await;
    let record = create(&store, "lost-race").await;
    let winner = worker(&store, "winner").await;
    let loser = worker(&store, "loser").await;
    let won = acquire(&store, &record, &winner).await;
    let (model, via) = metered(&store).await;
    // The winner retrying its landed acquire is still recognised from the
    // refusal: the item shows it with the token it wrote.
    lost_to_and_retried(&via, &record, &loser, &winner, &won).await;
    assert_judged_without_reads(&model, 2, 2);
}

/// The same store through a capacity model that counts its requests, with
/// nothing counted yet.
async fn metered(store: &LeaseStore) -> (tether_testkit::capacity::CapacityModel, LeaseStore) {
    let model = tether_testkit::capacity::CapacityModel::start(
        "127.0.0.1:0".parse().unwrap(),
        &tether_testkit::store::endpoint().0,
        false,
    )
    .await
    .unwrap();
    let mut cfg = store_config(store.table());
    cfg.endpoint = Some(model.endpoint());
    let via = LeaseStore::connect(cfg, Arc::new(StoreMetrics::new()))
        .await
        .unwrap();
    model.reset_usage();
    (model, via)
}

/// `writes` writes were sent and `refusals` of them refused; each refusal
/// that carried the item was judged from it, with no read, and only each
/// one that did not (a store that does not send it, such as dynalite) was
/// read back, once.
fn assert_judged_without_reads(
    model: &tether_testkit::capacity::CapacityModel,
    writes: u64,
    refusals: u64,
) {
    let report = model.report();
    let requests = &report.requests_by_target;
    assert_eq!(requests.get("UpdateItem"), Some(&writes), "{requests:?}");
    assert_eq!(report.refused_writes, refusals, "{requests:?}");
    if !tether_testkit::store::external() {
        assert_eq!(
            report.refused_writes_with_item, refusals,
            "dynoxide sends the item"
        );
    }
    let reads = requests.get("GetItem").copied().unwrap_or(0);
    assert_eq!(
        reads,
        refusals - report.refused_writes_with_item,
        "a refusal that carries the item needs no read: {requests:?}"
    );
}

/// An owner write that is refused (a checkpoint behind the stored one, a
/// release retried after it landed, a write by an owner whose stream was
/// released or taken) is judged from the item the refusal carries, as a
/// lost acquire is: each read back was a request and a read unit more, on
/// the paths a drain and a takeover take for many streams at once.
#[tokio::test]
async fn a_refused_owner_write_is_judged_from_the_refusal_without_a_read() {
    let store = fresh_store(None).await;
    let record = create(&store, "owner-writes").await;
    let me = worker(&store, "owner").await;
    let lease = acquire(&store, &record, &me).await;
    let (model, via) = metered(&store).await;
    let status = SessionStatus::default();
    let release = || {
        via.release(
            &lease,
            ReleaseReason::Shutdown,
            Some(9),
            &status,
            DesiredState::Started,
            tether::lease::now_ms(),
        )
    };
    assert_eq!(
        via.fold_checkpoint(&lease, 10).await.unwrap(),
        OwnerWrite::Done(())
    );
    // Behind the stored checkpoint: refused, and still done.
    assert_eq!(
        via.fold_checkpoint(&lease, 5).await.unwrap(),
        OwnerWrite::Done(())
    );
    // Carrying a checkpoint (9) behind the stored one: refused, then
    // sent again without it.
    assert_eq!(release().await.unwrap(), OwnerWrite::Done(()));
    // A retry of the release whose first attempt landed: refused, done.
    assert_eq!(release().await.unwrap(), OwnerWrite::Done(()));
    // A write after the release: refused, lost.
    assert_eq!(
        via.fold_checkpoint(&lease, 11).await.unwrap(),
        OwnerWrite::Lost
    );
    // Taken by another worker: the old lease's release is refused, lost.
    let released = store.get(&record.key).await.unwrap().unwrap();
    let other = worker(&store, "other").await;
    acquire(&store, &released, &other).await;
    assert_eq!(release().await.unwrap(), OwnerWrite::Lost);
    // Stopped by the control plane after its owner last looked: the release
    // believing it STARTED is refused, and sent again as the refusal shows it.
    let stopping = create(&store, "owner-stopped").await;
    let held = acquire(&store, &stopping, &me).await;
    let stopped = desired("owner-stopped", DesiredState::Stopped, 2);
    assert_eq!(
        store.upsert_desired(&stopped).await.unwrap(),
        UpsertOutcome::Applied
    );
    let released = via
        .release(
            &held,
            ReleaseReason::Stopped,
            None,
            &status,
            DesiredState::Started,
            tether::lease::now_ms(),
        )
        .await
        .unwrap();
    assert_eq!(released, OwnerWrite::Done(()));
    let after = store.get(&stopping.key).await.unwrap().unwrap();
    assert_eq!(
        (after.ownership(), after.desired_state, after.holder),
        (Ownership::Free, DesiredState::Stopped, None)
    );
    assert_judged_without_reads(&model, 9, 6);
    // What the refusals said is what the table says.
    let now = store.get(&record.key).await.unwrap().unwrap();
    assert_eq!(
        (now.checkpoint, now.ownership()),
        (Some(10), Ownership::Owned(other))
    );
}

#[tokio::test]
async fn a_registration_retried_after_its_first_attempt_landed_is_ours() {
    let store = fresh_store(None).await;
    let me = worker(&store, "pod-0").await;
    // The caller retries a registration that got no answer, later (a new
    // clock reading): the put had landed, and the item is this process's.
    tokio::time::sleep(Duration::from_millis(5)).await;
    store.register(&me, None).await.unwrap();
    let renewed = store.renew(&me, &renewal(0)).await.unwrap();
    assert!(
        matches!(renewed, RenewOutcome::Renewed { .. }),
        "{renewed:?}"
    );
}

#[tokio::test]
async fn an_acquire_without_an_answer_is_resolved_by_reading_it_back() {
    let store = fresh_store(None).await;
    let record = create(&store, "ambiguous").await;
    let me = worker(&store, "w").await;
    assert_eq!(
        store
            .resolve_acquire(&record.key, record.lease_counter, &me)
            .await
            .unwrap(),
        None
    );
    let lease = acquire(&store, &record, &me).await;
    let (resolved, _) = store
        .resolve_acquire(&record.key, record.lease_counter, &me)
        .await
        .unwrap()
        .expect("the write landed: it is ours");
    assert_eq!(resolved, lease);
    let other = worker(&store, "w").await;
    assert_eq!(
        store
            .resolve_acquire(&record.key, record.lease_counter, &other)
            .await
            .unwrap(),
        None
    );
}

#[tokio::test]
async fn a_release_is_final_keeps_the_checkpoint_and_frees_the_stream_at_once() {
    let store = fresh_store(None).await;
    let record = create(&store, "release").await;
    let me = worker(&store, "w1").await;
    let lease = acquire(&store, &record, &me).await;
    assert_eq!(
        store.fold_checkpoint(&lease, 10).await.unwrap(),
        OwnerWrite::Done(())
    );
    let status = SessionStatus::default();
    let release = || {
        store.release(
            &lease,
            ReleaseReason::Shutdown,
            Some(42),
            &status,
            DesiredState::Started,
            tether::lease::now_ms(),
        )
    };
    assert_eq!(release().await.unwrap(), OwnerWrite::Done(()));
    // A retry of the release (its answer lost) is still a success.
    assert_eq!(release().await.unwrap(), OwnerWrite::Done(()));
    let released = store.get(&record.key).await.unwrap().unwrap();
    assert_eq!(released.ownership(), Ownership::Free);
    assert_eq!(released.checkpoint, Some(42));
    assert_eq!(released.release_reason, Some(ReleaseReason::Shutdown));
    assert_eq!(released.holder, Some(record.key.unowned_holder()));
    // Nothing the old owner still has in flight can touch it again.
    assert_eq!(
        store
            .write_status(&lease, &status, 1, &Default::default())
            .await
            .unwrap(),
        OwnerWrite::Lost
    );
    assert_eq!(
        store.fold_checkpoint(&lease, 99).await.unwrap(),
        OwnerWrite::Lost
    );
    assert_eq!(store.get(&record.key).await.unwrap().unwrap(), released);
    // Found in its unowned partition and acquirable at once.
    let found = store.unowned(record.key.shard()).await.unwrap();
    assert!(found.records.iter().any(|r| r.key == record.key));
    let next = acquire(&store, &released, &worker(&store, "w2").await).await;
    assert_eq!(next.counter, lease.counter + 1);
    assert_eq!(
        store.get(&record.key).await.unwrap().unwrap().checkpoint,
        Some(42)
    );
}

#[tokio::test]
async fn checkpoints_never_move_last_seq_backwards_and_zero_is_a_checkpoint() {
    let store = fresh_store(None).await;
    let record = create(&store, "mono").await;
    assert_eq!(record.checkpoint, None, "no checkpoint yet");
    let lease = acquire(&store, &record, &worker(&store, "w1").await).await;
    assert_eq!(
        store.fold_checkpoint(&lease, 0).await.unwrap(),
        OwnerWrite::Done(())
    );
    assert_eq!(
        store.get(&record.key).await.unwrap().unwrap().checkpoint,
        Some(0)
    );
    store.fold_checkpoint(&lease, 10).await.unwrap();
    assert_eq!(
        store.fold_checkpoint(&lease, 5).await.unwrap(),
        OwnerWrite::Done(())
    );
    assert_eq!(
        store.get(&record.key).await.unwrap().unwrap().checkpoint,
        Some(10)
    );
    store
        .release(
            &lease,
            ReleaseReason::Shutdown,
            Some(7),
            &SessionStatus::default(),
            DesiredState::Started,
            tether::lease::now_ms(),
        )
        .await
        .unwrap();
    let released = store.get(&record.key).await.unwrap().unwrap();
    assert_eq!(
        (released.checkpoint, released.ownership()),
        (Some(10), Ownership::Free)
    );
}

#[tokio::test]
async fn a_dead_incarnation_can_never_renew_and_its_streams_move_with_its_checkpoints() {
    let store = fresh_store(None).await;
    let dead = worker(&store, "crashed").await;
    let taker = worker(&store, "taker").await;
    let record = create(&store, "moving").await;
    let lease = acquire(&store, &record, &dead).await;
    let key = record.key.clone();
    let packed = Checkpoint {
        seq: 77,
        token: lease.counter,
    };
    let shard0 = PackedShard {
        named: vec![(key.clone(), packed)],
        slotted: vec![],
    };
    let renew = Renewal {
        shard0: &shard0,
        checkpoint_shards: 1,
        ..renewal(1)
    };
    assert!(matches!(
        store.renew(&dead, &renew).await.unwrap(),
        RenewOutcome::Renewed { .. }
    ));
    // A peer that watched version 0 cannot declare it dead: it renewed since.
    assert_eq!(
        store.declare_dead(&dead, 0).await.unwrap(),
        Some(WorkerState::Live)
    );
    assert_eq!(
        store.declare_dead(&dead, 1).await.unwrap(),
        Some(WorkerState::Dead)
    );
    // Once dead, no renewal lands, whatever it carries.
    assert_eq!(
        store.renew(&dead, &renewal(2)).await.unwrap(),
        RenewOutcome::Dead
    );
    let fleet = store.fleet().await.unwrap();
    assert!(
        fleet
            .workers
            .iter()
            .any(|w| w.incarnation == dead && w.state == WorkerState::Dead)
    );
    let held = store.held_by(&dead).await.unwrap();
    assert_eq!(held.records.len(), 1);
    let checkpoints = store.checkpoints_of(&dead).await.unwrap();
    assert_eq!(checkpoints.get(&key), Some(&packed));
    let from = AcquireFrom::Dead {
        owner: dead.clone(),
        checkpoint: Some(77),
    };
    let moved = match store
        .acquire(&held.records[0], &from, &taker)
        .await
        .unwrap()
    {
        AcquireOutcome::Acquired { lease, record } => {
            assert_eq!(
                record.checkpoint,
                Some(77),
                "the packed checkpoint moves into the item"
            );
            lease
        }
        other => panic!("expected the takeover to succeed, got {other:?}"),
    };
    assert_eq!(moved.counter, lease.counter + 1);
    assert!(store.held_by(&dead).await.unwrap().records.is_empty());
    // The dead owner's writes change nothing.
    assert_eq!(
        store
            .write_status(&lease, &SessionStatus::default(), 1, &Default::default())
            .await
            .unwrap(),
        OwnerWrite::Lost
    );
    // A takeover from a stale view (the stream moved on) loses cleanly.
    assert!(matches!(
        store
            .acquire(&held.records[0], &from, &worker(&store, "late").await)
            .await
            .unwrap(),
        AcquireOutcome::Taken { .. }
    ));
}

#[tokio::test]
async fn a_restarted_container_proves_its_predecessor_dead_only_with_a_higher_restart_count() {
    let store = fresh_store(None).await;
    let pod = |restarts| PodIdentity {
        uid: "pod-uid-1".into(),
        container: "tether".into(),
        restart_count: restarts,
    };
    let before = Incarnation::new("tether-0");
    store.register(&before, Some(&pod(2))).await.unwrap();
    let stranger = Incarnation::new("tether-1");
    store
        .register(
            &stranger,
            Some(&PodIdentity {
                uid: "other".into(),
                ..pod(0)
            }),
        )
        .await
        .unwrap();
    let fleet = store.fleet().await.unwrap();
    // Same count (a stale pod status): no proof.
    let same = Incarnation::new("tether-0");
    store.register(&same, Some(&pod(2))).await.unwrap();
    assert!(
        store
            .declare_restarted_dead(&same, &pod(2), &fleet.workers)
            .await
            .unwrap()
            .is_empty()
    );
    let after = Incarnation::new("tether-0");
    store.register(&after, Some(&pod(3))).await.unwrap();
    let fleet = store.fleet().await.unwrap();
    let mut marked = store
        .declare_restarted_dead(&after, &pod(3), &fleet.workers)
        .await
        .unwrap();
    marked.sort();
    let mut expected = vec![before.clone(), same.clone()];
    expected.sort();
    assert_eq!(
        marked, expected,
        "both earlier runs of this container are gone"
    );
    assert_eq!(
        store.worker(&stranger).await.unwrap().unwrap().state,
        WorkerState::Live
    );
}

#[tokio::test]
async fn fencing_tokens_keep_growing_across_delete_and_recreate() {
    let store = fresh_store(None).await;
    let record = create(&store, "reborn").await;
    let me = worker(&store, "w").await;
    let first = acquire(&store, &record, &me).await;
    // Deleting under a live owner is refused until it released.
    assert_eq!(
        store.tombstone(&record.key, true, false).await.unwrap(),
        TombstoneOutcome::StillOwned {
            owner: me.to_string()
        }
    );
    store
        .release(
            &first,
            ReleaseReason::Stopped,
            Some(5),
            &SessionStatus::default(),
            DesiredState::Started,
            tether::lease::now_ms(),
        )
        .await
        .unwrap();
    assert_eq!(
        store
            .delete_stream(&record.key, Duration::from_secs(5))
            .await
            .unwrap(),
        DeleteOutcome::Deleted
    );
    let tombstone = store.get(&record.key).await.unwrap().unwrap();
    assert!(tombstone.is_tombstone());
    assert_eq!(tombstone.lease_counter, first.counter, "the token survives");
    assert!(
        store.list().await.unwrap().records.is_empty(),
        "deleted streams are not listed"
    );
    assert_eq!(
        store
            .delete_stream(&record.key, Duration::from_secs(1))
            .await
            .unwrap(),
        DeleteOutcome::NotFound
    );
    // Re-created under the same name: a new stream (no checkpoint), higher tokens.
    let again = create(&store, "reborn").await;
    assert_eq!(again.checkpoint, None);
    let second = acquire(&store, &again, &me).await;
    assert!(
        second.counter > first.counter,
        "{} > {}",
        second.counter,
        first.counter
    );
}

#[tokio::test]
async fn an_item_of_another_installation_is_refused_never_taken_over() {
    let store = fresh_store(None).await;
    let from = |installation: &str, uid: &str, created_ms| {
        let mut d = desired("shared", DesiredState::Started, 1);
        d.resource = Some(ResourceIdentity {
            uid: uid.into(),
            created_ms,
            installation: installation.into(),
        });
        d
    };
    assert_eq!(
        store
            .upsert_desired(&from("prod", "uid-p", 1_000))
            .await
            .unwrap(),
        UpsertOutcome::Applied
    );
    // Another installation, even with a newer resource of the same name.
    assert_eq!(
        store
            .upsert_desired(&from("staging", "uid-s", 9_000))
            .await
            .unwrap(),
        UpsertOutcome::Refused {
            reason: UpsertRefusal::OtherInstallation {
                stored: "prod".into()
            }
        }
    );
    let record = store
        .get(&StreamKey::new("test", "shared"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(record.installation.as_deref(), Some("prod"));
    assert_eq!(record.uid.as_deref(), Some("uid-p"));
    // The writing installation itself is not refused.
    assert_eq!(
        store
            .upsert_desired(&from("prod", "uid-p", 1_000))
            .await
            .unwrap(),
        UpsertOutcome::Unchanged
    );
}

#[tokio::test]
async fn the_mirror_is_guarded_by_resource_identity_and_generation() {
    let store = fresh_store(None).await;
    let resource = |uid: &str, created_ms| {
        Some(ResourceIdentity {
            uid: uid.into(),
            created_ms,
            installation: String::new(),
        })
    };
    let mut d = desired("mirror", DesiredState::Started, 2);
    d.resource = resource("uid-a", 1_000);
    assert_eq!(
        store.upsert_desired(&d).await.unwrap(),
        UpsertOutcome::Applied
    );
    assert_eq!(
        store.upsert_desired(&d).await.unwrap(),
        UpsertOutcome::Unchanged,
        "nothing new: no write"
    );
    let mut older = d.clone();
    older.generation = 1;
    assert_eq!(
        store.upsert_desired(&older).await.unwrap(),
        UpsertOutcome::Refused {
            reason: UpsertRefusal::StaleGeneration { stored: 2 }
        }
    );
    // Deleted by one replica; a lagging replica must not bring it back.
    assert_eq!(
        store.tombstone(&d.key, false, false).await.unwrap(),
        TombstoneOutcome::Deleted
    );
    assert_eq!(
        store.upsert_desired(&d).await.unwrap(),
        UpsertOutcome::Refused {
            reason: UpsertRefusal::Deleted
        }
    );
    // A new resource of the same name (created later) replaces the item ...
    let mut newer = desired("mirror", DesiredState::Started, 1);
    newer.resource = resource("uid-b", 2_000);
    assert_eq!(
        store.upsert_desired(&newer).await.unwrap(),
        UpsertOutcome::Applied
    );
    // ... and the old one can never overwrite it again.
    assert_eq!(
        store.upsert_desired(&d).await.unwrap(),
        UpsertOutcome::Refused {
            reason: UpsertRefusal::NewerResource {
                stored_uid: "uid-b".into()
            }
        }
    );
    let item = store.get(&d.key).await.unwrap().unwrap();
    assert_eq!((item.uid.as_deref(), item.generation), (Some("uid-b"), 1));
}

#[tokio::test]
async fn control_plane_changes_reach_the_owner_and_never_touch_lease_fields() {
    let store = fresh_store(None).await;
    let record = create(&store, "changed").await;
    let me = worker(&store, "w").await;
    let lease = acquire(&store, &record, &me).await;
    let before = store.get(&record.key).await.unwrap().unwrap();
    let mut stopped = desired("changed", DesiredState::Stopped, 2);
    stopped.ws_url = "ws://127.0.0.1:1/new".into();
    assert_eq!(
        store.upsert_desired(&stopped).await.unwrap(),
        UpsertOutcome::Applied
    );
    let after = store.get(&record.key).await.unwrap().unwrap();
    assert_eq!(
        (
            &after.lease_owner,
            after.lease_expires_at_ms,
            after.lease_counter,
            after.checkpoint,
            &after.holder
        ),
        (
            &before.lease_owner,
            before.lease_expires_at_ms,
            before.lease_counter,
            before.checkpoint,
            &before.holder
        ),
        "the mirror never touches lease fields"
    );
    let RenewOutcome::Renewed { changed } = store.renew(&me, &renewal(1)).await.unwrap() else {
        panic!("renewal failed")
    };
    assert_eq!(
        changed.iter().map(|c| &c.key).collect::<Vec<_>>(),
        vec![&record.key]
    );
    // A second change while the first is being handled is not lost with it.
    let mut again = desired("changed", DesiredState::Started, 3);
    again.ws_url = "ws://127.0.0.1:1/again".into();
    store.upsert_desired(&again).await.unwrap();
    let handled = Renewal {
        handled: changed.iter().map(|c| c.raw.clone()).collect(),
        ..renewal(2)
    };
    let RenewOutcome::Renewed { changed: next } = store.renew(&me, &handled).await.unwrap() else {
        panic!("renewal failed")
    };
    assert_eq!(next.len(), 1, "{next:?}");
    // The owner releases the STOPPED... (it was re-started: still ours).
    assert_eq!(
        store
            .write_status(&lease, &SessionStatus::default(), 3, &Default::default())
            .await
            .unwrap(),
        OwnerWrite::Done(())
    );
}

#[tokio::test]
async fn unowned_partitions_hold_exactly_the_free_started_streams_across_pages() {
    // Page size 3 forces several pages per partition.
    let store = fresh_store(Some(3)).await;
    let me = worker(&store, "holder").await;
    let mut expected = BTreeSet::new();
    let mut held = BTreeSet::new();
    for i in 0..40 {
        let record = create(&store, &format!("s{i:02}")).await;
        if i % 3 == 0 {
            acquire(&store, &record, &me).await;
            held.insert(record.key.clone());
        } else {
            expected.insert(record.key.clone());
        }
    }
    for i in 0..6 {
        store
            .upsert_desired(&desired(&format!("stopped{i}"), DesiredState::Stopped, 1))
            .await
            .unwrap();
    }
    let mut got = BTreeSet::new();
    for shard in 0..HOLDER_SHARDS {
        for r in store.unowned(shard).await.unwrap().records {
            assert_eq!(r.key.shard(), shard);
            assert!(got.insert(r.key), "no duplicates across pages");
        }
    }
    assert_eq!(got, expected);
    let mine: BTreeSet<_> = store
        .held_by(&me)
        .await
        .unwrap()
        .records
        .into_iter()
        .map(|r| r.key)
        .collect();
    assert_eq!(mine, held);
    assert_eq!(
        store.list().await.unwrap().records.len(),
        46,
        "the scan pages through everything"
    );
}

/// A bounded read of a holder partition (what a pass reads of an orphan
/// partition): at most the limit, from any start (a key that need not
/// exist), around the end to the start, every item at most once, and
/// `complete` exactly when it saw them all.
#[tokio::test]
async fn a_bounded_read_starts_anywhere_wraps_around_and_says_when_it_saw_everything() {
    // Page size 4 forces several pages per read.
    let store = fresh_store(Some(4)).await;
    let mut keys = Vec::new();
    for i in 0..120 {
        keys.push(create(&store, &format!("b{i:03}")).await.key);
    }
    let shard = keys[0].shard();
    let holder = tether::lease::unowned_holder(shard);
    let all: BTreeSet<String> = keys
        .iter()
        .filter(|k| k.shard() == shard)
        .map(StreamKey::pk)
        .collect();
    let n = all.len();
    assert!(n > 8, "only {n} streams in shard {shard}");
    let pks = |s: &tether::lease::Sample| -> Vec<String> {
        s.found.records.iter().map(|r| r.key.pk()).collect()
    };

    let part = store.sample_holder("test", &holder, 5, None).await.unwrap();
    assert_eq!((pks(&part).len(), part.complete), (5, false));
    assert_eq!(
        part.first.as_deref(),
        pks(&part).first().map(String::as_str)
    );
    let whole = store
        .sample_holder("test", &holder, n + 3, None)
        .await
        .unwrap();
    assert!(whole.complete);
    assert_eq!(pks(&whole).into_iter().collect::<BTreeSet<_>>(), all);
    let last = store.last_in_holder(&holder).await.unwrap().unwrap();
    assert_eq!(
        Some(&last),
        pks(&whole).last(),
        "the last item in the store's order"
    );

    // From the middle (an existing key and one that does not exist), past
    // the end, and from the last item: each item once, all of them.
    let middle = pks(&whole)[n / 2].clone();
    let missing = format!("{middle}~");
    for after in [middle.as_str(), missing.as_str(), "STREAM#~", last.as_str()] {
        let s = store
            .sample_holder("test", &holder, n + 3, Some(after))
            .await
            .unwrap();
        let got = pks(&s);
        let unique: BTreeSet<String> = got.iter().cloned().collect();
        assert_eq!(unique.len(), got.len(), "an item read twice from {after}");
        assert_eq!(unique, all, "from {after}");
        assert!(s.complete, "from {after}");
        let s = store
            .sample_holder("test", &holder, 5, Some(after))
            .await
            .unwrap();
        assert_eq!((pks(&s).len(), s.complete), (5, false), "from {after}");
    }
    // From the middle the first items are the ones after it.
    let s = store
        .sample_holder("test", &holder, 3, Some(&middle))
        .await
        .unwrap();
    assert_eq!(pks(&s), pks(&whole)[n / 2 + 1..n / 2 + 4].to_vec());

    let empty = store
        .sample_holder("test", "UNOWNED#nobody", 5, Some("STREAM#x"))
        .await
        .unwrap();
    assert!(empty.complete && empty.found.records.is_empty());
    assert_eq!(store.last_in_holder("UNOWNED#nobody").await.unwrap(), None);
}

#[tokio::test]
async fn a_malformed_item_is_reported_apart_and_the_others_are_still_found() {
    let store = fresh_store(None).await;
    let good = create(&store, "good").await;
    let shard = good.key.shard();
    let client = raw_client().await;
    // A hand-edited name, and a token that is not a number.
    let bad = [("CONN#a/b/c", "1"), ("CONN#test/bad-token", "seven")];
    for (pk, counter) in bad {
        let mut item = std::collections::HashMap::new();
        item.insert("Pk".to_string(), AttributeValue::S(pk.into()));
        item.insert(
            "desired_state".to_string(),
            AttributeValue::S("STARTED".into()),
        );
        item.insert(
            "holder".to_string(),
            AttributeValue::S(format!("UNOWNED#{shard}")),
        );
        item.insert(
            "lease_expires_at_ms".to_string(),
            AttributeValue::N("0".into()),
        );
        let counter = if counter.parse::<u64>().is_ok() {
            AttributeValue::N(counter.into())
        } else {
            AttributeValue::S(counter.into())
        };
        item.insert("lease_counter".to_string(), counter);
        client
            .put_item()
            .table_name(store.table())
            .set_item(Some(item))
            .send()
            .await
            .unwrap();
    }
    let found = store.unowned(shard).await.unwrap();
    assert!(
        found.records.iter().any(|r| r.key == good.key),
        "the good stream is still found"
    );
    let mut pks: Vec<_> = found.malformed.iter().map(|m| m.pk.as_str()).collect();
    pks.sort();
    assert_eq!(pks, vec!["CONN#a/b/c", "CONN#test/bad-token"]);
}

#[tokio::test]
async fn bad_input_gives_a_typed_error_and_writes_nothing() {
    tether::install_crypto_provider();
    let err = LeaseStore::connect(store_config("no"), Arc::new(StoreMetrics::new()))
        .await
        .err()
        .expect("invalid name is refused");
    assert!(matches!(err, StoreError::InvalidTableName(_)), "{err}");

    let mut cfg = store_config("tether-unreachable");
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

    let missing = LeaseStore::connect(
        store_config(&unique_table("missing")),
        Arc::new(StoreMetrics::new()),
    )
    .await
    .unwrap();
    let err = missing.check_table().await.unwrap_err();
    assert!(matches!(err, StoreError::TableNotFound { .. }), "{err}");

    let store = fresh_store(None).await;
    let mut big = desired("big", DesiredState::Started, 1);
    big.spec = json!({ "padding": "x".repeat(410 * 1024) }).to_string();
    let err = store.upsert_desired(&big).await.unwrap_err();
    assert!(matches!(err, StoreError::ItemTooLarge { .. }), "{err}");
    assert_eq!(store.get(&big.key).await.unwrap(), None, "nothing written");
}

#[tokio::test]
async fn table_create_is_idempotent() {
    let store = fresh_store(None).await;
    assert_eq!(store.create_table().await.unwrap(), TableChange::Unchanged);
    let layout = store.check_table().await.unwrap();
    assert!(!layout.legacy_index);
}

/// A store for the same table reached through a DynamoDB fault proxy.
async fn through_proxy(
    store: &LeaseStore,
) -> (LeaseStore, tether_testkit::dynamo_proxy::DynamoFaultProxy) {
    let proxy = tether_testkit::dynamo_proxy::DynamoFaultProxy::start(
        "127.0.0.1:0".parse().unwrap(),
        &tether_testkit::store::endpoint().0,
    )
    .await
    .unwrap();
    let mut cfg = store_config(store.table());
    cfg.endpoint = Some(proxy.endpoint());
    let via = LeaseStore::connect(cfg, Arc::new(StoreMetrics::new()))
        .await
        .unwrap();
    (via, proxy)
}

/// A stream `name` owned by a worker, and a second store for the same table
/// whose next write's answer is lost (the write lands).
async fn owned_and_losing_the_next_answer(
    name: &str,
) -> (
    LeaseStore,
    StreamRecord,
    Incarnation,
    LeaseStore,
    tether_testkit::dynamo_proxy::DynamoFaultProxy,
) {
    let store = fresh_store(None).await;
    let record = create(&store, name).await;
    let me = worker(&store, "w").await;
    acquire(&store, &record, &me).await;
    let (via, proxy) = through_proxy(&store).await;
    proxy.set(tether_testkit::dynamo_proxy::DynamoFault::LoseNextWriteAnswer);
    (store, record, me, via, proxy)
}

/// The owner's inbox after one renewal: the streams it was told about.
async fn told(store: &LeaseStore, me: &Incarnation) -> Vec<StreamKey> {
    let RenewOutcome::Renewed { changed } = store.renew(me, &renewal(1)).await.unwrap() else {
        panic!("renewal failed")
    };
    changed.into_iter().map(|c| c.key).collect()
}

/// A control-plane write whose answer is lost lands all the same; its retry
/// then fails its condition and reads the item back as wanted. That is the
/// write landing, not "unchanged": the owner is told, or it would serve a
/// STOPPED stream until something else made it look.
#[tokio::test]
async fn a_stop_whose_answer_was_lost_is_applied_and_reaches_the_owner() {
    let (store, record, me, via, _proxy) = owned_and_losing_the_next_answer("lost-stop").await;
    assert_eq!(
        via.upsert_desired(&desired("lost-stop", DesiredState::Stopped, 2))
            .await
            .unwrap(),
        UpsertOutcome::Applied
    );
    assert_eq!(told(&store, &me).await, vec![record.key.clone()]);
}

/// The same for a deletion: a tombstone found after a lost answer is ours.
#[tokio::test]
async fn a_deletion_whose_answer_was_lost_is_reported_and_reaches_the_owner() {
    let (store, record, me, via, _proxy) = owned_and_losing_the_next_answer("lost-delete").await;
    assert_eq!(
        via.tombstone(&record.key, true, true).await.unwrap(),
        TombstoneOutcome::Deleted
    );
    assert_eq!(told(&store, &me).await, vec![record.key.clone()]);
}

/// A stream is its resource (property 2c): a new resource of an old name, or
/// a deleted stream created again, is a new identity. It gets a new creation
/// time, a token above every earlier one (so the old owner's lease writes all
/// fail, and a dead owner's packed checkpoint, kept under the old token, can
/// never be carried over), and no checkpoint.
#[tokio::test]
async fn a_new_identity_of_an_old_name_gets_a_higher_token_and_nothing_of_the_old_progress() {
    let store = fresh_store(None).await;
    let mut first = desired("identity", DesiredState::Started, 1);
    first.resource = Some(ResourceIdentity {
        uid: "uid-a".into(),
        created_ms: 1_000,
        installation: String::new(),
    });
    store.upsert_desired(&first).await.unwrap();
    let record = store.get(&first.key).await.unwrap().unwrap();
    let me = worker(&store, "w").await;
    let lease = acquire(&store, &record, &me).await;
    assert_eq!(
        store.fold_checkpoint(&lease, 50).await.unwrap(),
        OwnerWrite::Done(())
    );
    let before = store.get(&first.key).await.unwrap().unwrap();
    assert_eq!(before.checkpoint, Some(50));
    let mut second = desired("identity", DesiredState::Started, 1);
    second.ws_url = "ws://127.0.0.1:1/another-feed".into();
    second.resource = Some(ResourceIdentity {
        uid: "uid-b".into(),
        created_ms: 2_000,
        installation: String::new(),
    });
    // Even through a lost answer: the retry must not bump the token twice.
    let (via, proxy) = through_proxy(&store).await;
    proxy.set(tether_testkit::dynamo_proxy::DynamoFault::LoseNextWriteAnswer);
    assert_eq!(
        via.upsert_desired(&second).await.unwrap(),
        UpsertOutcome::Applied
    );
    let after = store.get(&first.key).await.unwrap().unwrap();
    assert_eq!(after.uid.as_deref(), Some("uid-b"));
    assert_eq!(after.checkpoint, None, "no checkpoint of the old resource");
    assert_eq!(after.lease_counter, before.lease_counter + 1);
    assert!(after.created_at_ms > before.created_at_ms);
    assert_eq!(
        store.fold_checkpoint(&lease, 60).await.unwrap(),
        OwnerWrite::Lost,
        "the old lease writes nothing more"
    );
    assert_eq!(told(&store, &me).await, vec![first.key.clone()]);
    // Standalone: deleted and applied again, likewise.
    let tombstoned = store.tombstone(&first.key, false, true).await.unwrap();
    assert_eq!(tombstoned, TombstoneOutcome::Deleted);
    let deleted = store.get(&first.key).await.unwrap().unwrap();
    let mut third = desired("identity", DesiredState::Started, 1);
    third.resource = second.resource.clone().map(|mut r| {
        r.uid = "uid-c".into();
        r.created_ms = 3_000;
        r
    });
    store.upsert_desired(&third).await.unwrap();
    let revived = store.get(&first.key).await.unwrap().unwrap();
    assert_eq!(revived.lease_counter, deleted.lease_counter + 1);
    assert_eq!(revived.checkpoint, None);
}

/// A worker's heartbeat version only grows: an earlier renewal that lands
/// late (an attempt whose answer was given up on) cannot move it back, which
/// a peer watching for a version that stood still would misread.
#[tokio::test]
async fn a_late_earlier_renewal_never_moves_the_heartbeat_version_back() {
    let store = fresh_store(None).await;
    let me = worker(&store, "w").await;
    assert!(matches!(
        store.renew(&me, &renewal(2)).await.unwrap(),
        RenewOutcome::Renewed { .. }
    ));
    assert!(matches!(
        store.renew(&me, &renewal(1)).await.unwrap(),
        RenewOutcome::Renewed { .. }
    ));
    assert_eq!(
        store.worker(&me).await.unwrap().unwrap().heartbeat_version,
        2
    );
    // A renewal whose answer is lost is still a renewal, not a death.
    let (via, proxy) = through_proxy(&store).await;
    proxy.set(tether_testkit::dynamo_proxy::DynamoFault::LoseNextWriteAnswer);
    assert!(matches!(
        via.renew(&me, &renewal(3)).await.unwrap(),
        RenewOutcome::Renewed { .. }
    ));
    assert_eq!(
        store.worker(&me).await.unwrap().unwrap().heartbeat_version,
        3
    );
}

/// After a rolling upgrade, `finish-upgrade` drops version 1's index; a
/// STARTED stream still under a lapsed version-1 lease would then be found by
/// nothing. It is freed into an unowned partition (once its lease lapsed).
#[tokio::test]
async fn finish_upgrade_frees_streams_under_a_lapsed_version_1_lease() {
    let store = fresh_store(None).await;
    let key = StreamKey::new("test", "v1-leased");
    raw_client()
        .await
        .put_item()
        .table_name(store.table())
        .item("Pk", AttributeValue::S(key.pk()))
        .item("desired_state", AttributeValue::S("STARTED".into()))
        .item("ws_url", AttributeValue::S("ws://127.0.0.1:1/v1".into()))
        .item("lease_owner", AttributeValue::S("old-worker".into()))
        .item(
            "lease_expires_at_ms",
            AttributeValue::N((tether::lease::now_ms() - 60_000).to_string()),
        )
        .item("lease_counter", AttributeValue::N("4".into()))
        .send()
        .await
        .unwrap();
    assert_eq!(store.finish_upgrade().await.unwrap(), 1);
    let found = store.unowned(key.shard()).await.unwrap();
    let freed = found
        .records
        .iter()
        .find(|r| r.key == key)
        .expect("in an unowned partition");
    assert_eq!(freed.ownership(), Ownership::Free);
    assert_eq!(freed.lease_counter, 4, "the token carries on");
}

/// One packed checkpoint by name.
fn named(key: &StreamKey, seq: u64, token: u64) -> Vec<(StreamKey, Checkpoint)> {
    vec![(key.clone(), Checkpoint { seq, token })]
}

/// A slot page of `(slot, stream, token, base)` entries.
fn slot_page(entries: &[(u64, &StreamKey, u64, u64)]) -> SlotPage {
    let mut page = SlotPage::new();
    for &(slot, key, token, base) in entries {
        page.insert(
            slot,
            SlotEntry {
                key: key.clone(),
                token,
                base,
            },
        );
    }
    page
}

/// Renews `who` with `shard0`, two checkpoint shards and slot page 0.
async fn renew_packed(store: &LeaseStore, who: &Incarnation, version: u64, shard0: &PackedShard) {
    let renewal = Renewal {
        shard0,
        checkpoint_shards: 2,
        slot_pages: &[0],
        ..renewal(version)
    };
    assert!(matches!(
        store.renew(who, &renewal).await.unwrap(),
        RenewOutcome::Renewed { .. }
    ));
}

#[tokio::test]
async fn slotted_checkpoints_are_read_back_through_the_slot_pages_and_only_through_them() {
    let store = fresh_store(None).await;
    let dead = worker(&store, "slotted").await;
    let [a, b, c] = [
        create(&store, "slot-a").await,
        create(&store, "slot-b").await,
        create(&store, "slot-c").await,
    ];
    let [la, lb, lc] = [
        acquire(&store, &a, &dead).await,
        acquire(&store, &b, &dead).await,
        acquire(&store, &c, &dead).await,
    ];
    let page = slot_page(&[(0, &a.key, la.counter, 1_000), (1, &b.key, lb.counter, 5)]);
    assert!(store.write_slot_page(&dead, 0, &page, 1).await.unwrap());
    // Slot 7 is on no page: its entry is nothing.
    let shard0 = PackedShard {
        named: named(&c.key, 9, lc.counter),
        slotted: vec![(0, 234), (1, -2), (7, 50)],
    };
    let shard1 = PackedShard {
        named: vec![],
        slotted: vec![(1, 10)],
    };
    store
        .write_checkpoint_shard(&dead, 1, &shard1)
        .await
        .unwrap();
    renew_packed(&store, &dead, 1, &shard0).await;
    // The names the item-by-item reads had, and the batch's.
    let requests = |m: &StoreMetrics| {
        [
            "get_worker",
            "batch_get_checkpoints",
            "get_checkpoints",
            "get_slot_page",
            "get_unprocessed",
        ]
        .map(|op| m.succeeded(op))
    };
    let before = requests(store.metrics());
    let all = store.checkpoints_of(&dead).await.unwrap();
    let after = requests(store.metrics());
    assert_eq!(
        [0, 1, 2, 3, 4].map(|i| after[i] - before[i]),
        [1, 1, 0, 0, 0],
        "the worker item, then its shard and its page in one batch"
    );
    let seq = |key: &StreamKey| all.get(key).map(|c| (c.seq, c.token));
    assert_eq!(seq(&a.key), Some((1_234, la.counter)));
    assert_eq!(
        seq(&b.key),
        Some((15, lb.counter)),
        "the higher of two shards"
    );
    assert_eq!(seq(&c.key), Some((9, lc.counter)));
    assert_eq!(all.len(), 3);
    // A renewal with nothing packed leaves no entries behind.
    store
        .renew(
            &dead,
            &Renewal {
                checkpoint_shards: 1,
                ..renewal(2)
            },
        )
        .await
        .unwrap();
    assert!(store.checkpoints_of(&dead).await.unwrap().is_empty());
    // Without the page, slotted entries are nothing: the takeover replays.
    renew_packed(&store, &dead, 3, &shard0).await;
    store.delete_slot_page(&dead, 0, 1).await.unwrap();
    let left = store.checkpoints_of(&dead).await.unwrap();
    assert_eq!(left.keys().collect::<Vec<_>>(), vec![&c.key]);
    // Forgetting the incarnation deletes its pages and shards with its item.
    assert!(store.write_slot_page(&dead, 0, &page, 2).await.unwrap());
    assert_eq!(
        store.declare_dead(&dead, 3).await.unwrap(),
        Some(WorkerState::Dead)
    );
    let record = store.worker(&dead).await.unwrap();
    store.forget_worker(&dead, record.as_ref()).await.unwrap();
    let raw = raw_client().await;
    for pk in [dead.pk(), dead.slot_page_pk(0), dead.checkpoint_pk(1)] {
        let item = raw
            .get_item()
            .table_name(store.table())
            .key("Pk", AttributeValue::S(pk.clone()))
            .consistent_read(true)
            .send()
            .await
            .unwrap();
        assert!(item.item().is_none(), "{pk} is left behind");
    }
}

#[tokio::test]
async fn a_dead_owner_s_checkpoints_are_read_whole_when_a_batch_leaves_keys_unprocessed() {
    use tether_testkit::dynamo_proxy::DynamoFault;
    let store = fresh_store(None).await;
    let dead = worker(&store, "unprocessed").await;
    let [a, b] = [
        create(&store, "unprocessed-a").await,
        create(&store, "unprocessed-b").await,
    ];
    let [la, lb] = [
        acquire(&store, &a, &dead).await,
        acquire(&store, &b, &dead).await,
    ];
    let page = slot_page(&[(0, &a.key, la.counter, 100)]);
    assert!(store.write_slot_page(&dead, 0, &page, 1).await.unwrap());
    let shard1 = PackedShard {
        named: named(&b.key, 7, lb.counter),
        slotted: vec![],
    };
    store
        .write_checkpoint_shard(&dead, 1, &shard1)
        .await
        .unwrap();
    let shard0 = PackedShard {
        named: vec![],
        slotted: vec![(0, 5)],
    };
    // Two keys besides the worker item: shard 1 and slot page 0.
    renew_packed(&store, &dead, 1, &shard0).await;
    let direct = store.checkpoints_of(&dead).await.unwrap();
    let seq = |key: &StreamKey| direct.get(key).map(|c| (c.seq, c.token));
    assert_eq!(seq(&a.key), Some((105, la.counter)));
    assert_eq!(seq(&b.key), Some((7, lb.counter)));
    let (via, proxy) = through_proxy(&store).await;
    // One key a request: the rest is asked again until it is read.
    proxy.set(DynamoFault::ProcessBatchKeys(1));
    let batches = || via.metrics().succeeded("batch_get_checkpoints");
    assert_eq!(via.checkpoints_of(&dead).await.unwrap(), direct);
    assert_eq!(batches(), 2, "the unprocessed key asked for again");
    // Never processed by the batch: read one by one, nothing missing (a
    // takeover would otherwise resume from an older checkpoint and replay).
    proxy.set(DynamoFault::ProcessBatchKeys(0));
    assert_eq!(via.checkpoints_of(&dead).await.unwrap(), direct);
    assert_eq!(via.metrics().succeeded("get_unprocessed"), 2);
}

#[tokio::test]
async fn a_renewal_carrying_a_hundred_busy_streams_by_slot_costs_one_write_unit() {
    let store = fresh_store(None).await;
    // A worker as Kubernetes runs it: a pod's name and identity.
    let me = Incarnation::new("tether-worker-7d9f8c6b5-x2x4z");
    let pod = PodIdentity {
        uid: "0b4f3a52-5d0e-4c5b-9f1e-2a6c7d8e9f01".into(),
        container: "worker".into(),
        restart_count: 3,
    };
    store.register(&me, Some(&pod)).await.unwrap();
    let streams: Vec<StreamKey> = (0..100)
        .map(|i| StreamKey::new("transcription", format!("meeting-audio-{i:03}")))
        .collect();
    let by_name = PackedShard {
        named: streams
            .iter()
            .enumerate()
            .map(|(i, k)| {
                (
                    k.clone(),
                    Checkpoint {
                        seq: 1_700_000 + i as u64,
                        token: 41,
                    },
                )
            })
            .collect(),
        slotted: vec![],
    };
    let by_slot = PackedShard {
        named: vec![],
        slotted: (0..100).map(|i| (i, 3_600 + i as i64)).collect(),
    };
    let units = |store: &LeaseStore| store.metrics().write_units("renew");
    let mut version = 0;
    let mut cost = |shard0: PackedShard| {
        version += 1;
        let store = store.clone();
        let me = me.clone();
        async move {
            let before = units(&store);
            let renewal = Renewal {
                shard0: &shard0,
                checkpoint_shards: 1,
                slot_pages: &[0],
                held: 100,
                ..renewal(version)
            };
            store.renew(&me, &renewal).await.unwrap();
            units(&store) - before
        }
    };
    let named = cost(by_name).await;
    // The item shrinks with this write; DynamoDB bills the larger image.
    let _ = cost(by_slot.clone()).await;
    let slotted = cost(by_slot).await;
    assert_eq!(slotted, 1.0, "by slot (by name: {named})");
    assert!(named >= 3.0, "by name: {named}");
}

#[tokio::test]
async fn a_late_earlier_slot_page_write_or_delete_never_undoes_a_later_write() {
    let store = fresh_store(None).await;
    let me = worker(&store, "pages").await;
    let key = StreamKey::new("test", "paged");
    let page = |base| {
        SlotPage::from([(
            0,
            SlotEntry {
                key: key.clone(),
                token: 1,
                base,
            },
        )])
    };
    let shard0 = PackedShard {
        named: vec![],
        slotted: vec![(0, 1)],
    };
    renew_packed(&store, &me, 1, &shard0).await;
    let found = |store: LeaseStore, me: Incarnation, key: StreamKey| async move {
        store
            .checkpoints_of(&me)
            .await
            .unwrap()
            .get(&key)
            .map(|c| c.seq)
    };
    assert!(store.write_slot_page(&me, 0, &page(10), 2).await.unwrap());
    // The same write again (a retry whose first attempt landed) is fine.
    assert!(store.write_slot_page(&me, 0, &page(10), 2).await.unwrap());
    // An earlier write whose attempt lands late is refused ...
    assert!(!store.write_slot_page(&me, 0, &page(5), 1).await.unwrap());
    // ... and an earlier write's delete removes nothing.
    store.delete_slot_page(&me, 0, 1).await.unwrap();
    assert_eq!(
        found(store.clone(), me.clone(), key.clone()).await,
        Some(11)
    );
    // The delete of the write that is there removes it.
    store.delete_slot_page(&me, 0, 2).await.unwrap();
    assert_eq!(found(store.clone(), me.clone(), key.clone()).await, None);
}

/// A peer tells whether a released stream is still in its releaser's
/// published load by comparing two of the releaser's own times: the release
/// must carry the stamp its holder took when the stream left that load, and
/// a renewal the time taken before the load was counted, not times of their
/// own writes.
#[tokio::test]
async fn a_release_and_a_renewal_carry_the_times_their_worker_stamped() {
    let store = fresh_store(None).await;
    let me = worker(&store, "w").await;
    let record = create(&store, "s").await;
    let lease = acquire(&store, &record, &me).await;
    let renewed = Renewal {
        at_ms: 1_000,
        held: 1,
        ..renewal(1)
    };
    store.renew(&me, &renewed).await.unwrap();
    let published = store.watch(std::slice::from_ref(&me), false).await.unwrap();
    assert_eq!(published.changes, None, "the counter was not asked for");
    let mine = &published.workers[0];
    assert_eq!((mine.heartbeat_at_ms, mine.held), (1_000, 1));
    let released = store
        .release(
            &lease,
            ReleaseReason::Rebalance,
            Some(3),
            &SessionStatus::default(),
            DesiredState::Started,
            4_242,
        )
        .await
        .unwrap();
    assert_eq!(released, OwnerWrite::Done(()));
    let stored = store.get(&record.key).await.unwrap().expect("item exists");
    assert_eq!(stored.released_at_ms, Some(4_242));
    assert_eq!(stored.ownership(), Ownership::Free);
}

/// Whatever runs after a bump (the worker's pokes) runs once the bump landed,
/// so a strongly consistent read there sees it, and before the caller of
/// `announce_change` returns, so a process about to exit has run it.
#[tokio::test]
async fn the_step_after_a_bump_sees_it_landed_and_runs_before_the_announcer_returns() {
    let store = fresh_store(None).await;
    let before = store.changes_now().await.unwrap();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (reader, log) = (store.clone(), seen.clone());
    assert!(store.after_announcing(Arc::new(move || {
        let (reader, log) = (reader.clone(), log.clone());
        Box::pin(async move {
            let now = reader.changes_now().await.unwrap();
            log.lock().unwrap().push(now);
        })
    })));
    assert!(
        !store.after_announcing(Arc::new(|| Box::pin(async {}))),
        "a second step replaced the first"
    );
    store.announce_change().await;
    assert_eq!(*seen.lock().unwrap(), vec![before + 1]);
    store.announce_change().await;
    assert_eq!(*seen.lock().unwrap(), vec![before + 1, before + 2]);
}

/// A worker registered with an address carries it for its peers; one
/// registered without carries none.
#[tokio::test]
async fn a_worker_item_carries_where_peers_poke_it() {
    let store = fresh_store(None).await;
    let pokable = Incarnation::new("a");
    let addr: std::net::SocketAddr = "[fd00::7]:9090".parse().unwrap();
    store.register_at(&pokable, None, Some(addr)).await.unwrap();
    let plain = worker(&store, "b").await;
    let read = store.watch(&[pokable, plain], false).await.unwrap();
    let mut addrs: Vec<_> = read
        .workers
        .iter()
        .map(|w| (w.incarnation.worker_id().to_string(), w.poke_addr))
        .collect();
    addrs.sort();
    assert_eq!(addrs, vec![("a".into(), Some(addr)), ("b".into(), None)]);
    assert!(
        read.workers.iter().all(|w| w.pokes_peers),
        "every worker of this release pokes its peers, addressed or not"
    );
}
