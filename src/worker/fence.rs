//! Self-fencing: the local, monotonic-clock bound on how long a worker may act
//! for a lease without a confirmed renewal.
//!
//! A renewal sent at instant `t` and confirmed by DynamoDB extends the lease to at
//! least `t + lease_duration` in *everybody's* wall-clock time, give or take the
//! skew between clocks. So this worker may act until `t + window`, with
//! `window = lease_duration - max_clock_skew - margin`, and no other worker can
//! acquire before then. The deadline is measured on the monotonic clock, so a
//! process that was paused (SIGSTOP, a long GC-like stall, a VM freeze) wakes up
//! already fenced instead of trusting a stale lease.

use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// The fence of one lease.
#[derive(Debug)]
pub struct Fence {
    window: Duration,
    /// `None` once revoked (lease lost or fenced): never valid again.
    deadline: Mutex<Option<Instant>>,
}

impl Fence {
    /// A fence for a lease whose acquire was sent at `sent_at`.
    pub fn new(window: Duration, sent_at: Instant) -> Self {
        Self {
            window,
            deadline: Mutex::new(Some(sent_at + window)),
        }
    }

    /// Records a renewal that was sent at `sent_at` and confirmed.
    pub fn confirm(&self, sent_at: Instant) {
        let mut deadline = self.lock();
        if let Some(d) = deadline.as_mut() {
            *d = (*d).max(sent_at + self.window);
        }
    }

    /// Makes the fence permanently invalid.
    pub fn revoke(&self) {
        *self.lock() = None;
    }

    /// Whether the worker may still act (deliver, keep the session) right now.
    pub fn is_valid(&self) -> bool {
        self.lock().is_some_and(|d| Instant::now() < d)
    }

    /// When the fence closes; an instant in the past once revoked.
    pub fn deadline(&self) -> Instant {
        self.lock().unwrap_or_else(Instant::now)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        // A poisoned lock only means another thread panicked mid-update of a
        // plain Instant; the value is still meaningful.
        self.deadline.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// `lease_duration - max_clock_skew - margin`, or an error when that leaves no
/// room for at least two renewals.
pub fn fence_window(
    lease_duration: Duration,
    max_clock_skew: Duration,
    margin: Duration,
    heartbeat_interval: Duration,
) -> Result<Duration, String> {
    let window = lease_duration
        .checked_sub(max_clock_skew)
        .and_then(|d| d.checked_sub(margin))
        .unwrap_or_default();
    if window < heartbeat_interval * 2 {
        return Err(format!(
            "lease duration {lease_duration:?} minus clock skew {max_clock_skew:?} and margin {margin:?} \
             leaves {window:?}, less than two heartbeat intervals ({heartbeat_interval:?} each): \
             lengthen the lease or shorten the heartbeat"
        ));
    }
    Ok(window)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_lease_without_confirmed_renewals_fences_itself_before_it_expires() {
        let window = fence_window(
            Duration::from_secs(20),
            Duration::from_secs(2),
            Duration::from_secs(1),
            Duration::from_secs(5),
        )
        .unwrap();
        assert_eq!(window, Duration::from_secs(17));
        let fence = Fence::new(window, Instant::now());
        tokio::time::advance(Duration::from_secs(16)).await;
        assert!(fence.is_valid());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(
            !fence.is_valid(),
            "17 s without a confirmed renewal: fenced"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn confirmations_extend_from_when_the_renewal_was_sent() {
        let fence = Fence::new(Duration::from_secs(10), Instant::now());
        tokio::time::advance(Duration::from_secs(5)).await;
        let sent = Instant::now();
        // The response takes 3 s: the lease is counted from the send, not the reply.
        tokio::time::advance(Duration::from_secs(3)).await;
        fence.confirm(sent);
        assert_eq!(fence.deadline(), sent + Duration::from_secs(10));
        // A late confirmation of an older renewal never shortens the fence.
        fence.confirm(sent - Duration::from_secs(4));
        assert_eq!(fence.deadline(), sent + Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_paused_process_wakes_up_fenced() {
        let fence = Fence::new(Duration::from_secs(10), Instant::now());
        // Nothing ran for 30 s (SIGSTOP): the first check after waking fails.
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(!fence.is_valid());
    }

    #[tokio::test(start_paused = true)]
    async fn a_revoked_fence_stays_closed() {
        let fence = Fence::new(Duration::from_secs(10), Instant::now());
        fence.revoke();
        fence.confirm(Instant::now());
        assert!(!fence.is_valid());
    }

    #[test]
    fn settings_that_leave_no_room_for_renewals_are_refused() {
        let err = fence_window(
            Duration::from_secs(10),
            Duration::from_secs(2),
            Duration::from_secs(1),
            Duration::from_secs(5),
        )
        .unwrap_err();
        assert!(err.contains("two heartbeat intervals"), "{err}");
    }
}
