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
