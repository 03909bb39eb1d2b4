//! The standard `process_*` metrics (CPU, memory, file descriptors, start
//! time), read from `/proc/self` at each scrape, so dashboards and alerts
//! built for any Prometheus client work for tether too. Linux only: elsewhere
//! the collector reports nothing.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// `/proc` reports CPU time in USER_HZ ticks, which Linux fixes at 100.
const TICKS_PER_SECOND: f64 = 100.0;

/// Names and types, for the catalog of exported metrics.
pub const METRICS: [(&str, MetricType); 6] = [
    ("process_cpu_seconds", MetricType::Counter),
    ("process_resident_memory_bytes", MetricType::Gauge),
    ("process_virtual_memory_bytes", MetricType::Gauge),
    ("process_open_fds", MetricType::Gauge),
    ("process_max_fds", MetricType::Gauge),
    ("process_start_time_seconds", MetricType::Gauge),
];

#[derive(Debug, Default)]
pub struct ProcessCollector;

/// One reading of `/proc/self`.
#[derive(Debug, Default, PartialEq)]
pub struct Reading {
    pub cpu_seconds: f64,
    pub resident_bytes: f64,
    pub virtual_bytes: f64,
    pub open_fds: f64,
    pub max_fds: f64,
    pub start_time_seconds: f64,
}

/// What `/proc/<pid>/stat` says about CPU, start and size.
#[derive(Debug, Clone, Copy)]
pub struct Stat {
    /// User plus system CPU time, in seconds.
    pub cpu_seconds: f64,
    /// Start after boot, in ticks.
    start_ticks: f64,
    virtual_bytes: f64,
}

/// Reads `/proc/<pid>/stat` (this process for `None`).
pub fn stat(pid: Option<u32>) -> Option<Stat> {
    let path = pid.map_or_else(
        || "/proc/self/stat".to_string(),
        |p| format!("/proc/{p}/stat"),
    );
    stat_at(std::path::Path::new(&path))
}

/// Reads a `stat` file of that format: a process's, or one thread's
/// (`/proc/<pid>/task/<tid>/stat`; `/proc/<tid>/stat` counts the whole
/// process).
pub fn stat_at(path: &std::path::Path) -> Option<Stat> {
    let stat = std::fs::read_to_string(path).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let after = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    // `after` starts at field 3 (state): field n is fields[n - 3].
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<f64>().ok());
    Some(Stat {
        cpu_seconds: (field(14)? + field(15)?) / TICKS_PER_SECOND,
        start_ticks: field(22)?,
        virtual_bytes: field(23)?,
    })
}

/// Reads `/proc/self`; `None` where there is no such thing.
pub fn read() -> Option<Reading> {
    let Stat {
        cpu_seconds,
        start_ticks,
        virtual_bytes,
    } = stat(None)?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let resident_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())?;
    let boot_time = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse::<f64>().ok())?;
    let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as f64;
    let max_fds = std::fs::read_to_string("/proc/self/limits")
        .ok()?
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    Some(Reading {
        cpu_seconds,
        resident_bytes: resident_kib * 1024.0,
        virtual_bytes,
        open_fds,
        max_fds,
        start_time_seconds: boot_time + start_ticks / TICKS_PER_SECOND,
    })
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(r) = read() else { return Ok(()) };
        let cpu = ConstCounter::new(r.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            METRICS[0].0,
            "Total user and system CPU time spent in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let gauges = [
            (
                METRICS[1].0,
                "Resident memory size in bytes",
                r.resident_bytes,
            ),
            (
                METRICS[2].0,
                "Virtual memory size in bytes",
                r.virtual_bytes,
            ),
            (METRICS[3].0, "Number of open file descriptors", r.open_fds),
            (
                METRICS[4].0,
                "Maximum number of open file descriptors",
                r.max_fds,
            ),
            (
                METRICS[5].0,
                "Start time of the process since the Unix epoch in seconds",
                r.start_time_seconds,
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_process_reads_as_alive_and_using_memory() {
        let r = super::read().expect("Linux /proc");
        assert!(r.resident_bytes > 1e6, "{r:?}");
        assert!(r.open_fds >= 3.0 && r.max_fds >= r.open_fds, "{r:?}");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(
            r.start_time_seconds <= now + 1.0 && r.start_time_seconds > now - 3600.0,
            "{r:?}"
        );
    }
}
