//! What a held stream has achieved, shared by its session (which advances it),
//! its holder (which reports status and releases with the checkpoint) and the
//! worker's liveness task (which packs checkpoints into the worker item).

use crate::lease::{Phase, SessionStatus};
use crate::support::lock;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tokio::time::Instant;

/// `AtomicU64` value standing for "no checkpoint".
const NONE: u64 = u64::MAX;

fn load(a: &AtomicU64) -> Option<u64> {
    Some(a.load(Ordering::SeqCst)).filter(|v| *v != NONE)
}

/// One stream's checkpoint and session status.
#[derive(Debug)]
pub struct StreamProgress {
    /// The checkpoint: the highest sequence number the sink acknowledged.
    checkpoint: AtomicU64,
    /// The checkpoint known to be stored on the stream item itself.
    stored: AtomicU64,
    status: Mutex<SessionStatus>,
    status_dirty: AtomicBool,
    /// Signalled when the status changes, so the holder writes it soon.
    status_changed: tokio::sync::Notify,
    /// Sink requests that may still be applied: see [`Requests`].
    requests: Mutex<Requests>,
}

/// Sink requests of this stream whose application cannot be ruled out yet.
/// A request is on record from before it is sent until its answer arrives;
/// one that never gets an answer (its session was stopped, aborted or fenced
/// while it was out) stays on record until the send plus the sink's timeout:
/// dropping a client future does not unsend the bytes. Nothing here waits for
/// a drop to happen, so a release that looks right after stopping a session
/// sees the request that session had out.
#[derive(Debug, Default)]
struct Requests {
    /// The request out now, and until when the sink may apply it.
    out: Option<Instant>,
    /// The latest such instant of requests never answered.
    abandoned: Option<Instant>,
}

/// A sink request on record (see [`StreamProgress::in_flight`]).
#[must_use = "a request left on record holds up the stream's release until the sink's timeout"]
pub struct InFlight<'a> {
    progress: &'a StreamProgress,
}

impl InFlight<'_> {
    /// The sink answered: nothing of this request is left to settle.
    pub fn answered(self) {
        lock(&self.progress.requests).out = None;
    }
}

impl StreamProgress {
    /// Starting from `checkpoint` (the resume point), of which `stored` is
    /// already on the item.
    pub fn new(checkpoint: Option<u64>, stored: Option<u64>) -> Self {
        Self {
            checkpoint: AtomicU64::new(checkpoint.unwrap_or(NONE)),
            stored: AtomicU64::new(stored.unwrap_or(NONE)),
            status: Mutex::new(SessionStatus::default()),
            status_dirty: AtomicBool::new(false),
            status_changed: tokio::sync::Notify::new(),
            requests: Mutex::new(Requests::default()),
        }
    }

