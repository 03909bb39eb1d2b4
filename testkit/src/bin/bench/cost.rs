//! DynamoDB cost at steady state: write and read units per stream-hour, at 10
//! and at 100 streams per worker, for each design, metered by the capacity
//! model (the same meter for every design: the units DynamoDB bills, table and
//! indexes, as the store reports them per request).

use crate::designs::Design;
use crate::{Ctx, HOURS_PER_MONTH, PRICE_PER_MILLION_RRU, PRICE_PER_MILLION_WRU, stop_all};
use serde_json::{Value, json};
use std::time::Duration;
use tether_testkit::bed::{Bed, loopback};
use tether_testkit::capacity::CapacityModel;
use tether_testkit::processes::{WorkerProcess, metric_sum};
use tether_testkit::store::endpoint;
use tokio::time::Instant;

/// Workers in each measured fleet: three, so each watches two peers, as in
/// any fleet of three or more (the headline's 10,000 streams at 100 per
/// worker is a hundred workers); in a fleet of two each watches one, and
/// reads less than a real fleet would.
const WORKERS: usize = 3;

#[derive(Clone, Copy)]
struct Case {
    design: Design,
    per_worker: usize,
    /// Messages per second per stream (0: idle streams).
    rate: u32,
    /// Workers give peers an address to poke (as the chart runs them); off,
    /// they read the change counter every 500 ms (the binary's default).
    pokes: bool,
}

impl Case {
    fn label(&self) -> String {
        let activity = if self.rate == 0 { "idle" } else { "active" };
        let unpoked = if self.pokes { "" } else { "_unpoked" };
        format!(
            "{}_{}_per_worker_{activity}{unpoked}",
            self.design.name(),
            self.per_worker
        )
    }
}

pub async fn run(ctx: &Ctx) -> anyhow::Result<Value> {
    let mut cases = Vec::new();
    for per_worker in [10, 100] {
        for design in Design::measured(ctx) {
            cases.push(Case {
                design,
                per_worker,
                rate: 1,
                pokes: true,
            });
        }
    }
    cases.push(Case {
        design: Design::Tether,
        per_worker: 100,
        rate: 0,
        pokes: true,
    });
    cases.push(Case {
        design: Design::Tether,
        per_worker: 100,
        rate: 1,
        pokes: false,
    });
    // One size at a time (the designs of a size side by side): a 2-core
    // machine running every fleet at once measures its own overload.
    let mut results = Vec::new();
    for group in
        cases.chunk_by(|a, b| (a.per_worker, a.rate, a.pokes) == (b.per_worker, b.rate, b.pokes))
    {
        results.extend(futures::future::join_all(group.iter().map(|c| one(ctx, *c))).await);
    }
    let mut out = serde_json::Map::new();
    for (case, result) in cases.iter().zip(results) {
        let result = result.map_err(|e| e.context(case.label()))?;
        println!(
            "cost  {:<11}{} {:>3}/worker {:<6} {:>7.1} WRU/stream-hour {:>8.1} RRU/stream-hour  hottest key {:.1} WCU/s  (${:.0}/month for 10,000 streams; {} ownership changes in the window)",
            case.design.name(),
            if case.pokes { "" } else { " (unpoked)" },
            case.per_worker,
            if case.rate == 0 { "idle" } else { "active" },
            result["wru_per_stream_hour"].as_f64().unwrap_or(0.0),
            result["rru_per_stream_hour"].as_f64().unwrap_or(0.0),
            result["hottest_write_units_per_s"].as_f64().unwrap_or(0.0),
            result["monthly_usd_10000_streams"].as_f64().unwrap_or(0.0),
            result["ownership_changes_in_window"]
                .as_f64()
                .unwrap_or(0.0),
        );
        out.insert(case.label(), result);
    }
    out.insert(
        "prices".into(),
        json!({"usd_per_million_wru": PRICE_PER_MILLION_WRU, "usd_per_million_rru": PRICE_PER_MILLION_RRU}),
    );
    Ok(Value::Object(out))
}

