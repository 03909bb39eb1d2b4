//! The command line with kubectl's habits, as a user runs it: the real binary
//! against the embedded store's server, manifests on disk and on stdin.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use tether::lease::{DesiredState, LeaseStore, StreamKey};
use tether_testkit::store::{endpoint, fresh_store};

const EXE: &str = env!("CARGO_BIN_EXE_tether");

fn tether(store: &LeaseStore, args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(EXE)
        .args(["--table", store.table()])
        .args(args)
        .env("AWS_ENDPOINT_URL_DYNAMODB", endpoint().0)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "x")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    drop(child.stdin.take());
    child.wait_with_output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn manifest(name: &str, namespace: &str, extra: &str) -> String {
    format!(
        "apiVersion: tether.dev/v1alpha1\nkind: StreamConnection\nmetadata: {{name: {name}, namespace: {namespace}}}\n\
         spec: {{url: 'ws://127.0.0.1:9/{name}', sink: {{log: {{}}}}{extra}}}\n"
    )
}

async fn state(store: &LeaseStore, ns: &str, name: &str) -> Option<DesiredState> {
    store
        .get(&StreamKey::new(ns, name))
        .await
        .unwrap()
        .filter(|r| !r.is_tombstone())
        .map(|r| r.desired_state)
}

#[tokio::test]
async fn a_misspelt_field_is_refused_with_its_path_unless_validation_is_relaxed() {
    let store = fresh_store(None).await;
    let typo = manifest("typo", "default", ", desiredstate: Stopped");
    let out = tether(&store, &["apply", "-f", "-"], Some(&typo));
    assert!(!out.status.success(), "exit code 1");
    assert!(
        text(&out.stderr).contains(
            "error: - document 1: spec.desiredstate: unknown field (did you mean \"desiredState\"?)"
        ),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        state(&store, "default", "typo").await,
        None,
        "nothing applied"
    );

    let warned = tether(
        &store,
        &["apply", "-f", "-", "--validate=warn"],
        Some(&typo),
    );
    assert!(warned.status.success(), "{}", text(&warned.stderr));
    assert!(
        text(&warned.stderr).contains("warning:"),
        "{}",
        text(&warned.stderr)
    );
    assert_eq!(
        state(&store, "default", "typo").await,
        Some(DesiredState::Started)
    );
    let ignored = tether(
        &store,
        &["apply", "-f", "-", "--validate=false"],
        Some(&typo),
    );
    assert!(ignored.status.success());
    assert!(!text(&ignored.stderr).contains("warning:"));
}

