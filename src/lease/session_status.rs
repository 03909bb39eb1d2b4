//! What an owner reports about a stream, and why it gave one up. Both are
//! stored in the table and read by the controller, `tether get` and the fleet,
//! so each is one enum with one spelling.

use serde::Serialize;
use std::fmt;

/// Where a stream's session is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
pub enum Phase {
    /// Not (yet) served: no owner, or an owner that has not started a session.
    #[default]
    Pending,
    /// Dialling, TLS or WebSocket handshake.
    Connecting,
    /// The session is open.
    Connected,
    /// The last attempt failed; waiting before the next one.
    Backoff,
    /// `desiredState: Stopped`.
    Stopped,
    /// Refused permanently (invalid spec, host policy) until the spec changes.
    Failed,
}

impl Phase {
    pub const ALL: [Phase; 6] = [
        Phase::Pending,
        Phase::Connecting,
        Phase::Connected,
        Phase::Backoff,
        Phase::Stopped,
        Phase::Failed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Connecting => "Connecting",
            Self::Connected => "Connected",
            Self::Backoff => "Backoff",
            Self::Stopped => "Stopped",
            Self::Failed => "Failed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the owning worker reports about its session; written only by the
/// owner, under its ownership guard.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SessionStatus {
    pub phase: Phase,
    /// A CamelCase reason (`TLSError`, `SinkUnavailable`, ...), when not plain.
    pub reason: Option<String>,
    pub message: Option<String>,
    pub connected_since_ms: Option<u64>,
    pub reconnects: u64,
}

/// Why an owner released a stream. Peers decide who picks a released stream up
/// by this (a rebalanced stream is left to the worker it was meant for).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum ReleaseReason {
    /// The owner is shutting down.
    Shutdown,
    /// `desiredState: Stopped` (or the stream is being deleted).
    Stopped,
    /// Handed over so a less loaded worker can take it (fair share).
    Rebalance,
    /// Acquired by accident (an ambiguous write resolved on a later pass) and
    /// not wanted.
    Unwanted,
    /// Handed to another worker because the resource asked for it (a new
    /// value of its `tether.dev/move` annotation).
    Moved,
}

impl ReleaseReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Shutdown => "shutdown",
            Self::Stopped => "stopped",
            Self::Rebalance => "rebalance",
            Self::Unwanted => "unwanted",
            Self::Moved => "moved",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            Self::Shutdown,
            Self::Stopped,
            Self::Rebalance,
            Self::Unwanted,
            Self::Moved,
        ]
        .into_iter()
        .find(|r| r.as_str() == s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_and_reasons_round_trip_through_their_stored_names() {
        for p in Phase::ALL {
            assert_eq!(Phase::parse(p.as_str()), Some(p));
        }
        assert_eq!(Phase::parse("connected"), None);
        for r in [ReleaseReason::Shutdown, ReleaseReason::Rebalance] {
            assert_eq!(ReleaseReason::parse(r.as_str()), Some(r));
        }
    }
}
