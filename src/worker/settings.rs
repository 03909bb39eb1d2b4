//! Validated worker settings and the named multiples of time the worker uses.

use std::path::PathBuf;
use std::time::Duration;

/// A renewal that failed is retried after this, not after a whole heartbeat,
/// so a few seconds of DynamoDB trouble never fence a worker.
pub(super) const RENEW_RETRY: Duration = Duration::from_millis(500);
/// Fair share counts only peers whose heartbeat moved within this many
/// heartbeat intervals (a crashed worker stays LIVE until declared dead).
pub(super) const PEER_SILENCE_HEARTBEATS: u32 = 3;
/// Minimum time between two rebalancing handoffs of one worker, in heartbeats.
pub(super) const HANDOFF_COOLDOWN_HEARTBEATS: u32 = 2;
/// A giver computes the fair share from the most streams the fleet was seen
/// to hold over this many heartbeats (`acquirer::peak_total`): a stream in
/// flight is missing from the published counts from its release stamp until
/// a taker acquires it (a few passes) and that taker's next heartbeat is
/// read (two heartbeats more while it lives). Four were not enough on a
/// loaded machine: a newcomer took its streams two seconds after their
/// release and the dip lasted 4.8 heartbeats. A long window costs nothing
/// while nothing is deleted, as sums known to be high are never kept.
pub(super) const PEAK_TOTAL_HEARTBEATS: u32 = 8;
/// A worker hands an extra stream over (below the floor of the mean, see
/// `fair_share::FleetView::extra_handoff`) at most once per this many handoff
/// cooldowns.
pub(super) const EXTRA_HANDOFF_COOLDOWNS: u32 = 4;
/// Above its fair share, a worker leaves streams released on shutdown (or
/// never owned) this many reconcile intervals to workers below it.
pub(super) const SHARE_GRACE_INTERVALS: u32 = 2;
/// ... and streams released for rebalancing this many.
pub(super) const REBALANCE_GRACE_INTERVALS: u32 = 4;
/// Unowned partitions are scanned at least this often even when no peer
/// released anything (new streams from the control plane are found so).
pub(super) const UNOWNED_SCAN_PERIOD: Duration = Duration::from_secs(1);
/// The audit's tick, in heartbeats: own partitions are audited this often
/// while the change counter moves (anything owned but not served, an
/// acquire whose answer was lost, a task that died, is adopted; a change a
/// holder was not told of is acted on), and the sweep and the roster look
/// at every tick (`acquirer::audit`).
pub(super) const AUDIT_HEARTBEATS: u32 = 4;
/// Own partitions are audited at least this often, in heartbeats, when the
/// change counter stood still since the last audit (64 s with the
/// defaults): what waits that long is a write announced by neither a
/// notification nor a bump. Every 4 heartbeats, as before, the audit's
/// queries were a fifth of a quiet worker's reads.
pub(super) const QUIET_AUDIT_HEARTBEATS: u32 = 16;
/// Each held stream's item is re-read by its holder every this many ticks
/// (a share of them at each tick): the last resort for a spec written with
/// no notification at all (by hand, or by a writer of an earlier release),
/// acted on within `AUDIT_HEARTBEATS × CONTROL_SWEEP_TICKS` heartbeats
/// (8.5 min with the defaults), plus the ticks a takeover held shares back
/// (`acquirer::audit_schedule`; a worker that never stops taking orphans
/// over sweeps every fourth tick). A notification lost with its writer is
/// repaired sooner, by whoever mirrors the resource next
/// (`lease::owner_behind`); STOPPED and deletions show in the index and are
/// acted on at the next audit. Every 64 s, as before 0.3, this sweep was
/// half of a quiet worker's reads at 100 streams.
pub(super) const CONTROL_SWEEP_TICKS: u64 = 32;
/// Share of the drain timeout a stream's session may take to flush and close;
/// the rest is for releasing (a slow sink must never cost the release).
pub(super) const DRAIN_STOP_SHARE: f64 = 0.5;
/// Minimum time between two status writes of one stream.
pub(super) const STATUS_MIN_INTERVAL: Duration = Duration::from_secs(1);
/// Fraction of the reconcile interval used as jitter (±), so a fleet that
/// started together does not query and acquire in lockstep.
pub(super) const RECONCILE_JITTER: f64 = 0.25;

/// Validated worker settings.
#[derive(Clone, Debug)]
pub struct WorkerSettings {
    pub worker_id: String,
    /// Peers declare this worker dead after watching its heartbeat stand
    /// still this long.
    pub lease_duration: Duration,
    pub heartbeat_interval: Duration,
    pub reconcile_interval: Duration,
    /// `lease_duration - fence_margin`.
    pub fence_window: Duration,
    /// Largest clock disagreement with DynamoDB tolerated before refusing to acquire.
    pub max_clock_skew: Duration,
    pub max_connections: usize,
    pub drain_timeout: Duration,
    pub rebalance: bool,
    /// Extra trusted CA certificates for `wss://` upstreams.
    pub ca_file: Option<PathBuf>,
    /// Connects per second per upstream host (0: unlimited), and the burst.
    pub connect_rate: f64,
    pub connect_burst: u32,
    /// Which Kinesis data streams each namespace may write to.
    pub kinesis_streams: crate::egress::KinesisStreams,
    /// Read orphan partitions whole every pass, as 0.4 did, instead of a
    /// bounded read: only so the scale benchmark can run the earlier design
    /// beside this one in the same run. Never set by the command line.
    pub read_orphans_whole: bool,
    /// Where peers poke this worker (`worker::pokes`); `None`: not pokable,
    /// so it reads the change counter every 500 ms.
    pub poke_addr: Option<std::net::SocketAddr>,
}

/// `$POD_NAME` in Kubernetes; elsewhere the host name. Each process adds its
/// own random incarnation suffix, so two processes never share an owner
/// identity even with the same worker id.
pub fn default_worker_id() -> String {
    if let Ok(pod) = std::env::var("POD_NAME")
        && !pod.is_empty()
    {
        return pod;
    }
    let host = hostname::get()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "tether".into());
    host.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(128)
        .collect()
}

/// `interval` with ±[`RECONCILE_JITTER`] jitter.
pub(super) fn jittered(interval: Duration) -> Duration {
    use rand::Rng;
    let factor = rand::rng().random_range((1.0 - RECONCILE_JITTER)..=(1.0 + RECONCILE_JITTER));
    interval.mul_f64(factor)
}
