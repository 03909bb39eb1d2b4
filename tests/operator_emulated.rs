//! The real `tether operator` binary against a Kubernetes API emulator (kmock,
//! extended in testkit/k8s_emulator.py), the embedded DynamoDB-compatible
//! store and the feed: watch-driven behaviour end to end.

use serde_json::{Value, json};
use std::net::{Ipv4Addr, SocketAddr};
use std::process::{Command, Stdio};
use std::time::Duration;
use tether::lease::StreamKey;
use tether_testkit::bed::eventually_or;
use tether_testkit::k8s::{self, Emulator, merge_patch};
use tether_testkit::store::{endpoint, fresh_store};
use tether_testkit::upstream::start as start_upstream;

const PATH: &str = "/apis/tether.dev/v1alpha1/namespaces/feeds/streamconnections";

/// `tether operator` with the fast test timings, pointed at the emulator and
/// the embedded store.
fn operator_command(
    store: &tether::lease::LeaseStore,
    id: &str,
    dir: &std::path::Path,
    emulator: &Emulator,
    metrics: SocketAddr,
) -> tokio::process::Command {
    let kubeconfig = emulator.kubeconfig(dir, "feeds");
    k8s::operator_command_at(
        std::path::Path::new(env!("CARGO_BIN_EXE_tether")),
        store.table(),
        id,
        &kubeconfig,
        Duration::from_secs(3),
        Duration::from_millis(750),
        metrics,
    )
}

/// Creates `object` through the emulator at `url`; it must be accepted.
async fn create(http: &reqwest::Client, url: String, object: &Value) {
    let created = http.post(&url).json(object).send().await.unwrap();
    assert!(
        created.status().is_success(),
        "{url}: {}",
        created.text().await.unwrap()
    );
}

/// A Secret whose `key` holds `value`.
fn secret(namespace: &str, name: &str, key: &str, value: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace},
        "data": {key: base64::Engine::encode(&base64::engine::general_purpose::STANDARD, value)},
    })
}

/// A StreamConnection in `feeds` from `url` to the worker's log.
fn log_stream(name: &str, url: &str) -> Value {
    json!({
        "apiVersion": "tether.dev/v1alpha1",
        "kind": "StreamConnection",
        "metadata": {"name": name, "namespace": "feeds"},
        "spec": {"url": url, "sink": {"log": {}}},
    })
}

/// Creates a log-sink stream per name in `feeds`, each on its own feed path.
async fn create_log_streams(
    http: &reqwest::Client,
    emulator: &Emulator,
    upstream: &tether_testkit::upstream::TestUpstream,
    names: &[String],
) {
    for name in names {
        create(
            http,
            format!("{}{PATH}", emulator.url),
            &log_stream(name, &upstream.url(name)),
        )
        .await;
    }
}

async fn get(http: &reqwest::Client, url: &str) -> Option<Value> {
    let resp = http.get(url).send().await.ok()?;
    if resp.status() == 404 {
        return None;
    }
    resp.json().await.ok()
}

/// The emulator, a fresh store and the feed, with `tether operator` running
/// against them (stderr in [`Operated::LOG`] in `dir`), and an HTTP client.
struct Operated {
    emulator: Emulator,
    store: tether::lease::LeaseStore,
    upstream: tether_testkit::upstream::TestUpstream,
    dir: tempfile::TempDir,
    operator: tokio::process::Child,
    http: reqwest::Client,
    /// Where the operator serves `/metrics`.
    metrics: SocketAddr,
}

impl Operated {
    const LOG: &str = "operator.log";

