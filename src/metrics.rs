//! Prometheus metrics: one registry per process, one struct per subsystem.
//!
//! No metric carries a per-stream label: `tether_active_connections` is what an HPA
//! averages across pods, and per-object labels would make every dashboard's
//! cardinality grow with the number of streams.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

type Labels1 = [(&'static str, &'static str); 1];
type Labels2 = [(&'static str, &'static str); 2];

fn request_buckets() -> Histogram {
    // 1 ms .. ~8 s
    Histogram::new(exponential_buckets(0.001, 2.0, 14))
}

fn failover_buckets() -> Histogram {
    // 50 ms .. ~100 s: handoffs are sub-second, crash failovers are about a lease.
    Histogram::new(exponential_buckets(0.05, 2.0, 12))
}

/// DynamoDB request metrics.
pub struct StoreMetrics {
    requests: Family<Labels2, Counter>,
    latency: Family<Labels1, Histogram, fn() -> Histogram>,
    consumed_write_units: Family<Labels1, Counter<f64, AtomicU64>>,
    consumed_read_units: Family<Labels1, Counter<f64, AtomicU64>>,
}

impl Default for StoreMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl StoreMetrics {
    pub fn new() -> Self {
        Self {
            requests: Family::default(),
            latency: Family::new_with_constructor(request_buckets),
            consumed_write_units: Family::default(),
            consumed_read_units: Family::default(),
        }
    }

    pub fn observe(&self, operation: &'static str, result: &'static str, elapsed: Duration) {
        self.requests
            .get_or_create(&[("operation", operation), ("result", result)])
            .inc();
        self.latency
            .get_or_create(&[("operation", operation)])
            .observe(elapsed.as_secs_f64());
    }

    pub fn consumed_write_units(&self, operation: &'static str, units: f64) {
        self.consumed_write_units
            .get_or_create(&[("operation", operation)])
            .inc_by(units);
    }

    /// Write units counted so far for `operation` (benches and tests).
    pub fn write_units(&self, operation: &'static str) -> f64 {
        self.consumed_write_units
            .get_or_create(&[("operation", operation)])
            .get()
    }

    /// Read units counted so far for `operation` (benches and tests).
    pub fn read_units(&self, operation: &'static str) -> f64 {
        self.consumed_read_units
            .get_or_create(&[("operation", operation)])
            .get()
    }

    /// Requests made so far for `operation` that succeeded (tests).
    pub fn succeeded(&self, operation: &'static str) -> u64 {
        self.requests
            .get_or_create(&[("operation", operation), ("result", "ok")])
            .get()
    }

    pub fn consumed_read_units(&self, operation: &'static str, units: f64) {
        self.consumed_read_units
            .get_or_create(&[("operation", operation)])
            .inc_by(units);
    }

    fn register(self: &Arc<Self>, registry: &mut Catalog) {
        registry.register(
            "tether_dynamodb_requests",
            "DynamoDB requests by operation and result",
            self.requests.clone(),
        );
        registry.register(
            "tether_dynamodb_request_duration_seconds",
            "DynamoDB request latency, per attempt",
            self.latency.clone(),
        );
        registry.register(
            "tether_dynamodb_consumed_write_units",
            "Write capacity units DynamoDB reported as consumed (table and indexes)",
            self.consumed_write_units.clone(),
        );
        registry.register(
            "tether_dynamodb_consumed_read_units",
            "Read capacity units DynamoDB reported as consumed",
            self.consumed_read_units.clone(),
        );
    }
}

/// Worker metrics (sessions, leases, sinks).
pub struct WorkerMetrics {
    pub active_connections: Gauge,
    pub sessions_connected: Gauge,
    pub acquires: Family<Labels1, Counter>,
    pub renewals: Family<Labels1, Counter>,
    pub releases: Family<Labels1, Counter>,
    pub leases_lost: Family<Labels1, Counter>,
    pub self_fences: Counter,
    pub failover_seconds: Histogram,
    pub handoff_seconds: Histogram,
    /// Acquisition passes by kind (`quiet`, `full`, `skew`, `failed`): a full pass
    /// that takes long under load delays every orphan it would have found.
    pub acquisition_pass_seconds: Family<Labels1, Histogram, fn() -> Histogram>,
    pub reconnects: Counter,
    pub session_errors: Family<Labels1, Counter>,
    pub messages_received: Counter,
    pub bytes_received: Counter,
    pub messages_delivered: Counter,
    pub sink_batches: Family<Labels2, Counter>,
    pub sink_batch_seconds: Histogram,
    pub rebalance_handoffs: Counter,
    pub live_workers: Gauge,
    pub streams_unowned: Gauge,
    pub clock_offset_seconds: Gauge<f64, AtomicU64>,
    pub clock_skew_exceeded: Gauge,
    pub malformed_items: Counter,
    pub workers_declared_dead: Counter,
    pub duplicate_worker_id: Gauge,
    pub incarnation_restarts: Counter,
    pub connects_paced: Counter,
    pub pokes_sent: Family<Labels1, Counter>,
    pub pokes_received: Counter,
}

