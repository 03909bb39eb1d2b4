//! Self-fencing: the local, monotonic-clock bound on how long this worker may
//! act for its streams without a confirmed renewal of its worker item.
//!
//! A renewal sent at instant `t` and confirmed makes the incarnation provably
//! alive to every peer that reads the new version afterwards; a peer declares
//! it dead only after watching the version stand still for a whole lease on
//! its own monotonic clock, starting no earlier than `t`. So this worker may
//! act until `t + window`, with `window = lease_duration - fence_margin`, and
//! no peer can take its streams before then. The deadline is on the monotonic
//! clock, so a process that was paused (SIGSTOP, a VM freeze) wakes up already
//! fenced, and wall-clock skew plays no part.
//!
//! One fence per worker bounds everything: every session watches it, every
//! sink delivery and every backoff sleep is raced against it, in every state
//! (serving, draining, handing over, stopping).
//!
//! The monotonic clock stops while the machine is suspended (a laptop lid, a
//! VM suspended by its host), while peers' clocks run on: a resumed worker
//! would find its fence still open. So every deadline is also kept on
//! `CLOCK_BOOTTIME`, which counts suspended time, taken when the renewal was
//! sent; the fence is open only while both say so, and the watcher looks at
//! the boot clock every [`BOOT_RECHECK`] (a resumed process's timers fire late).

use std::sync::OnceLock;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::{Instant, sleep, sleep_until};

/// How often the watcher compares the boot clock with the deadline: how long
/// after waking from a suspend the fence's waiters learn that it closed
/// (`is_valid`, which deliveries ask before sending, knows at once).
pub(super) const BOOT_RECHECK: Duration = Duration::from_millis(200);

/// The time since boot, suspended time included; `None` where the system
/// has no such clock (the monotonic deadline then stands alone).
pub(super) type BootClock = fn() -> Option<Duration>;

fn boot_time() -> Option<Duration> {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .ok()
        .map(Duration::from)
}

/// When something was sent, on both clocks.
#[derive(Clone, Copy, Debug)]
pub struct Sent {
    at: Instant,
    boot: Option<Duration>,
}

impl Sent {
    pub fn now() -> Self {
        Self::with_clock(boot_time)
    }

    fn with_clock(boot: BootClock) -> Self {
        Self {
            at: Instant::now(),
            boot: boot(),
        }
    }

    /// The monotonic instant.
    pub fn at(&self) -> Instant {
        self.at
    }
}

/// When the fence closes, on both clocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Deadline {
    at: Instant,
    boot: Option<Duration>,
}

impl Deadline {
    fn after(sent: Sent, window: Duration) -> Self {
        Self {
            at: sent.at + window,
            boot: sent.boot.map(|b| b + window),
        }
    }

    fn passed(&self, boot: BootClock) -> bool {
        Instant::now() >= self.at || self.boot.zip(boot()).is_some_and(|(d, now)| now >= d)
    }
}

/// The fence of one worker incarnation.
#[derive(Debug)]
pub struct Fence {
    window: Duration,
    /// `None` once revoked (the incarnation was declared dead): never valid again.
    deadline: watch::Sender<Option<Deadline>>,
    boot: BootClock,
    /// The fence as its watcher last saw it: what [`Fence::closed`] and
    /// [`Fence::open`] wait on. It changes only when the fence closes or
    /// reopens, so a renewal (which moves the deadline) wakes one task, the
    /// watcher, instead of every session and holder of the worker, and each
    /// waiter holds a channel receiver instead of a timer of its own.
    shut: watch::Sender<Seen>,
    /// The watcher task, started by the first wait.
    watcher: OnceLock<AbortHandle>,
}

impl Drop for Fence {
    fn drop(&mut self) {
        if let Some(w) = self.watcher.get() {
            w.abort();
        }
    }
}

impl Fence {
    /// A fence for an incarnation whose registration was sent at `sent`.
    pub fn new(window: Duration, sent: Sent) -> Self {
        Self::with_boot_clock(window, sent, boot_time)
    }