    /// Starts `tether operator` with worker id `id` and environment `env`.
    async fn start(id: &str, env: &[(&str, &str)]) -> Self {
        let emulator = Emulator::start();
        let store = fresh_store(None).await;
        let upstream = start_upstream(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), 10)
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let log = std::fs::File::create(dir.path().join(Self::LOG)).unwrap();
        let metrics = tether_testkit::processes::free_port().unwrap();
        let operator = operator_command(&store, id, dir.path(), &emulator, metrics)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Self {
            emulator,
            store,
            upstream,
            dir,
            operator,
            http: reqwest::Client::new(),
            metrics,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_connection_is_mirrored_served_stopped_and_deleted() {
    let Operated {
        emulator,
        store,
        upstream,
        dir,
        mut operator,
        http,
        ..
    } = Operated::start("op-1", &[]).await;
    let object_url = format!("{}{PATH}/live", emulator.url);
    let manifest = json!({
        "apiVersion": "tether.dev/v1alpha1",
        "kind": "StreamConnection",
        "metadata": {"name": "live", "namespace": "feeds"},
        "spec": {"url": upstream.url("live"), "sequence": {"pointer": "/seq"}, "sink": {"log": {}}},
    });
    create(&http, format!("{}{PATH}", emulator.url), &manifest).await;
    let key = StreamKey::new("feeds", "live");
    let diagnostics =
        || std::fs::read_to_string(dir.path().join(Operated::LOG)).unwrap_or_default();

    // Created → mirrored, connected once, status shows owner and phase Connected.
    eventually_or(
        Duration::from_secs(30),
        "status shows Connected and the owner",
        || async {
            let obj = get(&http, &object_url).await.unwrap_or_default();
            obj["status"]["phase"] == "Connected" && obj["status"]["owner"] == "op-1"
        },
        diagnostics,
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
    merge_patch(
        &http,
        &object_url,
        json!({"spec": {"desiredState": "Stopped"}}),
    )
    .await;
    eventually_or(
        Duration::from_secs(30),
        "the session closes and status says Stopped",
        || async {
            let obj = get(&http, &object_url).await.unwrap_or_default();
            !upstream.open_sessions().contains_key("live") && obj["status"]["phase"] == "Stopped"
        },
        diagnostics,
    )
    .await;
    assert_eq!(
        store.get(&key).await.unwrap().unwrap().generation,
        2,
        "generation mirrored"
    );

    // Started again, then deleted → session closed, item gone, finalizer removed.
    merge_patch(
        &http,
        &object_url,
        json!({"spec": {"desiredState": "Started"}}),
    )
    .await;
    eventually_or(
        Duration::from_secs(30),
        "reconnected",
        || async { upstream.open_sessions().get("live") == Some(&1) },
        diagnostics,
    )
    .await;
    let deleted = http.delete(&object_url).send().await.unwrap();
    assert!(deleted.status().is_success());
    eventually_or(
        Duration::from_secs(30),
        "the object and its item are gone",
        || async {
            get(&http, &object_url).await.is_none()
                && store
                    .get(&key)
                    .await
                    .unwrap()
                    .is_some_and(|r| r.is_tombstone())
        },
        diagnostics,
    )
    .await;
    eventually_or(
        Duration::from_secs(10),
        "the session is closed",
        || async { !upstream.open_sessions().contains_key("live") },
        diagnostics,
    )
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
    let emulator = Emulator::start_without_crd();
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_tether"))
        .args(["operator", "--metrics-addr", "127.0.0.1:0"])
        .env("KUBECONFIG", emulator.kubeconfig(dir.path(), "feeds"))
        .env("AWS_ENDPOINT_URL_DYNAMODB", endpoint().0)
        .env("AWS_REGION", "us-east-1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("is the CRD installed?"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_secrets_are_read_at_connect_time_and_never_stored_or_logged() {
    let Operated {
        emulator,
        store,
        upstream,
        dir,
        mut operator,
        http,
        ..
    } = Operated::start(
        "op-s",
        &[(
            "RUST_LOG",
            "debug,aws_config=error,aws_smithy_runtime=info,hyper=info,kube=info",
        )],
    )
    .await;
    let log_path = dir.path().join(Operated::LOG);
    let diagnostics = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let manifest = |name: &str| {
        json!({
            "apiVersion": "tether.dev/v1alpha1",
            "kind": "StreamConnection",
            "metadata": {"name": name, "namespace": "feeds"},
            "spec": {
                "url": upstream.url(name),
                "sink": {"log": {}},
                "headers": [{"name": "Authorization", "valueFrom": {"secretKeyRef": {"name": "upstream-token", "key": "token"}}}],
            },
        })
    };
    // The Secret does not exist yet: the stream says why and retries.
    create(
        &http,
        format!("{}{PATH}", emulator.url),
        &manifest("secured"),
    )
    .await;
    let object_url = format!("{}{PATH}/secured", emulator.url);
    eventually_or(
        Duration::from_secs(30),
        "the status names the missing Secret",
        || async {
            let obj = get(&http, &object_url).await.unwrap_or_default();
            let ready = obj["status"]["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            ready.iter().any(|c| {
                c["type"] == "Ready"
                    && c["reason"] == "HeaderUnavailable"
                    && c["message"]
                        .as_str()
                        .is_some_and(|m| m.contains("upstream-token"))
            })
        },
        diagnostics,
    )
    .await;
    assert!(
        upstream.sessions_of("secured").is_empty(),
        "never dialled without its header"
    );
    // Said once as a Warning event while the stream retries: only the user
    // can create the Secret.
    let events_url = format!(
        "{}/apis/events.k8s.io/v1/namespaces/feeds/events",
        emulator.url
    );
    eventually_or(
        Duration::from_secs(30),
        "a Warning event names the missing Secret",
        || async {
            let events = get(&http, &events_url).await.unwrap_or_default();
            events["items"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .any(|e| {
                    e["reason"] == "HeaderUnavailable"
                        && e["type"] == "Warning"
                        && e["note"]
                            .as_str()
                            .is_some_and(|n| n.contains("upstream-token"))
                })
        },
        diagnostics,
    )
    .await;

    // Created: the next connect reads it.
    let secret_value = "Bearer s3cr3t-value-42";
    create(
        &http,
        format!("{}/api/v1/namespaces/feeds/secrets", emulator.url),
        &secret("feeds", "upstream-token", "token", secret_value),
    )
    .await;
    eventually_or(
        Duration::from_secs(30),
        "connected with the header",
        || async {
            upstream
                .sessions_of("secured")
                .iter()
                .any(|s| s.authorization.as_deref() == Some(secret_value))
        },
        diagnostics,
    )
    .await;
    // Never copied into the table, never logged (not even at debug level).
    let item = store
        .get(&StreamKey::new("feeds", "secured"))
        .await
        .unwrap()
        .unwrap();
    assert!(
        !format!("{item:?}").contains("s3cr3t"),
        "secret value in the lease table: {item:?}"
    );
    assert!(
        !diagnostics().contains("s3cr3t"),
        "secret value in the logs"
    );
    let _ = operator.start_kill();
}

/// Pods in `feeds` on the emulator, the streams of resources `names`, and
/// `tether operator` processes started as containers of those pods (as far
/// as their mount tables show): what the container-restart proof reads.
struct Pods {
    emulator: Emulator,
    store: tether::lease::LeaseStore,
    upstream: tether_testkit::upstream::TestUpstream,
    http: reqwest::Client,
    dir: tempfile::TempDir,
    kubeconfig: std::path::PathBuf,
    names: Vec<String>,
}

impl Pods {
    /// A lease long enough that waiting for it would be obvious.
    const LEASE: Duration = Duration::from_secs(20);

    /// Four resources `<prefix>0..3`, as users create them (in operator mode
    /// only the items of this installation's resources are served).
    async fn start(prefix: &str) -> Self {
        let emulator = Emulator::start();
        let store = fresh_store(None).await;
        let upstream = start_upstream(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), 10)
            .await
            .unwrap();
        let http = reqwest::Client::new();
        let names: Vec<String> = (0..4).map(|i| format!("{prefix}{i}")).collect();
        create_log_streams(&http, &emulator, &upstream, &names).await;
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = emulator.kubeconfig(dir.path(), "feeds");
        Self {
            emulator,
            store,
            upstream,
            http,
            dir,
            kubeconfig,
            names,
        }
    }

    fn pods_url(&self) -> String {
        format!("{}/api/v1/namespaces/feeds/pods", self.emulator.url)
    }

    /// Creates pod `name` (container `tether` running, no restarts) and
    /// returns the UID the API server gave it.
    async fn create_pod(&self, name: &str) -> String {
        let created = self
            .http
            .post(self.pods_url())
            .json(&k8s::pod(name, "feeds", 0))
            .send()
            .await
            .unwrap();
        assert!(created.status().is_success(), "{created:?}");
        let pod: Value = created.json().await.unwrap();
        pod["metadata"]["uid"].as_str().unwrap().to_string()
    }

    /// What the kubelet records when it restarts `pod`'s container.
    async fn record_restart(&self, pod: &str, restarts: u32) {
        merge_patch(
            &self.http,
            &format!("{}/{pod}/status", self.pods_url()),
            json!({"status": k8s::pod(pod, "feeds", restarts)["status"]}),
        )
        .await;
    }

    /// Starts `tether operator` with `POD_NAME=pod` inside container
    /// `tether` of the pod whose UID is `mounted_uid`, logging to `log`.
    fn start_in_pod(&self, pod: &str, mounted_uid: &str, log: &str) -> tokio::process::Child {
        let mut cmd = k8s::operator_command(
            std::path::Path::new(env!("CARGO_BIN_EXE_tether")),
            self.store.table(),
            pod,
            &self.kubeconfig,
            Self::LEASE,
            Duration::from_secs(5),
        );
        cmd.env("POD_NAME", pod).env("POD_NAMESPACE", "feeds");
        k8s::in_kubelet_container(cmd, self.dir.path(), mounted_uid, "tether")
            .unwrap()
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(self.dir.path().join(log)).unwrap(),
            ))
            .kill_on_drop(true)
            .spawn()
            .unwrap()
    }

    /// The logs, each under its name.
    fn logs(&self, logs: &[&str]) -> String {
        logs.iter()
            .map(|f| {
                let text = std::fs::read_to_string(self.dir.path().join(f)).unwrap_or_default();
                format!("{f}:\n{text}\n")
            })
            .collect()
    }

    /// Every stream has exactly one open session.
    fn each_served_once(&self) -> bool {
        let open = self.upstream.open_sessions();
        self.names.iter().all(|n| open.get(n) == Some(&1))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_container_takes_its_streams_back_at_once_not_after_a_lease() {
    let bed = Pods::start("r").await;
    let pod_uid = bed.create_pod("tether-0").await;
    let diagnostics = || bed.logs(&["first.log", "second.log"]);
    let mut first = bed.start_in_pod("tether-0", &pod_uid, "first.log");
    eventually_or(
        Duration::from_secs(30),
        "the first container serves every stream",
        || async { bed.each_served_once() },
        diagnostics,
    )
    .await;
    first.start_kill().unwrap();
    let _ = first.wait().await;
    bed.record_restart("tether-0", 1).await;
    let t0 = tokio::time::Instant::now();
    let _second = bed.start_in_pod("tether-0", &pod_uid, "second.log");
    eventually_or(
        Duration::from_secs(30),
        "the restarted container serves every stream again",
        || async {
            bed.each_served_once()
                && bed
                    .names
                    .iter()
                    .all(|n| bed.upstream.sessions_of(n).iter().any(|s| s.opened >= t0))
        },
        diagnostics,
    )
    .await;
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "reclaim took {:?} (lease {:?})\n{}",
        t0.elapsed(),
        Pods::LEASE,
        diagnostics()
    );
    assert!(
        diagnostics().contains("this container restarted"),
        "{}",
        diagnostics()
    );
    assert!(bed.upstream.overlaps().is_empty());
}

/// `POD_NAME` is an environment variable anyone can copy: a worker in another
/// pod that names this one must not be declared dead (while alive, streams
/// open) when this pod's container restarts. The proof is used only when the
/// process's own mounts put it in the pod the API server calls `POD_NAME`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copied_pod_name_never_gets_a_live_worker_declared_dead() {
    let bed = Pods::start("c").await;
    let real_uid = bed.create_pod("tether-0").await;
    let other_uid = bed.create_pod("tether-1").await;
    let diagnostics = || bed.logs(&["impostor.log", "real.log"]);
    // Runs in pod tether-1 but says POD_NAME=tether-0, and takes every stream.
    let _impostor = bed.start_in_pod("tether-0", &other_uid, "impostor.log");
    eventually_or(
        Duration::from_secs(30),
        "the impostor serves every stream",
        || async { bed.each_served_once() },
        diagnostics,
    )
    .await;
    // tether-0's container restarts; its new run really is tether-0's.
    bed.record_restart("tether-0", 1).await;
    let _real = bed.start_in_pod("tether-0", &real_uid, "real.log");
    eventually_or(
        Duration::from_secs(30),
        "the real container has registered",
        || async {
            let logs = diagnostics();
            logs.contains("running in a pod") && logs.contains("worker started")
        },
        diagnostics,
    )
    .await;
    // Long enough for a proof to have been acted on (it takes well under a
    // second), far shorter than the lease.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let fleet = bed.store.fleet().await.unwrap();
    let dead: Vec<_> = fleet
        .workers
        .iter()
        .filter(|w| w.state != tether::lease::WorkerState::Live)
        .collect();
    assert!(
        dead.is_empty(),
        "declared dead: {dead:?}\n{}",
        diagnostics()
    );
    assert!(
        diagnostics().contains("POD_NAME names a pod this process does not run in"),
        "{}",
        diagnostics()
    );
    assert!(
        bed.upstream.overlaps().is_empty(),
        "overlaps: {:?}",
        bed.upstream.overlaps()
    );
}

/// A confused deputy through the table: whoever can write the lease table
/// (the CLI's policy grants UpdateItem) must not get a worker to serve an item
/// no resource stands behind, nor to read a Secret of a namespace the item
/// merely names. Both forged items are refused with a reason in their status;
/// the upstream never sees them; the real resource keeps flowing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_written_straight_into_the_table_is_not_served_and_reads_no_secret() {
    let Operated {
        emulator,
        store,
        upstream,
        dir,
        mut operator,
        http,
        ..
    } = Operated::start("op-d", &[]).await;
    let log_path = dir.path().join(Operated::LOG);
    let diagnostics = || std::fs::read_to_string(&log_path).unwrap_or_default();
    // A Secret of another team's namespace, which the workers may read.
    let stolen = "Bearer other-teams-token-77";
    create(
        &http,
        format!("{}/api/v1/namespaces/bank/secrets", emulator.url),
        &secret("bank", "vault", "token", stolen),
    )
    .await;
    // A real resource, served as usual.
    create(
        &http,
        format!("{}{PATH}", emulator.url),
        &log_stream("legit", &upstream.url("legit")),
    )
    .await;
    // Two items written straight into the table, naming that Secret: one
    // with no resource at all, one claiming a UID no resource has.
    let forged = |name: &str| {
        let mut spec = tether_testkit::fixtures::log_spec(&upstream.url(name));
        spec.headers = vec![tether::crd::HeaderSpec {
            name: "Authorization".into(),
            value_from: tether::crd::HeaderValueSource {
                secret_key_ref: Some(tether::crd::SecretKeyRef {
                    name: "vault".into(),
                    key: "token".into(),
                }),
                env: None,
            },
        }];
        spec
    };
    let no_resource = StreamKey::new("bank", "forged");
    let made_up_uid = StreamKey::new("bank", "forged-uid");
    store
        .upsert_desired(&forged("forged").to_desired(no_resource.clone(), 1, None))
        .await
        .unwrap();
    store
        .upsert_desired(&forged("forged-uid").to_desired(
            made_up_uid.clone(),
            1,
            Some(tether::lease::ResourceIdentity {
                uid: "made-up-uid".into(),
                created_ms: 1,
                installation: "default".into(),
            }),
        ))
        .await
        .unwrap();
    for key in [&no_resource, &made_up_uid] {
        eventually_or(
            Duration::from_secs(30),
            &format!("{key} refused with a reason"),
            || async {
                store
                    .get(key)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|r| r.status)
                    .is_some_and(|s| s.reason.as_deref() == Some("UnverifiedOrigin"))
            },
            diagnostics,
        )
        .await;
    }
    eventually_or(
        Duration::from_secs(30),
        "the real resource is served",
        || async { !upstream.sessions_of("legit").is_empty() },
        diagnostics,
    )
    .await;
    assert!(
        upstream.sessions_of("forged").is_empty(),
        "a forged item was dialled"
    );
    assert!(
        upstream.sessions_of("forged-uid").is_empty(),
        "a forged item was dialled"
    );
    assert!(
        !diagnostics().contains("other-teams-token"),
        "the Secret leaked"
    );
    let _ = operator.start_kill();
}

