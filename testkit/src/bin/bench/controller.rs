//! The controller's load on the Kubernetes API and on DynamoDB, against the
//! API emulator: `tether operator` replicas (1 and 3) with N resources whose
//! streams are served, at steady state and in the minute after a replica is
//! killed (the leader for tether; a new pod replaces it when there was one),
//! tether next to tether 0.1 in the same run. Every flag is the binary's
//! default; the API requests are counted by the emulator, the DynamoDB
//! requests by each replica's own metrics (the controller's operations:
//! `upsert_desired`, `get_item`, `query_changes`; a holder's re-reads of
//! the streams it holds are `reread_item`, counted apart). "tether, polled" is this binary on a table without the
//! change index, where the controller falls back to the previous design:
//! each resource's item read every `--status-refresh`.

use crate::{Ctx, HOURS_PER_MONTH, PRICE_PER_MILLION_RRU, PRICE_PER_MILLION_WRU, round2};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tether_testkit::bed::loopback;
use tether_testkit::k8s::Emulator;
use tether_testkit::processes::{free_port, metric_sum};
use tether_testkit::store::{endpoint, fresh_store};
use tokio::process::Child;
use tokio::time::Instant;

const NAMESPACE: &str = "bench";

pub async fn run(ctx: &Ctx) -> anyhow::Result<Value> {
    let mut out = serde_json::Map::new();
    for replicas in [1usize, 3] {
        for (design, exe) in [
            ("tether", &ctx.exe),
            ("tether, polled", &ctx.exe),
            ("tether 0.1", &ctx.legacy),
        ] {
            let figures = one(ctx, exe, design == "tether, polled", replicas).await?;
            let line = |phase: &str| {
                let f = &figures[phase];
                format!(
                    "API writes {:>6.1}/min (status {:>6.1}, events {:>5.1}), DynamoDB upserts {:>6.1}/min, GetItem {:>6.1}/min, change queries {:>5.1}/min",
                    f["api_writes_per_min"].as_f64().unwrap_or(f64::NAN),
                    f["status_patches_per_min"].as_f64().unwrap_or(f64::NAN),
                    f["events_per_min"].as_f64().unwrap_or(f64::NAN),
                    f["dynamodb_upserts_per_min"].as_f64().unwrap_or(f64::NAN),
                    f["dynamodb_get_item_per_min"].as_f64().unwrap_or(f64::NAN),
                    f["dynamodb_change_queries_per_min"]
                        .as_f64()
                        .unwrap_or(f64::NAN),
                )
            };
            println!(
                "controller {design:<10} {replicas} replica(s) steady   {}",
                line("steady")
            );
            println!(
                "controller {design:<10} {replicas} replica(s) failover {}",
                line("failover")
            );
            out.insert(format!("{design} x{replicas}"), figures);
        }
    }
    out.insert("resources".into(), json!(ctx.profile.controller_resources));
    out.insert(
        "window_s".into(),
        json!(ctx.profile.controller_window.as_secs_f64()),
    );
    Ok(Value::Object(out))
}

struct Replica {
    child: Child,
    metrics: SocketAddr,
}

fn start_replica(
    exe: &Path,
    table: &str,
    id: &str,
    kubeconfig: &Path,
    log: PathBuf,
) -> anyhow::Result<Replica> {
    let metrics = free_port()?;
    let child = tokio::process::Command::new(exe)
        .args(["--table", table, "operator", "--worker-id", id])
        .args(["--metrics-addr", &metrics.to_string()])
        .env("KUBECONFIG", kubeconfig)
        .env("POD_NAMESPACE", NAMESPACE)
        .env("AWS_ENDPOINT_URL_DYNAMODB", endpoint().0)
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "x")
        .env("AWS_SECRET_ACCESS_KEY", "x")
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(log)?))
        .kill_on_drop(true)
        .spawn()?;
    Ok(Replica { child, metrics })
}

/// Requests to a saturated emulator must not hang the run.
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long replicas get to put an owner on every resource's status.
const SETTLE_LIMIT: Duration = Duration::from_secs(300);

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(HTTP_TIMEOUT)
        .build()
        .expect("an HTTP client")
}

