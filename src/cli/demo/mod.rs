//! `tether demo`: the whole system on one machine, with failures, in about
//! twenty seconds and with nothing to install. An embedded DynamoDB-compatible
//! store, a replaying demo feed and a verifying HTTP sink run in this process;
//! the workers are real `tether worker` processes. One worker is killed with
//! SIGKILL and one stopped with SIGTERM; the summary says how long streams
//! went without a session and whether anything overlapped, was lost, or was
//! delivered by a superseded owner.
//!
//! The feed and the sink are part of the product on purpose: they are what a
//! user needs to see the guarantees for themselves, and the test kit builds
//! its fault-injecting doubles on them instead of copying them.

pub mod feed;
pub mod sink;
pub mod workers;

use crate::config::DemoArgs;
use crate::embedded::EmbeddedStore;
use crate::lease::{LeaseStore, Phase, StoreConfig, StreamView, now_ms};
use crate::metrics::StoreMetrics;
use crate::support::quantile;
use anyhow::{Context, bail};
use feed::{Feed, FeedOptions};
use nix::sys::signal::Signal;
use sink::VerifyingSink;
use std::collections::{HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::process::Child;
use tokio::time::Instant;
use workers::LocalWorkers;

const NAMESPACE: &str = "demo";
const TABLE: &str = "tether-demo";
/// Messages per second each feed session emits.
const RATE: u32 = 10;
/// Bound on every wait in the demo.
const WAIT_LIMIT: Duration = Duration::from_secs(60);
/// How often the demo polls.
const POLL: Duration = Duration::from_millis(100);
/// Heartbeats per lease in the demo's short timings.
const HEARTBEATS_PER_LEASE: u32 = 3;

struct DemoWorker {
    id: String,
    child: Child,
}

fn loopback() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("cannot find the tether binary")?;
    let dir = std::env::temp_dir().join(format!("tether-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let server = EmbeddedStore::start(None, loopback()).await?;
    let feed = Feed::start(
        loopback(),
        FeedOptions {
            rate: RATE,
            ..FeedOptions::default()
        },
    )
    .await?;
    let sink = VerifyingSink::start(loopback()).await?;
    let store = LeaseStore::connect(
        StoreConfig::local(TABLE, server.endpoint()),
        Arc::new(StoreMetrics::new()),
    )
    .await?;
    store.create_table().await?;
    println!("tether demo");
    println!(
        "  store:    embedded dynoxide at {} (table {TABLE})",
        server.endpoint()
    );
    println!(
        "  upstream: ws://{} ({RATE} msg/s per stream, replays from ?after=N)",
        feed.addr
    );
    println!(
        "  sink:     {} (verifies sequence numbers and fencing tokens)",
        sink.url()
    );

    let names: Vec<String> = (0..args.streams).map(|i| format!("feed-{i:02}")).collect();
    let manifests = dir.join("streams.yaml");
    std::fs::write(&manifests, manifests_yaml(&feed, &sink, &names))?;
    println!("\n$ tether apply -f {}", manifests.display());
    super::apply::apply(&store, &[manifests], &Default::default()).await?;

    let lease = args.lease_duration;
    let fleet = LocalWorkers {
        exe,
        endpoint: server.endpoint(),
        table: TABLE.into(),
        lease_duration: lease,
        heartbeat_interval: lease / HEARTBEATS_PER_LEASE,
        reconcile_interval: crate::config::parse_duration(
            crate::config::DEFAULT_RECONCILE_INTERVAL,
        )
        .map_err(anyhow::Error::msg)?,
        fence_margin: Duration::from_secs(1),
        drain_timeout: Duration::from_secs(5),
    };
    println!(
        "\nstarting {} workers (lease {:?}, heartbeat {:?}); logs in {}",
        args.workers,
        lease,
        fleet.heartbeat_interval,
        dir.display()
    );
    let mut workers = Vec::new();
    for i in 1..=args.workers {
        let id = format!("worker-{i}");
        let metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, 0)).to_string();
        let child = fleet
            .command(
                &id,
                &fleet.endpoint,
                &metrics,
                &dir.join(format!("{id}.log")),
            )?
            .spawn()?;
        workers.push(DemoWorker { id, child });
    }
    wait(
        "every stream is connected once, on every worker",
        || async {
            let views = views(&store).await;
            let owners: HashSet<&str> = views
                .iter()
                .filter_map(|v| v.live_owner())
                .map(|o| o.worker_id.as_str())
                .collect();
            connected_once(&feed, &names)
                && owners.len() == args.workers
                && views.iter().all(|v| {
                    v.live_owner().is_some()
                        && v.record
                            .status
                            .as_ref()
                            .is_some_and(|s| s.phase == Phase::Connected)
                })
        },
    )
    .await?;
    show(&store, "every stream connected, load spread by fair share").await;

    // Crash: SIGKILL the busiest worker.
    let victim = busiest(&store, &workers).await;
    let crashed = streams_of(&store, &workers[victim].id).await;
    println!(
        "\n$ kill -KILL {}   # {} holds {} streams",
        workers[victim].child.id().unwrap_or(0),
        workers[victim].id,
        crashed.len()
    );
    let killed_at = Instant::now();
    workers::signal(&workers[victim].child, Signal::SIGKILL)?;
    let failover = new_session_latencies(&feed, &crashed, killed_at, WAIT_LIMIT).await?;
    workers.remove(victim);
    show(&store, "after the crash: its streams resumed elsewhere").await;

    // Graceful: SIGTERM the busiest remaining worker.
    let leaving = busiest(&store, &workers).await;
    let handed = streams_of(&store, &workers[leaving].id).await;
    println!(
        "\n$ kill -TERM {}   # {} holds {} streams",
        workers[leaving].child.id().unwrap_or(0),
        workers[leaving].id,
        handed.len()
    );
    let termed_at = Instant::now();
    workers::signal(&workers[leaving].child, Signal::SIGTERM)?;
    let handoff = new_session_latencies(&feed, &handed, termed_at, WAIT_LIMIT).await?;
    let status = tokio::time::timeout(Duration::from_secs(15), workers[leaving].child.wait())
        .await
        .context("the stopped worker did not exit")??;
    workers.remove(leaving);
    show(
        &store,
        &format!(
            "after the graceful stop (exit status {})",
            status.code().unwrap_or(-1)
        ),
    )
    .await;

    tokio::time::sleep(Duration::from_secs(2)).await;
    for w in &workers {
        let _ = workers::signal(&w.child, Signal::SIGTERM);
    }
    for w in &mut workers {
        let _ = tokio::time::timeout(Duration::from_secs(15), w.child.wait()).await;
    }

    let logs: Vec<_> = names
        .iter()
        .map(|n| sink.log(&format!("{NAMESPACE}/{n}")))
        .collect();
    let gaps: usize = logs.iter().map(|l| l.gaps(1).len()).sum();
    let duplicates: u64 = logs.iter().map(|l| l.duplicates()).sum();
    let delivered: usize = logs.iter().map(|l| l.seqs.len()).sum();
    let overlaps = feed.overlaps().len();
    let stale = sink.stale_messages();
    println!("\nsummary");
    println!(
        "  streams {}, workers {}, distinct messages delivered {delivered}",
        names.len(),
        args.workers
    );
    println!(
        "  crash failover (SIGKILL → new session's first message): p50 {:.2}s  max {:.2}s  (lease {lease:?})",
        quantile(&failover, 0.5),
        quantile(&failover, 1.0)
    );
    println!(
        "  graceful handoff (SIGTERM → new session's first message): p50 {:.2}s  max {:.2}s",
        quantile(&handoff, 0.5),
        quantile(&handoff, 1.0)
    );
    println!("  overlapping sessions: {overlaps}   (must be 0)");
    println!("  sequence gaps at the sink: {gaps}   (must be 0)");
    println!("  stale deliveries (superseded fencing token): {stale}   (must be 0)");
    println!("  duplicates (allowed, replayed after a crash): {duplicates}");
    println!("  worker logs: {}", dir.display());
    if overlaps + gaps > 0 || stale > 0 {
        bail!(
            "safety property violated: {overlaps} overlaps, {gaps} gaps, {stale} stale deliveries"
        );
    }
    Ok(())
}

