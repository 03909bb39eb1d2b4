//! Worker processes for tests and benchmarks: real `tether worker` processes
//! with their own metrics port and a log file each, built on the product's
//! own local-worker command.

use nix::sys::signal::Signal;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;
use tether::cli::demo::workers::LocalWorkers;
use tokio::process::Child;

/// Settings shared by the workers of one fleet.
#[derive(Clone, Debug)]
pub struct FleetConfig {
    pub workers: LocalWorkers,
    /// Where each worker's stderr goes (`<dir>/<id>.log`).
    pub log_dir: PathBuf,
    /// Extra arguments for every `tether worker`.
    pub extra_args: Vec<String>,
    /// Extra environment for every worker.
    pub env: Vec<(String, String)>,
}

impl FleetConfig {
    /// Short timings so failures play out in seconds (lease 3 s, heartbeat 0.75 s).
    pub fn fast(
        exe: impl Into<PathBuf>,
        endpoint: impl Into<String>,
        table: impl Into<String>,
        log_dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            workers: LocalWorkers {
                exe: exe.into(),
                endpoint: endpoint.into(),
                table: table.into(),
                lease_duration: Duration::from_secs(3),
                heartbeat_interval: Duration::from_millis(750),
                reconcile_interval: Duration::from_millis(200),
                fence_margin: Duration::from_millis(500),
                drain_timeout: Duration::from_secs(5),
            },
            log_dir: log_dir.into(),
            extra_args: Vec::new(),
            env: Vec::new(),
        }
    }

    /// The endpoint the fleet's store traffic goes to by default.
    pub fn endpoint(&self) -> &str {
        &self.workers.endpoint
    }

    /// Starts one worker with identity `id`, its store traffic sent to
    /// `endpoint` (pass a fault proxy's endpoint to cut it off), with `extra`
    /// arguments.
    pub fn spawn_with(
        &self,
        id: &str,
        endpoint: &str,
        extra: &[&str],
    ) -> std::io::Result<WorkerProcess> {
        let metrics_addr = free_port()?;
        let log_path = self
            .log_dir
            .join(format!("{id}-{}.log", rand::random::<u16>()));
        let mut cmd = self
            .workers
            .command(id, endpoint, &metrics_addr.to_string(), &log_path)?;
        cmd.args(&self.extra_args).args(extra).env(
            "RUST_LOG",
            std::env::var("TETHER_TEST_WORKER_LOG").unwrap_or_else(|_| "info".into()),
        );
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        Ok(WorkerProcess {
            id: id.to_string(),
            metrics_addr,
            log_path,
            child: cmd.spawn()?,
        })
    }

    pub fn spawn_via(&self, id: &str, endpoint: &str) -> std::io::Result<WorkerProcess> {
        self.spawn_with(id, endpoint, &[])
    }

    pub fn spawn(&self, id: &str) -> std::io::Result<WorkerProcess> {
        self.spawn_with(id, &self.workers.endpoint.clone(), &[])
    }
}

/// A port that was free a moment ago.
pub fn free_port() -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    listener.local_addr()
}

/// One running worker process; killed when dropped.
pub struct WorkerProcess {
    pub id: String,
    pub metrics_addr: SocketAddr,
    pub log_path: PathBuf,
    child: Child,
}

impl WorkerProcess {
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Sends a signal (SIGKILL, SIGTERM, SIGSTOP, SIGCONT, ...).
    pub fn signal(&self, signal: Signal) -> std::io::Result<()> {
        tether::cli::demo::workers::signal(&self.child, signal)
    }

    /// Waits for the process to exit, at most `limit`.
    pub async fn wait(&mut self, limit: Duration) -> std::io::Result<ExitStatus> {
        tokio::time::timeout(limit, self.child.wait())
            .await
            .map_err(|_| {
                std::io::Error::other(format!("worker {} did not exit within {limit:?}", self.id))
            })?
    }

    /// The worker's `/metrics` text.
    pub async fn metrics(&self) -> Result<String, String> {
        self.get("/metrics").await.map(|(_, body)| body)
    }

    /// DynamoDB requests of one operation (`query_fleet`, ...) made so far.
    pub async fn requests(&self, operation: &str) -> f64 {
        let text = self.metrics().await.unwrap_or_default();
        metric_sum(
            &text,
            "tether_dynamodb_requests_total",
            &format!("operation=\"{operation}\""),
        )
    }

    /// Whether the worker queried the fleet within `window` (waits it out):
    /// a worker making quiet passes does not.
    pub async fn queries_the_fleet(&self, window: Duration) -> bool {
        let before = self.requests("query_fleet").await;
        tokio::time::sleep(window).await;
        self.requests("query_fleet").await != before
    }

    /// GET a path on the worker's metrics server: (status, body).
    pub async fn get(&self, path: &str) -> Result<(u16, String), String> {
        let url = format!("http://{}{path}", self.metrics_addr);
        let resp = reqwest::Client::new()
            .get(&url)
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        Ok((status, resp.text().await.map_err(|e| e.to_string())?))
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        // A stopped process must be continued before it can handle the kill.
        let _ = self.signal(Signal::SIGCONT);
        let _ = self.child.start_kill();
    }
}

/// Waits (at most `limit`) until none of `workers` queries the fleet for two
/// seconds: they all make quiet passes.
pub async fn until_quiet(workers: &[&WorkerProcess], limit: Duration) -> anyhow::Result<()> {
    crate::bed::Bed::wait(limit, "the fleet goes quiet", || async {
        let checks = workers
            .iter()
            .map(|w| w.queries_the_fleet(Duration::from_secs(2)));
        !futures::future::join_all(checks)
            .await
            .into_iter()
            .any(|busy| busy)
    })
    .await
}

/// Reads one gauge or counter value (without labels) from metrics text.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Sum of a metric's samples (every label set) whose line contains `label`
/// (`""` for all), e.g. `metric_sum(text, "tether_lease_renewals_total", "result=\"error\"")`.
pub fn metric_sum(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| {
            matches!(
                l.strip_prefix(name).and_then(|rest| rest.chars().next()),
                Some('{' | ' ')
            )
        })
        .filter(|l| l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>()
        + 0.0
}
