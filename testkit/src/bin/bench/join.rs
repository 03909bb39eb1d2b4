//! A worker joining a balanced fleet: 30 streams on two workers (15 each)
//! and then on three (10 each), and one more starts. Sampled every 100 ms:
//! when the newcomer holds its share (10, or 7.5 ± 1: 7 or 8) and when every
//! worker does, with every stream open exactly once; overlapping sessions counted at the upstream. For
//! tether, tether 0.1, and (with `TETHER_BENCH_BASELINE_BIN=<tether binary>`)
//! another tether build in the same run, for an A/B of the rebalancing rule.

use crate::designs::Design;
use crate::{Ctx, round2};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;
use tether_testkit::bed::Bed;
use tokio::time::Instant;

const STREAMS: usize = 30;
const SAMPLE: Duration = Duration::from_millis(100);
/// Given up after this long from the newcomer's start.
const LIMIT: Duration = Duration::from_secs(90);

pub async fn run(ctx: &Ctx) -> anyhow::Result<Value> {
    let mut runs: Vec<(String, Design, Option<PathBuf>)> = vec![
        ("tether".into(), Design::Tether, None),
        ("tether-0.1".into(), Design::Today, None),
    ];
    if let Some(baseline) = std::env::var_os("TETHER_BENCH_BASELINE_BIN") {
        runs.push((
            "tether, baseline build".into(),
            Design::Tether,
            Some(baseline.into()),
        ));
    }
    let mut out = serde_json::Map::new();
    for (workers, (name, design, exe)) in runs.iter().flat_map(|r| [2, 3].map(|w| (w, r.clone()))) {
        let name = format!("{name}, {workers} → {}", workers + 1);
        let result = one(ctx, design, exe, &name, workers)
            .await
            .map_err(|e| e.context(name.clone()))?;
        println!(
            "join             {name:<28} newcomer at its share after {} s, whole fleet after {} s, moved {}, overlaps {}, loads at the end (newcomer / others) {}",
            result["newcomer_at_share_s"],
            result["fleet_balanced_s"],
            result["sessions_opened"],
            result["overlapping_sessions"],
            result["final_loads"]
        );
        out.insert(name, result);
    }
    Ok(Value::Object(out))
}

async fn one(
    ctx: &Ctx,
    design: Design,
    exe: Option<PathBuf>,
    name: &str,
    workers: usize,
) -> anyhow::Result<Value> {
    let namespace: String = format!(
        "join-{}",
        name.chars()
            .filter(char::is_ascii_alphanumeric)
            .collect::<String>()
    );
    let bed = design.bed(ctx, 10, &namespace).await?;
    let names = bed.apply("s", STREAMS).await?;
    let mut fleet = design.fleet(ctx, &bed, &tether_testkit::store::endpoint().0);
    if let Some(exe) = exe {
        fleet.workers.exe = exe;
    }
    let (lease, heartbeat, reconcile) = design.timings(ctx);
    let _workers: Vec<_> = (0..workers)
        .map(|i| fleet.spawn(&format!("w{i}")))
        .collect::<Result<_, _>>()?;
    let limit = lease * 3 + reconcile * 3 + Duration::from_secs(60);
    let share = STREAMS / workers;
    Bed::wait(limit, "the fleet balanced before the join", || async {
        let load = bed.loads().await;
        load.len() == workers && load.values().all(|n| *n == share) && once(&bed)
    })
    .await?;
    tokio::time::sleep(heartbeat * 2).await;
    let sessions_before = bed.upstream.sessions().len();
    let newcomer = fleet.spawn("joiner")?;
    let started = Instant::now();
    let (low, high) = (STREAMS / (workers + 1), STREAMS.div_ceil(workers + 1));
    let mut at_share = None;
    let mut balanced = None;
    let mut last = HashMap::new();
    while started.elapsed() < LIMIT && balanced.is_none() {
        tokio::time::sleep(SAMPLE).await;
        let load = bed.loads().await;
        last = load.clone();
        let mine = load
            .iter()
            .filter(|(owner, _)| owner.starts_with(newcomer.id.as_str()))
            .map(|(_, n)| *n)
            .sum::<usize>();
        let whole = once(&bed);
        if at_share.is_none() && whole && (low..=high).contains(&mine) {
            at_share = Some(started.elapsed());
        }
        if whole && load.len() == workers + 1 && load.values().all(|n| (low..=high).contains(n)) {
            balanced = Some(started.elapsed());
        }
    }
    let overlaps = bed.upstream.overlaps();
    let overlaps = overlaps
        .iter()
        .filter(|(a, _)| names.contains(&a.stream))
        .count();
    let secs = |d: Option<Duration>| d.map_or(Value::Null, |d| json!(round2(d.as_secs_f64())));
    Ok(json!({
        "streams": STREAMS,
        "workers_before": workers,
        "heartbeat_s": heartbeat.as_secs_f64(),
        "newcomer_at_share_s": secs(at_share),
        "fleet_balanced_s": secs(balanced),
        "sessions_opened": bed.upstream.sessions().len() - sessions_before,
        "final_loads": final_loads(&last, newcomer.id.as_str()),
        "overlapping_sessions": overlaps,
        "limit_s": LIMIT.as_secs_f64(),
    }))
}

/// The last loads seen, the newcomer's first: "6 / 8 8 8".
fn final_loads(load: &HashMap<String, usize>, newcomer: &str) -> String {
    let mine: usize = load
        .iter()
        .filter(|(o, _)| o.starts_with(newcomer))
        .map(|(_, n)| *n)
        .sum();
    let mut others: Vec<usize> = load
        .iter()
        .filter(|(o, _)| !o.starts_with(newcomer))
        .map(|(_, n)| *n)
        .collect();
    others.sort_unstable_by(|a, b| b.cmp(a));
    let others: Vec<String> = others.iter().map(ToString::to_string).collect();
    format!("{mine} / {}", others.join(" "))
}

/// Every stream has exactly one open session.
fn once(bed: &Bed) -> bool {
    let open = bed.upstream.open_sessions();
    open.len() == STREAMS && open.values().all(|n| *n == 1)
}
