//! What a worker is made of, across incarnations: the shared part every
//! task reads ([`Shared`]) and what only the main loop hands out (the dialer,
//! the sinks' clients, the pod, the session runner).

use super::error::WorkerError;
use super::incarnation::PodLookup;
use super::settings::WorkerSettings;
use super::shared::Shared;
use super::stream::{ConnectLimiter, Dialer, Provenance, Sessions, WebSocketSessions, tls_config};
use crate::egress::{HostPolicy, PolicyResolver};
use crate::lease::LeaseStore;
use crate::metrics::WorkerMetrics;
use crate::secrets::SecretSource;
use std::sync::Arc;
use std::time::Duration;

/// Connect timeout of the sink HTTP client.
const HTTP_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the sink HTTP client keeps idle connections.
const HTTP_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Everything a worker's tasks share, across incarnations.
pub struct WorkerCtx {
    /// What every task reads: settings, store, metrics.
    pub shared: Arc<Shared>,
    pub dialer: Dialer,
    /// The sinks' shared clients (the HTTP one's resolver enforces `sink_policy`).
    pub sinks: Arc<crate::sink::SinkClients>,
    /// Where HTTP and NATS sinks may be sent.
    pub sink_policy: HostPolicy,
    /// This process's pod, in Kubernetes (container-restart proof).
    pub pod: Option<PodLookup>,
    /// What a held stream runs (WebSocket sessions).
    pub sessions: Arc<dyn Sessions>,
    /// Which items may be served (every item, unless [`WorkerCtx::serving_only`]).
    pub provenance: Arc<Provenance>,
}

impl WorkerCtx {
    pub fn new(
        settings: WorkerSettings,
        store: LeaseStore,
        metrics: Arc<WorkerMetrics>,
        policy: HostPolicy,
        sink_policy: HostPolicy,
        secrets: SecretSource,
        pod: Option<PodLookup>,
    ) -> Result<Self, WorkerError> {
        let http = sink_http_client(&sink_policy)?;
        let tls = tls_config(settings.ca_file.as_deref()).map_err(WorkerError::Tls)?;
        let sinks = Arc::new(crate::sink::SinkClients::new(
            http,
            secrets.clone(),
            settings.worker_id.clone(),
            sink_policy.clone(),
        ));
        let pokes = Arc::new(super::pokes::Pokes::new(metrics.clone()));
        // Every bump of this process's store, the controller's too (one
        // store in `tether operator`), is followed by the pokes.
        store.after_announcing(pokes.after_bump());
        Ok(Self {
            dialer: Dialer {
                policy,
                tls,
                secrets,
                connect_limit: ConnectLimiter::new(settings.connect_rate, settings.connect_burst),
            },
            sinks,
            sink_policy,
            shared: Arc::new(Shared {
                settings,
                store,
                pokes,
                metrics,
                peers_read_slots: Default::default(),
            }),
            pod,
            sessions: Arc::new(WebSocketSessions),
            provenance: Arc::new(Provenance::AnyItem),
        })
    }

    /// The same worker serving only the items `provenance` admits (operator
    /// mode: this installation's resources).
    pub fn serving_only(mut self, provenance: Provenance) -> Self {
        self.provenance = Arc::new(provenance);
        self
    }

    /// The same worker running `sessions` instead of WebSocket sessions.
    pub fn with_sessions(mut self, sessions: Arc<dyn Sessions>) -> Self {
        self.sessions = sessions;
        self
    }
}

/// The HTTP client of every HTTP sink. Names resolve through the sink host
/// policy; redirects are never followed: a `Location` with an IP literal
/// reaches no resolver, so following one would send the batch to an address
/// the policy never saw. A sink must answer at the URL it is given; a 3xx is
/// a failed delivery that says so (see `SinkError::Status`).
pub(crate) fn sink_http_client(sink_policy: &HostPolicy) -> Result<reqwest::Client, WorkerError> {
    reqwest::Client::builder()
        .dns_resolver(Arc::new(PolicyResolver(sink_policy.clone())))
        .redirect(reqwest::redirect::Policy::none())
        .connect_timeout(HTTP_CONNECT_TIMEOUT)
        .pool_idle_timeout(HTTP_IDLE_TIMEOUT)
        .build()
        .map_err(|e| WorkerError::HttpClient(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A sink that answers every request with `307 Location: <target>`,
    /// the way a tenant's sink would try to reach an address it may not.
    async fn redirecting_sink(target: String) -> std::net::SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let target = target.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 * 1024];
                    let _ = socket.read(&mut buf).await;
                    let answer = format!(
                        "HTTP/1.1 307 Temporary Redirect\r\nLocation: {target}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    );
                    let _ = socket.write_all(answer.as_bytes()).await;
                });
            }
        });
        addr
    }

    #[tokio::test]
    async fn a_sink_that_redirects_gets_its_answer_and_the_target_nothing() {
        crate::support::install_crypto_provider();
        // The forbidden address: it counts every connection it is offered.
        let (forbidden_addr, offered) = crate::support::counting_listener().await;
        // An IP literal in Location: no resolver, so no host policy, sees it.
        let sink = redirecting_sink(format!("http://{forbidden_addr}/steal")).await;
        let client = sink_http_client(&HostPolicy::new(["*"])).unwrap();
        let answer = client
            .post(format!("http://{sink}/ingest"))
            .body("{\"messages\":[]}")
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status().as_u16(), 307);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            offered.load(Ordering::SeqCst),
            0,
            "the batch followed the redirect"
        );
    }
}
