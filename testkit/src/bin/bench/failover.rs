//! Crash failover (SIGKILL) and graceful handoff (SIGTERM): one worker holds
//! every stream, two peers run; the time from the signal to each stream's
//! first message on a new session, the data replayed after a crash (the
//! checkpoint lag), and the safety counts — for each design, at once.

use crate::designs::Design;
use crate::{Ctx, round2, stats, stop_all};
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use std::time::Duration;
use tether::support::quantile;
use tether_testkit::bed::Bed;
use tokio::time::Instant;

/// Messages per second per stream.
const RATE: u32 = 10;

pub async fn run(ctx: &Ctx) -> anyhow::Result<Value> {
    let mut out = serde_json::Map::new();
    for (label, signal) in [
        ("crash_sigkill", Signal::SIGKILL),
        ("graceful_sigterm", Signal::SIGTERM),
    ] {
        let designs = Design::measured(ctx);
        let results =
            futures::future::join_all(designs.iter().map(|d| one(ctx, *d, signal, label))).await;
        let mut row = serde_json::Map::new();
        for (design, result) in designs.iter().zip(results) {
            let result = result.map_err(|e| e.context(design.name()))?;
            println!(
                "{label:<17} {:<11} p50 {:>6.2}s p99 {:>6.2}s  checkpoint lag p99 {:>5.2}s  overlaps {} gaps {}",
                design.name(),
                result["p50_s"].as_f64().unwrap_or(f64::NAN),
                result["p99_s"].as_f64().unwrap_or(f64::NAN),
                result["checkpoint_lag_p99_s"].as_f64().unwrap_or(0.0),
                result["overlapping_sessions"],
                result["sequence_gaps"],
            );
            row.insert(design.name().into(), result);
        }
        out.insert(label.into(), Value::Object(row));
    }
    Ok(Value::Object(out))
}

async fn one(ctx: &Ctx, design: Design, signal: Signal, label: &str) -> anyhow::Result<Value> {
    let ns = format!("{}-{}", &label[..5], design.name().replace('.', ""));
    let bed = design.bed(ctx, RATE, &ns).await?;
    let names = bed.apply("s", ctx.profile.failover_streams).await?;
    let fleet = design.fleet(ctx, &bed, &tether_testkit::store::endpoint().0);
    // The victim keeps what it takes (the seed design never rebalances anyway).
    let keep: &[&str] = if design == Design::Seed {
        &[]
    } else {
        &["--no-rebalance"]
    };
    let mut victim = fleet.spawn_with("victim", fleet.endpoint(), keep)?;
    let (lease, heartbeat, reconcile) = design.timings(ctx);
    let limit = lease * 3 + reconcile * 3 + Duration::from_secs(30);
    Bed::wait(limit, "the victim holds every stream", || async {
        bed.connected_once(&names) && bed.owned_by("victim").await == names.len()
    })
    .await?;
    let mut others: Vec<_> = (0..2)
        .map(|i| fleet.spawn(&format!("w{i}")))
        .collect::<Result<_, _>>()?;
    // At a random point of the heartbeat cycle, so the checkpoint lag is not
    // measured at one lucky phase.
    tokio::time::sleep(heartbeat * 2 + heartbeat.mul_f64(rand::random::<f64>())).await;
    let before = bed.max_seqs(&names);
    let t0 = Instant::now();
    victim.signal(signal)?;
    let latencies = bed.new_session_latencies(&names, t0, limit).await?;
    if signal == Signal::SIGTERM {
        let _ = victim.wait(Duration::from_secs(30)).await;
    }
    // Seconds of data replayed: what the victim had delivered past the point
    // the new session resumed from.
    let lags: Vec<f64> = names
        .iter()
        .filter_map(|n| {
            let resumed = bed
                .upstream
                .sessions_of(n)
                .into_iter()
                .find(|s| s.opened >= t0)?;
            let delivered = before[n]?;
            let from = resumed.after.unwrap_or(0);
            Some(delivered.saturating_sub(from) as f64 / f64::from(RATE))
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop_all(&mut others).await;
    let mut result = stats(&latencies);
    result["checkpoint_lag_p99_s"] = json!(round2(quantile(&lags, 0.99)));
    result["checkpoint_lag_max_s"] = json!(round2(quantile(&lags, 1.0)));
    result["lease_s"] = json!(lease.as_secs_f64());
    result["overlapping_sessions"] = json!(bed.overlaps(&names));
    result["sequence_gaps"] = json!(bed.gaps(&names));
    result["stale_deliveries"] = json!(bed.stale(&names));
    result["streams"] = json!(names.len());
    Ok(result)
}
