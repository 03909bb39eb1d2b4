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

    /// Returns an acquire taken from `partition` but not tried (the pass
    /// left the partition to a worker that won a race there).
    pub(super) fn give_back(&mut self, partition: &str, rate: f64) {
        if let Some((tokens, _)) = self.buckets.get_mut(partition) {
            *tokens = (*tokens + 1.0).min(rate);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An acquire a pass chose but left untried (its partition was
    /// contested) goes back to the bucket, never beyond a second's worth.
    #[tokio::test(start_paused = true)]
    async fn an_untried_acquire_goes_back_to_its_bucket_up_to_the_share() {
        let mut pacing = Pacing::default();
        assert!(pacing.take("UNOWNED#1", 2.0));
        assert!(pacing.take("UNOWNED#1", 2.0));
        assert!(!pacing.take("UNOWNED#1", 2.0), "the share is spent");
        pacing.give_back("UNOWNED#1", 2.0);
        assert!(pacing.take("UNOWNED#1", 2.0), "one given back");
        assert!(!pacing.take("UNOWNED#1", 2.0));
        for _ in 0..5 {
            pacing.give_back("UNOWNED#1", 2.0);
        }
        assert!(pacing.take("UNOWNED#1", 2.0));
        assert!(pacing.take("UNOWNED#1", 2.0));
        assert!(
            !pacing.take("UNOWNED#1", 2.0),
            "never more than a second's worth"
        );
        pacing.give_back("UNOWNED#2", 2.0);
        assert!(pacing.take("UNOWNED#2", 2.0) && pacing.take("UNOWNED#2", 2.0));
        assert!(
            !pacing.take("UNOWNED#2", 2.0),
            "nothing given to a bucket never taken from"
        );
    }
}
