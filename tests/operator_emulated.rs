//! The real `tether operator` binary against a Kubernetes API emulator (kmock,
//! extended in tests/support/k8s_emulator.py), the embedded DynamoDB-compatible
//! store and the test upstream: watch-driven behaviour end to end.

mod support;

use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tether::lease::StreamKey;
use tether::testkit::fleet::free_port;
use tether::testkit::upstream::TestUpstream;

const PATH: &str = "/apis/tether.dev/v1alpha1/namespaces/feeds/streamconnections";

struct Emulator {
    url: String,
    child: Child,
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_emulator() -> Emulator {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/k8s_emulator.py");
    let mut child = Command::new("python3")
        .arg(script)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3 runs");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(
        line.starts_with("http://"),
        "the Kubernetes API emulator did not start (it needs `pip install kmock==0.8`, which scripts/test does): {line:?}"
    );
    Emulator {
        url: line.trim().to_string(),
        child,
    }
}

fn kubeconfig(dir: &std::path::Path, server: &str) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: emu\n  cluster:\n    server: {server}\n\
             users:\n- name: emu\n  user:\n    token: test\ncontexts:\n- name: emu\n  context:\n    cluster: emu\n    user: emu\n    namespace: feeds\n\
             current-context: emu\n"
        ),
    )
    .unwrap();
    path
}

async fn wait_for<F, Fut>(limit: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {limit:?} waiting until {what}; operator log:\n{}",
            LOG_PATH
                .get()
                .and_then(|p| std::fs::read_to_string(p).ok())
                .unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn get(http: &reqwest::Client, url: &str) -> Option<Value> {
    let resp = http.get(url).send().await.ok()?;
    if resp.status() == 404 {
        return None;
    }
    resp.json().await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_connection_is_mirrored_served_stopped_and_deleted() {
    let emulator = start_emulator();
    let store = support::fresh_store(None).await;
    let upstream = TestUpstream::start(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), 10)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let log = std::fs::File::create(dir.path().join("operator.log")).unwrap();
    // Read by wait_for to explain a timeout (one operator per test binary run).
    set_log_path(&dir.path().join("operator.log"));
    let mut operator = tokio::process::Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(["--table", store.table(), "operator", "--worker-id", "op-1"])
        .args([
            "--lease-duration",
            "3s",
            "--heartbeat-interval",
            "500ms",
            "--reconcile-interval",
            "200ms",
        ])
        .args([
            "--max-clock-skew",
            "500ms",
            "--fence-margin",
            "300ms",
            "--status-refresh",
            "500ms",
        ])
        .args(["--metrics-addr", &free_port().unwrap().to_string()])
        .env("KUBECONFIG", kubeconfig(dir.path(), &emulator.url))
        .env("AWS_ENDPOINT_URL_DYNAMODB", support::endpoint().0)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "x")
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let http = reqwest::Client::new();
    let object_url = format!("{}{PATH}/live", emulator.url);
    let manifest = json!({
        "apiVersion": "tether.dev/v1alpha1",
        "kind": "StreamConnection",
        "metadata": {"name": "live", "namespace": "feeds"},
        "spec": {"url": upstream.url("live"), "sequence": {"pointer": "/seq"}, "sink": {"log": {}}},
    });
    let created = http
        .post(format!("{}{PATH}", emulator.url))
        .json(&manifest)
        .send()
        .await
        .unwrap();
    assert!(
        created.status().is_success(),
        "{}",
        created.text().await.unwrap()
    );
    let key = StreamKey::new("feeds", "live");
    let diagnostics =
        || std::fs::read_to_string(dir.path().join("operator.log")).unwrap_or_default();

    // Created → mirrored, connected once, status shows owner and phase Connected.
    wait_for(
        Duration::from_secs(30),
        "status shows Connected and the owner",
        || async {
            let obj = get(&http, &object_url).await.unwrap_or_default();
            obj["status"]["phase"] == "Connected" && obj["status"]["owner"] == "op-1"
        },
    )
    .await;
    let item = store
        .get(&key)
        .await
        .unwrap()
        .expect("mirrored into the table");
    assert_eq!(item.generation, 1);
    assert_eq!(upstream.open_sessions().get("live"), Some(&1));
    let obj = get(&http, &object_url).await.unwrap();
    assert!(
        obj["metadata"]["finalizers"]
            .to_string()
            .contains("tether.dev/lease-cleanup")
    );
    assert_eq!(obj["status"]["observedGeneration"], 1);
    let conditions = obj["status"]["conditions"].as_array().unwrap();
    assert!(
        conditions
            .iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True"),
        "{obj}"
    );

    // Stopped → session closed, status Stopped.
    let patched = http
        .patch(&object_url)
        .header("content-type", "application/merge-patch+json")
        .body(json!({"spec": {"desiredState": "Stopped"}}).to_string())
        .send()
        .await
        .unwrap();
    assert!(patched.status().is_success());
    wait_for(
        Duration::from_secs(30),
        "the session closes and status says Stopped",
        || async {
            let obj = get(&http, &object_url).await.unwrap_or_default();
            !upstream.open_sessions().contains_key("live") && obj["status"]["phase"] == "Stopped"
        },
    )
    .await;
    assert_eq!(
        store.get(&key).await.unwrap().unwrap().generation,
        2,
        "generation mirrored"
    );

    // Started again, then deleted → session closed, item gone, finalizer removed.
    http.patch(&object_url)
        .header("content-type", "application/merge-patch+json")
        .body(json!({"spec": {"desiredState": "Started"}}).to_string())
        .send()
        .await
        .unwrap();
    wait_for(Duration::from_secs(30), "reconnected", || async {
        upstream.open_sessions().get("live") == Some(&1)
    })
    .await;
    let deleted = http.delete(&object_url).send().await.unwrap();
    assert!(deleted.status().is_success());
    wait_for(
        Duration::from_secs(30),
        "the object and its item are gone",
        || async {
            get(&http, &object_url).await.is_none() && store.get(&key).await.unwrap().is_none()
        },
    )
    .await;
    wait_for(Duration::from_secs(10), "the session is closed", || async {
        !upstream.open_sessions().contains_key("live")
    })
    .await;
    assert!(upstream.overlaps().is_empty());

    // SIGTERM: a clean exit.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(operator.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(15), operator.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(
        status.success(),
        "operator exit: {status:?}\n{}",
        diagnostics()
    );
}

#[tokio::test]
async fn the_operator_exits_with_a_clear_error_when_the_crd_is_missing() {
    // A plain kmock emulator that knows no StreamConnection resource.
    let emulator = start_emulator_without_crd();
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(["operator", "--metrics-addr", "127.0.0.1:0"])
        .env("KUBECONFIG", kubeconfig(dir.path(), &emulator.url))
        .env("AWS_ENDPOINT_URL_DYNAMODB", support::endpoint().0)
        .env("AWS_REGION", "us-east-1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("is the CRD installed?"), "{stderr}");
}

fn start_emulator_without_crd() -> Emulator {
    let mut child = Command::new("python3")
        .args([
            "-c",
            "import asyncio\nfrom kmock._internal import apps, k8s\nasync def main():\n    e = k8s.KubernetesEmulator()\n    async with e, apps.Server(e) as s:\n        print(f'http://{s.host}:{s.port}', flush=True)\n        await asyncio.Event().wait()\nasyncio.run(main())\n",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("http://"), "kmock did not start: {line:?}");
    Emulator {
        url: line.trim().to_string(),
        child,
    }
}

fn set_log_path(path: &std::path::Path) {
    LOG_PATH.set(path.to_path_buf()).ok();
}

static LOG_PATH: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