/// `kubectl annotate sconn live tether.dev/reconnect=<new value>`: the
/// controller mirrors the annotation beside the spec (no generation change),
/// and the owner closes the session and opens it again, once per value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_annotation_asks_the_owner_to_reconnect_once_per_value() {
    let Operated {
        emulator,
        store,
        upstream,
        dir,
        operator: _operator,
        http,
        ..
    } = Operated::start("op-1", &[]).await;
    create(
        &http,
        format!("{}{PATH}", emulator.url),
        &log_stream("live", &upstream.url("live")),
    )
    .await;
    let diagnostics =
        || std::fs::read_to_string(dir.path().join(Operated::LOG)).unwrap_or_default();
    let open_once = || upstream.open_sessions().get("live") == Some(&1);
    eventually_or(
        Duration::from_secs(30),
        "the stream is served",
        || async { open_once() },
        diagnostics,
    )
    .await;
    let annotate = |value: &'static str| {
        let http = http.clone();
        let url = format!("{}{PATH}/live", emulator.url);
        async move {
            merge_patch(
                &http,
                &url,
                json!({"metadata": {"annotations": {"tether.dev/reconnect": value}}}),
            )
            .await;
        }
    };
    annotate("1").await;
    eventually_or(
        Duration::from_secs(20),
        "a second session, and only one open",
        || async { upstream.sessions_of("live").len() == 2 && open_once() },
        diagnostics,
    )
    .await;
    let item = store
        .get(&StreamKey::new("feeds", "live"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(item.requests.reconnect.as_deref(), Some("1"));
    assert_eq!(item.generation, 1, "an annotation is not a spec change");
    // The same value again (any other change to the resource) asks nothing.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(upstream.sessions_of("live").len(), 2, "{}", diagnostics());
    annotate("2").await;
    eventually_or(
        Duration::from_secs(20),
        "a third session for the new value",
        || async { upstream.sessions_of("live").len() == 3 && open_once() },
        diagnostics,
    )
    .await;
    assert!(upstream.overlaps().is_empty());
}

/// What GitOps tools (kstatus: Flux, Argo CD, cli-utils) and `kubectl wait`
/// read from the status the real operator writes, sampled through a spec
/// change whose new session cannot open for a while, the way back, and a
/// refusal for good: a new generation is never Current or Ready before its
/// own session runs, and a refusal is Failed (Stalled), not InProgress forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_generation_is_in_progress_until_its_session_runs_and_a_refusal_stalls() {
    use tether_testkit::kstatus::{self, Kstatus};
    use tether_testkit::upstream::{FaultyUpstream, Misbehavior};
    let Operated {
        emulator,
        store: _store,
        upstream,
        dir,
        operator: _operator,
        http,
        ..
    } = Operated::start("op-1", &[]).await;
    let object_url = format!("{}{PATH}/gen", emulator.url);
    create(
        &http,
        format!("{}{PATH}", emulator.url),
        &log_stream("gen", &upstream.url("gen")),
    )
    .await;
    let diagnostics =
        || std::fs::read_to_string(dir.path().join(Operated::LOG)).unwrap_or_default();
    let verdict = |wanted: Kstatus, generation: i64| {
        let http = http.clone();
        let url = object_url.clone();
        async move {
            let obj = get(&http, &url).await.unwrap_or_default();
            // Before the controller's first status write kstatus calls any
            // object Current (it has nothing to read): wait for a status.
            obj["status"]["phase"].is_string()
                && obj["metadata"]["generation"] == generation
                && kstatus::compute(&obj) == wanted
        }
    };
    // Current for kstatus, and what kubectl wait --for=condition=Ready waits for.
    let current_and_ready = |generation: i64| {
        let http = http.clone();
        let url = object_url.clone();
        let verdict = &verdict;
        async move {
            eventually_or(
                Duration::from_secs(30),
                &format!("generation {generation} is Current"),
                || verdict(Kstatus::Current, generation),
                diagnostics,
            )
            .await;
            let obj = get(&http, &url).await.unwrap();
            assert!(kstatus::kubectl_wait_satisfied(&obj, "Ready"), "{obj}");
        }
    };
    current_and_ready(1).await;

    let patch_spec = |spec: Value| {
        let http = http.clone();
        let url = object_url.clone();
        async move { merge_patch(&http, &url, json!({ "spec": spec })).await }
    };
    // Generation 2 points at an upstream that refuses the handshake.
    let faulty = FaultyUpstream::start(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
        .await
        .unwrap();
    faulty.set("gen", Misbehavior::Reject);
    patch_spec(json!({"url": faulty.url("gen")})).await;
    let mut seen = Vec::new();
    let until = tokio::time::Instant::now() + Duration::from_secs(6);
    while tokio::time::Instant::now() < until {
        let obj = get(&http, &object_url).await.unwrap();
        assert_eq!(
            kstatus::compute(&obj),
            Kstatus::InProgress,
            "generation 2 cannot be served yet: {obj}"
        );
        assert!(!kstatus::kubectl_wait_satisfied(&obj, "Ready"), "{obj}");
        let ready = obj["status"]["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Ready").cloned())
            .unwrap_or_default();
        seen.push((
            obj["status"]["observedGeneration"].clone(),
            ready["reason"].clone(),
        ));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        seen.iter().any(|(g, r)| *g == 2 && *r == "HandshakeFailed"),
        "the owner's retries of generation 2 are observed: {seen:?}"
    );

    // Back to a working upstream: generation 3 is Current once it runs.
    patch_spec(json!({"url": upstream.url("gen")})).await;
    current_and_ready(3).await;

    // A sink no policy allows: refused for good, so Failed, not InProgress.
    patch_spec(json!({"sink": {"http": {"url": "http://169.254.169.254/ingest"}, "log": null}}))
        .await;
    eventually_or(
        Duration::from_secs(30),
        "generation 4 is Failed (Stalled)",
        || verdict(Kstatus::Failed, 4),
        diagnostics,
    )
    .await;
}

