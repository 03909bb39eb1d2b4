//! Telling peers at once that the change counter moved.
//!
//! A quiet worker learns of a change (a drain's releases, a new stream, a
//! death) by reading the change counter (`lease::changes`). Read every
//! 500 ms, that read is the largest part of a quiet fleet's bill, and it is
//! what keeps a drain's handoff well under a second. So every worker
//! `POST`s `/poke` to its LIVE peers after each bump of its process that
//! landed (the controller's too, in `tether operator`), and a worker that
//! gives peers an address (`--advertise-ip`: its pod IP, with the metrics
//! port) reads the counter once a heartbeat instead, while every LIVE peer
//! pokes (`pokes_peers` on its item; a worker of an earlier release does
//! not, and then the counter is read every 500 ms as before). A poke makes
//! the receiver's next quiet pass read the counter, strongly consistent, so
//! that read cannot miss the write the poke followed.
//!
//! A poke carries nothing and is never a condition: a lost one (a network
//! policy, a timeout, a `tether apply` from outside the fleet, which pokes
//! nobody) costs at most the slower read's period, a heartbeat; a forged
//! one costs one read; a receiver takes at most one poke per pass, however
//! many arrive. Addresses come from the worker items, which only the
//! workers' own role can write.

use crate::lease::AfterBump;
use crate::metrics::WorkerMetrics;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    /// the metrics listener's `/poke`).
    received: Arc<AtomicBool>,
    client: reqwest::Client,
    metrics: Arc<WorkerMetrics>,
    /// Pokes under way (detached from the bump that started them).
    in_flight: tokio_util::task::TaskTracker,
}

impl Pokes {
    pub fn new(metrics: Arc<WorkerMetrics>) -> Self {
        crate::support::install_crypto_provider();
        let client = reqwest::Client::builder()
            // Pod addresses: never through a proxy, never redirected.
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(POKE_TIMEOUT)
            .build()
            // Only fails when the TLS backend cannot start, and pokes use
            // none: fall back to the default client all the same.
            .unwrap_or_default();
        Self {
            peers: Mutex::default(),
            received: Arc::default(),
            client,
            metrics,
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

    /// Sets the peers to poke.
    pub(crate) fn set_peers(&self, peers: Vec<SocketAddr>) {
        *crate::support::lock(&self.peers) = peers;
    }

    /// Pokes every peer at once and waits for their answers (each bounded by
    /// [`POKE_TIMEOUT`]); failures are counted and otherwise ignored.
    pub async fn send(&self) {
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
                    tracing::debug!(peer = %addr, error = %e, "poke not delivered; the peer reads the counter within its period");
                    "failed"
                }
            };
            self.metrics
                .pokes_sent
                .get_or_create(&[("result", result)])
                .inc();
        }
    }

    /// What the lease store runs after each bump of this process
    /// (`LeaseStore::after_announcing`): starts the pokes and returns, so a
    /// peer that does not answer (a dead node's pod IP) delays no caller,
    /// not even one declaring a peer dead on the way to taking its streams.
    pub fn after_bump(self: &Arc<Self>) -> AfterBump {
        let pokes = self.clone();
        Arc::new(move || {
            let sending = pokes.clone();
            pokes.in_flight.spawn(async move { sending.send().await });
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
