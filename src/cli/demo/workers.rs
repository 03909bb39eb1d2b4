//! Starting `tether worker` processes against a local DynamoDB-compatible
//! endpoint, for the demo (and, through the test kit, for tests and benchmarks).

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::process::{Child, Command};

/// Timings and where to find the table, for a fleet of local workers.
#[derive(Clone, Debug)]
pub struct LocalWorkers {
    /// The `tether` binary.
    pub exe: PathBuf,
    /// DynamoDB endpoint the workers use.
    pub endpoint: String,
    pub table: String,
    pub lease_duration: Duration,
    pub heartbeat_interval: Duration,
    pub reconcile_interval: Duration,
    pub fence_margin: Duration,
    pub drain_timeout: Duration,
}

impl LocalWorkers {
    /// The command for one worker with identity `id`, its store traffic sent to
    /// `endpoint`, serving metrics on `metrics_addr`, logging to `log`.
    pub fn command(
        &self,
        id: &str,
        endpoint: &str,
        metrics_addr: &str,
        log: &Path,
    ) -> std::io::Result<Command> {
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
            .arg("--fence-margin")
            .arg(ms(self.fence_margin))
            .arg("--drain-timeout")
            .arg(ms(self.drain_timeout))
            .arg("--metrics-addr")
            .arg(metrics_addr)
            .env("AWS_ENDPOINT_URL_DYNAMODB", endpoint)
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ACCESS_KEY_ID", crate::lease::LOCAL_CREDENTIALS.0)
            .env("AWS_SECRET_ACCESS_KEY", crate::lease::LOCAL_CREDENTIALS.1)
            .env_remove("TETHER_EMBEDDED_STORE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(log)?))
            .kill_on_drop(true);
        Ok(cmd)
    }
}

/// Sends `signal` to a child process (SIGKILL, SIGTERM, SIGSTOP, SIGCONT, ...).
pub fn signal(child: &Child, signal: Signal) -> std::io::Result<()> {
    let pid = child
        .id()
        .ok_or_else(|| std::io::Error::other("process already exited"))?;
    kill(Pid::from_raw(pid as i32), signal).map_err(std::io::Error::from)
}
