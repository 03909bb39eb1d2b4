//! Command-line and environment configuration. Every flag also reads an
//! environment variable, and every default is documented here and in `--help`.

use crate::manifest::Validation;
pub use crate::telemetry::LogFormat;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Default lease: peers declare a worker dead after watching its heartbeat
/// stand still this long, so crash failover is about this plus one orphan scan
/// (p99 under 10 s).
pub const DEFAULT_LEASE_DURATION: &str = "8s";
/// Default heartbeat: one renewal of the worker item (which also carries the
/// packed checkpoints) per interval. With the defaults a worker tolerates 3 s
/// of DynamoDB trouble before fencing (lease − margin − heartbeat), and a
/// worker holding 10 streams costs about 90 write units per stream-hour.
pub const DEFAULT_HEARTBEAT_INTERVAL: &str = "4s";
/// Default orphan scan interval. The GSI query is cheap (0.5 read units when
/// nothing is orphaned: about $0.65 a month per worker at 4 queries a second),
/// and it bounds graceful-handoff latency: p99 under a second needs two scans
/// (one may land mid-release) inside it.
pub const DEFAULT_RECONCILE_INTERVAL: &str = "250ms";
/// Default allowance for this clock's disagreement with DynamoDB's: measured
/// from every response's `Date` header; beyond it a worker refuses to acquire.
pub const DEFAULT_MAX_CLOCK_SKEW: &str = "2s";
/// Default margin between a worker fencing itself and the earliest moment a
/// peer may declare it dead (covers closing sessions).
pub const DEFAULT_FENCE_MARGIN: &str = "1s";
/// Default bound on graceful shutdown (the chart's grace period is longer).
pub const DEFAULT_DRAIN_TIMEOUT: &str = "10s";

#[derive(Debug, Parser)]
#[command(
    name = "tether",
    version,
    about = "Keeps long-lived outbound WebSocket streams alive across a fleet of workers"
)]
pub struct Cli {
    #[command(flatten)]
    pub store: StoreArgs,

    /// Log format.
    #[arg(long, env = "TETHER_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

/// Where the lease table lives. The endpoint, region and credentials come from the
/// standard AWS configuration (`AWS_REGION`, `AWS_ENDPOINT_URL_DYNAMODB` or
/// `AWS_ENDPOINT_URL`, the default credential chain).
#[derive(Clone, Debug, Args)]
pub struct StoreArgs {
    /// DynamoDB table holding stream items.
    #[arg(
        long,
        env = "TETHER_TABLE",
        default_value = "tether-streams",
        global = true
    )]
    pub table: String,

    /// Run an embedded DynamoDB-compatible store (dynoxide) in this process, backed by
    /// this SQLite file (`:memory:` for none), and use it instead of DynamoDB. Only
    /// for local use: it is never chosen unless you pass this flag.
    #[arg(long, env = "TETHER_EMBEDDED_STORE", global = true)]
    pub embedded_store: Option<PathBuf>,

    /// Bound on one DynamoDB call including retries of throttling and transient errors.
    #[arg(long, env = "TETHER_STORE_CALL_DEADLINE", default_value = "4s", value_parser = parse_duration, global = true)]
    pub store_call_deadline: Duration,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Kubernetes mode: controller + worker in one process (the Helm chart's default).
    Operator(OperatorArgs),
    /// Worker only, no Kubernetes: acquire, serve, renew and release streams.
    Worker(WorkerArgs),
    /// Standalone control plane: upsert StreamConnection manifests into the table.
    /// Exits 0 when every document applied, 1 when any was invalid or refused
    /// (the valid ones are still applied).
    Apply {
        /// A YAML/JSON file (several documents allowed), a directory of them,
        /// or `-` for standard input. Repeatable.
        #[arg(
            short = 'f',
            long = "filename",
            env = "TETHER_APPLY_FILE",
            value_delimiter = ',',
            required = true
        )]
        files: Vec<PathBuf>,
        /// Descend into subdirectories of directories given with `-f`.
        #[arg(short = 'R', long)]
        recursive: bool,
        /// Fields the CRD does not declare: refuse the document (`strict`,
        /// also `true`), apply with a warning (`warn`) or silently (`ignore`,
        /// also `false`).
        #[arg(long, value_enum, default_value_t = Validation::Strict)]
        validate: Validation,
    },
    /// Show streams: desired state, phase, owner, lease left, last_seq.
    Get {
        /// `name` or `namespace/name`; every stream in scope when omitted.
        name: Option<String>,
        /// Namespace of `name`, or the only namespace listed (`default` for a bare name).
        #[arg(short = 'n', long)]
        namespace: Option<String>,
        /// Every namespace (the default when neither a name nor `-n` is given).
        #[arg(short = 'A', long = "all-namespaces", conflicts_with = "namespace")]
        all_namespaces: bool,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Table)]
        output: OutputFormat,
        /// Keep running and print a row again whenever it changes.
        #[arg(short = 'w', long)]
        watch: bool,
    },
    /// Delete streams: each is stopped, its owner releases it, then it is removed.
    Delete {
        /// `name` or `namespace/name`, several allowed.
        names: Vec<String>,
        /// Delete the streams these manifests name (files, directories, `-`).
        #[arg(short = 'f', long = "filename", value_delimiter = ',')]
        files: Vec<PathBuf>,
        /// Descend into subdirectories of directories given with `-f`.
        #[arg(short = 'R', long)]
        recursive: bool,
        /// Namespace of bare names (default `default`).
        #[arg(short = 'n', long)]
        namespace: Option<String>,
        /// A stream that does not exist is not an error.
        #[arg(long)]
        ignore_not_found: bool,
    },
    /// Print a shell completion script (`source <(tether completion bash)`).
    Completion {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Manage the lease table.
    Table {
        #[command(subcommand)]
        command: TableCommand,
    },
    /// Print the StreamConnection CRD YAML.
    Crd,
    /// Serve the embedded DynamoDB-compatible store over HTTP for several local processes.
    LocalStore {
        /// Address to listen on.
        #[arg(
            long,
            env = "TETHER_LOCAL_STORE_LISTEN",
            default_value = "127.0.0.1:8000"
        )]
        listen: SocketAddr,
        /// SQLite file to keep data in (`:memory:` for none).
        #[arg(long, env = "TETHER_LOCAL_STORE_DATA", default_value = ":memory:")]
        data: PathBuf,
    },
    /// Run the whole system locally: embedded store, a demo feed, a verifying
    /// sink, three workers, a crash and a graceful stop.
    Demo(DemoArgs),
}

