//! Watching peers' heartbeats: which items are read each pass, the fleet
//! view fair share is computed from, duplicate worker ids, and declaring an
//! overdue peer dead.

use super::fair_share::{FleetView, Peer};
use super::overdue::successors;
use super::pass::Acquirer;
use crate::lease::{FleetEntry, Incarnation, StoreError, WorkerRecord, WorkerState};
use crate::worker::settings::PEER_SILENCE_HEARTBEATS;
use tokio::time::Instant;

use super::quiet_state::{WATCHED_PEERS, every_live_peer};

/// What one read of peers' items (and the change counter) showed.
pub(super) struct WatchRead {
    pub(super) workers: Vec<WorkerRecord>,
    /// Whether the change counter moved (`false` when it was not read).
    pub(super) moved: bool,
    /// When the answer came.
    pub(super) answered: Instant,
}

impl Acquirer {
    /// Reads `who`'s items, and the change counter when `with_changes`, and
    /// records what they showed: each peer's version (a version shown again
    /// counts from when the read was sent, as the next may land while it is
    /// under way; see `renewal_forecast`) and the counter.
    pub(super) async fn read_watched(
        &mut self,
        who: &[Incarnation],
        with_changes: bool,
    ) -> Result<WatchRead, StoreError> {
        let asked = Instant::now();
        let read = self.ctx.store.watch(who, with_changes).await?;
        let answered = Instant::now();
        for r in &read.workers {
            self.observer.observe(r, asked, answered);
        }
        let moved = read
            .changes
            .is_some_and(|changes| self.quiet.saw(changes, answered));
        Ok(WatchRead {
            workers: read.workers,
            moved,
            answered,
        })
    }

    /// Reads peers' items (a few every pass, all every heartbeat), updates the
    /// fleet view, and declares overdue peers dead.
    pub(super) async fn watch_peers(&mut self, workers: &[FleetEntry]) -> Result<(), StoreError> {
        let live = super::pass::live_incarnations(workers);
        let draining: Vec<&Incarnation> = workers
            .iter()
            .filter(|w| w.draining)
            .map(|w| &w.incarnation)
            .collect();
        self.observer.retain(|i| live.contains(i));
        let now = Instant::now();
        let full = self
            .last_full_refresh
            .is_none_or(|t| now.duration_since(t) >= self.ctx.settings.heartbeat_interval);
        let to_read: Vec<Incarnation> = if full {
            self.last_full_refresh = Some(now);
            live.iter().filter(|i| **i != self.me).cloned().collect()
        } else {
            successors(&self.me, &live, WATCHED_PEERS)
        };
        let WatchRead {
            workers: records,
            answered: now,
            ..
        } = self.read_watched(&to_read, true).await?;
        let silence = self.ctx.settings.heartbeat_interval * PEER_SILENCE_HEARTBEATS;
        if full {
            // The peers that take streams: fair share's view, and the ones
            // to tell of a change.
            let taking: Vec<&WorkerRecord> = records
                .iter()
                .filter(|r| r.state == WorkerState::Live && !draining.contains(&&r.incarnation))
                .collect();
            self.view = FleetView {
                peers: taking
                    .iter()
                    .map(|r| Peer {
                        incarnation: r.incarnation.clone(),
                        held: r.held,
                        progressing: self.observer.progressing(&r.incarnation, now, silence),
                        published_at_ms: r.heartbeat_at_ms,
                        marked_released_at_ms: r.released_at_ms,
                    })
                    .collect(),
            };
            self.ctx.metrics.live_workers.set(self.view.live() as i64);
            self.ctx
                .pokes
                .set_peers(taking.iter().filter_map(|r| r.poke_addr));
            // One LIVE peer of an earlier release, which does not move the
            // change counter, and every pass is full.
            self.quiet.set_peers_announce(workers, &self.me, &records);
            // Likewise one that cannot read slotted checkpoints, and this
            // worker's go by name.
            self.ctx.peers_read_slots.store(
                every_live_peer(workers, &self.me, &records, |r| r.reads_slots),
                std::sync::atomic::Ordering::Relaxed,
            );
            let duplicates = records
                .iter()
                .filter(|r| {
                    r.state == WorkerState::Live && r.incarnation.worker_id() == self.me.worker_id()
                })
                .count();
            self.ctx.metrics.duplicate_worker_id.set(duplicates as i64);
            if duplicates > 0 {
                tracing::warn!(
                    worker_id = self.me.worker_id(),
                    others = duplicates,
                    "another live process runs with this worker id; each keeps its own incarnation, but check the deployment"
                );
            }
        } else {
            self.view
                .peers
                .retain(|p| !draining.contains(&&p.incarnation));
            for p in &mut self.view.peers {
                p.progressing = self.observer.progressing(&p.incarnation, now, silence);
            }
        }
        for (peer, version) in self.observer.overdue(now) {
            match self.ctx.store.declare_dead(&peer, version).await? {
                Some(WorkerState::Dead) => {
                    self.ctx.metrics.workers_declared_dead.inc();
                    tracing::warn!(worker = %peer, version, "peer's heartbeat stood still for a lease: declared dead");
                }
                state => {
                    tracing::debug!(worker = %peer, ?state, "peer was not declared dead (it renewed or left)")
                }
            }
        }
        Ok(())
    }
}
