//! Container restart inside a pod, against the Kubernetes API emulator: the
//! new container proves from its pod's status that its predecessor is gone and
//! takes its streams back at once. Measured from the new process's start to
//! each stream's first message on a new session, with the proof and without
//! it (a pod status the kubelet has not updated: the lease decides).

use crate::{Ctx, stats};
use serde_json::{Value, json};
use std::process::Stdio;
use std::time::Duration;
use tether_testkit::bed::loopback;
use tether_testkit::fixtures::log_spec;
use tether_testkit::k8s::{self, Emulator};
use tether_testkit::store::fresh_store;
use tokio::time::Instant;

const STREAMS: usize = 20;

pub async fn run(ctx: &Ctx) -> anyhow::Result<Value> {
    let proven = one(ctx, true).await?;
    let unproven = one(ctx, false).await?;
    println!(
        "container restart  with the kubelet's proof p99 {:.2}s | without it (lease {:?}) p99 {:.2}s",
        proven["p99_s"].as_f64().unwrap_or(f64::NAN),
        ctx.profile.lease,
        unproven["p99_s"].as_f64().unwrap_or(f64::NAN)
    );
    Ok(
        json!({"with_proof": proven, "without_proof": unproven, "lease_s": ctx.profile.lease.as_secs_f64()}),
    )
}

async fn one(ctx: &Ctx, record_restart: bool) -> anyhow::Result<Value> {
    let emulator = Emulator::start();
    let store = fresh_store(None).await;
    let upstream = tether_testkit::upstream::start(loopback(), 10).await?;
    let http = reqwest::Client::new();
    let pods = format!("{}/api/v1/namespaces/bench/pods", emulator.url);
    let created: Value = http
        .post(&pods)
        .json(&k8s::pod("tether-0", "bench", 0))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let pod_uid = created["metadata"]["uid"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("the emulator gave the pod no uid: {created}"))?
        .to_string();
    let names: Vec<String> = (0..STREAMS).map(|i| format!("r{i:02}")).collect();
    // Resources, as users create them: in operator mode a worker serves only
    // items the controller wrote for an existing StreamConnection.
    let resources = format!(
        "{}/apis/tether.dev/v1alpha1/namespaces/bench/streamconnections",
        emulator.url
    );
    for n in &names {
        http.post(&resources)
            .json(&json!({
                "apiVersion": "tether.dev/v1alpha1",
                "kind": "StreamConnection",
                "metadata": {"name": n, "namespace": "bench"},
                "spec": log_spec(&upstream.url(n)),
            }))
            .send()
            .await?
            .error_for_status()?;
    }
    let dir = std::env::temp_dir().join(format!(
        "tether-bench-restart-{:08x}",
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir)?;
    let kubeconfig = emulator.kubeconfig(&dir, "bench");
    // Each run is the pod's container as its own mounts show it (what the
    // proof checks besides POD_NAME).
    let start = |log: &str| -> anyhow::Result<tokio::process::Child> {
        let mut cmd = k8s::operator_command(
            &ctx.exe,
            store.table(),
            "tether-0",
            &kubeconfig,
            ctx.profile.lease,
            ctx.profile.heartbeat,
        );
        cmd.env("POD_NAME", "tether-0")
            .env("POD_NAMESPACE", "bench");
        Ok(k8s::in_kubelet_container(cmd, &dir, &pod_uid, "tether")?
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(dir.join(log))?))
            .kill_on_drop(true)
            .spawn()?)
    };
    let mut first = start("first.log")?;
    tether_testkit::bed::Bed::wait(
        Duration::from_secs(60),
        "the first container serves every stream",
        || async {
            let open = upstream.open_sessions();
            names.iter().all(|n| open.get(n) == Some(&1))
        },
    )
    .await?;
    tokio::time::sleep(ctx.profile.heartbeat).await;
    first.start_kill()?;
    let _ = first.wait().await;
    if record_restart {
        http.patch(format!("{pods}/tether-0/status"))
            .header("content-type", "application/merge-patch+json")
            .body(json!({"status": k8s::pod("tether-0", "bench", 1)["status"]}).to_string())
            .send()
            .await?
            .error_for_status()?;
    }
    let t0 = Instant::now();
    let mut second = start("second.log")?;
    let latencies =
        tether::cli::demo::new_session_latencies(&upstream, &names, t0, ctx.profile.lease * 4)
            .await?;
    second.start_kill()?;
    let _ = second.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
    let mut result = stats(&latencies);
    result["overlapping_sessions"] = json!(upstream.overlaps().len());
    Ok(result)
}