#[derive(Debug, Subcommand)]
pub enum TableCommand {
    /// Create the table and its `by_holder` index, or add the index to a table
    /// made by version 0.1 (idempotent; waits until ACTIVE).
    Create,
    /// End a rolling upgrade from 0.1 once no 0.1 process uses the table:
    /// give old free streams their index key and drop the `by_state` index.
    FinishUpgrade,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Columns: name, state, phase, owner, token, last_seq.
    Table,
    /// The table plus URL, reason and proven-for.
    Wide,
    Json,
    Yaml,
    /// `streamconnection/<namespace>/<name>` per line.
    Name,
}

#[derive(Clone, Debug, Args)]
pub struct DemoArgs {
    /// Run one part of the demo on its own instead of the whole demo.
    #[command(subcommand)]
    pub part: Option<DemoPart>,
    /// Number of streams to apply.
    #[arg(long, default_value_t = 12)]
    pub streams: usize,
    /// Number of worker processes.
    #[arg(long, default_value_t = 3)]
    pub workers: usize,
    /// Lease duration the demo's workers use (shorter than production so it ends quickly).
    #[arg(long, default_value = "6s", value_parser = parse_duration)]
    pub lease_duration: Duration,
}

/// A part of the demo that also runs on its own.
#[derive(Clone, Debug, Subcommand)]
pub enum DemoPart {
    /// Serve the demo's replaying WebSocket feed: `ws://ADDR/<stream>?after=<n>`
    /// sends `{"seq":N,...}` text messages from n+1 (from 1 without `after`).
    /// A first upstream for a new installation (run it with the same image).
    Feed {
        /// Address to listen on.
        #[arg(
            long,
            env = "TETHER_DEMO_FEED_LISTEN",
            default_value = "127.0.0.1:9001"
        )]
        listen: SocketAddr,
        /// Messages per second per session.
        #[arg(long, default_value_t = 10)]
        rate: u32,
    },
}