impl Default for WorkerMetrics {
    fn default() -> Self {
        Self {
            active_connections: Gauge::default(),
            sessions_connected: Gauge::default(),
            acquires: Family::default(),
            renewals: Family::default(),
            releases: Family::default(),
            leases_lost: Family::default(),
            self_fences: Counter::default(),
            failover_seconds: failover_buckets(),
            handoff_seconds: failover_buckets(),
            acquisition_pass_seconds: Family::new_with_constructor(request_buckets),
            reconnects: Counter::default(),
            session_errors: Family::default(),
            messages_received: Counter::default(),
            bytes_received: Counter::default(),
            messages_delivered: Counter::default(),
            sink_batches: Family::default(),
            sink_batch_seconds: request_buckets(),
            rebalance_handoffs: Counter::default(),
            live_workers: Gauge::default(),
            streams_unowned: Gauge::default(),
            clock_offset_seconds: Gauge::default(),
            clock_skew_exceeded: Gauge::default(),
            malformed_items: Counter::default(),
            workers_declared_dead: Counter::default(),
            duplicate_worker_id: Gauge::default(),
            incarnation_restarts: Counter::default(),
            connects_paced: Counter::default(),
            pokes_sent: Family::default(),
            pokes_received: Counter::default(),
        }
    }
}

