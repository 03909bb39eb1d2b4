//! `tether demo`: the whole system on one machine, with failures. An embedded
//! DynamoDB-compatible store, the test upstream and a recording HTTP sink run in
//! this process; the workers are real `tether worker` processes. One worker is
//! killed with SIGKILL and one stopped with SIGTERM; the summary says how long
//! streams went without a session and whether anything overlapped or was lost.

use crate::cli;
use crate::config::DemoArgs;
use crate::embedded::{EMBEDDED_CREDENTIALS, EmbeddedStore};
use crate::lease::{LeaseStore, StoreConfig, now_ms};
use crate::metrics::StoreMetrics;
use crate::testkit::fleet::{FleetConfig, WorkerProcess};
use crate::testkit::sink::RecordingSink;
use crate::testkit::upstream::TestUpstream;
use anyhow::{Context, bail};
use nix::sys::signal::Signal;
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

const NAMESPACE: &str = "demo";
/// Messages per second each test-upstream session emits.
const RATE: u32 = 10;
/// Bound on every wait in the demo.
const WAIT_LIMIT: Duration = Duration::from_secs(60);

fn loopback() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, 0))
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("cannot find the tether binary")?;
    let store_server = EmbeddedStore::start(None, loopback()).await?;
    let mut cfg = StoreConfig::new("tether-demo");
    cfg.endpoint = Some(store_server.endpoint());
    cfg.region = Some("us-east-1".into());
    cfg.static_credentials = Some((EMBEDDED_CREDENTIALS.0.into(), EMBEDDED_CREDENTIALS.1.into()));
    let store = LeaseStore::connect(cfg, Arc::new(StoreMetrics::new())).await?;
    store.create_table().await?;
    let upstream = TestUpstream::start(loopback(), RATE).await?;
    let sink = RecordingSink::start(loopback()).await?;
    println!("tether demo");
    println!(
        "  store:    embedded dynoxide at {} (table tether-demo)",
        store_server.endpoint()
    );
    println!(
        "  upstream: ws://{} ({RATE} msg/s per stream, replays from ?after=N)",
        upstream.addr
    );
    println!("  sink:     {}", sink.url());

    let dir = std::env::temp_dir().join(format!("tether-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let manifests = dir.join("streams.yaml");
    std::fs::write(&manifests, manifests_yaml(&upstream, &sink, args.streams))?;
    println!("\n$ tether apply -f {}", manifests.display());
    cli::apply(&store, &manifests).await?;

    let lease = args.lease_duration;
    let fleet = FleetConfig {
        exe,
        endpoint: store_server.endpoint(),
        table: store.table().to_string(),
        lease_duration: lease,
        heartbeat_interval: lease / 5,
        reconcile_interval: Duration::from_millis(500),
        max_clock_skew: lease / 6,
        fence_margin: lease / 12,
        drain_timeout: Duration::from_secs(5),
        log_dir: dir.clone(),
        extra_args: Vec::new(),
    };
    println!(
        "\nstarting {} workers (lease {:?}, heartbeat {:?}); logs in {}",
        args.workers,
        lease,
        fleet.heartbeat_interval,
        dir.display()
    );
    let mut workers: Vec<WorkerProcess> = Vec::new();
    for i in 1..=args.workers {
        workers.push(fleet.spawn(&format!("worker-{i}"))?);
    }
    wait(
        &format!("all {} streams are connected once and spread", args.streams),
        || async {
            connected_once(&upstream, &store, args.streams).await
                && store
                    .list()
                    .await
                    .unwrap_or_default()
                    .iter()
                    .all(|r| r.status.as_ref().is_some_and(|s| s.phase == "Connected"))
                && owners(&store)
                    .await
                    .values()
                    .map(String::as_str)
                    .collect::<std::collections::HashSet<_>>()
                    .len()
                    == args.workers
        },
    )
    .await?;
    show(&store, "every stream connected, load spread by fair share").await?;

    // Crash: SIGKILL the busiest worker.
    let victim = busiest(&store, &workers).await;
    let crashed = streams_of(&store, &workers[victim].id).await;
    println!(
        "\n$ kill -KILL {}   # {} holds {} streams",
        workers[victim].pid().unwrap_or(0),
        workers[victim].id,
        crashed.len()
    );
    let killed_at = Instant::now();
    workers[victim].signal(Signal::SIGKILL)?;
    let failover = reconnect_times(&upstream, &crashed, killed_at).await?;
    workers.remove(victim);
    show(&store, "after the crash: its streams resumed elsewhere").await?;

    // Graceful: SIGTERM the busiest remaining worker.
    let leaving = busiest(&store, &workers).await;
    let handed = streams_of(&store, &workers[leaving].id).await;
    println!(
        "\n$ kill -TERM {}   # {} holds {} streams",
        workers[leaving].pid().unwrap_or(0),
        workers[leaving].id,
        handed.len()
    );
    let termed_at = Instant::now();
    workers[leaving].signal(Signal::SIGTERM)?;
    let handoff = reconnect_times(&upstream, &handed, termed_at).await?;
    let status = workers[leaving].wait(Duration::from_secs(15)).await?;
    workers.remove(leaving);
    show(
        &store,
        &format!(
            "after the graceful stop (exit status {})",
            status.code().unwrap_or(-1)
        ),
    )
    .await?;

    tokio::time::sleep(Duration::from_secs(2)).await;
    for w in &workers {
        let _ = w.signal(Signal::SIGTERM);
    }
    for w in &mut workers {
        let _ = w.wait(Duration::from_secs(15)).await;
    }

    let logs = sink.logs();
    let gaps: usize = logs.values().map(|l| l.gaps(1).len()).sum();
    let duplicates: u64 = logs.values().map(|l| l.duplicates()).sum();
    let delivered: usize = logs.values().map(|l| l.seqs.len()).sum();
    let overlaps = upstream.overlaps().len();
    let stale = sink.stale_messages();
    println!("\nsummary");
    println!(
        "  streams {}, workers {}, distinct messages delivered {delivered}",
        args.streams, args.workers
    );
    println!(
        "  crash failover (SIGKILL → new session's first message): p50 {:.2}s  max {:.2}s  (lease {:?})",
        pct(&failover, 0.5),
        pct(&failover, 1.0),
        lease
    );
    println!(
        "  graceful handoff (SIGTERM → new session's first message): p50 {:.2}s  max {:.2}s",
        pct(&handoff, 0.5),
        pct(&handoff, 1.0)
    );
    println!("  overlapping sessions: {overlaps}   (must be 0)");
    println!("  sequence gaps at the sink: {gaps}   (must be 0)");
    println!("  stale deliveries (superseded fencing token): {stale}   (must be 0)");
    println!("  duplicates (allowed, replayed after a crash): {duplicates}");
    store_server.shutdown().await;
    if overlaps + gaps > 0 || stale > 0 {
        bail!(
            "safety property violated: {overlaps} overlaps, {gaps} gaps, {stale} stale deliveries"
        );
    }
    println!("  worker logs: {}", dir.display());
    Ok(())
}

fn manifests_yaml(upstream: &TestUpstream, sink: &RecordingSink, n: usize) -> String {
    (0..n)
        .map(|i| {
            let name = format!("feed-{i:02}");
            format!(
                "apiVersion: tether.dev/v1alpha1\nkind: StreamConnection\nmetadata:\n  name: {name}\n  namespace: {NAMESPACE}\n\
                 spec:\n  url: \"{}\"\n  sequence:\n    pointer: /seq\n  keepalive:\n    intervalSeconds: 2\n    timeoutSeconds: 2\n\
                 \x20 sink:\n    http:\n      url: \"{}\"\n      lingerMs: 50\n",
                upstream.url(&name),
                sink.url()
            )
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

async fn wait<F, Fut>(what: &str, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + WAIT_LIMIT;
    while !check().await {
        if Instant::now() > deadline {
            bail!("demo gave up waiting until {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

async fn owners(store: &LeaseStore) -> HashMap<String, String> {
    let now = now_ms();
    store
        .list()
        .await
        .unwrap_or_default()
        .into_iter()
        .filter_map(|r| {
            r.live_owner(now)
                .map(|o| (r.key.name.clone(), o.to_string()))
        })
        .collect()
}

async fn connected_once(upstream: &TestUpstream, store: &LeaseStore, n: usize) -> bool {
    let open = upstream.open_sessions();
    let owners = owners(store).await;
    owners.len() == n && open.len() == n && open.values().all(|c| *c == 1)
}

async fn streams_of(store: &LeaseStore, worker: &str) -> Vec<String> {
    owners(store)
        .await
        .into_iter()
        .filter(|(_, o)| o == worker)
        .map(|(s, _)| s)
        .collect()
}

async fn busiest(store: &LeaseStore, workers: &[WorkerProcess]) -> usize {
    let owners = owners(store).await;
    (0..workers.len())
        .max_by_key(|i| owners.values().filter(|o| **o == workers[*i].id).count())
        .unwrap_or(0)
}

/// Per stream: time from `since` to the first message sent on a session opened after it.
async fn reconnect_times(
    upstream: &TestUpstream,
    streams: &[String],
    since: Instant,
) -> anyhow::Result<Vec<f64>> {
    let mut times = HashMap::new();
    wait("the affected streams have new sessions", || {
        for s in upstream.sessions() {
            if s.opened >= since
                && streams.contains(&s.stream)
                && let Some(first) = s.first_sent
            {
                times
                    .entry(s.stream.clone())
                    .or_insert((first - since).as_secs_f64());
            }
        }
        let done = times.len() == streams.len();
        async move { done }
    })
    .await?;
    Ok(times.into_values().collect())
}

fn pct(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v[i]
}

async fn show(store: &LeaseStore, title: &str) -> anyhow::Result<()> {
    println!("\n$ tether get   # {title}");
    print!("{}", cli::table_text(&store.list().await?, now_ms()));
    Ok(())
}