fn manifests_yaml(feed: &Feed, sink: &VerifyingSink, names: &[String]) -> String {
    names
        .iter()
        .map(|name| {
            format!(
                "apiVersion: tether.dev/v1alpha1\nkind: StreamConnection\nmetadata:\n  name: {name}\n  namespace: {NAMESPACE}\n\
                 spec:\n  url: \"{}\"\n  sequence:\n    pointer: /seq\n  keepalive:\n    intervalSeconds: 2\n    timeoutSeconds: 2\n\
                 \x20 sink:\n    http:\n      url: \"{}\"\n      lingerMs: 50\n",
                feed.url(name),
                sink.url()
            )
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

async fn views(store: &LeaseStore) -> Vec<StreamView> {
    store.view_all().await.map(|(v, _)| v).unwrap_or_default()
}

fn connected_once(feed: &Feed, names: &[String]) -> bool {
    let open = feed.open_sessions();
    names.iter().all(|n| open.get(n) == Some(&1))
}

/// Polls `check` until it holds or [`WAIT_LIMIT`] passes.
async fn wait<F, Fut>(what: &str, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + WAIT_LIMIT;
    while !check().await {
        if Instant::now() > deadline {
            bail!("gave up after {WAIT_LIMIT:?} waiting until {what}");
        }
        tokio::time::sleep(POLL).await;
    }
    Ok(())
}

/// Per stream: seconds from `since` to the first message of a session opened
/// after it (how long a failover or handoff took, end to end).
pub async fn new_session_latencies(
    feed: &Feed,
    names: &[String],
    since: Instant,
    limit: Duration,
) -> anyhow::Result<Vec<f64>> {
    let mut found = HashMap::new();
    let deadline = Instant::now() + limit;
    while found.len() < names.len() {
        for s in feed.sessions() {
            if s.opened >= since
                && names.contains(&s.stream)
                && let Some(first) = s.first_sent
            {
                found
                    .entry(s.stream.clone())
                    .or_insert((first - since).as_secs_f64());
            }
        }
        if Instant::now() > deadline {
            bail!(
                "only {}/{} streams got a new session within {limit:?}",
                found.len(),
                names.len()
            );
        }
        tokio::time::sleep(POLL / 2).await;
    }
    Ok(found.into_values().collect())
}

async fn streams_of(store: &LeaseStore, worker: &str) -> Vec<String> {
    views(store)
        .await
        .into_iter()
        .filter(|v| v.live_owner().is_some_and(|o| o.worker_id == worker))
        .map(|v| v.record.key.name)
        .collect()
}

async fn busiest(store: &LeaseStore, workers: &[DemoWorker]) -> usize {
    let views = views(store).await;
    (0..workers.len())
        .max_by_key(|i| {
            views
                .iter()
                .filter(|v| {
                    v.live_owner()
                        .is_some_and(|o| o.worker_id == workers[*i].id)
                })
                .count()
        })
        .unwrap_or(0)
}

async fn show(store: &LeaseStore, title: &str) {
    println!("\n$ tether get   # {title}");
    print!("{}", super::get::table_text(&views(store).await, now_ms()));
}