/// Worker settings (also used by `operator`).
#[derive(Clone, Debug, Args)]
pub struct WorkerArgs {
    /// Worker id (letters, digits, `.`, `_`, `-`). Default: `$POD_NAME`, else the host
    /// name. Each process adds a random incarnation suffix, so two processes never
    /// act as one owner even when started with the same id.
    #[arg(long, env = "TETHER_WORKER_ID")]
    pub worker_id: Option<String>,

    /// Peers declare a worker dead after watching its heartbeat stand still this
    /// long; its streams then move.
    #[arg(long, env = "TETHER_LEASE_DURATION", default_value = DEFAULT_LEASE_DURATION, value_parser = parse_duration)]
    pub lease_duration: Duration,

    /// How often the worker renews its worker item (carrying the packed checkpoints).
    #[arg(long, env = "TETHER_HEARTBEAT_INTERVAL", default_value = DEFAULT_HEARTBEAT_INTERVAL, value_parser = parse_duration)]
    pub heartbeat_interval: Duration,

    /// How often to look for orphaned streams (jittered ±25%).
    #[arg(long, env = "TETHER_RECONCILE_INTERVAL", default_value = DEFAULT_RECONCILE_INTERVAL, value_parser = parse_duration)]
    pub reconcile_interval: Duration,

    /// Largest disagreement with DynamoDB's clock tolerated; beyond it (measured
    /// from response `Date` headers) the worker refuses to acquire and is not ready.
    #[arg(long, env = "TETHER_MAX_CLOCK_SKEW", default_value = DEFAULT_MAX_CLOCK_SKEW, value_parser = parse_duration)]
    pub max_clock_skew: Duration,

    /// Safety margin: sessions close when no renewal was confirmed within
    /// `lease_duration - fence_margin`, before any peer may declare the worker dead.
    #[arg(long, env = "TETHER_FENCE_MARGIN", default_value = DEFAULT_FENCE_MARGIN, value_parser = parse_duration)]
    pub fence_margin: Duration,

    /// Most sessions this worker holds at once.
    #[arg(long, env = "TETHER_MAX_CONNECTIONS", default_value_t = 1000)]
    pub max_connections: usize,

    /// Address of `/metrics`, `/healthz`, `/readyz`. Port 0 picks a free port.
    #[arg(long, env = "TETHER_METRICS_ADDR", default_value = "127.0.0.1:9090")]
    pub metrics_addr: SocketAddr,

    /// The IP peers reach this worker at (in Kubernetes, the pod IP). Given,
    /// peers tell this worker at once when they move the change counter
    /// (`POST /poke` on --metrics-addr's port), and it reads the counter once
    /// a heartbeat instead of every 500 ms, which were most of a quiet
    /// worker's reads. Unset, nothing is advertised and nothing changes.
    #[arg(long, env = "TETHER_ADVERTISE_IP")]
    pub advertise_ip: Option<std::net::IpAddr>,

    /// Bound on graceful shutdown (flush, checkpoint, close, release).
    #[arg(long, env = "TETHER_DRAIN_TIMEOUT", default_value = DEFAULT_DRAIN_TIMEOUT, value_parser = parse_duration)]
    pub drain_timeout: Duration,

