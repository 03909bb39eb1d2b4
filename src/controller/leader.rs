//! Leader election on a `coordination.k8s.io/v1` Lease, so exactly one replica
//! of an installation reconciles while the others stand by.
//!
//! Why a Lease and not sharding over the worker fleet: the controller's load
//! is API-server requests, which a shard would not reduce (every replica would
//! still watch every resource), and a Lease is what cluster operators already
//! read (`kubectl get lease`). The mirror stays idempotent and guarded by
//! UID, generation and installation, so a short overlap of two leaders (a
//! paused leader that wakes up) can only repeat writes, never undo them.
//!
//! The rules are client-go's: writes are optimistic on the Lease's
//! `resourceVersion` (a lost race is a 409 and changes nothing); a holder is
//! considered gone only after its record stood still for a whole lease on
//! *this* replica's monotonic clock (no wall-clock comparison between
//! replicas); a leader that cannot renew for two thirds of the lease steps
//! down before anyone may take over; a leader that stops cleanly clears the
//! holder so a standby takes over at its next try instead of after a lease.

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use std::time::Duration;
use tokio::time::{Instant, sleep};
use tokio_util::sync::CancellationToken;

/// Who competes for which Lease, and how fast.
#[derive(Clone, Debug)]
pub(super) struct Election {
    pub namespace: String,
    pub lease_name: String,
    /// This replica's identity (unique per process).
    pub identity: String,
    pub lease: Duration,
}

impl Election {
    /// Renewals and standby attempts happen this often.
    pub(super) fn retry_period(&self) -> Duration {
        self.lease / 3
    }

    /// A leader that has not renewed for this long steps down; strictly
    /// shorter than the lease, so it has stopped before a standby may start.
    pub(super) fn renew_deadline(&self) -> Duration {
        self.lease * 2 / 3
    }
}

/// What this replica last saw of the Lease and when (its own clock).
#[derive(Default)]
struct Observed {
    record: Option<(Option<String>, Option<String>)>,
    since: Option<Instant>,
}

impl Observed {
    fn note(&mut self, holder: Option<String>, version: Option<String>) {
        let record = Some((holder, version));
        if self.record != record {
            self.record = record;
            self.since = Some(Instant::now());
        }
    }

    fn stood_still_for(&self, lease: Duration) -> bool {
        self.since.is_some_and(|t| t.elapsed() >= lease)
    }
}

/// The result of one attempt.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Attempt {
    /// This replica holds the Lease (acquired or renewed).
    Leading,
    /// Someone else does (or won the race).
    Standby,
}

/// One replica's side of the election.
pub(super) struct Elector {
    api: Api<Lease>,
    election: Election,
    observed: Observed,
}

impl Elector {
    pub(super) fn new(client: kube::Client, election: Election) -> Self {
        Self {
            api: Api::namespaced(client, &election.namespace),
            election,
            observed: Observed::default(),
        }
    }

    pub(super) fn election(&self) -> &Election {
        &self.election
    }

    /// Acquires or renews the Lease once.
    pub(super) async fn try_acquire_or_renew(&mut self) -> Result<Attempt, kube::Error> {
        let now = MicroTime(k8s_openapi::jiff::Timestamp::now());
        let me = self.election.identity.clone();
        let seconds = self.election.lease.as_secs().max(1) as i32;
        let Some(lease) = absent_as_none(self.api.get(&self.election.lease_name).await)? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.election.lease_name.clone()),
                    namespace: Some(self.election.namespace.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(me),
                    lease_duration_seconds: Some(seconds),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => Ok(Attempt::Leading),
                Err(e) if is_conflict(&e) => Ok(Attempt::Standby),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        self.observed
            .note(holder.clone(), lease.metadata.resource_version.clone());
        let ours = holder.as_deref() == Some(me.as_str());
        let held_by_other = holder.is_some() && !ours;
        // The holder's own lease length, not ours: replicas may disagree.
        let their_lease = spec
            .lease_duration_seconds
            .map_or(
                self.election.lease,
                |s| Duration::from_secs(s.max(1) as u64),
            );
        if held_by_other && !self.observed.stood_still_for(their_lease) {
            return Ok(Attempt::Standby);
        }
        let mut patch = serde_json::json!({
            "metadata": {"resourceVersion": lease.metadata.resource_version},
            "spec": {
                "holderIdentity": me,
                "leaseDurationSeconds": seconds,
                "renewTime": now,
            }
        });
        if !ours {
            patch["spec"]["acquireTime"] = serde_json::json!(now);
            patch["spec"]["leaseTransitions"] =
                serde_json::json!(spec.lease_transitions.unwrap_or(0).saturating_add(1));
        }
        match self.patch(&patch).await {
            Ok(()) => Ok(Attempt::Leading),
            Err(e) if is_conflict(&e) => Ok(Attempt::Standby),
            Err(e) => Err(e),
        }
    }

