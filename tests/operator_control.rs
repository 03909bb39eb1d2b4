//! The controller in a shared cluster, with the real `tether operator` binary
//! against the Kubernetes API emulator and the embedded store: one leader per
//! installation and hand-over, two installations side by side, deletion while
//! the table is unreachable, and garbage collection of orphaned items.

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tether::lease::{DesiredState, LeaseStore, ResourceIdentity, StreamKey};
use tether_testkit::bed::{eventually_or, loopback};
use tether_testkit::dynamo_proxy::{DynamoFault, DynamoFaultProxy};
use tether_testkit::k8s::{self, Emulator};
use tether_testkit::processes::{free_port, metric_sum};
use tether_testkit::store::{endpoint, fresh_store};

const NAMESPACE: &str = "feeds";

/// One `tether operator` process.
struct Operator {
    child: tokio::process::Child,
    metrics: SocketAddr,
    log: PathBuf,
}

impl Operator {
    fn start(
        emulator: &Emulator,
        store: &LeaseStore,
        id: &str,
        dir: &Path,
        dynamodb: Option<&str>,
        extra: &[&str],
    ) -> Self {
        let metrics = free_port().unwrap();
        let log = dir.join(format!("{id}.log"));
        let kubeconfig = emulator.kubeconfig(dir, NAMESPACE);
        let mut cmd = k8s::operator_command_at(
            Path::new(env!("CARGO_BIN_EXE_tether")),
            store.table(),
            id,
            &kubeconfig,
            Duration::from_secs(3),
            Duration::from_millis(750),
            metrics,
        );
        if let Some(endpoint) = dynamodb {
            cmd.env("AWS_ENDPOINT_URL_DYNAMODB", endpoint);
        }
        let child = cmd
            .args(extra)
            .env("POD_NAMESPACE", NAMESPACE)
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        Self {
            child,
            metrics,
            log,
        }
    }

    async fn metric(&self, name: &str) -> f64 {
        let text = reqwest::get(format!("http://{}/metrics", self.metrics))
            .await
            .ok();
        match text {
            Some(r) => metric_sum(&r.text().await.unwrap_or_default(), name, ""),
            None => 0.0,
        }
    }

    async fn leading(&self) -> bool {
        self.metric("tether_controller_leader").await == 1.0
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn signal(&self, signal: Signal) {
        let pid = self.child.id().expect("running") as i32;
        kill(Pid::from_raw(pid), signal).unwrap();
    }
}

struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    fn new(emulator: &Emulator) -> Self {
        Self {
            http: reqwest::Client::new(),
            base: format!(
                "{}/apis/tether.dev/v1alpha1/namespaces/{NAMESPACE}/streamconnections",
                emulator.url
            ),
        }
    }

    async fn create(&self, name: &str, installation: Option<&str>) {
        let mut metadata = json!({"name": name, "namespace": NAMESPACE});
        if let Some(i) = installation {
            metadata["labels"] = json!({"tether.dev/installation": i});
        }
        let manifest = json!({
            "apiVersion": "tether.dev/v1alpha1",
            "kind": "StreamConnection",
            "metadata": metadata,
            // Nothing listens there: the stream stays in backoff, which is
            // all these tests need.
            "spec": {"url": "ws://127.0.0.1:9/feed", "sink": {"log": {}}},
        });
        let r = self
            .http
            .post(&self.base)
            .json(&manifest)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    }

    async fn get(&self, name: &str) -> Option<Value> {
        let r = self
            .http
            .get(format!("{}/{name}", self.base))
            .send()
            .await
            .ok()?;
        if r.status() == 404 {
            return None;
        }
        r.json().await.ok()
    }

    async fn patch(&self, name: &str, body: Value) {
        k8s::merge_patch(&self.http, &format!("{}/{name}", self.base), body).await;
    }

    async fn delete(&self, name: &str) {
        let r = self
            .http
            .delete(format!("{}/{name}", self.base))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    }

