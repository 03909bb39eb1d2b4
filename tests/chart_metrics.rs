//! Every metric the chart's alerts and dashboard query is one tether exports:
//! a renamed metric must not leave an alert that can never fire.

use std::collections::BTreeSet;

/// Sample names the process can expose.
fn exported() -> BTreeSet<String> {
    tether::metrics::Metrics::new()
        .sample_names()
        .into_iter()
        .collect()
}

/// Every `tether_*` identifier in `text`.
fn queried(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("tether_") {
        let start = i + at;
        let boundary =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let end = text[start..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(text.len(), |n| start + n);
        if boundary {
            out.insert(text[start..end].to_string());
        }
        i = end;
    }
    out
}

#[test]
fn the_standard_process_metrics_are_exported_with_values() {
    let metrics = tether::metrics::Metrics::new();
    let text = metrics.encode_prometheus_text();
    assert!(tether_testkit::processes::metric_value(&text, "process_cpu_seconds_total").is_some());
    for name in [
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ] {
        let value = tether_testkit::processes::metric_value(&text, name);
        assert!(value.is_some_and(|v| v > 0.0), "{name}: {value:?}\n{text}");
    }
}

#[test]
fn every_metric_the_alerts_and_the_dashboard_query_is_exported() {
    let chart = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/tether");
    let exported = exported();
    assert!(exported.contains("tether_streams_unowned"), "{exported:?}");
    let mut checked = 0;
    for file in ["files/dashboard.json", "templates/prometheusrule.yaml"] {
        let text = std::fs::read_to_string(chart.join(file)).unwrap();
        for name in queried(&text) {
            checked += 1;
            assert!(
                exported.contains(&name),
                "{file} queries {name}, which tether does not export"
            );
        }
    }
    assert!(checked >= 15, "only {checked} queries found");
}
