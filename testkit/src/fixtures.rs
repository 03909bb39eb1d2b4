//! Specs for tests, written once.

use serde_json::json;
use tether::crd::StreamConnectionSpec;

/// A stream sequenced by `/seq`, delivering to an HTTP sink in small batches,
/// with a keepalive short enough for tests.
pub fn http_spec(url: &str, sink_url: &str) -> StreamConnectionSpec {
    serde_json::from_value(json!({
        "url": url,
        "sequence": {"pointer": "/seq"},
        "keepalive": {"intervalSeconds": 1, "timeoutSeconds": 2},
        "sink": {"http": {"url": sink_url, "maxBatchMessages": 20, "lingerMs": 20, "timeoutSeconds": 2}},
    }))
    .expect("a valid spec")
}

/// A stream writing to the worker's log sink.
pub fn log_spec(url: &str) -> StreamConnectionSpec {
    serde_json::from_value(json!({"url": url, "sink": {"log": {}}})).expect("a valid spec")
}