    async fn ready_reason(&self, name: &str) -> Option<String> {
        let obj = self.get(name).await?;
        obj["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "Ready")
            .and_then(|c| c["reason"].as_str().map(String::from))
    }
}

async fn mirrored(store: &LeaseStore, name: &str) -> bool {
    store
        .get(&StreamKey::new(NAMESPACE, name))
        .await
        .ok()
        .flatten()
        .is_some_and(|r| !r.is_tombstone())
}

/// An item as a controller of `installation` would have mirrored it from the
/// resource `uid` (which need not exist).
async fn mirror_item(
    store: &LeaseStore,
    namespace: &str,
    name: &str,
    uid: &str,
    installation: &str,
) {
    let item = tether_testkit::fixtures::log_spec("ws://127.0.0.1:9/x").to_desired(
        StreamKey::new(namespace, name),
        1,
        Some(ResourceIdentity {
            uid: uid.into(),
            created_ms: 1,
            installation: installation.into(),
        }),
    );
    store.upsert_desired(&item).await.unwrap();
}

async fn lease_holder(emulator: &Emulator, name: &str) -> Option<String> {
    let url = format!(
        "{}/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{name}",
        emulator.url
    );
    let lease: Value = reqwest::get(url).await.ok()?.json().await.ok()?;
    lease["spec"]["holderIdentity"].as_str().map(String::from)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_reconciles_and_a_standby_takes_over_when_it_dies() {
    let emulator = Emulator::start();
    let store = fresh_store(None).await;
    let dir = tempfile::tempdir().unwrap();
    let api = Api::new(&emulator);
    let a = Operator::start(&emulator, &store, "op-a", dir.path(), None, &[]);
    let explain = || std::fs::read_to_string(dir.path().join("op-a.log")).unwrap_or_default();
    eventually_or(
        Duration::from_secs(20),
        "op-a leads",
        || a.leading(),
        explain,
    )
    .await;
    let b = Operator::start(&emulator, &store, "op-b", dir.path(), None, &[]);
    let both = || format!("op-a:\n{}\nop-b:\n{}", a.log(), b.log());
    eventually_or(
        Duration::from_secs(20),
        "op-b is up (standing by)",
        || async {
            reqwest::get(format!("http://{}/metrics", b.metrics))
                .await
                .is_ok()
        },
        both,
    )
    .await;
    api.create("first", None).await;
    eventually_or(
        Duration::from_secs(20),
        "the leader mirrors a new resource",
        || mirrored(&store, "first"),
        both,
    )
    .await;
    // Several renewals later the standby still stands by.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(a.leading().await, "{}", both());
    assert!(!b.leading().await, "two leaders\n{}", both());
    assert_eq!(b.metric("tether_controller_reconciles_total").await, 0.0);
    assert!(
        lease_holder(&emulator, "tether-controller")
            .await
            .is_some_and(|h| h.starts_with("op-a-")),
        "{}",
        both()
    );

    // The leader crashes: the standby takes over after the lease (3 s).
    a.signal(Signal::SIGKILL);
    let crashed = tokio::time::Instant::now();
    eventually_or(
        Duration::from_secs(15),
        "op-b leads",
        || b.leading(),
        || b.log(),
    )
    .await;
    let took = crashed.elapsed();
    api.create("second", None).await;
    eventually_or(
        Duration::from_secs(20),
        "the new leader mirrors a new resource",
        || mirrored(&store, "second"),
        || b.log(),
    )
    .await;
    assert!(
        lease_holder(&emulator, "tether-controller")
            .await
            .is_some_and(|h| h.starts_with("op-b-")),
        "{}",
        b.log()
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");

    // A clean stop hands over at the next attempt, not after a lease.
    let c = Operator::start(&emulator, &store, "op-c", dir.path(), None, &[]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!c.leading().await);
    b.signal(Signal::SIGTERM);
    eventually_or(
        Duration::from_secs(15),
        "op-c leads after op-b stopped cleanly",
        || c.leading(),
        || format!("op-b:\n{}\nop-c:\n{}", b.log(), c.log()),
    )
    .await;
}

/// The API emulator and two fresh tables, for two installations side by
/// side (each test starts its operators when its scenario needs them).
struct TwoTables {
    emulator: Emulator,
    first: LeaseStore,
    second: LeaseStore,
    dir: tempfile::TempDir,
    api: Api,
}

impl TwoTables {
    async fn new() -> Self {
        let emulator = Emulator::start();
        let api = Api::new(&emulator);
        Self {
            first: fresh_store(None).await,
            second: fresh_store(None).await,
            dir: tempfile::tempdir().unwrap(),
            emulator,
            api,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_installations_in_one_cluster_never_claim_the_same_resource() {
    let TwoTables {
        emulator,
        first: prod_table,
        second: staging_table,
        dir,
        api,
    } = TwoTables::new().await;
    let prod = Operator::start(&emulator, &prod_table, "prod", dir.path(), None, &[]);
    let staging = Operator::start(
        &emulator,
        &staging_table,
        "staging",
        dir.path(),
        None,
        &["--installation", "staging"],
    );
    let explain = || format!("prod:\n{}\nstaging:\n{}", prod.log(), staging.log());
    // Another cluster wrote `feeds/shared` into the staging table first.
    mirror_item(
        &staging_table,
        NAMESPACE,
        "shared",
        "uid-elsewhere",
        "eu-cluster",
    )
    .await;
    api.create("unlabelled", None).await;
    api.create("for-staging", Some("staging")).await;
    api.create("shared", Some("staging")).await;
    eventually_or(
        Duration::from_secs(20),
        "each installation mirrors its own resource",
        || async {
            mirrored(&prod_table, "unlabelled").await
                && mirrored(&staging_table, "for-staging").await
        },
        explain,
    )
    .await;
    eventually_or(
        Duration::from_secs(20),
        "the other installation's item is refused in status",
        || async { api.ready_reason("shared").await.as_deref() == Some("MirrorRefused") },
        explain,
    )
    .await;
    // Well after both reconciled everything: nothing crossed over.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!mirrored(&prod_table, "for-staging").await, "{}", explain());
    assert!(!mirrored(&prod_table, "shared").await, "{}", explain());
    assert!(
        !mirrored(&staging_table, "unlabelled").await,
        "{}",
        explain()
    );
    let kept = staging_table
        .get(&StreamKey::new(NAMESPACE, "shared"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(kept.installation.as_deref(), Some("eu-cluster"));
    assert_eq!(kept.uid.as_deref(), Some("uid-elsewhere"));
    let prod_item = prod_table
        .get(&StreamKey::new(NAMESPACE, "unlabelled"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(prod_item.installation.as_deref(), Some("default"));
    // Each installation leads through its own Lease.
    assert!(prod.leading().await && staging.leading().await);
    assert!(lease_holder(&emulator, "tether-controller").await.is_some());
    assert!(
        lease_holder(&emulator, "tether-controller-staging")
            .await
            .is_some()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletion_while_the_table_is_unreachable_is_reported_and_can_be_skipped_then_collected() {
    let emulator = Emulator::start();
    let store = fresh_store(None).await;
    let proxy = DynamoFaultProxy::start(loopback(), &endpoint().0)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let api = Api::new(&emulator);
    let op = Operator::start(
        &emulator,
        &store,
        "op",
        dir.path(),
        Some(&proxy.endpoint()),
        &["--gc-grace", "2s"],
    );
    let explain = || op.log();
    api.create("doomed", None).await;
    eventually_or(
        Duration::from_secs(20),
        "mirrored with status",
        || async { mirrored(&store, "doomed").await && api.ready_reason("doomed").await.is_some() },
        explain,
    )
    .await;

    proxy.set(DynamoFault::Blackhole);
    api.delete("doomed").await;
    eventually_or(
        Duration::from_secs(30),
        "status says the cleanup is blocked",
        || async { api.ready_reason("doomed").await.as_deref() == Some("CleanupBlocked") },
        explain,
    )
    .await;
    let events: Value = reqwest::get(format!(
        "{}/apis/events.k8s.io/v1/namespaces/{NAMESPACE}/events",
        emulator.url
    ))
    .await
    .unwrap()
    .json()
    .await
    .unwrap();
    assert!(
        events["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["reason"] == "CleanupBlocked"),
        "{events}"
    );
    assert!(api.get("doomed").await.is_some(), "the finalizer holds it");

    // The admin lets it go; the item stays until the table answers again.
    api.patch(
        "doomed",
        json!({"metadata": {"annotations": {"tether.dev/skip-cleanup": "true"}}}),
    )
    .await;
    eventually_or(
        Duration::from_secs(20),
        "the resource is gone",
        || async { api.get("doomed").await.is_none() },
        explain,
    )
    .await;
    assert!(mirrored(&store, "doomed").await, "left in the table");
    proxy.set(DynamoFault::Pass);
    eventually_or(
        Duration::from_secs(30),
        "the garbage collector stops and deletes the orphaned item",
        || async { !mirrored(&store, "doomed").await },
        explain,
    )
    .await;
    let item = store
        .get(&StreamKey::new(NAMESPACE, "doomed"))
        .await
        .unwrap();
    assert!(
        item.is_none_or(|r| r.is_tombstone() && r.desired_state == DesiredState::Stopped),
        "a tombstone keeps the token"
    );
    // Counted once the collection's last write (telling the owner) returns,
    // which can be just after the tombstone is visible.
    eventually_or(
        Duration::from_secs(10),
        "the collection is counted",
        || async { op.metric("tether_controller_items_collected_total").await == 1.0 },
        explain,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_item_whose_finalizer_was_stripped_by_hand_is_collected_after_the_grace_only() {
    let emulator = Emulator::start();
    let store = fresh_store(None).await;
    let dir = tempfile::tempdir().unwrap();
    let api = Api::new(&emulator);
    let op = Operator::start(
        &emulator,
        &store,
        "op",
        dir.path(),
        None,
        &["--gc-grace", "4s"],
    );
    let explain = || op.log();
    api.create("stripped", None).await;
    api.create("kept", None).await;
    eventually_or(
        Duration::from_secs(20),
        "both mirrored",
        || async { mirrored(&store, "stripped").await && mirrored(&store, "kept").await },
        explain,
    )
    .await;
    // An item the controller did not write (standalone `tether apply`) is
    // never collected, whatever its name.
    let standalone = tether_testkit::fixtures::log_spec("ws://127.0.0.1:9/x").to_desired(
        StreamKey::new(NAMESPACE, "standalone"),
        1,
        None,
    );
    store.upsert_desired(&standalone).await.unwrap();
    // While no operator runs, an admin strips the finalizer and deletes the
    // resource: nothing cleans the item up at deletion.
    let mut op = op;
    op.child.kill().await.unwrap();
    api.patch("stripped", json!({"metadata": {"finalizers": []}}))
        .await;
    api.delete("stripped").await;
    assert!(api.get("stripped").await.is_none());
    let op = Operator::start(
        &emulator,
        &store,
        "op2",
        dir.path(),
        None,
        &["--gc-grace", "4s"],
    );
    let explain = || op.log();
    let gone_at = tokio::time::Instant::now();
    eventually_or(
        Duration::from_secs(20),
        "op2 leads",
        || op.leading(),
        explain,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        mirrored(&store, "stripped").await,
        "collected before the grace"
    );
    eventually_or(
        Duration::from_secs(30),
        "collected after the grace",
        || async { !mirrored(&store, "stripped").await },
        explain,
    )
    .await;
    assert!(gone_at.elapsed() >= Duration::from_secs(4));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(mirrored(&store, "kept").await, "{}", op.log());
    assert!(mirrored(&store, "standalone").await, "{}", op.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_watched_namespaces_are_reconciled_and_collected() {
    let emulator = Emulator::start();
    let store = fresh_store(None).await;
    let dir = tempfile::tempdir().unwrap();
    let api = Api::new(&emulator);
    // Orphaned items of this installation in a watched and an unwatched namespace.
    for ns in [NAMESPACE, "elsewhere"] {
        mirror_item(&store, ns, "orphan", "uid-gone", "default").await;
    }
    let op = Operator::start(
        &emulator,
        &store,
        "op",
        dir.path(),
        None,
        &["--watch-namespaces", NAMESPACE, "--gc-grace", "1s"],
    );
    let explain = || op.log();
    let elsewhere = format!(
        "{}/apis/tether.dev/v1alpha1/namespaces/elsewhere/streamconnections",
        emulator.url
    );
    let created = reqwest::Client::new()
        .post(&elsewhere)
        .json(&json!({
            "apiVersion": "tether.dev/v1alpha1",
            "kind": "StreamConnection",
            "metadata": {"name": "unwatched", "namespace": "elsewhere"},
            "spec": {"url": "ws://127.0.0.1:9/feed", "sink": {"log": {}}},
        }))
        .send()
        .await
        .unwrap();
    assert!(created.status().is_success());
    api.create("watched", None).await;
    eventually_or(
        Duration::from_secs(20),
        "the watched namespace's resource is mirrored and its orphan collected",
        || async { mirrored(&store, "watched").await && !mirrored(&store, "orphan").await },
        explain,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let in_elsewhere = |name: &'static str| {
        let store = store.clone();
        async move {
            store
                .get(&StreamKey::new("elsewhere", name))
                .await
                .unwrap()
                .is_some_and(|r| !r.is_tombstone())
        }
    };
    assert!(!in_elsewhere("unwatched").await, "{}", op.log());
    assert!(
        in_elsewhere("orphan").await,
        "collected outside the watched namespaces"
    );
}

/// Two unnamed installations (each in its own namespace, so each leads
/// through its own Lease) on different tables both select every unlabelled
/// resource. Each resource is claimed for one table before anything is
/// mirrored (an annotation written on the resource version), so it lands in
/// exactly one table and its stream runs once; the other installation says
/// why it leaves it alone, and takes it over only when the claim is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_unnamed_installations_on_different_tables_never_serve_one_resource_twice() {
    let TwoTables {
        emulator,
        first: first_table,
        second: second_table,
        dir,
        api,
    } = TwoTables::new().await;
    let names: Vec<String> = (0..6).map(|i| format!("u{i}")).collect();
    // Resources first, then both operators at once: every claim is a race.
    for name in &names {
        api.create(name, None).await;
    }
    let first = Operator::start(&emulator, &first_table, "first", dir.path(), None, &[]);
    let second = Operator::start(
        &emulator,
        &second_table,
        "second",
        dir.path(),
        None,
        &["--leader-namespace", "other-release"],
    );
    let explain = || format!("first:\n{}\nsecond:\n{}", first.log(), second.log());
    let tables = [
        (first_table.identity(), &first_table),
        (second_table.identity(), &second_table),
    ];
    eventually_or(
        Duration::from_secs(30),
        "every resource claimed and mirrored",
        || async {
            for name in &names {
                let claimed = api.get(name).await.and_then(|o| {
                    o["metadata"]["annotations"]["tether.dev/table"]
                        .as_str()
                        .map(String::from)
                });
                let Some(claimed) = claimed else { return false };
                let Some((_, store)) = tables.iter().find(|(t, _)| *t == claimed) else {
                    return false;
                };
                if !mirrored(store, name).await {
                    return false;
                }
            }
            true
        },
        explain,
    )
    .await;
    // Well after both reconciled everything: each resource in one table only.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut per_table = [0, 0];
    for name in &names {
        let in_first = mirrored(&first_table, name).await;
        let in_second = mirrored(&second_table, name).await;
        assert!(
            in_first != in_second,
            "{name}: in both tables or none\n{}",
            explain()
        );
        per_table[usize::from(in_second)] += 1;
    }
    assert!(first.leading().await && second.leading().await);
    let refusals = first.log().matches("leaves it alone").count()
        + second.log().matches("leaves it alone").count();
    assert_eq!(
        refusals,
        names.len(),
        "one refusal per resource\n{}",
        explain()
    );

    // The claim moved by hand (a migration between tables): the table that
    // loses it stops and deletes its item, so the stream still runs from one
    // table only.
    // Whichever table won the first resource, move it to the other.
    let moved = names[0].clone();
    let (from, to) = if mirrored(&first_table, &moved).await {
        (&first_table, &second_table)
    } else {
        (&second_table, &first_table)
    };
    api.patch(
        &moved,
        json!({"metadata": {"annotations": {"tether.dev/table": to.identity()}}}),
    )
    .await;
    eventually_or(
        Duration::from_secs(30),
        "the moved resource is in the other table only",
        || async { mirrored(to, &moved).await && !mirrored(from, &moved).await },
        explain,
    )
    .await;
    eprintln!("resources per table: {per_table:?}");
}

/// Event writes (creates and patches of events.k8s.io Events) so far.
async fn event_writes(emulator: &Emulator) -> f64 {
    let counts: std::collections::BTreeMap<String, f64> =
        reqwest::get(format!("{}/_requests", emulator.url))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    counts
        .iter()
        .filter(|(k, _)| k.ends_with(" events") && !k.starts_with("GET") && !k.starts_with("WATCH"))
        .map(|(_, v)| v)
        .sum()
}

/// Resources in `NAMESPACE` whose streams `upstream` serves, and a reader of
/// their owners once every one is Connected.
struct Served {
    http: reqwest::Client,
    base: String,
    names: Vec<String>,
}

impl Served {
    async fn create(
        emulator: &Emulator,
        upstream: &tether_testkit::upstream::TestUpstream,
        names: Vec<String>,
    ) -> Self {
        let http = reqwest::Client::new();
        let base = format!(
            "{}/apis/tether.dev/v1alpha1/namespaces/{NAMESPACE}/streamconnections",
            emulator.url
        );
        for name in &names {
            let r = http
                .post(&base)
                .json(&json!({
                    "apiVersion": "tether.dev/v1alpha1",
                    "kind": "StreamConnection",
                    "metadata": {"name": name, "namespace": NAMESPACE},
                    "spec": {"url": upstream.url(name), "sink": {"log": {}}},
                }))
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success());
        }
        Self { http, base, names }
    }

    /// Each resource's status owner, once all are Connected.
    async fn owners(&self) -> Option<Vec<String>> {
        let mut owners = Vec::new();
        for name in &self.names {
            let obj: Value = self
                .http
                .get(format!("{}/{name}", self.base))
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            if obj["status"]["phase"] != "Connected" {
                return None;
            }
            owners.push(obj["status"]["owner"].as_str()?.to_string());
        }
        Some(owners)
    }

    /// Every resource Connected, owned by one of `allowed`.
    async fn served_by(&self, allowed: &[&str]) -> bool {
        self.owners()
            .await
            .is_some_and(|o| o.iter().all(|w| allowed.contains(&w.as_str())))
    }
}

/// Two operator replicas on one table serving `count` streams named
/// `<prefix><i>` from a live upstream (`b_args`: the second one's extra
/// flags).
struct ServedFleet {
    emulator: Emulator,
    store: LeaseStore,
    upstream: tether_testkit::upstream::TestUpstream,
    dir: tempfile::TempDir,
    served: Served,
    a: Operator,
    b: Operator,
}

impl ServedFleet {
    async fn start(prefix: &str, count: usize, ids: [&str; 2], b_args: &[&str]) -> Self {
        let emulator = Emulator::start();
        let store = fresh_store(None).await;
        let upstream = tether_testkit::upstream::start(loopback(), 5)
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let names = (0..count).map(|i| format!("{prefix}{i}")).collect();
        let served = Served::create(&emulator, &upstream, names).await;
        let a = Operator::start(&emulator, &store, ids[0], dir.path(), None, &[]);
        let b = Operator::start(&emulator, &store, ids[1], dir.path(), None, b_args);
        Self {
            emulator,
            store,
            upstream,
            dir,
            served,
            a,
            b,
        }
    }
}

/// A rolling restart moves every stream (some twice) and writes a bounded
/// number of events: an owner move is routine, shown in status and metrics,
/// not one event per stream per move (that was `Acquired` for every move:
/// at least one event per stream here, ten thousand on a large fleet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_moves_every_stream_and_writes_a_bounded_number_of_events() {
    let ServedFleet {
        emulator,
        store,
        upstream: _upstream,
        dir,
        served,
        mut a,
        mut b,
    } = ServedFleet::start("r", 10, ["roll-a", "roll-b"], &[]).await;
    let explain = || String::from("see the operators' logs in the test's directory");
    eventually_or(
        Duration::from_secs(40),
        "every stream Connected",
        || served.served_by(&["roll-a", "roll-b"]),
        explain,
    )
    .await;
    let before = event_writes(&emulator).await;
    // Replace each pod in turn, as a Deployment's rolling update does.
    for (old, new_id) in [(&mut a, "roll-c"), (&mut b, "roll-d")] {
        old.signal(Signal::SIGTERM);
        let _ = tokio::time::timeout(Duration::from_secs(20), old.child.wait()).await;
        *old = Operator::start(&emulator, &store, new_id, dir.path(), None, &[]);
    }
    eventually_or(
        Duration::from_secs(60),
        "every stream Connected on the new pods",
        || served.served_by(&["roll-c", "roll-d"]),
        explain,
    )
    .await;
    // The moves are summed up on the leader's Lease: a count, not an event
    // per stream per move.
    let events_url = format!(
        "{}/apis/events.k8s.io/v1/namespaces/{NAMESPACE}/events",
        emulator.url
    );
    let moved = || async {
        let events: Value = reqwest::get(&events_url)
            .await
            .unwrap()
            .json()
            .await
            .unwrap_or_default();
        events["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["reason"] == "OwnersMoved" && e["regarding"]["kind"] == "Lease")
            .filter_map(|e| e["note"].as_str()?.split(' ').next()?.parse::<u64>().ok())
            .sum::<u64>()
    };
    eventually_or(
        Duration::from_secs(45),
        "a summary counts every stream that moved",
        || async { moved().await >= served.names.len() as u64 },
        explain,
    )
    .await;
    let written = event_writes(&emulator).await - before;
    assert!(
        written <= 4.0,
        "{written} event writes for a rolling restart of {} streams",
        served.names.len()
    );
}

/// The status follows an owner that dies while the controller lives on (the
/// feed reads the fleet and the acquisitions that follow; nothing polls each
/// resource): every stream of the killed worker shows its new owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_a_worker_dies_the_status_of_its_streams_follows_them_to_the_survivor() {
    // Every part is bound: a dropped emulator or upstream would stop.
    let ServedFleet {
        emulator: _emulator,
        store: _store,
        upstream: _upstream,
        dir,
        served,
        a,
        b,
    } = ServedFleet::start("d", 8, ["live-a", "live-b"], &[]).await;
    let explain = || format!("a:\n{}\nb:\n{}", a.log(), b.log());
    // Both hold streams (fair share), and one of them leads.
    eventually_or(
        Duration::from_secs(40),
        "both workers hold streams",
        || async {
            served
                .owners()
                .await
                .is_some_and(|o| o.iter().any(|w| w == "live-a") && o.iter().any(|w| w == "live-b"))
        },
        explain,
    )
    .await;
    let (survivor, victim) = if a.leading().await { (a, b) } else { (b, a) };
    let survivor_id = if survivor.log == dir.path().join("live-a.log") {
        "live-a"
    } else {
        "live-b"
    };
    victim.signal(Signal::SIGKILL);
    let only_survivor = [survivor_id];
    eventually_or(
        Duration::from_secs(40),
        "every status shows the survivor",
        || served.served_by(&only_survivor),
        || survivor.log(),
    )
    .await;
}

/// Two unnamed installations (each leading in its own namespace) on one
/// table: both claim with the same table, mirror into the same item, and the
/// table's one owner serves each stream once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_unnamed_installations_on_one_table_serve_each_resource_once() {
    let ServedFleet {
        emulator,
        store,
        upstream,
        dir: _dir,
        served,
        a: x,
        b: y,
    } = ServedFleet::start("s", 4, ["x", "y"], &["--leader-namespace", "other-release"]).await;
    let explain = || format!("x:\n{}\ny:\n{}", x.log(), y.log());
    eventually_or(
        Duration::from_secs(40),
        "every stream Connected",
        || served.served_by(&["x", "y"]),
        explain,
    )
    .await;
    assert!(x.leading().await && y.leading().await, "{}", explain());
    // Both controllers reconcile every resource; a few seconds of that.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let api = Api::new(&emulator);
    for name in &served.names {
        let obj = api.get(name).await.unwrap();
        assert_eq!(
            obj["metadata"]["annotations"]["tether.dev/table"],
            store.identity().as_str()
        );
        assert_eq!(
            upstream.open_sessions().get(name.as_str()),
            Some(&1),
            "{name}"
        );
    }
    assert!(upstream.overlaps().is_empty(), "{:?}", upstream.overlaps());
    assert!(
        !x.log().contains("leaves it alone") && !y.log().contains("leaves it alone"),
        "one table: nothing refused\n{}",
        explain()
    );
}
