//! Workers that give an address (`--advertise-ip`) are told at once when a
//! peer moves the change counter (`POST /poke`), and read the counter less
//! often. A drain in a quiet fleet reaches its peers by the poke; a poke that
//! cannot be delivered costs only the slower read's period.

use nix::sys::signal::Signal;
use std::time::Duration;
use tether_testkit::bed::{Bed, BedOptions};
use tether_testkit::processes::{WorkerProcess, metric_sum, until_quiet};

const EXE: &str = env!("CARGO_BIN_EXE_tether");
/// Longest wait for a fleet to go quiet.
const QUIET: Duration = Duration::from_secs(30);

async fn pokes_received(w: &WorkerProcess) -> f64 {
    let text = w.metrics().await.unwrap_or_default();
    metric_sum(&text, "tether_pokes_received_total", "")
}

/// A bed with two workers advertising `ip`, five streams each, quiet.
struct Pair {
    bed: Bed,
    names: Vec<String>,
    a: WorkerProcess,
    b: WorkerProcess,
}

async fn quiet_pair(ip: &str) -> Pair {
    let bed = Bed::start(
        EXE,
        BedOptions {
            rate: 10,
            ..BedOptions::default()
        },
    )
    .await
    .unwrap();
    let names = bed.apply("p", 10).await.unwrap();
    let args = ["--advertise-ip", ip];
    let a = bed
        .fleet
        .spawn_with("a", bed.fleet.endpoint(), &args)
        .unwrap();
    let b = bed
        .fleet
        .spawn_with("b", bed.fleet.endpoint(), &args)
        .unwrap();
    Bed::wait(Duration::from_secs(30), "5 streams each", || async {
        let load = bed.loads().await;
        load.len() == 2 && load.values().all(|n| *n == 5) && bed.connected_once(&names)
    })
    .await
    .unwrap();
    until_quiet(&[&a, &b], QUIET).await.unwrap();
    Pair { bed, names, a, b }
}

impl Pair {
    /// SIGTERM to `a`; waits (at most `within`) until `b` holds all ten.
    async fn drain_a(&mut self, within: Duration) {
        self.a.signal(Signal::SIGTERM).unwrap();
        let _ = self.a.wait(Duration::from_secs(15)).await;
        let bed = &self.bed;
        Bed::wait(within, "b holds all 10", || async {
            bed.owned_by("b").await == 10
        })
        .await
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_pokes_its_quiet_peer_which_reads_the_counter_and_takes_the_streams() {
    let mut pair = quiet_pair("127.0.0.1").await;
    let pokes_before = pokes_received(&pair.b).await;
    let reads_before = pair.b.requests("read_changes_poked").await;
    pair.drain_a(Duration::from_secs(4)).await;
    assert!(
        pokes_received(&pair.b).await > pokes_before,
        "the draining worker did not poke its peer"
    );
    assert!(
        pair.b.requests("read_changes_poked").await > reads_before,
        "the poked worker did not read the counter for it"
    );
    pair.bed.assert_safe(&pair.names, 0);
}

/// Pokes sent to an address nobody answers at (TEST-NET-1): the drain's
/// streams still move, by the counter read once a heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poke_that_cannot_be_delivered_only_waits_for_the_slower_counter_read() {
    let mut pair = quiet_pair("192.0.2.1").await;
    pair.drain_a(Duration::from_secs(8)).await;
    assert_eq!(
        pokes_received(&pair.b).await,
        0.0,
        "a poke arrived after all"
    );
    pair.bed.assert_safe(&pair.names, 0);
}

/// Pokes carry nothing and anyone who reaches the port can send one: a flood
/// of them costs at most one counter read a second, and nothing moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_pokes_costs_at_most_one_counter_read_a_second() {
    let pair = quiet_pair("127.0.0.1").await;
    let b = &pair.b;
    let reads_before = b.requests("read_changes_poked").await;
    let url = format!("http://{}/poke", b.metrics_addr);
    let client = reqwest::Client::new();
    let started = tokio::time::Instant::now();
    let mut sent = 0;
    while started.elapsed() < Duration::from_secs(2) {
        let pokes = (0..20).map(|_| client.post(&url).send());
        for answer in futures::future::join_all(pokes).await {
            assert_eq!(answer.unwrap().status().as_u16(), 204);
            sent += 1;
        }
    }
    let elapsed = started.elapsed();
    // Let the last poke's read happen (a second apart, and a pass), then
    // count.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let reads = b.requests("read_changes_poked").await - reads_before;
    let seconds = (elapsed + Duration::from_millis(1_500)).as_secs_f64();
    assert!(reads >= 2.0, "{sent} pokes over 2 s and {reads} reads");
    assert!(
        reads <= seconds.ceil() + 1.0,
        "{sent} pokes cost {reads} reads in {seconds:.1} s: more than one a second"
    );
    assert_eq!(pair.bed.owned_by("a").await, 5);
    assert_eq!(pair.bed.owned_by("b").await, 5);
    pair.bed.assert_safe(&pair.names, 0);
}
