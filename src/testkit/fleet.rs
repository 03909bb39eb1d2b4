//! Worker processes for tests, the demo and benchmarks: real `tether worker`
//! processes with their own metrics port and a log file each.

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
use tokio::process::{Child, Command};

/// Settings shared by the workers of one fleet.
#[derive(Clone, Debug)]
pub struct FleetConfig {
    /// The `tether` binary.
    pub exe: PathBuf,
    /// DynamoDB endpoint the workers use.
    pub endpoint: String,
    pub table: String,
    pub lease_duration: Duration,
    pub heartbeat_interval: Duration,
    pub reconcile_interval: Duration,
    pub max_clock_skew: Duration,
    pub fence_margin: Duration,
    pub drain_timeout: Duration,
    /// Where each worker's stderr goes (`<dir>/<id>.log`).
    pub log_dir: PathBuf,
    /// Extra arguments for `tether worker`.
    pub extra_args: Vec<String>,
}

impl FleetConfig {
    /// Short timings so failures play out in seconds (lease 3 s, heartbeat 0.5 s).
    pub fn fast(
        exe: impl Into<PathBuf>,
        endpoint: impl Into<String>,
        table: impl Into<String>,
        log_dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            exe: exe.into(),
            endpoint: endpoint.into(),
            table: table.into(),
            lease_duration: Duration::from_secs(3),
            heartbeat_interval: Duration::from_millis(500),
            reconcile_interval: Duration::from_millis(200),
            max_clock_skew: Duration::from_millis(500),
            fence_margin: Duration::from_millis(300),
            drain_timeout: Duration::from_secs(5),
            log_dir: log_dir.into(),
            extra_args: Vec::new(),
        }
    }

    /// Starts one worker with identity `id`, its store traffic sent to `endpoint`
    /// (pass a fault proxy's endpoint to be able to cut it off).
    pub fn spawn_via(&self, id: &str, endpoint: &str) -> std::io::Result<WorkerProcess> {
        self.spawn_with(id, endpoint, &[])
    }

    /// Like [`FleetConfig::spawn_via`], with extra `tether worker` arguments.
    pub fn spawn_with(
        &self,
        id: &str,
        endpoint: &str,
        extra: &[&str],
    ) -> std::io::Result<WorkerProcess> {
        let metrics_addr = free_port()?;
        let log_path = self.log_dir.join(format!("{id}.log"));
        let log = std::fs::File::create(&log_path)?;
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        let mut cmd = Command::new(&self.exe);
        cmd.arg("--table")
            .arg(&self.table)
            .arg("worker")
            .arg("--worker-id")
            .arg(id)
            .arg("--lease-duration")
            .arg(ms(self.lease_duration))
            .arg("--heartbeat-interval")
            .arg(ms(self.heartbeat_interval))
            .arg("--reconcile-interval")
            .arg(ms(self.reconcile_interval))
            .arg("--max-clock-skew")
            .arg(ms(self.max_clock_skew))
            .arg("--fence-margin")
            .arg(ms(self.fence_margin))
            .arg("--drain-timeout")
            .arg(ms(self.drain_timeout))
            .arg("--metrics-addr")
            .arg(metrics_addr.to_string())
            .args(&self.extra_args)
            .args(extra)
            .env("AWS_ENDPOINT_URL_DYNAMODB", endpoint)
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ACCESS_KEY_ID", "tether-local")
            .env("AWS_SECRET_ACCESS_KEY", "tether-local")
            .env_remove("TETHER_EMBEDDED_STORE")
            .env(
                "RUST_LOG",
                std::env::var("TETHER_TEST_WORKER_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true);
        let child = cmd.spawn()?;
        Ok(WorkerProcess {
            id: id.to_string(),
            metrics_addr,
            log_path,
            child,
        })
    }

    pub fn spawn(&self, id: &str) -> std::io::Result<WorkerProcess> {
        self.spawn_via(id, &self.endpoint.clone())
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
        let pid = self
            .pid()
            .ok_or_else(|| std::io::Error::other("process already exited"))?;
        kill(Pid::from_raw(pid as i32), signal).map_err(std::io::Error::from)
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
        read_log(&self.log_path)
    }
}

fn read_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        // A stopped process cannot die from SIGKILL until continued on some
        // kernels' views of it; continue first, then kill.
        let _ = self.signal(Signal::SIGCONT);
        let _ = self.child.start_kill();
    }
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
        .sum()
}
