//! Computing a `StreamConnection`'s status from its lease-table item: pure, so
//! every rule here is unit-tested without an API server.

use crate::crd::{StreamConnection, StreamConnectionStatus};
use crate::lease::{DesiredState, Phase, StreamView};
use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

pub(super) const READY: &str = "Ready";
pub(super) const OWNED: &str = "Owned";
pub(super) const RECONCILING: &str = "Reconciling";
pub(super) const STALLED: &str = "Stalled";
/// Ready's reason while the owner still serves an older generation.
pub(super) const RECONFIGURING: &str = "Reconfiguring";

fn rfc3339(ms: u64) -> Option<String> {
    DateTime::<Utc>::from_timestamp_millis(ms as i64)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
}

/// What the status should be. `invalid` carries the validation message of a
/// spec that was not mirrored; `refused` why the table refused the mirror.
pub(super) fn compute(
    obj: &StreamConnection,
    view: Option<&StreamView>,
    invalid: Option<&str>,
    refused: Option<&str>,
) -> StreamConnectionStatus {
    let previous = obj.status.as_ref();
    // The generation this status describes, so that `kubectl wait`, Argo CD
    // and Flux (kstatus) never take the old session's Ready for the new spec.
    let generation = observed_generation(obj, view, invalid.or(refused).is_some());
    let mut status = StreamConnectionStatus {
        observed_generation: generation,
        ..Default::default()
    };
    let not_mirrored = |reason: &str, message: &str| {
        (
            (false, reason.to_string(), message.to_string()),
            (false, reason.to_string(), message.to_string()),
        )
    };
    let (ready, owned) = if let Some(message) = invalid {
        status.phase = Some(Phase::Failed.to_string());
        (
            (false, "InvalidSpec".to_string(), message.to_string()),
            (
                false,
                "InvalidSpec".to_string(),
                "the spec is invalid; nothing was mirrored to the lease table".to_string(),
            ),
        )
    } else if let Some(message) = refused {
        status.phase = Some(Phase::Failed.to_string());
        not_mirrored("MirrorRefused", message)
    } else if let Some(v) = view {
        let r = &v.record;
        let owner = v.live_owner();
        let session = r.status.as_ref();
        let phase = match (owner, r.desired_state) {
            (None, DesiredState::Stopped) => Phase::Stopped,
            // Refused for good by the last owner, for the spec the table
            // holds: still the user's to fix. A failure of an older
            // generation says nothing about the new one.
            (None, DesiredState::Started)
                if session.is_some_and(|s| s.phase == Phase::Failed)
                    && r.served_generation.is_none_or(|g| g == r.generation) =>
            {
                Phase::Failed
            }
            (None, DesiredState::Started) => Phase::Pending,
            (Some(_), _) => session.map_or(Phase::Pending, |s| s.phase),
        };
        let reason = session.and_then(|s| s.reason.clone());
        let message = session.and_then(|s| s.message.clone());
        status.last_seq = v.checkpoint;
        if let Some(owner) = owner {
            status.lease_expires_at = owner.until_ms.and_then(rfc3339);
            status.reconnects = session.map(|s| s.reconnects);
            if phase == Phase::Connected {
                status.connected_since =
                    session.and_then(|s| s.connected_since_ms).and_then(rfc3339);
            }
            status.owner = Some(owner.worker_id.clone());
        }
        let ready = match phase {
            Phase::Connected => (
                true,
                "Connected".to_string(),
                message.unwrap_or_else(|| "the upstream session is open".into()),
            ),
            Phase::Stopped => (
                false,
                "Stopped".to_string(),
                "desiredState is Stopped".to_string(),
            ),
            other => (
                false,
                reason.unwrap_or_else(|| other.to_string()),
                message.unwrap_or_else(|| match other {
                    Phase::Pending => "waiting for a worker to acquire the stream".into(),
                    Phase::Connecting => "connecting to the upstream".into(),
                    _ => format!("phase {other}"),
                }),
            ),
        };
        let owned = match (owner, r.desired_state) {
            (Some(o), _) => (
                true,
                "LeaseHeld".to_string(),
                format!("held by {} (fencing token {})", o.owner, r.lease_counter),
            ),
            (None, DesiredState::Stopped) => (
                false,
                "Stopped".to_string(),
                "no worker holds a stopped stream".into(),
            ),
            (None, DesiredState::Started) => (
                false,
                "NoOwner".to_string(),
                "no worker holds the stream yet".into(),
            ),
        };
        status.phase = Some(phase.to_string());
        (ready, owned)
    } else {
        status.phase = Some(Phase::Pending.to_string());
        not_mirrored("NotMirrored", "not yet in the lease table")
    };
    // The live owner still runs an older generation: not Ready for this one,
    // whatever the old session's state.
    let reconfiguring = invalid.or(refused).is_none()
        && view.is_some_and(|v| {
            v.live_owner().is_some() && v.record.desired_state == DesiredState::Started
        })
        && generation < obj.metadata.generation;
    let ready = if reconfiguring {
        (
            false,
            RECONFIGURING.to_string(),
            format!(
                "the owner's session runs generation {}; generation {} starts with its next session",
                generation.unwrap_or_default(),
                obj.metadata.generation.unwrap_or_default()
            ),
        )
    } else {
        ready
    };
    status.conditions = vec![
        condition(READY, ready.clone(), generation, previous),
        condition(OWNED, owned, generation, previous),
    ];
    status.conditions.extend(progress_conditions(
        status.phase.as_deref(),
        &ready,
        generation,
        previous,
    ));
    status
}

