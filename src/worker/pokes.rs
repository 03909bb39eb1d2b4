//! Telling peers at once that the change counter moved.
//!
//! A quiet worker learns of a change (a drain's releases, a new stream, a
//! death) by reading the change counter (`lease::changes`). Read every
//! 500 ms, that read is the largest part of a quiet fleet's bill, and it is
//! what keeps a drain's handoff well under a second. So every worker
//! `POST`s `/poke` to its LIVE peers after each bump of its process that
//! landed (the controller's too, in `tether operator`; and it rings its own
//! doorbell, so its own controller's changes reach it), and a worker that
//! gives peers an address (`--advertise-ip`: its pod IP, with the metrics
//! port) reads the counter once a heartbeat instead, while every LIVE peer
//! pokes (`pokes_peers` on its item; a worker of an earlier release does
//! not, and then the counter is read every 500 ms as before) and its reads
//! find no move that no poke announced (see `acquirer::quiet`). A poke makes
//! the receiver's next quiet pass read the counter, strongly consistent, so
//! that read cannot miss the write the poke followed.
//!
//! A poke carries nothing and is never a condition: a lost one (a network
//! policy, a timeout, a `tether apply` from outside the fleet, which pokes
//! nobody) costs at most the slower read's period, a heartbeat, after which
//! the receiver reads every 500 ms for a while; a forged one costs at most
//! one read a second; rounds of pokes are coalesced like the bumps (one
//! under way, and one more after it for whatever landed meanwhile).
//! Addresses come from the worker items; one that no worker could be reached
//! at (a wildcard, multicast, link-local such as the metadata service) is
//! never poked.

use crate::lease::AfterBump;
use crate::metrics::WorkerMetrics;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Bound on one poke (connect and answer). Pokes go out together and
/// detached, so no caller waits for them; a process about to exit waits this
/// long at most ([`Pokes::settle`]).
const POKE_TIMEOUT: Duration = Duration::from_millis(250);

/// Peers to poke, and whether this worker was poked.
pub struct Pokes {
    /// The LIVE peers' addresses, as the last full read of their items found
    /// them.
    peers: Mutex<Vec<SocketAddr>>,
    /// A poke came and no quiet pass has read the counter since (set by
    /// the metrics listener's `/poke`, and by this process's own bumps).
    received: Arc<AtomicBool>,
    client: reqwest::Client,
    metrics: Arc<WorkerMetrics>,
    /// A round of pokes is under way, and whether another must follow it.
    rounds: Mutex<Rounds>,
    /// When a poke last failed (a peer that may read the counter only once
    /// a heartbeat; see `acquirer::pass::release_deferred`).
    last_failure: Mutex<Option<Instant>>,
    /// The rounds under way (detached from the bumps that started them).
    in_flight: tokio_util::task::TaskTracker,
}

#[derive(Default)]
struct Rounds {
    running: bool,
    again: bool,
}

impl Pokes {
    pub fn new(metrics: Arc<WorkerMetrics>) -> Self {
        crate::support::install_crypto_provider();
        let client = reqwest::Client::builder()
            // Pod addresses: never through a proxy, never redirected.
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(POKE_TIMEOUT)
            // One connection kept per peer: rounds follow one another.
            .pool_max_idle_per_host(1)
            .build()
            // Only fails when the TLS backend cannot start, and pokes use
            // none: fall back to the default client all the same.
            .unwrap_or_default();
        Self {
            peers: Mutex::default(),
            received: Arc::default(),
            client,
            metrics,
            rounds: Mutex::default(),
            last_failure: Mutex::default(),
            in_flight: tokio_util::task::TaskTracker::new(),
        }
    }

    /// The flag `/poke` sets (see `probes::serve`).
    pub fn doorbell(&self) -> Arc<AtomicBool> {
        self.received.clone()
    }

    /// Whether a poke came since the last call (and forgets it).
    pub(crate) fn take(&self) -> bool {
        self.received.swap(false, Ordering::AcqRel)
    }

    /// Whether a poke came that no read has followed yet.
    pub(crate) fn pending(&self) -> bool {
        self.received.load(Ordering::Acquire)
    }

    /// Sets the flag again: what it announced was not read.
    pub(crate) fn ring_again(&self) {
        self.received.store(true, Ordering::Release);
    }

    /// Whether a poke failed at or after `since`.
    pub(crate) fn failed_since(&self, since: Instant) -> bool {
        crate::support::lock(&self.last_failure).is_some_and(|at| at >= since)
    }

    /// Sets the peers to poke: those with an address a worker can listen at.
    pub(crate) fn set_peers(&self, peers: impl IntoIterator<Item = SocketAddr>) {
        *crate::support::lock(&self.peers) =
            peers.into_iter().filter(|a| listenable(a.ip())).collect();
    }