async fn one(ctx: &Ctx, case: Case) -> anyhow::Result<Value> {
    // Packed checkpoints carry stream names, so every tether build gets a
    // namespace of the same length: a longer one would cost it write units.
    let design = match case.design {
        Design::Baseline => "prev00".to_string(),
        d => d.name().replace('.', ""),
    };
    let ns = format!(
        "cost-{design}-{}-{}{}",
        case.per_worker,
        case.rate,
        if case.pokes { "p" } else { "u" }
    );
    let bed = case.design.bed(ctx, case.rate, &ns).await?;
    let names = bed.apply("s", case.per_worker * WORKERS).await?;
    let model = CapacityModel::start(loopback(), &endpoint().0, false).await?;
    let mut fleet = case.design.fleet(ctx, &bed, &model.endpoint());
    if !case.pokes {
        fleet.env.retain(|(k, _)| k != crate::designs::ADVERTISE_IP);
    }
    let (lease, heartbeat, reconcile) = case.design.timings(ctx);
    let mut workers: Vec<_> = (0..WORKERS)
        .map(|i| fleet.spawn(&format!("w{i}")))
        .collect::<Result<_, _>>()?;
    let limit = lease * 3 + reconcile * 3 + Duration::from_secs(60);
    Bed::wait(limit, "cost streams connected", || async {
        bed.connected_once(&names)
    })
    .await?;
    // Settled: no acquire or release for three heartbeats (fair share done),
    // statuses written, checkpoints flowing. Churn inside the window is
    // reported, not hidden.
    let settled = settle(&workers, heartbeat * 3, limit).await?;
    model.reset();
    let before = ownership_changes(&workers).await?;
    let reads_before = units_by_operation(&workers, "read").await?;
    let t0 = Instant::now();
    tokio::time::sleep(ctx.profile.cost_window).await;
    let report = model.report();
    let churn = ownership_changes(&workers).await? - before;
    let hours = t0.elapsed().as_secs_f64() / 3600.0;
    // Where the units went, by operation, as the workers counted them: writes
    // over the whole run, reads per worker-hour in the window.
    let by_operation = units_by_operation(&workers, "write").await?;
    let mut reads_by_operation = units_by_operation(&workers, "read").await?;
    for (op, units) in &mut reads_by_operation {
        *units = ((*units - reads_before.get(op).copied().unwrap_or(0.0))
            / (WORKERS as f64 * hours))
            .round();
    }
    stop_all(&mut workers).await;
    let streams = names.len() as f64;
    let wru = report.write_units / (streams * hours);
    let rru = report.read_units / (streams * hours);
    let monthly = |per_hour: f64, price: f64, n: f64| per_hour * n * HOURS_PER_MONTH * price / 1e6;
    Ok(json!({
        "streams": names.len(),
        "workers": WORKERS,
        "rate_msgs_per_s": case.rate,
        "heartbeat_s": heartbeat.as_secs_f64(),
        "window_s": t0.elapsed().as_secs_f64(),
        "wru_per_stream_hour": wru.round(),
        "rru_per_stream_hour": rru.round(),
        "rru_per_worker_hour": (report.read_units / (WORKERS as f64 * hours)).round(),
        "write_units": report.write_units,
        "refused_writes": report.refused_writes,
        "refused_write_units": report.refused_write_units,
        "read_units": report.read_units,
        "hottest_write_key": report.hottest_write_key,
        "write_units_by_operation_whole_run": by_operation,
        "rru_per_worker_hour_by_operation": reads_by_operation,
        "settle_s": settled.as_secs_f64(),
        "ownership_changes_in_window": churn,
        "hottest_write_units_per_s": report.hottest_write_units_per_s,
        "monthly_usd_10000_streams": (monthly(wru, PRICE_PER_MILLION_WRU, 10_000.0) + monthly(rru, PRICE_PER_MILLION_RRU, 10_000.0)).round(),
        "monthly_usd_writes_10000_streams": monthly(wru, PRICE_PER_MILLION_WRU, 10_000.0).round(),
        "monthly_usd_reads_10000_streams": monthly(rru, PRICE_PER_MILLION_RRU, 10_000.0).round(),
    }))
}

/// Capacity units (`kind`: `read` or `write`) the workers counted so far, summed
/// over the fleet, by operation.
async fn units_by_operation(
    workers: &[WorkerProcess],
    kind: &str,
) -> anyhow::Result<std::collections::BTreeMap<String, f64>> {
    let prefix = format!("tether_dynamodb_consumed_{kind}_units_total{{");
    let mut by_operation = std::collections::BTreeMap::<String, f64>::new();
    for w in workers {
        let text = w.metrics().await.map_err(anyhow::Error::msg)?;
        for line in text.lines().filter(|l| l.starts_with(&prefix)) {
            if let (Some(op), Some(v)) = (
                line.split("operation=\"")
                    .nth(1)
                    .and_then(|r| r.split('"').next()),
                line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()),
            ) {
                *by_operation.entry(op.to_string()).or_default() += v;
            }
        }
    }
    Ok(by_operation)
}

/// Acquires and releases made so far, fleet-wide, whatever their result.
async fn ownership_changes(workers: &[WorkerProcess]) -> anyhow::Result<f64> {
    let mut total = 0.0;
    for w in workers {
        let text = w.metrics().await.map_err(anyhow::Error::msg)?;
        total += metric_sum(&text, "tether_lease_acquires_total", "")
            + metric_sum(&text, "tether_lease_releases_total", "");
    }
    Ok(total)
}

/// Waits until no acquire or release happened for `quiet`; how long that took.
async fn settle(
    workers: &[WorkerProcess],
    quiet: Duration,
    limit: Duration,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut last = ownership_changes(workers).await?;
    let mut since = Instant::now();
    while since.elapsed() < quiet {
        if started.elapsed() > limit {
            anyhow::bail!("ownership still changing after {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = ownership_changes(workers).await?;
        if now != last {
            last = now;
            since = Instant::now();
        }
    }
    Ok(started.elapsed())
}