    /// Puts a sink request on record before it is sent: the sink may apply
    /// it until `settles_by`. A request still out (never answered) is kept
    /// as abandoned.
    pub fn in_flight(&self, settles_by: Instant) -> InFlight<'_> {
        let mut requests = lock(&self.requests);
        requests.abandoned = requests.abandoned.max(requests.out.take());
        requests.out = Some(settles_by);
        InFlight { progress: self }
    }

    /// Until when a sink request that was sent and not answered may still be
    /// applied, if that is still ahead.
    pub fn unsettled_until(&self) -> Option<Instant> {
        let requests = lock(&self.requests);
        requests
            .abandoned
            .max(requests.out)
            .filter(|until| *until > Instant::now())
    }

    /// The checkpoint: the highest acknowledged sequence number, if any.
    pub fn checkpoint(&self) -> Option<u64> {
        load(&self.checkpoint)
    }

    /// Advances the checkpoint (never backwards).
    pub fn ack(&self, seq: u64) {
        let _ = self
            .checkpoint
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |cur| {
                (cur == NONE || seq > cur).then_some(seq)
            });
    }

    pub fn stored_checkpoint(&self) -> Option<u64> {
        load(&self.stored)
    }

    /// Records that the stream item now holds at least `seq`.
    pub fn mark_stored(&self, seq: u64) {
        let _ = self
            .stored
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |cur| {
                (cur == NONE || seq > cur).then_some(seq)
            });
    }

    /// The checkpoint if it is ahead of what the stream item holds: what the
    /// worker must keep in its packed checkpoints.
    pub fn unstored_checkpoint(&self) -> Option<u64> {
        match (self.checkpoint(), self.stored_checkpoint()) {
            (Some(a), Some(p)) if a <= p => None,
            (a, _) => a,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SessionStatus> {
        lock(&self.status)
    }

    /// Changes the status; the holder writes it (rate-limited) when it changed.
    pub fn update_status(&self, change: impl FnOnce(&mut SessionStatus)) {
        let mut status = self.lock();
        let before = status.clone();
        change(&mut status);
        // Only what a reader acts on is worth a write: the phase, the reason,
        // and when the session connected (not every reconnect count).
        let changed = status.phase != before.phase
            || status.reason != before.reason
            || status.connected_since_ms != before.connected_since_ms;
        if changed {
            self.status_dirty.store(true, Ordering::SeqCst);
            self.status_changed.notify_one();
        }
    }

    /// Resolves after the next status change (or at once if one is pending).
    pub async fn status_changed(&self) {
        self.status_changed.notified().await;
    }

    /// The status, if it changed since the last call (which marks it taken).
    pub fn take_status(&self) -> Option<SessionStatus> {
        self.status_dirty
            .swap(false, Ordering::SeqCst)
            .then(|| self.lock().clone())
    }

    /// Whether a status change waits to be written.
    pub fn has_unwritten_status(&self) -> bool {
        self.status_dirty.load(Ordering::SeqCst)
    }

    /// Marks the status as not yet written (after a failed write).
    pub fn status_unwritten(&self) {
        self.status_dirty.store(true, Ordering::SeqCst);
    }

    pub fn status(&self) -> SessionStatus {
        self.lock().clone()
    }

    pub fn phase(&self) -> Phase {
        self.lock().phase
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request cut short stays on record until the sink's timeout, also
    /// when a later session's request is answered meanwhile.
    #[tokio::test(start_paused = true)]
    async fn a_request_never_answered_holds_the_release_until_the_sink_timeout() {
        let p = StreamProgress::new(None, None);
        assert_eq!(p.unsettled_until(), None);
        let first = Instant::now() + std::time::Duration::from_secs(10);
        let cut_short = p.in_flight(first);
        drop(cut_short);
        assert_eq!(p.unsettled_until(), Some(first));
        let second = Instant::now() + std::time::Duration::from_secs(3);
        p.in_flight(second).answered();
        assert_eq!(p.unsettled_until(), Some(first), "the first is still out");
        tokio::time::advance(std::time::Duration::from_secs(10)).await;
        assert_eq!(p.unsettled_until(), None, "past the sink's timeout");
    }

    #[test]
    fn no_checkpoint_and_checkpoint_zero_are_different() {
        let p = StreamProgress::new(None, None);
        assert_eq!(p.checkpoint(), None);
        p.ack(0);
        assert_eq!(p.checkpoint(), Some(0), "sequence 0 is a checkpoint");
        assert_eq!(p.unstored_checkpoint(), Some(0));
        p.mark_stored(0);
        assert_eq!(p.unstored_checkpoint(), None);
        p.ack(5);
        p.ack(3);
        assert_eq!(p.checkpoint(), Some(5), "never backwards");
        assert_eq!(p.unstored_checkpoint(), Some(5));
    }

    #[test]
    fn status_changes_are_taken_once_and_counters_alone_are_not_news() {
        let p = StreamProgress::new(None, None);
        assert!(p.take_status().is_none());
        p.update_status(|s| s.phase = Phase::Connected);
        assert_eq!(p.take_status().map(|s| s.phase), Some(Phase::Connected));
        assert!(p.take_status().is_none());
        p.update_status(|s| s.reconnects += 1);
        assert!(
            p.take_status().is_none(),
            "a reconnect count alone is not written"
        );
    }
}
