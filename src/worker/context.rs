//! What a worker is made of, across incarnations: the shared part every
//! task reads ([`Shared`]) and what only the main loop hands out (the dialer,
//! the sinks' clients, the pod, the session runner).

use super::error::WorkerError;
use super::incarnation::PodLookup;
use super::settings::WorkerSettings;
use super::shared::Shared;
use super::stream::{ConnectLimiter, Dialer, Sessions, WebSocketSessions, tls_config};
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
        let http = reqwest::Client::builder()
            .dns_resolver(Arc::new(PolicyResolver(sink_policy.clone())))
            .connect_timeout(HTTP_CONNECT_TIMEOUT)
            .pool_idle_timeout(HTTP_IDLE_TIMEOUT)
            .build()
            .map_err(|e| WorkerError::HttpClient(e.to_string()))?;
        let tls = tls_config(settings.ca_file.as_deref()).map_err(WorkerError::Tls)?;
        let sinks = Arc::new(crate::sink::SinkClients::new(
            http,
            secrets.clone(),
            settings.worker_id.clone(),
        ));
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
                metrics,
            }),
            pod,
            sessions: Arc::new(WebSocketSessions),
        })
    }

    /// The same worker running `sessions` instead of WebSocket sessions.
    pub fn with_sessions(mut self, sessions: Arc<dyn Sessions>) -> Self {
        self.sessions = sessions;
        self
    }
}
