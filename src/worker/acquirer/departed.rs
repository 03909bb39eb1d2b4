//! Departed (DEAD or LEFT) incarnations: whose streams still need taking,
//! who looks again for late arrivals, and when an incarnation is forgotten.

use super::overdue::successors;
use super::pass::{Acquirer, Candidate, Ended};
use crate::lease::{
    AcquireFrom, DesiredState, FleetEntry, HOLDER_SHARDS, Incarnation, Ownership, StoreError,
    WorkerState,
};
use tokio::time::Instant;

/// After a departed (DEAD or LEFT) incarnation's partitions were found empty,
/// its ring successor looks again this often ...
const ENDED_RESCAN: std::time::Duration = std::time::Duration::from_secs(5);
/// ... and forgets it (deletes its items) once it has been gone this long: an
/// acquire it sent just before it ended can still land after the first empty
/// scan, and must still be found.
const FORGET_AFTER: std::time::Duration = std::time::Duration::from_secs(120);
impl Ended {
    /// Whether this worker looks at the incarnation's partitions now: until
    /// they were found empty, and then only its ring successor (`mine`), now
    /// and then.
    fn due(&self, mine: bool, now: Instant) -> bool {
        !self.emptied
            || (mine
                && self
                    .last_scan
                    .is_none_or(|t| now.duration_since(t) >= ENDED_RESCAN))
    }
}

impl Acquirer {
    /// Whether a departed incarnation of `workers` needs a look now.
    pub(super) fn ended_due(&self, workers: &[FleetEntry], now: Instant) -> bool {
        let live = super::pass::live_incarnations(workers);
        self.ended
            .iter()
            .any(|(inc, e)| e.due(successors(inc, &live, 1).first() == Some(&self.me), now))
    }

    /// Departed incarnations: everyone takes a dead one's streams until its
    /// partitions are empty; then its ring successor alone looks again now
    /// and then (for an acquire it sent just before it ended) and finally
    /// forgets it. A LEFT one released everything itself: only the successor looks.
    pub(super) async fn ended_candidates(
        &mut self,
        workers: &[FleetEntry],
        candidates: &mut Vec<Candidate>,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let live = super::pass::live_incarnations(workers);
        for w in workers
            .iter()
            .filter(|w| w.state != WorkerState::Live && w.incarnation != self.me)
        {
            self.ended.entry(w.incarnation.clone()).or_insert(Ended {
                first_seen: now,
                emptied: w.state == WorkerState::Left,
                empty_shards: 0,
                rotation: super::rotation::Rotation::default(),
                last_scan: None,
            });
        }
        self.ended
            .retain(|inc, _| workers.iter().any(|w| &w.incarnation == inc));
        let ended: Vec<Incarnation> = self.ended.keys().cloned().collect();
        for inc in ended {
            let mine = successors(&inc, &live, 1).first() == Some(&self.me);
            if !self.ended.get(&inc).is_some_and(|e| e.due(mine, now)) {
                continue;
            }
            let found_any = self.ended_streams(&inc, candidates).await?;
            if let Some(e) = self.ended.get_mut(&inc) {
                e.last_scan = Some(now);
                if !found_any {
                    e.emptied = true;
                    if mine && now.duration_since(e.first_seen) >= FORGET_AFTER {
                        let record = self.ctx.store.worker(&inc).await?;
                        self.ctx.store.forget_worker(&inc, record.as_ref()).await?;
                        self.dead_checkpoints.remove(&inc);
                        self.ended.remove(&inc);
                    }
                }
            }
        }
        Ok(())
    }

    /// A departed incarnation's streams, a bounded read (`sampling`) of this
    /// pass's turn of its partitions not yet found empty (`rotation`; every
    /// one of them once it was found empty, for its successor's look for late
    /// arrivals): STARTED ones become candidates (with its packed
    /// checkpoint), STOPPED ones are freed. `false` once every partition was
    /// found empty.
    async fn ended_streams(
        &mut self,
        dead: &Incarnation,
        candidates: &mut Vec<Candidate>,
    ) -> Result<bool, StoreError> {
        let per_pass = self.shards_per_pass();
        let Some(ended) = self.ended.get_mut(dead) else {
            return Ok(false);
        };
        if ended.emptied {
            ended.empty_shards = 0;
        }
        let remaining: Vec<u32> = (0..HOLDER_SHARDS)
            .filter(|&s| ended.empty_shards & (1 << s) == 0)
            .collect();
        let count = if ended.emptied {
            remaining.len()
        } else {
            per_pass
        };
        let turn = ended.rotation.turn(&remaining, count);
        let mut found = crate::lease::Found::default();
        let mut emptied_now = 0u32;
        for shard in turn {
            let (part, complete) = self.sample("query_departed", &dead.holder(shard)).await?;
            if complete && part.records.is_empty() && part.malformed.is_empty() {
                emptied_now |= 1 << shard;
            }
            found.records.extend(part.records);
            found.malformed.extend(part.malformed);
        }
        let all_empty = self.ended.get_mut(dead).is_none_or(|e| {
            e.empty_shards |= emptied_now;
            e.empty_shards == (1 << HOLDER_SHARDS) - 1
        });
        if found.records.is_empty() && found.malformed.is_empty() {
            return Ok(!all_empty);
        }
        if !self.dead_checkpoints.contains_key(dead) {
            let checkpoints = self.ctx.store.checkpoints_of(dead).await?;
            self.dead_checkpoints
                .insert(dead.clone(), std::sync::Arc::new(checkpoints));
        }
        let checkpoints = self.dead_checkpoints.get(dead).cloned().unwrap_or_default();
        let mut started = crate::lease::Found {
            malformed: found.malformed,
            ..Default::default()
        };
        for r in found.records {
            if r.ownership() != Ownership::Owned(dead.clone()) {
                continue; // the index lags: it has moved already
            }
            if r.desired_state == DesiredState::Stopped || r.is_tombstone() {
                self.ctx.store.clear_dead_owner(&r).await?;
            } else {
                started.records.push(r);
            }
        }
        self.take_found(started, candidates, |r| {
            let checkpoint = checkpoints
                .get(&r.key)
                .filter(|c| c.token == r.lease_counter)
                .map(|c| c.seq);
            Some(AcquireFrom::Dead {
                owner: dead.clone(),
                checkpoint,
            })
        });
        Ok(true)
    }
}