#[tokio::test]
async fn several_files_directories_recursion_namespaces_outputs_and_delete_by_file() {
    let store = fresh_store(None).await;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::write(root.join("a.yaml"), manifest("a", "red", "")).unwrap();
    std::fs::create_dir(root.join("more")).unwrap();
    std::fs::write(root.join("more/b.yaml"), manifest("b", "blue", "")).unwrap();
    let single = root.join("c.yaml");
    std::fs::write(&single, manifest("c", "red", "")).unwrap();
    let dir_arg = root.to_str().unwrap();

    // A directory without -R: its subdirectories are left alone.
    let flat = tether(&store, &["apply", "-f", dir_arg], None);
    assert!(flat.status.success(), "{}", text(&flat.stderr));
    assert_eq!(state(&store, "blue", "b").await, None);
    let out = tether(
        &store,
        &["apply", "-f", dir_arg, "-R", "-f", single.to_str().unwrap()],
        None,
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(state(&store, "blue", "b").await.is_some());

    let names = tether(&store, &["get", "-n", "red", "-o", "name"], None);
    assert_eq!(
        text(&names.stdout),
        "streamconnection/red/a\nstreamconnection/red/c\n"
    );
    let all = tether(&store, &["get", "-A", "-o", "name"], None);
    assert_eq!(text(&all.stdout).lines().count(), 3);
    let one: serde_yaml::Value = serde_yaml::from_slice(
        &tether(&store, &["get", "b", "-n", "blue", "-o", "yaml"], None).stdout,
    )
    .unwrap();
    assert_eq!(one["name"].as_str(), Some("blue/b"));
    let wide = text(&tether(&store, &["get", "-o", "wide"], None).stdout);
    assert!(
        wide.lines().next().unwrap().contains("URL") && wide.contains("ws://127.0.0.1:9/a"),
        "{wide}"
    );

    // delete -f removes what the manifests name; a missing one is an error
    // unless ignored.
    let deleted = tether(&store, &["delete", "-f", single.to_str().unwrap()], None);
    assert!(deleted.status.success(), "{}", text(&deleted.stderr));
    assert_eq!(state(&store, "red", "c").await, None);
    let missing = tether(&store, &["delete", "c", "-n", "red"], None);
    assert!(!missing.status.success());
    let ignored = tether(
        &store,
        &["delete", "c", "a", "-n", "red", "--ignore-not-found"],
        None,
    );
    assert!(ignored.status.success(), "{}", text(&ignored.stderr));
    assert_eq!(state(&store, "red", "a").await, None);
}

#[test]
fn completions_are_generated_for_each_shell() {
    for shell in ["bash", "zsh", "fish"] {
        let out = Command::new(EXE)
            .args(["completion", shell])
            .output()
            .unwrap();
        assert!(out.status.success(), "{shell}");
        let script = text(&out.stdout);
        assert!(
            script.contains("tether") && script.contains("apply"),
            "{shell}: {script}"
        );
    }
    assert!(Path::new(EXE).exists());
}

#[tokio::test]
async fn get_watch_prints_a_row_again_when_it_changes_and_stops_on_sigint() {
    let store = fresh_store(None).await;
    let doc = manifest("watched", "default", "");
    assert!(
        tether(&store, &["apply", "-f", "-"], Some(&doc))
            .status
            .success()
    );
    let child = Command::new(EXE)
        .args(["--table", store.table(), "get", "-w"])
        .env("AWS_ENDPOINT_URL_DYNAMODB", endpoint().0)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "x")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let stopped = manifest("watched", "default", ", desiredState: Stopped");
    assert!(
        tether(&store, &["apply", "-f", "-"], Some(&stopped))
            .status
            .success()
    );
    tokio::time::sleep(std::time::Duration::from_secs(4)).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let printed = text(&out.stdout);
    let rows: Vec<&str> = printed
        .lines()
        .filter(|l| l.starts_with("default/watched"))
        .collect();
    assert_eq!(
        printed.lines().filter(|l| l.starts_with("NAME")).count(),
        1,
        "{printed}"
    );
    assert_eq!(rows.len(), 2, "{printed}");
    assert!(
        rows[0].contains("STARTED") && rows[1].contains("STOPPED"),
        "{printed}"
    );
}

/// The rules of CloudWatch's Embedded Metric Format specification: a
/// millisecond `_aws.Timestamp`, directives with a Namespace (not `AWS/`),
/// at most 30 dimensions per set, each a string member of the root, 1 to 100
/// metrics, each a number member of the root.
fn assert_valid_emf(doc: &serde_json::Value) {
    let aws = &doc["_aws"];
    assert!(
        aws["Timestamp"]
            .as_u64()
            .is_some_and(|t| t > 1_000_000_000_000),
        "{doc}"
    );
    let directives = aws["CloudWatchMetrics"].as_array().expect("directives");
    assert!(!directives.is_empty());
    for d in directives {
        let ns = d["Namespace"].as_str().expect("a namespace");
        assert!(!ns.is_empty() && ns.len() <= 255 && !ns.starts_with("AWS/"));
        for set in d["Dimensions"].as_array().expect("dimension sets") {
            let set = set.as_array().expect("a dimension set");
            assert!(set.len() <= 30);
            for key in set {
                assert!(doc[key.as_str().unwrap()].is_string(), "dimension {key}");
            }
        }
        let metrics = d["Metrics"].as_array().expect("metrics");
        assert!(!metrics.is_empty() && metrics.len() <= 100);
        for m in metrics {
            let name = m["Name"].as_str().expect("a metric name");
            assert!(doc[name].is_number(), "metric {name}");
        }
    }
}

