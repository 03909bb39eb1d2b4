//! The fleet's change counter: one small item, `FLEET#CHANGES`, whose counter
//! is moved by every write that may give a peer something to do, once that
//! write landed. A worker starting to take streams, draining, releasing,
//! leaving or declared dead; a worker's load changing; a stream created,
//! started or re-created by the control plane.
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
//! Bumps are coalesced per process by one detached task: a request made
//! while a bump is in flight is covered by one more bump after it, whatever
//! number of requests arrive meanwhile. A burst (a controller creating
//! thousands of streams) then writes the item about once per round trip,
//! far below DynamoDB's per-key write limit. The task is not the caller's:
//! a caller that is cancelled loses nothing, and none is kept bumping for
//! others.

use super::client::LeaseStore;
use super::codec::{Item, n};
use super::error::StoreError;
use super::update::Update;
use aws_sdk_dynamodb::types::ReturnValue;

/// The change counter's item.
pub const CHANGES_PK: &str = "FLEET#CHANGES";
/// Its counter attribute.
const CHANGES: &str = "changes";

impl LeaseStore {
    /// Moves the change counter, after a write peers should act on landed,
    /// and returns once a bump begun after this call was made (so a process
    /// about to exit has announced). Never fails: a bump that cannot be made
    /// is logged, and readers find the change at their next full pass.
    pub async fn announce_change(&self) {
        let mine = self.announce_change_soon();
        self.announcer.covered(mine).await;
    }

    /// [`LeaseStore::announce_change`] without waiting for the bump (off a
    /// critical path: the heartbeat, a pass). Returns the request's number.
    pub fn announce_change_soon(&self) -> u64 {
        let (mine, start) = self.announcer.request();
        if start {
            tokio::spawn(self.clone().bump_until_covered());
        }
        mine
    }

    /// The bumping task: one bump per round of requests, until a bump covers
    /// every request made before it began.
    async fn bump_until_covered(self) {
        loop {
            let target = self.announcer.target();
            match self.bump_changes().await {
                Ok(()) => {
                    if let Some(after) = self.announcer.after_bump() {
                        after().await;
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "change counter not moved; peers find the change at their next full pass");
                }
            }
            if self.announcer.finished(target) {
                return;
            }
        }
    }

    /// Sets what runs after each bump of this process that landed, before
    /// the callers it covers return (so a process about to exit has run it
    /// too): the worker tells its peers there (`worker::pokes`). Set once;
    /// `false` when a hook was set already.
    pub fn after_announcing(&self, hook: super::announcer::AfterBump) -> bool {
        self.announcer.set_after_bump(hook)
    }

    /// The counter, strongly consistent (1 read unit, where the quiet read
    /// is half of one): read when a peer said it just moved it, so a read
    /// right after that write cannot miss it.
    pub async fn changes_now(&self) -> Result<u64, StoreError> {
        Ok(self
            .get_raw("read_changes_poked", CHANGES_PK)
            .await?
            .as_ref()
            .map_or(0, changes_of))
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
pub(super) fn changes_of(item: &Item) -> u64 {
    item.get(CHANGES)
        .and_then(|v| v.as_n().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}
