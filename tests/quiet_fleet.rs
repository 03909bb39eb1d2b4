//! A quiet fleet reads the change counter instead of the fleet: at steady
//! state workers stop querying the fleet and the unowned partitions, and every
//! kind of change still reaches them at once through the counter (a new
//! stream, a newcomer, a crash, a shutdown), well before the fallback full
//! pass every 30 s would.

use nix::sys::signal::Signal;
use std::time::Duration;
use tether_testkit::bed::{Bed, BedOptions};
use tether_testkit::processes::until_quiet;

const EXE: &str = env!("CARGO_BIN_EXE_tether");
/// Longest wait for a fleet to go quiet.
const QUIET: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_fleet_reads_the_change_counter_and_still_acts_on_every_change() {
    let bed = Bed::start(
        EXE,
        BedOptions {
            rate: 10,
            ..BedOptions::default()
        },
    )
    .await
    .unwrap();
    let mut names = bed.apply("q", 10).await.unwrap();
    let a = bed.fleet.spawn("a").unwrap();
    let mut b = bed.fleet.spawn("b").unwrap();
    Bed::wait(Duration::from_secs(30), "5 streams each", || async {
        let load = bed.loads().await;
        load.len() == 2 && load.values().all(|n| *n == 5) && bed.connected_once(&names)
    })
    .await
    .unwrap();

    // Steady state: over six seconds (eight heartbeats) neither worker
    // queries the fleet or the unowned partitions; both still watch; and
    // each audits its 8 partitions at most once (every 16 heartbeats while
    // the counter stands still; every 4, twice in the window, until 0.4).
    until_quiet(&[&a, &b], QUIET).await.unwrap();
    let ops = [
        "query_fleet",
        "query_unowned",
        "batch_get_workers",
        "query_held",
    ];
    let mut before = Vec::new();
    for w in [&a, &b] {
        for op in ops {
            before.push(w.requests(op).await);
        }
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    let mut i = 0;
    for (w, name) in [(&a, "a"), (&b, "b")] {
        let mut made = Vec::new();
        for op in ops {
            made.push(w.requests(op).await - before[i]);
            i += 1;
        }
        assert_eq!(
            (made[0], made[1]),
            (0.0, 0.0),
            "worker {name} queried the fleet / unowned partitions while nothing changed"
        );
        assert!(made[2] >= 5.0, "worker {name} stopped watching: {made:?}");
        assert!(
            made[3] <= 8.0,
            "worker {name} audited its partitions more than once while nothing changed: {made:?}"
        );
    }

    // A stream created while the fleet is quiet is taken at once.
    bed.apply_one_served_within(
        "late",
        &mut names,
        Duration::from_secs(5),
        "the new stream connected",
    )
    .await
    .unwrap();

    // A newcomer joining a quiet fleet gets its share.
    until_quiet(&[&a, &b], QUIET).await.unwrap();
    let mut c = bed.fleet.spawn("c").unwrap();
    Bed::wait(
        Duration::from_secs(10),
        "three workers hold 3 or 4 each",
        || async {
            let load = bed.loads().await;
            load.len() == 3 && load.values().all(|n| (3..=4).contains(n))
        },
    )
    .await
    .unwrap();

    // A crash in a quiet fleet: its streams move within about a lease (3 s).
    until_quiet(&[&a, &b, &c], QUIET).await.unwrap();
    b.signal(Signal::SIGKILL).unwrap();
    let _ = b.wait(Duration::from_secs(5)).await;
    Bed::wait(
        Duration::from_secs(8),
        "b's streams moved to a and c",
        || async {
            let load = bed.loads().await;
            load.len() == 2 && load.values().sum::<usize>() == 11
        },
    )
    .await
    .unwrap();

    // A shutdown in a quiet fleet: its streams are handed over at once.
    until_quiet(&[&a, &c], QUIET).await.unwrap();
    c.signal(Signal::SIGTERM).unwrap();
    let _ = c.wait(Duration::from_secs(15)).await;
    Bed::wait(Duration::from_secs(4), "a holds all 11", || async {
        bed.owned_by("a").await == 11
    })
    .await
    .unwrap();
    bed.assert_safe(&names, 0);
}

/// Each worker is watched closely by its two ring predecessors. A worker and
/// one of its watchers crashing together (two pods of one node) are both
/// found about a lease after their last renewals: the other watcher sees
/// the one, the watcher's own watchers the other. With one watcher each, the
/// second was found a lease after its new watcher first read its last
/// version: two leases (6.3–6.7 s here), which this bound refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_and_its_watcher_crashing_together_are_both_found() {
    let bed = Bed::start(
        EXE,
        BedOptions {
            rate: 5,
            ..BedOptions::default()
        },
    )
    .await
    .unwrap();
    let names = bed.apply("pair", 12).await.unwrap();
    let mut workers: Vec<_> = ["a", "b", "c", "d"]
        .into_iter()
        .map(|id| bed.fleet.spawn(id).unwrap())
        .collect();
    Bed::wait(Duration::from_secs(30), "3 streams each", || async {
        let load = bed.loads().await;
        load.len() == 4 && load.values().all(|n| *n == 3) && bed.connected_once(&names)
    })
    .await
    .unwrap();
    until_quiet(&workers.iter().collect::<Vec<_>>(), QUIET)
        .await
        .unwrap();
    // The ring is the LIVE incarnations in order; the first watches the
    // second.
    let mut ring: Vec<_> = bed
        .store
        .fleet()
        .await
        .unwrap()
        .workers
        .into_iter()
        .filter(|w| w.state == tether::lease::WorkerState::Live)
        .map(|w| w.incarnation)
        .collect();
    ring.sort();
    let (watcher, watched) = (
        ring[0].worker_id().to_string(),
        ring[1].worker_id().to_string(),
    );
    let killed = tokio::time::Instant::now();
    for w in workers
        .iter()
        .filter(|w| w.id == watcher || w.id == watched)
    {
        w.signal(Signal::SIGKILL).unwrap();
    }
    for w in workers
        .iter_mut()
        .filter(|w| w.id == watcher || w.id == watched)
    {
        let _ = w.wait(Duration::from_secs(5)).await;
    }
    // Lease 3 s, heartbeat 750 ms: a lease after the last renewals, and a
    // pass, an acquire and a connect (3.2–3.3 s on an idle machine).
    Bed::wait(
        Duration::from_millis(5_500),
        &format!("{watcher}'s and {watched}'s streams moved to the other two"),
        || async {
            let load = bed.loads().await;
            load.len() == 2 && load.values().sum::<usize>() == 12
        },
    )
    .await
    .unwrap();
    eprintln!(
        "both found and their streams moved {:?} after the kill",
        killed.elapsed()
    );
    bed.assert_safe(&names, 0);
}