#[tokio::test]
async fn a_worker_writes_the_cloudwatch_emf_line_with_its_assigned_streams() {
    let store = fresh_store(None).await;
    // Assigned but unreachable: it counts, as for the HPA gauge.
    let doc = manifest("emf", "default", "");
    assert!(
        tether(&store, &["apply", "-f", "-"], Some(&doc))
            .status
            .success()
    );
    let mut child = tokio::process::Command::new(EXE)
        .args([
            "--table",
            store.table(),
            "worker",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .args(["--emf-namespace", "Tether", "--emf-interval", "1s"])
        .env("AWS_ENDPOINT_URL_DYNAMODB", endpoint().0)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "x")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let found = tokio::time::timeout(std::time::Duration::from_secs(20), async {
        while let Ok(Some(line)) = lines.next_line().await {
            let Ok(doc) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            if doc.get("_aws").is_some() && doc["ActiveConnections"] == 1 {
                return doc;
            }
        }
        panic!("stdout closed without an EMF line");
    })
    .await
    .expect("an EMF line with the assigned stream");
    assert_valid_emf(&found);
    assert_eq!(found["Table"], store.table());
    assert_eq!(found["_aws"]["CloudWatchMetrics"][0]["Namespace"], "Tether");
    let _ = child.kill().await;
}

/// Right after a worker starts serving, `tether get` says what v2 stores: how
/// long ago the owner renewed its heartbeat (a new incarnation has renewed
/// nothing yet, but it registered), and the freshest checkpoint, which the
/// owner packs into its heartbeat once the sink acknowledged something.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_shows_the_owners_heartbeat_age_and_the_freshest_checkpoint_from_the_start() {
    use std::time::Duration;
    use tether_testkit::bed::{Bed, BedOptions, eventually};
    let bed = Bed::start(EXE, BedOptions::default()).await.unwrap();
    let names = bed.apply("g", 1).await.unwrap();
    let _worker = bed.fleet.spawn("w1").unwrap();
    eventually(Duration::from_secs(20), "the stream is connected", || {
        bed.all_connected_once(&names)
    })
    .await;
    let table = text(&tether(&bed.store, &["get"], None).stdout);
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "STATE", "PHASE", "OWNER", "HEARTBEAT", "CHECKPOINT"],
        "{table}"
    );
    let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(row[3], "w1", "{table}");
    // "1.2s ago": a real age, not a countdown stuck at 0.0s before the first renewal.
    assert_eq!(row[5], "ago", "{table}");
    let age: f64 = row[4].trim_end_matches('s').parse().unwrap();
    assert!(age < 10.0, "{table}");
    // Within a heartbeat the sink's acknowledgements reach the checkpoint column.
    eventually(Duration::from_secs(10), "a checkpoint is shown", || async {
        let table = text(&tether(&bed.store, &["get", "-o", "json"], None).stdout);
        let rows: serde_json::Value = serde_json::from_str(&table).unwrap();
        rows[0]["lastSeq"].as_u64().is_some() && rows[0]["heartbeatAgeMs"].as_u64().is_some()
    })
    .await;
}

/// `--advertise-ip` must be an address peers can reach: a wildcard is
/// refused at start, with the flag named, before anything is registered.
#[tokio::test]
async fn a_wildcard_advertise_ip_is_refused_with_a_clear_error() {
    let store = fresh_store(None).await;
    let out = tether(
        &store,
        &[
            "worker",
            "--metrics-addr",
            "127.0.0.1:0",
            "--advertise-ip",
            "0.0.0.0",
        ],
        None,
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("--advertise-ip 0.0.0.0") && err.contains("pod IP"),
        "{err}"
    );
    assert!(store.fleet().await.unwrap().workers.is_empty());
}