impl WorkerMetrics {
    fn register(&self, r: &mut Catalog) {
        r.register(
            "tether_active_connections",
            "Streams assigned to this worker (held), connected or not: the HPA metric, so an upstream outage does not read as no load",
            self.active_connections.clone(),
        );
        r.register(
            "tether_sessions_connected",
            "Upstream WebSocket sessions open on this worker right now",
            self.sessions_connected.clone(),
        );
        r.register(
            "tether_lease_acquires",
            "Lease acquire attempts by result: acquired, taken (another worker won the race), unavailable, error, resolved (an unanswered one found to have landed), adopted (found owned by the audit), skipped (not tried: this pass kept losing races in the same partition)",
            self.acquires.clone(),
        );
        r.register(
            "tether_lease_renewals",
            "Worker heartbeats (renewals of the worker item) by result",
            self.renewals.clone(),
        );
        r.register(
            "tether_lease_releases",
            "Lease releases by result",
            self.releases.clone(),
        );
        r.register(
            "tether_leases_lost",
            "Leases lost, by reason",
            self.leases_lost.clone(),
        );
        r.register(
            "tether_self_fences",
            "Sessions closed because the worker's fence closed (no renewal confirmed in time)",
            self.self_fences.clone(),
        );
        r.register(
            "tether_failover_seconds",
            "Time a version-1 owner's lapsed stream waited before this worker acquired it",
            self.failover_seconds.clone(),
        );
        r.register(
            "tether_handoff_seconds",
            "Time from a graceful release to this worker acquiring the stream",
            self.handoff_seconds.clone(),
        );
        r.register(
            "tether_acquisition_pass_duration_seconds",
            "Acquisition passes by kind: quiet (the change counter and watched peers), full (the fleet, orphans, acquires), skew (stopped at the clock check: this clock is off), failed",
            self.acquisition_pass_seconds.clone(),
        );
        r.register(
            "tether_session_reconnects",
            "Upstream reconnect attempts",
            self.reconnects.clone(),
        );
        r.register(
            "tether_session_errors",
            "Upstream session errors by kind",
            self.session_errors.clone(),
        );
        r.register(
            "tether_messages_received",
            "Messages read from upstreams",
            self.messages_received.clone(),
        );
        r.register(
            "tether_received_bytes",
            "Payload bytes read from upstreams",
            self.bytes_received.clone(),
        );
        r.register(
            "tether_messages_delivered",
            "Messages acknowledged by a sink",
            self.messages_delivered.clone(),
        );
        r.register(
            "tether_sink_batches",
            "Sink batches by sink and result",
            self.sink_batches.clone(),
        );
        r.register(
            "tether_sink_batch_duration_seconds",
            "Sink delivery latency per attempt",
            self.sink_batch_seconds.clone(),
        );
        r.register(
            "tether_rebalance_handoffs",
            "Streams this worker handed over to rebalance the fleet",
            self.rebalance_handoffs.clone(),
        );
        r.register(
            "tether_live_workers",
            "Workers this worker currently sees as alive (itself included)",
            self.live_workers.clone(),
        );
        r.register(
            "tether_streams_unowned",
            "STARTED streams without a live owner, as this worker's last orphan scan saw them; during a mass change a lower bound, as a scan reads a bounded share of each partition (fleet-wide: every worker reports about the same figure, so aggregate with max, not sum)",
            self.streams_unowned.clone(),
        );
        r.register(
            "tether_clock_offset_seconds",
            "This clock minus DynamoDB's (midpoint of the measured interval)",
            self.clock_offset_seconds.clone(),
        );
        r.register(
            "tether_clock_skew_exceeded",
            "1 while the clock provably disagrees with DynamoDB's by more than --max-clock-skew (no acquisitions)",
            self.clock_skew_exceeded.clone(),
        );
        r.register(
            "tether_malformed_items",
            "Table items skipped because they could not be read",
            self.malformed_items.clone(),
        );
        r.register(
            "tether_workers_declared_dead",
            "Peers this worker declared dead (heartbeat still for a lease, or a restarted container)",
            self.workers_declared_dead.clone(),
        );
        r.register(
            "tether_duplicate_worker_id",
            "Other live processes running with this worker's --worker-id",
            self.duplicate_worker_id.clone(),
        );
        r.register(
            "tether_connects_paced",
            "Session connects delayed to keep within --connect-rate for their upstream host",
            self.connects_paced.clone(),
        );
        r.register(
            "tether_pokes_sent",
            "Peers told that this process moved the change counter (POST /poke), by result",
            self.pokes_sent.clone(),
        );
        r.register(
            "tether_pokes_received",
            "Pokes from peers (each makes the next quiet pass read the change counter)",
            self.pokes_received.clone(),
        );
        r.register(
            "tether_incarnation_restarts",
            "Times this process was declared dead by peers and started over as a new incarnation",
            self.incarnation_restarts.clone(),
        );
    }
}

/// Controller metrics (`tether operator` only; zero elsewhere).
#[derive(Default)]
pub struct ControllerMetrics {
    /// 1 while this replica leads its installation.
    pub leader: Gauge,
    pub reconciles: Family<Labels1, Counter>,
    pub reconcile_errors: Family<Labels1, Counter>,
    pub reconcile_seconds: ReconcileHistogram,
    /// Reconciles running now. The controller runs them without a concurrency
    /// cap, so this is also the depth of its work queue.
    pub reconciles_in_flight: Gauge,
    pub status_writes: Family<Labels1, Counter>,
    pub items_collected: Counter,
}

/// Reconcile durations, 1 ms .. ~8 s.
pub struct ReconcileHistogram(pub Histogram);

impl Default for ReconcileHistogram {
    fn default() -> Self {
        Self(request_buckets())
    }
}

impl ControllerMetrics {
    fn register(&self, r: &mut Catalog) {
        r.register(
            "tether_controller_leader",
            "1 while this replica is its installation's active controller (leader Lease held)",
            self.leader.clone(),
        );
        r.register(
            "tether_controller_reconciles",
            "Reconciles finished, by result (ok, error)",
            self.reconciles.clone(),
        );
        r.register(
            "tether_controller_reconcile_errors",
            "Failed reconciles by error category",
            self.reconcile_errors.clone(),
        );
        r.register(
            "tether_controller_reconcile_seconds",
            "Duration of one reconcile",
            self.reconcile_seconds.0.clone(),
        );
        r.register(
            "tether_controller_reconciles_in_flight",
            "Reconciles running now (the controller's queue depth: it runs them without a concurrency cap)",
            self.reconciles_in_flight.clone(),
        );
        r.register(
            "tether_controller_status_writes",
            "Status writes by kind (change: phase, owner or conditions; progress: checkpoint and lease expiry at the progress interval)",
            self.status_writes.clone(),
        );
        r.register(
            "tether_controller_items_collected",
            "Table items of this installation whose resource no longer existed, stopped and deleted by the garbage collector",
            self.items_collected.clone(),
        );
    }
}

