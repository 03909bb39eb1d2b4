//! A rolling restart of three workers (the new one starts first, then the old
//! one gets SIGTERM, as the chart's Deployment does), for each design; and the
//! seeded chaos soak (tether only).

use crate::designs::Design;
use crate::{Ctx, stop_all};
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::time::Duration;
use tether_testkit::bed::{Bed, BedOptions};
use tether_testkit::chaos::{self, ChaosConfig};
use tokio::time::Instant;

const SAMPLE: Duration = Duration::from_millis(100);

pub async fn run(ctx: &Ctx) -> anyhow::Result<Value> {
    let designs = Design::measured(ctx);
    let results = futures::future::join_all(designs.iter().map(|d| one(ctx, *d))).await;
    let mut row = serde_json::Map::new();
    for (design, result) in designs.iter().zip(results) {
        let result = result.map_err(|e| e.context(design.name()))?;
        println!(
            "rolling restart   {:<11} {:>7.1} stream-s ownerless (max {:.1}s)  overlaps {} gaps {}",
            design.name(),
            result["ownerless_stream_seconds"].as_f64().unwrap_or(0.0),
            result["max_ownerless_s"].as_f64().unwrap_or(0.0),
            result["overlapping_sessions"],
            result["sequence_gaps"],
        );
        row.insert(design.name().into(), result);
    }
    Ok(Value::Object(row))
}

async fn one(ctx: &Ctx, design: Design) -> anyhow::Result<Value> {
    let bed = design
        .bed(ctx, 10, &format!("roll-{}", design.name().replace('.', "")))
        .await?;
    let names = bed.apply("s", ctx.profile.rolling_streams).await?;
    let fleet = design.fleet(ctx, &bed, &tether_testkit::store::endpoint().0);
    let (lease, heartbeat, reconcile) = design.timings(ctx);
    let mut workers: Vec<_> = (0..3)
        .map(|i| fleet.spawn(&format!("a{i}")))
        .collect::<Result<_, _>>()?;
    let limit = lease * 3 + reconcile * 3 + Duration::from_secs(30);
    Bed::wait(limit, "all rolling streams connected", || async {
        bed.connected_once(&names)
    })
    .await?;
    tokio::time::sleep(heartbeat * 2).await;
    let started = Instant::now();
    let mut ownerless = 0.0;
    let mut max_run: f64 = 0.0;
    let mut runs: HashMap<String, f64> = HashMap::new();
    for (i, slot) in workers.iter_mut().enumerate() {
        let replacement = fleet.spawn(&format!("b{i}"))?;
        tokio::time::sleep(heartbeat * 2).await;
        let mut old = std::mem::replace(slot, replacement);
        old.signal(Signal::SIGTERM)?;
        let deadline = Instant::now() + limit;
        let mut exited = false;
        loop {
            let open = bed.upstream.open_sessions();
            let mut all = true;
            for n in &names {
                let run = runs.entry(n.clone()).or_insert(0.0);
                if open.get(n) == Some(&1) {
                    *run = 0.0;
                } else {
                    all = false;
                    *run += SAMPLE.as_secs_f64();
                    ownerless += SAMPLE.as_secs_f64();
                    max_run = max_run.max(*run);
                }
            }
            if !exited {
                exited = old.wait(Duration::from_millis(1)).await.is_ok();
            }
            if all && exited {
                break;
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "{}: streams not reconnected within {limit:?}",
                    design.name()
                );
            }
            tokio::time::sleep(SAMPLE).await;
        }
        // Let a restarted worker take its share before the next restart.
        tokio::time::sleep(heartbeat * 2).await;
    }
    let elapsed = started.elapsed();
    stop_all(&mut workers).await;
    Ok(json!({
        "workers": 3,
        "streams": names.len(),
        "ownerless_stream_seconds": (ownerless * 10.0_f64).round() / 10.0,
        "max_ownerless_s": (max_run * 10.0_f64).round() / 10.0,
        "restart_wall_time_s": elapsed.as_secs_f64(),
        "overlapping_sessions": bed.overlaps(&names),
        "sequence_gaps": bed.gaps(&names),
        "stale_deliveries": bed.stale(&names),
    }))
}

pub async fn chaos(ctx: &Ctx) -> anyhow::Result<Value> {
    let bed = Bed::start(
        ctx.exe.clone(),
        BedOptions {
            rate: 20,
            first_seq: 0,
            namespace: "chaos".into(),
            legacy_table: None,
            ..BedOptions::default()
        },
    )
    .await?;
    // A lease longer than the feed's 3-4 s cut-off for silent (paused) clients,
    // as any deployment should have; tether's defaults otherwise.
    let lease = ctx.profile.lease.max(Duration::from_secs(6));
    let cfg = ChaosConfig {
        seed: ctx.seed,
        duration: ctx.profile.chaos,
        streams: 16,
        workers: 5,
        lease,
        heartbeat: ctx.profile.heartbeat.min(lease / 3),
        reconcile: ctx.profile.reconcile,
        real_sinks: true,
    };
    let report = chaos::run(&bed, &cfg).await?;
    println!(
        "chaos soak        {:.0}s seed {} events {:?}: overlaps {} gaps {} stale {} duplicates {} max ownerless {:.1}s",
        report.duration_s,
        report.seed,
        report.events,
        report.overlapping_sessions,
        report.sequence_gaps,
        report.stale_deliveries,
        report.duplicates,
        report.max_ownerless_s
    );
    let mut value = serde_json::to_value(&report)?;
    value["lease_s"] = json!(lease.as_secs_f64());
    Ok(value)
}