async fn metrics_text(replica: &Replica) -> String {
    match http()
        .get(format!("http://{}/metrics", replica.metrics))
        .send()
        .await
    {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// API requests (from the emulator) and the controller's DynamoDB requests
/// (summed over replicas, including ones already gone: kept in `gone`).
#[derive(Clone, Default)]
struct Counts {
    api: BTreeMap<String, f64>,
    upserts: f64,
    get_items: f64,
    change_queries: f64,
    /// Capacity units the controller's operations consumed, as each
    /// replica's store client counted them from DynamoDB's answers.
    read_units: f64,
    write_units: f64,
}

/// The store operations of the controller half of `tether operator` (the
/// worker half's are labelled apart: its fleet, peers, counter, partitions
/// and re-reads): mirror writes and tombstones, the change feed, and status
/// reads (`get_item`; the owner's worker item and checkpoints, read for a
/// status, are `get_worker`/`batch_get_checkpoints`, which a worker also makes
/// only when it declares a peer dead or takes its streams over, and which are
/// left out).
const CONTROLLER_OPERATIONS: [&str; 4] =
    ["upsert_desired", "tombstone", "query_changes", "get_item"];

async fn counts(emulator: &Emulator, replicas: &[Replica], gone: &Counts) -> Counts {
    let api: BTreeMap<String, f64> = match http()
        .get(format!("{}/_requests", emulator.url))
        .send()
        .await
    {
        Ok(r) => r.json().await.unwrap_or_default(),
        Err(_) => BTreeMap::new(),
    };
    let mut c = Counts {
        api,
        ..gone.clone()
    };
    for r in replicas {
        let text = metrics_text(r).await;
        for op in CONTROLLER_OPERATIONS {
            let label = format!("operation=\"{op}\"");
            c.read_units += metric_sum(&text, "tether_dynamodb_consumed_read_units_total", &label);
            c.write_units +=
                metric_sum(&text, "tether_dynamodb_consumed_write_units_total", &label);
        }
        c.upserts += metric_sum(
            &text,
            "tether_dynamodb_requests_total",
            "operation=\"upsert_desired\"",
        );
        c.get_items += metric_sum(
            &text,
            "tether_dynamodb_requests_total",
            "operation=\"get_item\"",
        );
        c.change_queries += metric_sum(
            &text,
            "tether_dynamodb_requests_total",
            "operation=\"query_changes\"",
        );
    }
    c
}

/// Requests per minute between two counts; the capacity units only with
/// `units_counted` (tether 0.1 counts no read units: `null` rather than 0).
fn per_minute(before: &Counts, after: &Counts, window: Duration, units_counted: bool) -> Value {
    let scale = 60.0 / window.as_secs_f64();
    let api = |pred: &dyn Fn(&str) -> bool| {
        after
            .api
            .iter()
            .filter(|(k, _)| pred(k))
            .map(|(k, v)| v - before.api.get(k).copied().unwrap_or(0.0))
            .sum::<f64>()
            * scale
            // An empty float sum is -0.0; report 0.
            + 0.0
    };
    let writes =
        api(&|k| !k.starts_with("GET") && !k.starts_with("WATCH") && !k.contains("leases"));
    let read_units = (after.read_units - before.read_units) * scale;
    let write_units = (after.write_units - before.write_units) * scale;
    json!({
        "api_writes_per_min": round2(writes),
        "status_patches_per_min": round2(api(&|k| k.starts_with("PATCH") && k.ends_with("/status"))),
        "events_per_min": round2(api(&|k| k.starts_with("POST events") || k.starts_with("PATCH events"))),
        "lease_requests_per_min": round2(api(&|k| k.contains("leases"))),
        "api_reads_per_min": round2(api(&|k| k.starts_with("GET"))),
        "dynamodb_upserts_per_min": round2((after.upserts - before.upserts) * scale),
        "dynamodb_get_item_per_min": round2((after.get_items - before.get_items) * scale),
        "dynamodb_change_queries_per_min": round2((after.change_queries - before.change_queries) * scale),
        "dynamodb_read_units_per_min": units_counted.then(|| round2(read_units)),
        "dynamodb_write_units_per_min": units_counted.then(|| round2(write_units)),
        // At this rate for a month, on-demand prices.
        "dynamodb_usd_per_month": units_counted.then(|| round2(
            (read_units * PRICE_PER_MILLION_RRU + write_units * PRICE_PER_MILLION_WRU)
                * 60.0
                * HOURS_PER_MONTH
                / 1e6
        )),
    })
}

async fn one(ctx: &Ctx, exe: &Path, polled: bool, replicas: usize) -> anyhow::Result<Value> {
    let n = ctx.profile.controller_resources;
    let window = ctx.profile.controller_window;
    let emulator = Emulator::start();
    let units_counted = exe != ctx.legacy.as_path();
    // Each design on a table it created (0.1 refuses a table without its index).
    let store = if !units_counted {
        tether_testkit::bed::legacy_store(&ctx.legacy).await?
    } else if polled {
        tether_testkit::store::store_without_change_index().await
    } else {
        fresh_store(None).await
    };
    let upstream = tether_testkit::upstream::start(loopback(), 1).await?;
    let dir = std::env::temp_dir().join(format!(
        "tether-bench-controller-{:08x}",
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir)?;
    let kubeconfig = emulator.kubeconfig(&dir, NAMESPACE);
    let http = http();
    let base = format!(
        "{}/apis/tether.dev/v1alpha1/namespaces/{NAMESPACE}/streamconnections",
        emulator.url
    );
    for i in 0..n {
        let name = format!("s{i:05}");
        http.post(&base)
            .json(&json!({
                "apiVersion": "tether.dev/v1alpha1",
                "kind": "StreamConnection",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"url": upstream.url(&name), "sink": {"log": {}}},
            }))
            .send()
            .await?
            .error_for_status()?;
    }
    let mut fleet = Vec::new();
    for r in 0..replicas {
        fleet.push(start_replica(
            exe,
            store.table(),
            &format!("op-{r}"),
            &kubeconfig,
            dir.join(format!("op-{r}.log")),
        )?);
    }
    // Every resource served and its status written once. A design that
    // saturates the emulator may never get there: it is measured anyway, and
    // the run says so.
    let settled =
        tether_testkit::bed::Bed::wait(SETTLE_LIMIT, "every resource shows an owner", || async {
            let list: Value = match http.get(&base).send().await {
                Ok(r) => r.json().await.unwrap_or_default(),
                Err(_) => return false,
            };
            list["items"].as_array().is_some_and(|items| {
                items.len() == n && items.iter().all(|o| o["status"]["owner"].is_string())
            })
        })
        .await
        .is_ok();
    if !settled {
        println!(
            "controller: not every status showed an owner within {SETTLE_LIMIT:?} (emulator saturated); measuring anyway"
        );
    }
    tokio::time::sleep(Duration::from_secs(20)).await;
    let gone = Counts::default();
    let before = counts(&emulator, &fleet, &gone).await;
    tokio::time::sleep(window).await;
    let after = counts(&emulator, &fleet, &gone).await;
    let steady = per_minute(&before, &after, window, units_counted);

    // Failover: kill the leader (tether) or the first replica (0.1); a lone
    // replica is replaced by a new pod, as its Deployment would.
    let mut victim = 0;
    for (i, r) in fleet.iter().enumerate() {
        if metric_sum(&metrics_text(r).await, "tether_controller_leader", "") == 1.0 {
            victim = i;
        }
    }
    let before = counts(&emulator, &fleet, &gone).await;
    let mut dead = fleet.remove(victim);
    let last = counts(&emulator, std::slice::from_ref(&dead), &Counts::default()).await;
    let gone = Counts {
        api: BTreeMap::new(),
        ..last
    };
    dead.child.kill().await?;
    let killed = Instant::now();
    if fleet.is_empty() {
        fleet.push(start_replica(
            exe,
            store.table(),
            "op-replacement",
            &kubeconfig,
            dir.join("op-replacement.log"),
        )?);
    }
    tokio::time::sleep(window.saturating_sub(killed.elapsed())).await;
    let after = counts(&emulator, &fleet, &gone).await;
    let failover = per_minute(&before, &after, window, units_counted);
    for mut r in fleet {
        let _ = r.child.kill().await;
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(json!({"steady": steady, "failover": failover, "replicas": replicas, "settled": settled}))
}