    fn with_boot_clock(window: Duration, sent: Sent, boot: BootClock) -> Self {
        Self {
            window,
            deadline: watch::Sender::new(Some(Deadline::after(sent, window))),
            boot,
            shut: watch::Sender::new(Seen::Open),
            watcher: OnceLock::new(),
        }
    }

    /// Records a renewal that was sent at `sent` and confirmed.
    pub fn confirm(&self, sent: Sent) {
        let later = Deadline::after(sent, self.window);
        self.deadline.send_if_modified(|d| match d {
            Some(current) if later.at > current.at => {
                *current = later;
                true
            }
            _ => false,
        });
    }

    /// Makes the fence permanently invalid.
    pub fn revoke(&self) {
        self.deadline.send_replace(None);
    }

    /// Whether the worker may act (deliver, keep sessions) right now.
    pub fn is_valid(&self) -> bool {
        self.deadline.borrow().is_some_and(|d| !d.passed(self.boot))
    }

    /// When the fence closes (monotonic clock), unless a renewal moves it;
    /// `None` once revoked.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline.borrow().map(|d| d.at)
    }

    /// Resolves once the fence has closed (at once if it is closed).
    pub async fn closed(&self) {
        self.wait_until(|fence| !fence.is_valid()).await;
    }

    /// Resolves once the fence is open (at once if it is). Never resolves
    /// after a revocation.
    pub async fn open(&self) {
        self.wait_until(Fence::is_valid).await;
    }

    /// Waits until `done` holds. `done` is always asked of the deadline itself:
    /// the watcher only says when to ask again (when what it saw changed, see
    /// [`Seen`]), so its lag can neither end a wait early nor make one miss
    /// the change it waits for.
    async fn wait_until(&self, done: impl Fn(&Self) -> bool) {
        self.watcher.get_or_init(|| {
            tokio::spawn(watch_deadline(
                self.deadline.subscribe(),
                self.shut.clone(),
                self.boot,
            ))
            .abort_handle()
        });
        let mut shut = self.shut.subscribe();
        while !done(self) {
            // `self` owns the sender, so the channel cannot close under us.
            let _ = shut.changed().await;
        }
    }
}

/// What the watcher last saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    Open,
    /// Closed at this deadline (`None`: revoked). The deadline is part of
    /// the value so that a close the watcher sees right after another one
    /// still wakes the waiters: a late renewal can reopen the fence and a
    /// new deadline pass before the watcher runs, and a waiter that came in
    /// while it was open is waiting for a change, not for a state.
    Closed(Option<Deadline>),
}

/// The watcher: keeps `shut` saying whether the deadline has passed or the
/// fence was revoked, waking at the deadline and whenever it moves.
async fn watch_deadline(
    mut deadline: watch::Receiver<Option<Deadline>>,
    shut: watch::Sender<Seen>,
    boot: BootClock,
) {
    loop {
        let current = *deadline.borrow_and_update();
        let closed = current.is_none_or(|d| d.passed(boot));
        let seen = if closed {
            Seen::Closed(current)
        } else {
            Seen::Open
        };
        shut.send_if_modified(|s| std::mem::replace(s, seen) != seen);
        let moved = match current {
            // Revoked: never valid again, nothing more to watch.
            None => return,
            Some(d) if !closed => tokio::select! {
                _ = sleep_until(d.at) => Ok(()),
                _ = sleep(BOOT_RECHECK), if d.boot.is_some() => Ok(()),
                moved = deadline.changed() => moved,
            },
            Some(_) => deadline.changed().await,
        };
        if moved.is_err() {
            return;
        }
    }
}