    /// Clears the holder if it is still this replica, so a standby takes
    /// over at its next attempt.
    pub(super) async fn release(&mut self) {
        let Ok(Some(lease)) = absent_as_none(self.api.get(&self.election.lease_name).await) else {
            return;
        };
        let holder = lease.spec.as_ref().and_then(|s| s.holder_identity.clone());
        if holder.as_deref() != Some(self.election.identity.as_str()) {
            return;
        }
        let patch = serde_json::json!({
            "metadata": {"resourceVersion": lease.metadata.resource_version},
            "spec": {"holderIdentity": null, "leaseDurationSeconds": 1}
        });
        if let Err(e) = self.patch(&patch).await {
            tracing::debug!(error = %e, "leader lease not released");
        }
    }

    /// A merge patch of the Lease; a `resourceVersion` in it makes it
    /// conditional (409 when someone wrote in between).
    async fn patch(&self, patch: &serde_json::Value) -> Result<(), kube::Error> {
        self.api
            .patch(
                &self.election.lease_name,
                &PatchParams::default(),
                &Patch::Merge(patch),
            )
            .await
            .map(|_| ())
    }

    /// Keeps renewing while leading; returns when a renewal has not
    /// succeeded for the renew deadline, the Lease went to someone else, or
    /// `stop` fired.
    pub(super) async fn hold(&mut self, stop: &CancellationToken) -> LeadershipEnd {
        let mut last_renewed = Instant::now();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return LeadershipEnd::Stopped,
                _ = sleep(self.election.retry_period()) => {}
            }
            match self.try_acquire_or_renew().await {
                Ok(Attempt::Leading) => last_renewed = Instant::now(),
                Ok(Attempt::Standby) => return LeadershipEnd::Lost,
                Err(e) => {
                    tracing::warn!(error = %e, "leader lease not renewed");
                }
            }
            if last_renewed.elapsed() >= self.election.renew_deadline() {
                return LeadershipEnd::Lost;
            }
        }
    }

    /// Waits until this replica leads; `false` if `stop` fired first.
    pub(super) async fn acquire(&mut self, stop: &CancellationToken) -> bool {
        loop {
            match self.try_acquire_or_renew().await {
                Ok(Attempt::Leading) => return true,
                Ok(Attempt::Standby) => {}
                Err(e) => tracing::warn!(error = %e, "cannot read the leader lease"),
            }
            tokio::select! {
                _ = stop.cancelled() => return false,
                _ = sleep(self.election.retry_period()) => {}
            }
        }
    }
}

/// Why a replica stopped leading.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum LeadershipEnd {
    /// Asked to stop (shutdown).
    Stopped,
    /// Renewals failed past the deadline, or another replica holds the Lease.
    Lost,
}

/// A 404 as `None`, whatever `reason` the server gives with it.
pub(super) fn absent_as_none<T>(result: Result<T, kube::Error>) -> Result<Option<T>, kube::Error> {
    match result {
        Ok(v) => Ok(Some(v)),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(None),
        Err(e) => Err(e),
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}
