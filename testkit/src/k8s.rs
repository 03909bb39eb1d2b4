//! The Kubernetes API emulator (kmock from PyPI, extended in
//! `testkit/k8s_emulator.py`): a real HTTP API server for `tether operator`,
//! and the `tether operator` command pointed at it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running emulator; stopped when dropped.
pub struct Emulator {
    pub url: String,
    child: Child,
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Emulator {
    /// Starts the extended emulator (StreamConnections, Events, Secrets, Pods, Leases).
    pub fn start() -> Self {
        Self::spawn(
            Command::new("python3").arg(concat!(env!("CARGO_MANIFEST_DIR"), "/k8s_emulator.py")),
        )
    }

    /// Starts plain kmock, which knows no StreamConnection resource.
    pub fn start_without_crd() -> Self {
        Self::spawn(Command::new("python3").args([
            "-c",
            "import asyncio\nfrom kmock._internal import apps, k8s\nasync def main():\n    e = k8s.KubernetesEmulator()\n    async with e, apps.Server(e) as s:\n        print(f'http://{s.host}:{s.port}', flush=True)\n        await asyncio.Event().wait()\nasyncio.run(main())\n",
        ]))
    }

    fn spawn(cmd: &mut Command) -> Self {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 runs");
        let mut line = String::new();
        let stdout = child.stdout.take().expect("piped stdout");
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("emulator output");
        assert!(
            line.starts_with("http://"),
            "the Kubernetes API emulator did not start (it needs `pip install kmock==0.8`, which scripts/test does): {line:?}"
        );
        Self {
            url: line.trim().to_string(),
            child,
        }
    }

    /// A kubeconfig for the emulator in `dir` (namespace `namespace`).
    pub fn kubeconfig(&self, dir: &Path, namespace: &str) -> PathBuf {
        let path = dir.join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: emu\n  cluster:\n    server: {}\n\
                 users:\n- name: emu\n  user:\n    token: test\ncontexts:\n- name: emu\n  context:\n    cluster: emu\n    user: emu\n    namespace: {namespace}\n\
                 current-context: emu\n",
                self.url
            ),
        )
        .expect("kubeconfig written");
        path
    }
}

/// `tether operator` for `table` on the server under test, pointed at the
/// emulator through `kubeconfig`, with the given timings.
pub fn operator_command(
    exe: &Path,
    table: &str,
    id: &str,
    kubeconfig: &Path,
    lease: Duration,
    heartbeat: Duration,
) -> tokio::process::Command {
    let metrics = crate::processes::free_port().expect("a free port");
    operator_command_at(exe, table, id, kubeconfig, lease, heartbeat, metrics)
}

/// [`operator_command`] serving its metrics at `metrics`.
pub fn operator_command_at(
    exe: &Path,
    table: &str,
    id: &str,
    kubeconfig: &Path,
    lease: Duration,
    heartbeat: Duration,
    metrics: std::net::SocketAddr,
) -> tokio::process::Command {
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    let mut cmd = tokio::process::Command::new(exe);
    cmd.args(["--table", table, "operator", "--worker-id", id])
        .args([
            "--lease-duration",
            &ms(lease),
            "--heartbeat-interval",
            &ms(heartbeat),
        ])
        .args([
            "--reconcile-interval",
            "200ms",
            "--fence-margin",
            "500ms",
            "--status-refresh",
            "500ms",
            "--leader-lease",
            "3s",
        ])
        .args(["--metrics-addr", &metrics.to_string()])
        .env("KUBECONFIG", kubeconfig)
        .env("AWS_ENDPOINT_URL_DYNAMODB", crate::store::endpoint().0)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "x");
    cmd
}

/// A pod object as the API server would show it, with one running container
/// `tether` restarted `restarts` times.
pub fn pod(name: &str, namespace: &str, restarts: u32) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": [{"name": "tether", "image": "tether"}]},
        "status": {"containerStatuses": [{
            "name": "tether", "image": "tether", "imageID": "", "ready": true,
            "restartCount": restarts,
            "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
        }]}
    })
}

/// `cmd` started as a kubelet would have started it in container `container`
/// of the pod with UID `pod_uid`, as far as its own mount table shows: in a
/// private mount namespace (`unshare`), with a file bind-mounted from
/// `<dir>/kubelet/pods/<uid>/containers/<name>/<id>` the way the kubelet
/// mounts a container's termination log. That mount is what the worker's
/// container-restart proof trusts over `POD_NAME`. The wrapper `exec`s into
/// `cmd`'s program, so the child's pid is the worker's.
pub fn in_kubelet_container(
    cmd: tokio::process::Command,
    dir: &Path,
    pod_uid: &str,
    container: &str,
) -> std::io::Result<tokio::process::Command> {
    let id = format!("{:08x}", rand::random::<u32>());
    let from = dir
        .join("kubelet/pods")
        .join(pod_uid)
        .join("containers")
        .join(container);
    std::fs::create_dir_all(&from)?;
    let from = from.join(&id);
    std::fs::write(&from, b"")?;
    let onto = dir.join(format!("termination-log-{id}"));
    std::fs::write(&onto, b"")?;
    let inner = cmd.as_std();
    let mut wrapped = tokio::process::Command::new("unshare");
    wrapped.arg("--mount");
    if !nix::unistd::geteuid().is_root() {
        wrapped.arg("--map-root-user");
    }
    wrapped
        .args([
            "sh",
            "-c",
            r#"mount --bind "$1" "$2" && shift 2 && exec "$@""#,
            "sh",
        ])
        .arg(&from)
        .arg(&onto)
        .arg(inner.get_program())
        .args(inner.get_args());
    for (key, value) in inner.get_envs() {
        match value {
            Some(v) => wrapped.env(key, v),
            None => wrapped.env_remove(key),
        };
    }
    if let Some(d) = inner.get_current_dir() {
        wrapped.current_dir(d);
    }
    Ok(wrapped)
}

/// Applies a JSON merge patch to the object at `url` (the emulator's API);
/// it must be accepted.
pub async fn merge_patch(http: &reqwest::Client, url: &str, patch: serde_json::Value) {
    let patched = http
        .patch(url)
        .header("content-type", "application/merge-patch+json")
        .body(patch.to_string())
        .send()
        .await
        .unwrap();
    assert!(
        patched.status().is_success(),
        "{url}: {}",
        patched.text().await.unwrap()
    );
}