/// `lease_duration - fence_margin`, or an error when that leaves no room for
/// at least two renewals (one failed renewal must not fence a worker).
pub fn fence_window(
    lease_duration: Duration,
    fence_margin: Duration,
    heartbeat_interval: Duration,
) -> Result<Duration, String> {
    let window = lease_duration.checked_sub(fence_margin).unwrap_or_default();
    if window <= heartbeat_interval + heartbeat_interval / 2 {
        return Err(format!(
            "lease duration {lease_duration:?} minus fence margin {fence_margin:?} leaves {window:?}, \
             not more than 1.5 heartbeat intervals ({heartbeat_interval:?} each): lengthen the lease \
             or shorten the heartbeat"
        ));
    }
    Ok(window)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Sent at `at` on the monotonic clock alone (the boot clock does not
    /// move under a paused test clock).
    fn sent(at: Instant) -> Sent {
        Sent { at, boot: None }
    }

    /// A boot clock the test moves by hand: milliseconds since "boot".
    static FAKE_BOOT_MS: AtomicU64 = AtomicU64::new(1_000_000);

    fn fake_boot() -> Option<Duration> {
        Some(Duration::from_millis(FAKE_BOOT_MS.load(Ordering::SeqCst)))
    }

    /// A machine suspended for an hour: the monotonic clock stood still, the
    /// boot clock (and every peer's) did not. The worker wakes up fenced, and
    /// whatever waits for the fence to close learns it within a recheck.
    #[tokio::test(start_paused = true)]
    async fn a_worker_resumed_from_suspend_wakes_up_fenced() {
        let fence = std::sync::Arc::new(Fence::with_boot_clock(
            Duration::from_secs(10),
            Sent::with_clock(fake_boot),
            fake_boot,
        ));
        tokio::time::advance(Duration::from_secs(5)).await;
        fence.confirm(Sent::with_clock(fake_boot));
        let waiter = tokio::spawn({
            let fence = fence.clone();
            async move { fence.closed().await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(fence.is_valid());
        FAKE_BOOT_MS.fetch_add(3_600_000, Ordering::SeqCst);
        assert!(!fence.is_valid(), "an hour asleep: fenced at once");
        let before = Instant::now();
        waiter.await.unwrap();
        assert!(Instant::now() - before <= BOOT_RECHECK);
    }

    #[tokio::test(start_paused = true)]
    async fn a_worker_without_confirmed_renewals_fences_itself_before_peers_may_declare_it_dead() {
        let window = fence_window(
            Duration::from_secs(8),
            Duration::from_secs(1),
            Duration::from_secs(4),
        )
        .unwrap();
        assert_eq!(window, Duration::from_secs(7));
        let fence = Fence::new(window, sent(Instant::now()));
        tokio::time::advance(Duration::from_secs(6)).await;
        assert!(fence.is_valid());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(!fence.is_valid(), "7 s without a confirmed renewal: fenced");
    }

    #[tokio::test(start_paused = true)]
    async fn confirmations_extend_from_when_the_renewal_was_sent() {
        let fence = Fence::new(Duration::from_secs(10), sent(Instant::now()));
        tokio::time::advance(Duration::from_secs(5)).await;
        let at = Instant::now();
        tokio::time::advance(Duration::from_secs(3)).await;
        fence.confirm(sent(at));
        assert_eq!(fence.deadline(), Some(at + Duration::from_secs(10)));
        fence.confirm(sent(at - Duration::from_secs(4)));
        assert_eq!(
            fence.deadline(),
            Some(at + Duration::from_secs(10)),
            "an older confirmation never shortens the fence"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_paused_process_wakes_up_fenced() {
        let fence = Fence::new(Duration::from_secs(10), sent(Instant::now()));
        tokio::time::advance(Duration::from_secs(30)).await;
        assert!(!fence.is_valid());
    }

    #[tokio::test(start_paused = true)]
    async fn a_revoked_fence_stays_closed() {
        let fence = Fence::new(Duration::from_secs(10), sent(Instant::now()));
        fence.revoke();
        fence.confirm(sent(Instant::now()));
        assert!(!fence.is_valid());
        fence.closed().await;
    }

    #[tokio::test(start_paused = true)]
    async fn closed_follows_a_moving_deadline_and_open_waits_for_a_renewal() {
        let fence = std::sync::Arc::new(Fence::new(Duration::from_secs(10), sent(Instant::now())));
        let started = Instant::now();
        let watcher = tokio::spawn({
            let fence = fence.clone();
            async move {
                fence.closed().await;
                Instant::now()
            }
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        fence.confirm(sent(Instant::now()));
        let closed_at = watcher.await.unwrap();
        assert_eq!(closed_at - started, Duration::from_secs(15));
        let reopened = tokio::spawn({
            let fence = fence.clone();
            async move { fence.open().await }
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!reopened.is_finished());
        fence.confirm(sent(Instant::now()));
        reopened.await.unwrap();
    }

    /// Renewals move the deadline every heartbeat; a worker's thousands of
    /// sessions and holders wait on `closed()`, and none of them may be woken
    /// by a renewal (each wake-up is work times ten thousand).
    #[tokio::test(start_paused = true)]
    async fn renewals_do_not_wake_what_waits_for_the_fence_to_close() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let fence = std::sync::Arc::new(Fence::new(Duration::from_secs(10), sent(Instant::now())));
        let polls = std::sync::Arc::new(AtomicUsize::new(0));
        let waiter = tokio::spawn({
            let (fence, polls) = (fence.clone(), polls.clone());
            async move {
                let mut closed = std::pin::pin!(fence.closed());
                std::future::poll_fn(|cx| {
                    polls.fetch_add(1, Ordering::Relaxed);
                    closed.as_mut().poll(cx)
                })
                .await;
                Instant::now()
            }
        });
        let started = Instant::now();
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            fence.confirm(sent(Instant::now()));
        }
        let closed_at = waiter.await.unwrap();
        assert_eq!(closed_at - started, Duration::from_secs(15));
        assert!(
            polls.load(Ordering::Relaxed) <= 3,
            "woken {} times by 100 renewals",
            polls.load(Ordering::Relaxed)
        );
    }

    /// A fence that closed and was reopened by a late renewal: a wait that
    /// starts before the watcher has seen the renewal does not end at once.
    #[tokio::test(start_paused = true)]
    async fn a_wait_on_a_reopened_fence_lasts_until_the_new_deadline() {
        let fence = std::sync::Arc::new(Fence::new(Duration::from_secs(10), sent(Instant::now())));
        let started = Instant::now();
        fence.closed().await;
        assert_eq!(Instant::now() - started, Duration::from_secs(10));
        tokio::time::sleep(Duration::from_secs(2)).await;
        fence.confirm(sent(Instant::now()));
        assert!(fence.is_valid());
        fence.closed().await;
        assert_eq!(Instant::now() - started, Duration::from_secs(22));
    }

    /// A late renewal reopens a closed fence for a moment, and its new
    /// deadline passes before the watcher has run. A wait that began while
    /// the fence was open must still end when it closes again (the watcher
    /// saw closed, then closed: a flag that only flips would not move).
    #[tokio::test(start_paused = true)]
    async fn a_wait_begun_in_a_short_reopening_ends_when_the_fence_closes_again() {
        let window = Duration::from_secs(10);
        let fence = Fence::new(window, sent(Instant::now()));
        fence.closed().await;
        // Reopened until 1 ms from now; the watcher has not run since.
        fence.confirm(sent(Instant::now() + Duration::from_millis(1) - window));
        assert!(fence.is_valid());
        let mut waiting = std::pin::pin!(fence.closed());
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        tokio::time::advance(Duration::from_millis(2)).await;
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("a wait on a fence that closed again never ended");
    }

    #[test]
    fn settings_that_leave_no_room_for_renewals_are_refused() {
        let err = fence_window(
            Duration::from_secs(6),
            Duration::from_secs(1),
            Duration::from_secs(4),
        )
        .unwrap_err();
        assert!(err.contains("heartbeat"), "{err}");
    }
}
