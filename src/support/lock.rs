//! A mutex guard whatever became of the previous holder.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, taking the data over if a holder panicked: every lock in tether
/// guards bookkeeping that stays consistent between statements (a panic
/// cannot leave it half-written), so one panicked task must not take the
/// process's other tasks down with it.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