/// kstatus's abnormal-true conditions (the convention Flux, Argo CD's
/// kstatus checks and cli-utils read), present only while true:
/// `Stalled` when the stream failed for good (only a spec change helps),
/// `Reconciling` while it is on its way to Ready (not mirrored, no owner,
/// connecting, retrying, a new generation waiting for its session). Ready and
/// Stopped streams carry neither: both are where the spec asks them to be.
fn progress_conditions(
    phase: Option<&str>,
    (ok, reason, message): &(bool, String, String),
    generation: Option<i64>,
    previous: Option<&StreamConnectionStatus>,
) -> Option<Condition> {
    let type_ = match phase {
        _ if *ok => return None,
        Some(p) if p == Phase::Stopped.as_str() => return None,
        Some(p) if p == Phase::Failed.as_str() => STALLED,
        _ => RECONCILING,
    };
    Some(condition(
        type_,
        (true, reason.clone(), message.clone()),
        generation,
        previous,
    ))
}

/// The generation a status reports on: the one refused (an invalid spec, a
/// refused mirror: the controller's verdict is on the current spec); else,
/// while a live owner serves the stream, the generation its session runs (it
/// writes it with every status); else the generation the table holds (what
/// the next owner will serve). Never above the resource's own.
fn observed_generation(
    obj: &StreamConnection,
    view: Option<&StreamView>,
    refused: bool,
) -> Option<i64> {
    let current = obj.metadata.generation;
    if refused {
        return current;
    }
    let Some(v) = view else {
        // Not mirrored yet: nothing of this resource is observed.
        return None;
    };
    let r = &v.record;
    // A live owner's session (stopping included) runs what it serves.
    let observed = match v.live_owner() {
        Some(_) => r.served_generation.unwrap_or(r.generation),
        None => r.generation,
    };
    Some(current.map_or(observed, |c| observed.min(c)))
}

/// Replaces the Ready condition (keeping the others), for states the table
/// cannot tell (a blocked cleanup).
pub(super) fn set_ready(
    status: &mut StreamConnectionStatus,
    ok: bool,
    reason: &str,
    message: &str,
) {
    let previous = status.clone();
    let ready = condition(
        READY,
        (ok, reason.to_string(), message.to_string()),
        previous.observed_generation,
        Some(&previous),
    );
    status.conditions.retain(|c| c.type_ != READY);
    status.conditions.insert(0, ready);
}

fn condition(
    type_: &str,
    (ok, reason, message): (bool, String, String),
    generation: Option<i64>,
    previous: Option<&StreamConnectionStatus>,
) -> Condition {
    let status = if ok { "True" } else { "False" };
    // Keep the transition time while the condition's status stays the same.
    let last_transition_time = previous
        .and_then(|p| p.conditions.iter().find(|c| c.type_ == type_))
        .filter(|c| c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(k8s_openapi::jiff::Timestamp::now()));
    Condition {
        type_: type_.to_string(),
        status: status.to_string(),
        reason,
        message,
        observed_generation: generation,
        last_transition_time,
    }
}

