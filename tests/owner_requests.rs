//! What a resource asks of its owner through annotations, written into the
//! item as the controller mirrors them (`tether.dev/reconnect`,
//! `tether.dev/move`): real worker processes, the real store, the feed. Each
//! request is acted on once per value, by the owner holding the stream when
//! the value changed, and never at the cost of an overlap or a gap.

use std::time::Duration;
use tether::lease::{OwnerRequests, UpsertOutcome};
use tether_testkit::bed::{Bed, BedOptions, eventually};

const EXE: &str = env!("CARGO_BIN_EXE_tether");

/// Writes `name`'s standard spec again (same generation) carrying `requests`.
async fn ask(bed: &Bed, name: &str, requests: OwnerRequests) -> UpsertOutcome {
    let mut desired = bed.spec(name).to_desired(bed.key(name), 1, None);
    desired.requests = requests;
    bed.store.upsert_desired(&desired).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_request_reopens_the_session_once_and_a_move_request_moves_the_stream_once() {
    let bed = Bed::start(EXE, BedOptions::default()).await.unwrap();
    let names = bed.apply("r", 2).await.unwrap();
    let _workers: Vec<_> = ["a", "b"]
        .iter()
        .map(|id| bed.fleet.spawn(id).unwrap())
        .collect();
    eventually(
        Duration::from_secs(20),
        "both streams are connected once",
        || bed.all_connected_once(&names),
    )
    .await;
    // Let the fair share settle (one each) before asking anything.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let target = &names[0];
    let owner = bed.owners().await[target].clone();
    let sessions = bed.upstream.sessions_of(target).len();

    // Reconnect: one new session, same owner.
    let reconnect = OwnerRequests {
        reconnect: Some("2026-12-04T16:30:00Z".into()),
        move_away: None,
    };
    assert_eq!(
        ask(&bed, target, reconnect.clone()).await,
        UpsertOutcome::Applied
    );
    eventually(
        Duration::from_secs(10),
        "the owner opened a new session",
        || async {
            bed.upstream.sessions_of(target).len() == sessions + 1
                && bed.all_connected_once(&names).await
        },
    )
    .await;
    assert_eq!(
        bed.owners().await[target],
        owner,
        "a reconnect moved the stream"
    );
    // The same value again changes nothing, and is not acted on again.
    assert_eq!(
        ask(&bed, target, reconnect.clone()).await,
        UpsertOutcome::Unchanged
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        bed.upstream.sessions_of(target).len(),
        sessions + 1,
        "a reconnect request was acted on more than once"
    );

    // Move: another worker serves it, once.
    let moved = OwnerRequests {
        move_away: Some("1".into()),
        ..reconnect
    };
    assert_eq!(ask(&bed, target, moved).await, UpsertOutcome::Applied);
    eventually(
        Duration::from_secs(10),
        "another worker serves the stream",
        || async {
            bed.owners().await.get(target).is_some_and(|o| *o != owner)
                && bed.all_connected_once(&names).await
        },
    )
    .await;
    let new_owner = bed.owners().await[target].clone();
    let after_move = bed.upstream.sessions_of(target).len();
    // The move leaves the fleet uneven (2 and 0): fair share hands a stream
    // back, and it must not be the one that was asked to move; nor may the
    // new owner act on the request again.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        bed.owners().await[target],
        new_owner,
        "the moved stream went back (acted on twice, or undone by rebalancing)"
    );
    assert_eq!(bed.upstream.sessions_of(target).len(), after_move);
    bed.assert_safe(&names, 10);
}
