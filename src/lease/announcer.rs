//! Coalescing of change-counter bumps (see `changes`): requests are numbered,
//! one detached task bumps for every request made before its bump began, and
//! each caller waits until a finished bump covers its number.

use futures::future::BoxFuture;
use std::sync::{Arc, Mutex, OnceLock};
use tokio::sync::watch;

/// What runs after each bump that landed, before the requests it covers are
/// answered (`LeaseStore::after_announcing`).
pub type AfterBump = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// This process's bump requests and the task that serves them.
pub(crate) struct Announcer {
    state: Mutex<State>,
    /// The highest request number a finished bump covers.
    covered: watch::Sender<u64>,
    after_bump: OnceLock<AfterBump>,
}

impl std::fmt::Debug for Announcer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Announcer")
            .field("state", &self.state)
            .field("covered", &self.covered)
            .field("after_bump", &self.after_bump.get().is_some())
            .finish()
    }
}

impl Default for Announcer {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            covered: watch::channel(0).0,
            after_bump: OnceLock::new(),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    /// Requests made so far (each one's number).
    requested: u64,
    /// The bumping task runs.
    running: bool,
}

impl Announcer {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Numbers a new request; `true` when no task runs and the caller must
    /// start one (it is then marked running).
    pub(super) fn request(&self) -> (u64, bool) {
        let mut state = self.state();
        state.requested += 1;
        let start = !state.running;
        state.running = true;
        (state.requested, start)
    }

    /// Sets what runs after each bump that landed; `false` when it was set
    /// already (the first one stays).
    pub(super) fn set_after_bump(&self, hook: AfterBump) -> bool {
        self.after_bump.set(hook).is_ok()
    }

    pub(super) fn after_bump(&self) -> Option<AfterBump> {
        self.after_bump.get().cloned()
    }

    /// The request a bump beginning now covers.
    pub(super) fn target(&self) -> u64 {
        self.state().requested
    }

    /// Records a finished bump for `target`; `true` when no request came
    /// after it began and the task ends.
    pub(super) fn finished(&self, target: u64) -> bool {
        self.covered.send_replace(target);
        let mut state = self.state();
        let done = state.requested == target;
        if done {
            state.running = false;
        }
        done
    }

    /// Waits until a finished bump covers request `number`.
    pub(super) async fn covered(&self, number: u64) {
        let mut covered = self.covered.subscribe();
        // The sender lives as long as this announcer: the wait ends.
        let _ = covered.wait_for(|c| *c >= number).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_during_a_bump_are_covered_by_one_more_and_then_the_task_ends() {
        let a = Announcer::default();
        assert_eq!(a.request(), (1, true));
        let target = a.target();
        // Two more while the first bump is in flight: no second task.
        assert_eq!(a.request(), (2, false));
        assert_eq!(a.request(), (3, false));
        assert!(!a.finished(target), "requests 2 and 3 need one more bump");
        let target = a.target();
        assert_eq!(target, 3);
        assert!(a.finished(target));
        // The next request starts a task again.
        assert_eq!(a.request(), (4, true));
    }
}