/// Whether `new` differs from `old` in something a user acts on (not just the
/// ever-moving checkpoint and lease expiry).
pub(super) fn significant_change(
    old: Option<&StreamConnectionStatus>,
    new: &StreamConnectionStatus,
) -> bool {
    let Some(old) = old else { return true };
    let key = |s: &StreamConnectionStatus| {
        (
            s.phase.clone(),
            s.owner.clone(),
            s.observed_generation,
            s.reconnects,
            s.connected_since.clone(),
            s.conditions
                .iter()
                .map(|c| {
                    (
                        c.type_.clone(),
                        c.status.clone(),
                        c.reason.clone(),
                        c.message.clone(),
                    )
                })
                .collect::<Vec<_>>(),
        )
    };
    key(old) != key(new)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::StreamConnectionSpec;
    use crate::lease::{
        Incarnation, OWNED_EXPIRY_MS, OwnerView, SessionStatus, StreamKey, StreamRecord,
    };

    fn obj() -> StreamConnection {
        let mut o = StreamConnection::new("feed", StreamConnectionSpec::test("ws://x/"));
        o.metadata.namespace = Some("ns".into());
        o.metadata.generation = Some(4);
        o
    }

    fn view(owner: Option<(&str, bool)>, phase: Phase) -> StreamView {
        let inc = owner.map(|(id, _)| Incarnation::parse(&format!("{id}~1")).unwrap());
        StreamView {
            record: StreamRecord {
                generation: 4,
                lease_owner: inc.as_ref().map(ToString::to_string),
                lease_expires_at_ms: if inc.is_some() { OWNED_EXPIRY_MS } else { 0 },
                lease_counter: 7,
                checkpoint: Some(40),
                served_generation: Some(4),
                status: Some(SessionStatus {
                    phase,
                    connected_since_ms: Some(1_000),
                    reconnects: 2,
                    ..Default::default()
                }),
                ..StreamRecord::for_test(StreamKey::new("ns", "feed"))
            },
            owner: owner.zip(inc).map(|((id, alive), inc)| OwnerView {
                owner: inc.to_string(),
                worker_id: id.to_string(),
                alive,
                until_ms: Some(10_000),
                heartbeat_at_ms: Some(2_000),
            }),
            checkpoint: Some(42),
        }
    }

    fn cond<'a>(s: &'a StreamConnectionStatus, t: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn a_connected_stream_is_ready_and_owned_with_the_freshest_checkpoint() {
        let s = compute(
            &obj(),
            Some(&view(Some(("w1", true)), Phase::Connected)),
            None,
            None,
        );
        assert_eq!(s.phase.as_deref(), Some("Connected"));
        assert_eq!(s.owner.as_deref(), Some("w1"));
        assert_eq!(
            s.last_seq,
            Some(42),
            "the owner's packed checkpoint is ahead of the item"
        );
        assert_eq!(s.observed_generation, Some(4));
        assert_eq!(s.lease_expires_at.as_deref(), Some("1970-01-01T00:00:10Z"));
        assert_eq!(cond(&s, READY).status, "True");
        assert_eq!(cond(&s, OWNED).reason, "LeaseHeld");
    }

    #[test]
    fn after_a_spec_change_the_old_session_is_not_reported_for_the_new_generation() {
        let mut o = obj();
        o.metadata.generation = Some(5);
        // Mirrored, but the owner still runs generation 4.
        let mut v = view(Some(("w1", true)), Phase::Connected);
        v.record.generation = 5;
        let s = compute(&o, Some(&v), None, None);
        assert_eq!(s.observed_generation, Some(4));
        assert_eq!(cond(&s, READY).observed_generation, Some(4));
        assert_eq!(
            (
                cond(&s, READY).status.as_str(),
                cond(&s, READY).reason.as_str()
            ),
            ("False", RECONFIGURING),
            "the old session is not Ready for generation 5"
        );
        assert_eq!(cond(&s, RECONCILING).status, "True");
        // Once the owner's session runs it, it is observed.
        v.record.served_generation = Some(5);
        let s = compute(&o, Some(&v), None, None);
        assert_eq!(s.observed_generation, Some(5));
        assert_eq!(cond(&s, READY).observed_generation, Some(5));
        assert_eq!(cond(&s, READY).status, "True");
        assert!(s.conditions.iter().all(|c| c.type_ != RECONCILING));
        // A refused spec is observed at once, with its reason.
        let s = compute(&o, Some(&v), Some("spec.url: bad"), None);
        assert_eq!(s.observed_generation, Some(5));
        assert_eq!(cond(&s, READY).reason, "InvalidSpec");
        // Not mirrored yet: nothing is observed.
        let s = compute(&o, None, None, None);
        assert_eq!(s.observed_generation, None);
    }

    #[test]
    fn reconciling_and_stalled_are_present_only_while_true() {
        let kinds = |s: &StreamConnectionStatus| {
            s.conditions
                .iter()
                .filter(|c| c.type_ == RECONCILING || c.type_ == STALLED)
                .map(|c| (c.type_.clone(), c.status.clone()))
                .collect::<Vec<_>>()
        };
        let reconciling = vec![(RECONCILING.to_string(), "True".to_string())];
        let stalled = vec![(STALLED.to_string(), "True".to_string())];
        let on = |owner, phase| compute(&obj(), Some(&view(owner, phase)), None, None);
        assert_eq!(kinds(&on(Some(("w1", true)), Phase::Connected)), vec![]);
        assert_eq!(
            kinds(&on(Some(("w1", true)), Phase::Connecting)),
            reconciling
        );
        assert_eq!(kinds(&on(Some(("w1", true)), Phase::Backoff)), reconciling);
        assert_eq!(kinds(&on(None, Phase::Pending)), reconciling);
        assert_eq!(kinds(&on(Some(("w1", true)), Phase::Failed)), stalled);
        assert_eq!(
            kinds(&on(None, Phase::Failed)),
            stalled,
            "kept without an owner"
        );
        assert_eq!(kinds(&compute(&obj(), None, None, None)), reconciling);
        assert_eq!(kinds(&compute(&obj(), None, Some("bad"), None)), stalled);
        let mut stopped = view(None, Phase::Pending);
        stopped.record.desired_state = DesiredState::Stopped;
        assert_eq!(kinds(&compute(&obj(), Some(&stopped), None, None)), vec![]);
    }

    #[test]
    fn a_failure_of_an_older_generation_is_not_the_new_one_s_and_stopping_is_in_progress() {
        let mut o = obj();
        o.metadata.generation = Some(5);
        let mut v = view(None, Phase::Failed);
        v.record.generation = 5;
        v.record.served_generation = Some(4);
        let s = compute(&o, Some(&v), None, None);
        assert_eq!(
            s.phase.as_deref(),
            Some("Pending"),
            "the fix waits for an owner"
        );
        assert!(s.conditions.iter().all(|c| c.type_ != STALLED));
        assert_eq!(cond(&s, RECONCILING).status, "True");
        // Stopped in the spec, the live owner still connected on generation 4.
        let mut v = view(Some(("w1", true)), Phase::Connected);
        v.record.generation = 5;
        v.record.desired_state = DesiredState::Stopped;
        let s = compute(&o, Some(&v), None, None);
        assert_eq!(s.observed_generation, Some(4), "not yet the stopped spec");
    }

    #[test]
    fn a_refusal_outlives_the_owner_that_found_it() {
        let mut v = view(None, Phase::Failed);
        if let Some(s) = v.record.status.as_mut() {
            s.reason = Some("SinkNotAllowed".into());
            s.message = Some("sink http://10.0.0.1/: in a denied network".into());
        }
        let s = compute(&obj(), Some(&v), None, None);
        assert_eq!(s.phase.as_deref(), Some("Failed"));
        assert_eq!(cond(&s, READY).reason, "SinkNotAllowed");
        assert!(cond(&s, READY).message.contains("denied network"));
    }

    #[test]
    fn a_dead_owner_means_no_owner_and_pending() {
        let s = compute(
            &obj(),
            Some(&view(Some(("w1", false)), Phase::Connected)),
            None,
            None,
        );
        assert_eq!(
            (s.phase.as_deref(), s.owner.as_deref()),
            (Some("Pending"), None)
        );
        assert_eq!(cond(&s, OWNED).reason, "NoOwner");
        assert_eq!(cond(&s, READY).status, "False");
    }

    #[test]
    fn an_invalid_spec_says_why_on_both_conditions() {
        let s = compute(
            &obj(),
            None,
            Some("spec.url: must be a ws:// or wss:// URL with a host"),
            None,
        );
        assert_eq!(s.phase.as_deref(), Some("Failed"));
        assert_eq!(cond(&s, READY).reason, "InvalidSpec");
        assert!(cond(&s, READY).message.contains("spec.url"));
    }

    #[test]
    fn a_refused_mirror_is_not_ready() {
        let s = compute(
            &obj(),
            Some(&view(None, Phase::Pending)),
            None,
            Some("the table holds generation 9"),
        );
        assert_eq!(cond(&s, READY).reason, "MirrorRefused");
        assert_eq!(cond(&s, READY).status, "False");
    }

    #[test]
    fn backoff_carries_the_worker_s_reason_and_message() {
        let mut v = view(Some(("w1", true)), Phase::Backoff);
        let st = v.record.status.as_mut().unwrap();
        st.reason = Some("TLSError".into());
        st.message = Some("TLS handshake with x failed".into());
        let s = compute(&obj(), Some(&v), None, None);
        assert_eq!(cond(&s, READY).reason, "TLSError");
        assert_eq!(cond(&s, READY).message, "TLS handshake with x failed");
    }

    #[test]
    fn transition_times_survive_unchanged_conditions_and_progress_is_not_significant() {
        let first = compute(
            &obj(),
            Some(&view(Some(("w1", true)), Phase::Connected)),
            None,
            None,
        );
        let mut o = obj();
        o.status = Some(first.clone());
        let mut later = view(Some(("w1", true)), Phase::Connected);
        later.checkpoint = Some(99);
        let second = compute(&o, Some(&later), None, None);
        assert_eq!(
            cond(&first, READY).last_transition_time,
            cond(&second, READY).last_transition_time
        );
        assert!(
            !significant_change(Some(&first), &second),
            "only progress moved"
        );
        let third = compute(
            &o,
            Some(&view(Some(("w2", true)), Phase::Connected)),
            None,
            None,
        );
        assert!(
            significant_change(Some(&first), &third),
            "the owner changed"
        );
    }
}
