//! Jittered exponential backoff within a deadline, for throttling and transient errors.

use rand::Rng;
use std::time::Duration;

/// How the store retries a call that failed transiently (throttled, 5xx, timeout,
/// connection refused). The deadline bounds the whole call, so a worker's heartbeat
/// never waits on DynamoDB longer than it can afford.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    pub first_delay: Duration,
    pub max_delay: Duration,
    pub deadline: Duration,
}

/// Default first backoff step: short, because most throttling clears in milliseconds.
pub(super) const DEFAULT_FIRST_DELAY: Duration = Duration::from_millis(25);
/// Default cap on one backoff step.
pub(super) const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(1);
/// Default bound on one store call, retries included. Shorter than a heartbeat
/// interval so a slow call never makes a worker skip a renewal.
pub(super) const DEFAULT_CALL_DEADLINE: Duration = Duration::from_secs(4);

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            first_delay: DEFAULT_FIRST_DELAY,
            max_delay: DEFAULT_MAX_DELAY,
            deadline: DEFAULT_CALL_DEADLINE,
        }
    }
}

impl RetryPolicy {
    /// The delay before retry number `attempt` (0-based): "full jitter", uniformly
    /// drawn from zero to the exponential step, so a fleet that was throttled at
    /// the same moment does not retry in lockstep.
    pub fn delay(&self, attempt: u32) -> Duration {
        let cap = exponential(self.first_delay, self.max_delay, attempt);
        let ms = cap.as_millis() as u64;
        Duration::from_millis(rand::rng().random_range(0..=ms.max(1)))
    }
}

/// `first * 2^attempt`, capped at `max`.
pub fn exponential(first: Duration, max: Duration, attempt: u32) -> Duration {
    first.saturating_mul(1u32 << attempt.min(20)).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_then_caps() {
        let first = Duration::from_millis(10);
        let max = Duration::from_millis(100);
        assert_eq!(exponential(first, max, 0), first);
        assert_eq!(exponential(first, max, 3), Duration::from_millis(80));
        assert_eq!(exponential(first, max, 4), max);
        assert_eq!(exponential(first, max, 60), max);
    }

    #[test]
    fn jittered_delays_stay_under_the_step() {
        let policy = RetryPolicy::default();
        for attempt in 0..10 {
            let cap = exponential(policy.first_delay, policy.max_delay, attempt);
            assert!(policy.delay(attempt) <= cap);
        }
    }
}