/// DynamoDB requests of one operation the operator has made so far (its
/// `/metrics`, every result).
async fn requests_of(http: &reqwest::Client, metrics: SocketAddr, operation: &str) -> f64 {
    let text = http
        .get(format!("http://{metrics}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| {
            l.starts_with("tether_dynamodb_requests_total{")
                && l.contains(&format!("operation=\"{operation}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The controller's status follows what changed: with 20 resources served and
/// nothing changing, a status refresh of 500 ms reads no stream item per
/// resource per refresh (that was 20 reads a refresh), only the change index
/// and the fleet each pass; and a change a worker makes (a new session asked
/// through the reconnect annotation) still reaches the status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steady_state_status_reads_follow_changes_not_resources() {
    let Operated {
        emulator,
        upstream,
        dir,
        http,
        metrics,
        store: _store,
        operator: _operator,
    } = Operated::start("op-1", &[]).await;
    let names: Vec<String> = (0..20).map(|i| format!("s{i:02}")).collect();
    create_log_streams(&http, &emulator, &upstream, &names).await;
    let diagnostics =
        || std::fs::read_to_string(dir.path().join(Operated::LOG)).unwrap_or_default();
    eventually_or(
        Duration::from_secs(40),
        "every status says Connected",
        || async {
            for name in &names {
                let obj = get(&http, &format!("{}{PATH}/{name}", emulator.url))
                    .await
                    .unwrap_or_default();
                if obj["status"]["phase"] != "Connected" {
                    return false;
                }
            }
            true
        },
        diagnostics,
    )
    .await;
    // Let the last reconciles of the start settle, then count 5 s.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = requests_of(&http, metrics, "get_item").await;
    let passes_before = requests_of(&http, metrics, "query_changes").await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let stream_reads = requests_of(&http, metrics, "get_item").await - before;
    let passes = requests_of(&http, metrics, "query_changes").await - passes_before;
    assert!(
        passes >= 16.0 * 5.0,
        "the change index is read every pass (one query per shard): {passes} queries"
    );
    // Polling would be 20 resources x 10 refreshes = 200 reads (the owners'
    // own re-reads are `reread_item`, not counted here).
    assert!(
        stream_reads < 5.0,
        "{stream_reads} stream item reads in 5 s of steady state\n{}",
        diagnostics()
    );

    // A change only a worker writes still reaches the status.
    let object_url = format!("{}{PATH}/s07", emulator.url);
    let since = get(&http, &object_url).await.unwrap()["status"]["connectedSince"].clone();
    assert!(since.is_string());
    // connectedSince has a resolution of one second.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    merge_patch(
        &http,
        &object_url,
        json!({"metadata": {"annotations": {"tether.dev/reconnect": "1"}}}),
    )
    .await;
    eventually_or(
        Duration::from_secs(20),
        "the new session shows in status",
        || async {
            let obj = get(&http, &object_url).await.unwrap_or_default();
            obj["status"]["connectedSince"] != since && obj["status"]["phase"] == "Connected"
        },
        diagnostics,
    )
    .await;
}