    /// Pokes every peer at once and waits for their answers (each bounded by
    /// [`POKE_TIMEOUT`]); failures are counted and otherwise ignored.
    async fn send(&self) {
        let peers = crate::support::lock(&self.peers).clone();
        let sent = peers
            .iter()
            .map(|addr| self.client.post(format!("http://{addr}/poke")).send());
        for (addr, answer) in peers.iter().zip(futures::future::join_all(sent).await) {
            let result = match answer {
                Ok(r) if r.status().is_success() => "ok",
                Ok(r) => {
                    tracing::debug!(peer = %addr, status = %r.status(), "poke refused");
                    "failed"
                }
                Err(e) => {
                    tracing::debug!(peer = %addr, error = %e, "poke not delivered; the peer reads the counter within a heartbeat");
                    "failed"
                }
            };
            if result == "failed" {
                *crate::support::lock(&self.last_failure) = Some(Instant::now());
            }
            self.metrics
                .pokes_sent
                .get_or_create(&[("result", result)])
                .inc();
        }
    }

    /// Starts a round unless one is under way, in which case one more
    /// follows it: a burst of bumps (a controller creating thousands of
    /// streams) costs a round per round trip to the peers, not one per bump.
    fn start_round(self: &Arc<Self>) {
        {
            let mut rounds = crate::support::lock(&self.rounds);
            if rounds.running {
                rounds.again = true;
                return;
            }
            rounds.running = true;
        }
        let pokes = self.clone();
        self.in_flight.spawn(async move {
            loop {
                pokes.send().await;
                let mut rounds = crate::support::lock(&pokes.rounds);
                if !std::mem::take(&mut rounds.again) {
                    rounds.running = false;
                    return;
                }
            }
        });
    }

    /// What the lease store runs after each bump of this process
    /// (`LeaseStore::after_announcing`): rings this worker's own doorbell
    /// (its controller's changes are news to it too), starts the pokes and
    /// returns, so a peer that does not answer (a dead node's pod IP) delays
    /// no caller, not even one declaring a peer dead on the way to taking its
    /// streams.
    pub fn after_bump(self: &Arc<Self>) -> AfterBump {
        let pokes = self.clone();
        Arc::new(move || {
            pokes.ring_again();
            pokes.start_round();
            Box::pin(std::future::ready(()))
        })
    }

    /// Waits for the pokes under way (each bounded by [`POKE_TIMEOUT`]): a
    /// process leaving has told its peers of its last releases.
    pub async fn settle(&self) {
        self.in_flight.close();
        self.in_flight.wait().await;
        self.in_flight.reopen();
    }
}

/// Whether a worker can be listening at `ip`: not a wildcard, multicast or
/// broadcast, nor link-local (where the cloud's metadata service answers).
fn listenable(ip: IpAddr) -> bool {
    let link_local = match ip {
        IpAddr::V4(v4) => v4.is_link_local() || v4.is_broadcast(),
        IpAddr::V6(v6) => v6.is_unicast_link_local(),
    };
    !(ip.is_unspecified() || ip.is_multicast() || link_local)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_addresses_a_worker_can_listen_at_are_poked() {
        for ok in ["10.1.2.3", "127.0.0.1", "fd00::7", "::1", "192.0.2.1"] {
            assert!(listenable(ok.parse().unwrap()), "{ok}");
        }
        for refused in [
            "169.254.169.254",
            "fe80::1",
            "0.0.0.0",
            "::",
            "224.0.0.1",
            "ff02::1",
            "255.255.255.255",
        ] {
            assert!(!listenable(refused.parse().unwrap()), "{refused}");
        }
    }

    /// A burst of bumps while a round is under way makes one more round,
    /// not one per bump; and each bump rings this worker's own doorbell.
    #[tokio::test]
    async fn bumps_during_a_round_make_one_more_round() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counting = served.clone();
        let app = axum::Router::new().route(
            "/poke",
            axum::routing::post(move || {
                let counting = counting.clone();
                async move {
                    // Slow enough that the burst lands during the first round.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    counting.fetch_add(1, Ordering::SeqCst);
                    axum::http::StatusCode::NO_CONTENT
                }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let metrics = Arc::new(WorkerMetrics::default());
        let pokes = Arc::new(Pokes::new(metrics.clone()));
        pokes.set_peers([addr]);
        let after = pokes.after_bump();
        for _ in 0..10 {
            after().await;
        }
        assert!(pokes.take(), "a bump rings this worker's own doorbell");
        pokes.settle().await;
        assert_eq!(served.load(Ordering::SeqCst), 2, "one round and one more");
        assert_eq!(
            metrics.pokes_sent.get_or_create(&[("result", "ok")]).get(),
            2
        );
        assert!(!pokes.failed_since(Instant::now() - Duration::from_secs(60)));
    }
}
