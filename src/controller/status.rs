//! Computing a `StreamConnection`'s status from its lease-table item: pure, so
//! every rule here is unit-tested without an API server.

use crate::crd::{StreamConnection, StreamConnectionStatus};
use crate::lease::{DesiredState, StreamRecord};
use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

pub const READY: &str = "Ready";
pub const OWNED: &str = "Owned";

fn rfc3339(ms: u64) -> Option<String> {
    DateTime::<Utc>::from_timestamp_millis(ms as i64)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
}

/// What the status should be. `invalid` carries the validation message of a
/// spec that was not mirrored.
pub fn compute(
    obj: &StreamConnection,
    record: Option<&StreamRecord>,
    now_ms: u64,
    invalid: Option<&str>,
) -> StreamConnectionStatus {
    let generation = obj.metadata.generation;
    let previous = obj.status.as_ref();
    let mut status = StreamConnectionStatus {
        observed_generation: generation,
        ..Default::default()
    };
    let (ready, owned) = if let Some(message) = invalid {
        status.phase = Some("Failed".into());
        (
            (false, "InvalidSpec".to_string(), message.to_string()),
            (
                false,
                "InvalidSpec".to_string(),
                "the spec is invalid; nothing was mirrored to the lease table".to_string(),
            ),
        )
    } else if let Some(r) = record {
        let owner = r.live_owner(now_ms).map(str::to_string);
        let session = r.status.as_ref();
        let phase = match (&owner, r.desired_state) {
            (None, DesiredState::Stopped) => "Stopped".to_string(),
            (None, DesiredState::Started) => "Pending".to_string(),
            (Some(_), _) => session
                .map(|s| s.phase.clone())
                .unwrap_or_else(|| "Pending".into()),
        };
        let reason = session
            .and_then(|s| s.reason.clone())
            .filter(|s| !s.is_empty());
        let message = session
            .and_then(|s| s.message.clone())
            .filter(|s| !s.is_empty());
        status.last_seq = r.last_seq;
        if let Some(owner) = &owner {
            status.lease_expires_at = rfc3339(r.lease_expires_at_ms);
            status.reconnects = session.map(|s| s.reconnects);
            if phase == "Connected" {
                status.connected_since = session
                    .and_then(|s| s.connected_since_ms)
                    .filter(|ms| *ms > 0)
                    .and_then(rfc3339);
            }
            status.owner = Some(owner.clone());
        }
        let ready = match phase.as_str() {
            "Connected" => (
                true,
                "Connected".to_string(),
                message.unwrap_or_else(|| "the upstream session is open".into()),
            ),
            "Stopped" => (
                false,
                "Stopped".to_string(),
                "desiredState is Stopped".to_string(),
            ),
            other => (
                false,
                reason.unwrap_or_else(|| other.to_string()),
                message.unwrap_or_else(|| match other {
                    "Pending" => "waiting for a worker to acquire the stream".into(),
                    "Connecting" => "connecting to the upstream".into(),
                    _ => format!("phase {other}"),
                }),
            ),
        };
        let owned = match (&owner, r.desired_state) {
            (Some(o), _) => (
                true,
                "LeaseHeld".to_string(),
                format!("held by {o} (fencing token {})", r.lease_counter),
            ),
            (None, DesiredState::Stopped) => (
                false,
                "Stopped".to_string(),
                "no worker holds a stopped stream".into(),
            ),
            (None, DesiredState::Started) => (
                false,
                "NoOwner".to_string(),
                "no worker holds the lease yet".into(),
            ),
        };
        status.phase = Some(phase);
        (ready, owned)
    } else {
        status.phase = Some("Pending".into());
        (
            (
                false,
                "NotMirrored".to_string(),
                "not yet in the lease table".to_string(),
            ),
            (
                false,
                "NotMirrored".to_string(),
                "not yet in the lease table".to_string(),
            ),
        )
    };
    status.conditions = vec![
        condition(READY, ready, generation, previous),
        condition(OWNED, owned, generation, previous),
    ];
    status
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
pub fn significant_change(
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
    use crate::lease::{SessionStatus, StreamKey};

    fn obj() -> StreamConnection {
        let mut o = StreamConnection::new("feed", StreamConnectionSpec::test("ws://x/"));
        o.metadata.namespace = Some("ns".into());
        o.metadata.generation = Some(4);
        o
    }

    fn record(owner: Option<&str>, expires: u64, phase: &str) -> StreamRecord {
        StreamRecord {
            key: StreamKey::new("ns", "feed"),
            desired_state: DesiredState::Started,
            ws_url: "ws://x/".into(),
            spec: None,
            generation: 4,
            lease_owner: owner.map(Into::into),
            lease_expires_at_ms: expires,
            lease_counter: 7,
            last_seq: Some(42),
            released_at_ms: None,
            created_at_ms: None,
            status: Some(SessionStatus {
                phase: phase.into(),
                connected_since_ms: Some(1_000),
                reconnects: 2,
                ..Default::default()
            }),
        }
    }

    fn cond<'a>(s: &'a StreamConnectionStatus, t: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn a_connected_stream_is_ready_and_owned() {
        let s = compute(
            &obj(),
            Some(&record(Some("w1"), 10_000, "Connected")),
            5_000,
            None,
        );
        assert_eq!(s.phase.as_deref(), Some("Connected"));
        assert_eq!(s.owner.as_deref(), Some("w1"));
        assert_eq!(s.last_seq, Some(42));
        assert_eq!(s.observed_generation, Some(4));
        assert_eq!(s.lease_expires_at.as_deref(), Some("1970-01-01T00:00:10Z"));
        assert_eq!(cond(&s, READY).status, "True");
        assert_eq!(cond(&s, OWNED).reason, "LeaseHeld");
    }

    #[test]
    fn an_expired_lease_means_no_owner_and_pending() {
        let s = compute(
            &obj(),
            Some(&record(Some("w1"), 4_000, "Connected")),
            5_000,
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
            0,
            Some("spec.url: must be a ws:// or wss:// URL with a host"),
        );
        assert_eq!(s.phase.as_deref(), Some("Failed"));
        assert_eq!(cond(&s, READY).reason, "InvalidSpec");
        assert!(cond(&s, READY).message.contains("spec.url"));
    }

    #[test]
    fn backoff_carries_the_worker_s_reason_and_message() {
        let mut r = record(Some("w1"), 10_000, "Backoff");
        r.status.as_mut().unwrap().reason = Some("TLSError".into());
        r.status.as_mut().unwrap().message = Some("TLS handshake with x failed".into());
        let s = compute(&obj(), Some(&r), 5_000, None);
        assert_eq!(cond(&s, READY).reason, "TLSError");
        assert_eq!(cond(&s, READY).message, "TLS handshake with x failed");
    }

    #[test]
    fn transition_times_survive_unchanged_conditions_and_progress_is_not_significant() {
        let first = compute(
            &obj(),
            Some(&record(Some("w1"), 10_000, "Connected")),
            5_000,
            None,
        );
        let mut o = obj();
        o.status = Some(first.clone());
        let mut later = record(Some("w1"), 20_000, "Connected");
        later.last_seq = Some(99);
        let second = compute(&o, Some(&later), 15_000, None);
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
            Some(&record(Some("w2"), 20_000, "Connected")),
            15_000,
            None,
        );
        assert!(
            significant_change(Some(&first), &third),
            "the owner changed"
        );
    }
}