    /// Hosts streams may connect to (comma-separated; `*.example.com` matches
    /// subdomains; `*` allows all). Link-local and cloud metadata addresses are
    /// refused unless listed explicitly.
    #[arg(
        long,
        env = "TETHER_ALLOW_HOSTS",
        value_delimiter = ',',
        default_value = "*"
    )]
    pub allow_hosts: Vec<String>,

    /// Hosts HTTP sinks may be sent to (same syntax as --allow-hosts). Apart
    /// from upstreams because they are usually inside the platform's own
    /// network while upstreams are outside it.
    #[arg(
        long,
        env = "TETHER_ALLOW_SINK_HOSTS",
        value_delimiter = ',',
        default_value = "*"
    )]
    pub allow_sink_hosts: Vec<String>,

    /// Kinesis data streams a resource's sink may write to (comma-separated;
    /// `*` matches any run of characters, `{namespace}` stands for the
    /// resource's namespace; empty: none). Workers write with their own AWS
    /// role, so this keeps one namespace's resources out of another's data
    /// streams (the chart sets `{namespace}-*`).
    #[arg(
        long,
        env = "TETHER_KINESIS_STREAMS",
        value_delimiter = ',',
        default_value = "*"
    )]
    pub kinesis_streams: Vec<String>,

    /// Networks neither upstreams nor sinks may reach unless the host is
    /// listed by its exact name (comma-separated CIDRs; the chart sets the
    /// cluster's service and pod networks).
    #[arg(long, env = "TETHER_DENY_CIDRS", value_delimiter = ',')]
    pub deny_cidrs: Vec<ipnet::IpNet>,

    /// Extra CA certificates (PEM) trusted for `wss://` upstreams, in addition to
    /// the Mozilla roots. Verification itself cannot be turned off.
    #[arg(long, env = "TETHER_CA_FILE")]
    pub ca_file: Option<PathBuf>,

    /// Most session connects per second to one upstream host, after a burst
    /// of `--connect-burst` (a takeover of many streams is spread out so it
    /// never exceeds the upstream's limit); 0 for no limit.
    #[arg(long, env = "TETHER_CONNECT_RATE", default_value_t = 100.0)]
    pub connect_rate: f64,

    /// Connects to one host that may happen at once before `--connect-rate` applies.
    #[arg(long, env = "TETHER_CONNECT_BURST", default_value_t = 100)]
    pub connect_burst: u32,

    /// Write the CloudWatch Embedded Metric Format line (`ActiveConnections`,
    /// dimension `Table`) to stdout under this namespace; off when unset.
    #[arg(long, env = "TETHER_EMF_NAMESPACE")]
    pub emf_namespace: Option<String>,

    /// How often the EMF line is written.
    #[arg(long, env = "TETHER_EMF_INTERVAL", default_value = "60s", value_parser = parse_duration)]
    pub emf_interval: Duration,

    /// Disable fair share: acquire greedily and never hand streams over (streams
    /// then stay where they were acquired, as in the seed design).
    #[arg(long, env = "TETHER_NO_REBALANCE")]
    pub no_rebalance: bool,
}

/// `tether operator`: a worker plus the controller.
#[derive(Debug, clap::Args)]
pub struct OperatorArgs {
    #[command(flatten)]
    pub worker: WorkerArgs,
    #[command(flatten)]
    pub controller: ControllerArgs,
}

/// The controller's own settings (`tether operator` only).
#[derive(Debug, Clone, clap::Args)]
pub struct ControllerArgs {
    /// How often the leader reads what changed in the table (the change index
    /// and the fleet) for status; on a table without that index, how often
    /// each resource's item is read back.
    #[arg(long, env = "TETHER_STATUS_REFRESH", default_value = "10s", value_parser = parse_duration)]
    pub status_refresh: Duration,

    /// Progress-only status fields (checkpoint, lease expiry) are written at
    /// most this often per resource; phase, owner and conditions at once.
    #[arg(long, env = "TETHER_STATUS_PROGRESS_INTERVAL", default_value = "5m", value_parser = parse_duration)]
    pub status_progress_interval: Duration,

    /// This installation's identity. It reconciles only resources labelled
    /// `tether.dev/installation=<value>`; the empty default reconciles only
    /// resources without that label. Its items in the table carry it, and an
    /// item written by another installation is refused, never taken over.
    #[arg(long, env = "TETHER_INSTALLATION", default_value = "")]
    pub installation: String,

    /// Namespaces to watch (comma-separated); all namespaces when empty.
    #[arg(long, env = "TETHER_WATCH_NAMESPACES", value_delimiter = ',')]
    pub watch_namespaces: Vec<String>,

    /// Namespace of the leader-election Lease (the pod's own namespace in the chart).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub leader_namespace: String,

    /// How long a leader's Lease lasts without renewal before a standby
    /// replica takes over (renewed every third of it).
    #[arg(long, env = "TETHER_LEADER_LEASE", default_value = "15s", value_parser = parse_duration)]
    pub leader_lease: Duration,

    /// An item whose resource is gone is stopped and deleted after this long
    /// (only items of this installation; a resource deleted with its
    /// finalizer stripped by hand leaves one).
    #[arg(long, env = "TETHER_GC_GRACE", default_value = "10m", value_parser = parse_duration)]
    pub gc_grace: Duration,
}

/// Parses `250ms`, `5s`, `2m`, `1h` (or a bare number of seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a duration (try 500ms, 5s, 2m)"))?;
    let secs = match unit {
        "ms" => value / 1000.0,
        "" | "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => {
            return Err(format!(
                "'{s}' has an unknown unit '{unit}' (use ms, s, m, h)"
            ));
        }
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("'{s}' is not a valid duration"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
