//! Acquisition pacing: DynamoDB throttles an index partition above 1,000
//! write units per second, and a takeover moves many items out of one dead
//! incarnation's partitions at once; each worker takes only its share.

use std::collections::HashMap;
use tokio::time::Instant;

/// Write units per second one index partition may take from the whole fleet's
/// acquisitions: DynamoDB's limit is 1,000; the rest is headroom. Each worker
/// takes its share of this (divided by the live workers) per source partition.
pub(super) const PARTITION_WRITE_BUDGET: f64 = 800.0;

/// Per-partition token buckets: this worker's share of each source partition's
/// write budget.
#[derive(Default)]
pub(super) struct Pacing {
    buckets: HashMap<String, (f64, Instant)>,
}

impl Pacing {
    pub(super) fn take(&mut self, partition: &str, rate: f64) -> bool {
        let now = Instant::now();
        let (tokens, at) = self
            .buckets
            .entry(partition.to_string())
            .or_insert((rate, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * rate).min(rate);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}