/// The registry, plus the name and type of everything registered in it (so
/// the chart's alerts and dashboard can be checked against what is exported,
/// even for families that have no sample yet).
#[derive(Default)]
struct Catalog {
    registry: Registry,
    names: Vec<(String, MetricType)>,
}

impl Catalog {
    fn register(&mut self, name: &str, help: &str, metric: impl Metric) {
        self.names.push((name.to_string(), metric.metric_type()));
        self.registry.register(name, help, metric);
    }

    fn register_process_metrics(&mut self) {
        self.names.extend(
            crate::process_metrics::METRICS
                .iter()
                .map(|(name, kind)| (name.to_string(), *kind)),
        );
        self.registry
            .register_collector(Box::new(crate::process_metrics::ProcessCollector));
    }
}

/// All metrics of one process and the registry that exposes them.
pub struct Metrics {
    catalog: Catalog,
    pub store: Arc<StoreMetrics>,
    pub worker: Arc<WorkerMetrics>,
    pub controller: Arc<ControllerMetrics>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Catalog::default();
        let store = Arc::new(StoreMetrics::new());
        let worker = Arc::new(WorkerMetrics::default());
        let controller = Arc::new(ControllerMetrics::default());
        store.register(&mut registry);
        worker.register(&mut registry);
        controller.register(&mut registry);
        registry.register_process_metrics();
        let build_info: Family<Labels1, Gauge> = Family::default();
        build_info
            .get_or_create(&[("version", env!("CARGO_PKG_VERSION"))])
            .set(1);
        registry.register("tether_build_info", "Build information", build_info);
        Self {
            catalog: registry,
            store,
            worker,
            controller,
        }
    }

    /// Every sample name this process can expose (`_total` for counters;
    /// `_bucket`, `_sum`, `_count` for histograms), samples or not.
    pub fn sample_names(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (name, kind) in &self.catalog.names {
            match kind {
                MetricType::Counter => out.push(format!("{name}_total")),
                MetricType::Histogram => {
                    out.extend(["_bucket", "_sum", "_count"].map(|s| format!("{name}{s}")))
                }
                _ => out.push(name.clone()),
            }
        }
        out
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.catalog.registry);
        out
    }

    /// The classic Prometheus text format (0.0.4), for scrapers and parsers that
    /// do not speak OpenMetrics.
    pub fn encode_prometheus_text(&self) -> String {
        openmetrics_to_prometheus_text(&self.encode())
    }
}

/// Converts OpenMetrics text to Prometheus text 0.0.4: counter families are
/// named with their `_total` suffix in `# HELP`/`# TYPE`, and the OpenMetrics-only
/// `# UNIT` and `# EOF` lines are dropped. Samples are identical in both.
pub fn openmetrics_to_prometheus_text(text: &str) -> String {
    let counters: std::collections::HashSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let rewritten = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters.contains(name).then(|| {
                format!("{prefix}{name}_total {tail}")
                    .trim_end()
                    .to_string()
            })
        });
        out.push_str(rewritten.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_get_their_total_suffix_in_prometheus_text() {
        let om = "# HELP x_requests Requests.\n# TYPE x_requests counter\nx_requests_total{a=\"b\"} 3\n\
                  # HELP g A gauge.\n# TYPE g gauge\ng 1\n# EOF\n";
        assert_eq!(
            openmetrics_to_prometheus_text(om),
            "# HELP x_requests_total Requests.\n# TYPE x_requests_total counter\nx_requests_total{a=\"b\"} 3\n\
             # HELP g A gauge.\n# TYPE g gauge\ng 1\n"
        );
    }

    #[test]
    fn the_registry_exposes_the_hpa_gauge() {
        let m = Metrics::new();
        m.worker.active_connections.set(3);
        assert!(
            m.encode_prometheus_text()
                .contains("\ntether_active_connections 3\n")
        );
    }
}
