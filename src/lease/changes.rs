//! The fleet's change counter: one small item, `FLEET#CHANGES`, whose counter
//! is moved by every write that may give a peer something to do, once that
//! write landed. A worker joining, draining, releasing, leaving or declared
//! dead; a worker's load changing; a stream created, started or re-created by
//! the control plane.
//!
//! It lets a quiet fleet read almost nothing. A worker reads the counter
//! together with the peers it watches (one request), and queries the fleet and
//! the unowned partitions only while the counter moves (see
//! `worker::acquirer::quiet`). The counter is a hint and never a condition:
//! every ownership write keeps its own condition. So a bump that is lost (its
//! writer crashed between the event and the bump, or runs a release that does
//! not bump) only delays a pickup until the reader's next full pass. It can
//! never let two owners in.
//!
//! Bumps are coalesced per process: while one is in flight, any number of
//! further requests make one more bump after it. A burst (a controller
//! creating thousands of streams) then writes the item about once per round
//! trip, which keeps its key far below DynamoDB's per-key write limit.

use super::client::LeaseStore;
use super::codec::{attr, n, s};
use super::error::StoreError;
use super::update::Update;
use aws_sdk_dynamodb::types::ReturnValue;
use std::sync::Mutex;

/// The change counter's item.
pub const CHANGES_PK: &str = "FLEET#CHANGES";
/// Its counter attribute.
const CHANGES: &str = "changes";

/// Coalesces this process's bumps (see the module's documentation).
#[derive(Debug, Default)]
pub(crate) struct Announcer {
    state: Mutex<AnnouncerState>,
}

#[derive(Debug, Default)]
struct AnnouncerState {
    /// A caller is bumping now.
    running: bool,
    /// Someone asked for a bump after the one in flight began.
    again: bool,
}

/// Clears `running` when the bumping caller finishes or is dropped midway.
struct Running<'a>(&'a Announcer);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        let mut state = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        state.running = false;
        state.again = false;
    }
}

impl LeaseStore {
    /// Moves the change counter, after a write peers should act on landed.
    /// Returns at once when a bump is already in flight (that caller bumps
    /// once more for this one). Never fails: a bump that cannot be made is
    /// logged, and readers find the change at their next full pass.
    pub async fn announce_change(&self) {
        {
            let mut state = self
                .announcer
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if state.running {
                state.again = true;
                return;
            }
            state.running = true;
        }
        let _running = Running(&self.announcer);
        loop {
            if let Err(e) = self.bump_changes().await {
                tracing::debug!(error = %e, "change counter not moved; peers find the change at their next full pass");
            }
            let mut state = self
                .announcer
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if !state.again {
                return;
            }
            state.again = false;
        }
    }

    async fn bump_changes(&self) -> Result<(), StoreError> {
        let mut update = Update::new();
        update.add(CHANGES, ":one", n(1));
        self.update_item("announce_change", CHANGES_PK, &update, ReturnValue::None)
            .await?
            // Unconditional: a failed condition cannot happen.
            .ok();
        Ok(())
    }
}

/// The counter in a read of [`CHANGES_PK`] (0 before the first bump).
pub(super) fn changes_of(item: Option<&super::codec::Item>) -> u64 {
    item.and_then(|i| i.get(CHANGES))
        .and_then(|v| v.as_n().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The key of [`CHANGES_PK`], for a batch read.
pub(super) fn changes_key()
-> std::collections::HashMap<String, aws_sdk_dynamodb::types::AttributeValue> {
    std::collections::HashMap::from([(attr::PK.to_string(), s(CHANGES_PK))])
}
