//! CloudWatch Embedded Metric Format: one JSON line per interval on stdout
//! carrying `ActiveConnections` (the same value as the HPA gauge,
//! `tether_active_connections`), so workers on ECS or EC2 can be scaled by a
//! target-tracking policy on a CloudWatch metric without any SDK call: the
//! CloudWatch agent or the `awslogs` driver turns the line into the metric.
//! Off unless `--emf-namespace` is set.

use crate::metrics::WorkerMetrics;
use serde_json::json;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

/// The metric's name in CloudWatch.
pub(crate) const METRIC: &str = "ActiveConnections";
/// The dimension every worker of one table shares: CloudWatch then averages
/// over the workers, which is what target tracking wants.
pub(crate) const DIMENSION: &str = "Table";

/// One EMF document (a single line).
pub(crate) fn line(namespace: &str, table: &str, worker: &str, active: i64, now_ms: u64) -> String {
    json!({
        "_aws": {
            "Timestamp": now_ms,
            "CloudWatchMetrics": [{
                "Namespace": namespace,
                "Dimensions": [[DIMENSION]],
                "Metrics": [{"Name": METRIC, "Unit": "Count"}],
            }],
        },
        DIMENSION: table,
        // Not a dimension: searchable in the log, no extra metric cost.
        "WorkerId": worker,
        METRIC: active,
    })
    .to_string()
}

/// Writes a line every `interval` until the process ends.
pub(crate) async fn run(
    namespace: String,
    table: String,
    worker: String,
    interval: Duration,
    metrics: Arc<WorkerMetrics>,
) {
    let mut tick = tokio::time::interval(interval);
    loop {
        tick.tick().await;
        let text = line(
            &namespace,
            &table,
            &worker,
            metrics.active_connections.get(),
            crate::lease::now_ms(),
        );
        let mut out = std::io::stdout().lock();
        if writeln!(out, "{text}").and_then(|_| out.flush()).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_with_the_value_and_its_dimension_at_the_root() {
        let text = line("Tether", "tether-streams", "w-1", 42, 1_700_000_000_000);
        assert!(!text.contains('\n'), "one line");
        let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(doc[METRIC], 42);
        assert_eq!(doc[DIMENSION], "tether-streams");
        assert_eq!(doc["_aws"]["Timestamp"], 1_700_000_000_000u64);
    }
}
