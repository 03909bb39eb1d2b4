//! A per-upstream-host limit on how fast sessions connect, so a takeover of
//! thousands of streams (a peer crashed, a rollout) never connects faster than
//! the upstream allows: many services cap connects or identifies per second
//! and drop or ban clients beyond it.
//!
//! The bucket is GCRA (the token bucket as one timestamp per host): at most
//! `burst` connects at once, then one every `1 / rate` seconds. Each connect
//! reserves its slot up front, so concurrent sessions queue in order and the
//! limit holds over every window; the wait is an ordinary cancellable sleep.

use crate::support::lock;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

#[derive(Clone, Debug)]
pub struct ConnectLimiter {
    /// `None`: no limit.
    interval: Option<Duration>,
    /// How far ahead of its schedule a host may run: `(burst - 1) × interval`.
    tolerance: Duration,
    /// Per host, the theoretical time of its next connect.
    next: Arc<Mutex<HashMap<String, Instant>>>,
}

impl ConnectLimiter {
    /// `rate` connects per second per host (0: unlimited), `burst` at once.
    pub fn new(rate: f64, burst: u32) -> Self {
        let interval =
            (rate > 0.0 && rate.is_finite()).then(|| Duration::from_secs_f64(1.0 / rate));
        Self {
            interval,
            tolerance: interval.unwrap_or_default() * burst.max(1).saturating_sub(1),
            next: Arc::default(),
        }
    }

    /// Reserves a connect to `host` and returns when it may happen (now or
    /// later); `None` when unlimited.
    pub fn reserve(&self, host: &str) -> Option<Instant> {
        let interval = self.interval?;
        let now = Instant::now();
        let mut next = lock(&self.next);
        let tat = next.entry(host.to_string()).or_insert(now);
        let scheduled = (*tat).max(now);
        let at = scheduled
            .checked_sub(self.tolerance)
            .map_or(now, |t| t.max(now));
        *tat = scheduled + interval;
        Some(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_burst_then_one_per_interval_per_host_and_hosts_apart() {
        let limiter = ConnectLimiter::new(10.0, 3);
        let start = Instant::now();
        let slots: Vec<Duration> = (0..6)
            .map(|_| limiter.reserve("a.example").unwrap() - start)
            .collect();
        let ms: Vec<u128> = slots.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [0, 0, 0, 100, 200, 300]);
        // Another host has its own bucket.
        assert_eq!(limiter.reserve("b.example").unwrap(), start);
        // After a quiet spell the burst is available again.
        tokio::time::advance(Duration::from_secs(5)).await;
        let now = Instant::now();
        assert_eq!(limiter.reserve("a.example").unwrap(), now);
    }

    #[test]
    fn zero_means_unlimited() {
        assert_eq!(ConnectLimiter::new(0.0, 10).reserve("a"), None);
    }
}
