//! `tether demo`: the whole system on one machine, with failures. An embedded
//! DynamoDB-compatible store, the test upstream and a recording HTTP sink run in
//! this process; the workers are real `tether worker` processes. One worker is
//! killed with SIGKILL and one stopped with SIGTERM; the summary says how long
//! streams went without a session and whether anything overlapped or was lost.

use crate::cli;
use crate::config::DemoArgs;
use crate::lease::{LeaseStore, now_ms};
use crate::testkit::bed::{Bed, quantile};
use crate::testkit::fleet::WorkerProcess;
use anyhow::{Context, bail};
use nix::sys::signal::Signal;
use std::time::Duration;
use tokio::time::Instant;

const NAMESPACE: &str = "demo";
/// Messages per second each test-upstream session emits.
const RATE: u32 = 10;
/// Bound on every wait in the demo.
const WAIT_LIMIT: Duration = Duration::from_secs(60);

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("cannot find the tether binary")?;
    let dir = std::env::temp_dir().join(format!("tether-demo-{}", std::process::id()));
    let bed = Bed::start(exe, dir.clone(), RATE).await?;
    let store = bed.table("tether-demo").await?;
    println!("tether demo");
    println!(
        "  store:    embedded dynoxide at {} (table tether-demo)",
        bed.store_server.endpoint()
    );
    println!(
        "  upstream: ws://{} ({RATE} msg/s per stream, replays from ?after=N)",
        bed.upstream.addr
    );
    println!("  sink:     {}", bed.sink.url());

    let names: Vec<String> = (0..args.streams).map(|i| format!("feed-{i:02}")).collect();
    let manifests = dir.join("streams.yaml");
    std::fs::write(&manifests, manifests_yaml(&bed, &names))?;
    println!("\n$ tether apply -f {}", manifests.display());
    cli::apply(&store, &manifests).await?;

    let lease = args.lease_duration;
    let mut fleet = bed.fleet(
        &store,
        lease,
        lease / 5,
        crate::config::parse_duration(crate::config::DEFAULT_RECONCILE_INTERVAL)
            .map_err(anyhow::Error::msg)?,
    );
    fleet.drain_timeout = Duration::from_secs(5);
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
    Bed::wait(
        WAIT_LIMIT,
        "every stream is connected once, on every worker",
        || async {
            let owners = Bed::owners(&store).await;
            let distinct: std::collections::HashSet<&String> = owners.values().collect();
            bed.connected_once(&names)
                && owners.len() == names.len()
                && distinct.len() == args.workers
                && store
                    .list()
                    .await
                    .unwrap_or_default()
                    .iter()
                    .all(|r| r.status.as_ref().is_some_and(|s| s.phase == "Connected"))
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
    let failover = bed
        .new_session_latencies(&crashed, killed_at, WAIT_LIMIT)
        .await?;
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
    let handoff = bed
        .new_session_latencies(&handed, termed_at, WAIT_LIMIT)
        .await?;
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

    let gaps = bed.gaps(NAMESPACE, &names);
    let overlaps = bed.overlaps(&names);
    let stale = bed.sink.stale_messages();
    let delivered: usize = names
        .iter()
        .map(|n| bed.sink.log(&format!("{NAMESPACE}/{n}")).seqs.len())
        .sum();
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
    println!(
        "  duplicates (allowed, replayed after a crash): {}",
        bed.duplicates(NAMESPACE, &names)
    );
    println!("  worker logs: {}", dir.display());
    if overlaps + gaps > 0 || stale > 0 {
        bail!(
            "safety property violated: {overlaps} overlaps, {gaps} gaps, {stale} stale deliveries"
        );
    }
    Ok(())
}

fn manifests_yaml(bed: &Bed, names: &[String]) -> String {
    names
        .iter()
        .map(|name| {
            format!(
                "apiVersion: tether.dev/v1alpha1\nkind: StreamConnection\nmetadata:\n  name: {name}\n  namespace: {NAMESPACE}\n\
                 spec:\n  url: \"{}\"\n  sequence:\n    pointer: /seq\n  keepalive:\n    intervalSeconds: 2\n    timeoutSeconds: 2\n\
                 \x20 sink:\n    http:\n      url: \"{}\"\n      lingerMs: 50\n",
                bed.upstream.url(name),
                bed.sink.url()
            )
        })
        .collect::<Vec<_>>()
        .join("---\n")
}

async fn streams_of(store: &LeaseStore, worker: &str) -> Vec<String> {
    Bed::owners(store)
        .await
        .into_iter()
        .filter(|(_, o)| o == worker)
        .map(|(s, _)| s)
        .collect()
}

async fn busiest(store: &LeaseStore, workers: &[WorkerProcess]) -> usize {
    let owners = Bed::owners(store).await;
    (0..workers.len())
        .max_by_key(|i| owners.values().filter(|o| **o == workers[*i].id).count())
        .unwrap_or(0)
}

async fn show(store: &LeaseStore, title: &str) -> anyhow::Result<()> {
    println!("\n$ tether get   # {title}");
    print!("{}", cli::table_text(&store.list().await?, now_ms()));
    Ok(())
}
