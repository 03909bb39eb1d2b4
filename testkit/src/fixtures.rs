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

/// A stream sequenced by `/seq`, delivering to Kinesis data stream `stream_name`
/// (the worker's `AWS_ENDPOINT_URL_KINESIS` says where Kinesis is).
pub fn kinesis_spec(url: &str, stream_name: &str) -> StreamConnectionSpec {
    serde_json::from_value(json!({
        "url": url,
        "sequence": {"pointer": "/seq"},
        "keepalive": {"intervalSeconds": 1, "timeoutSeconds": 2},
        "sink": {"kinesis": {"streamName": stream_name, "maxBatchRecords": 50, "lingerMs": 20, "timeoutSeconds": 2}},
    }))
    .expect("a valid spec")
}

/// A stream sequenced by `/seq`, publishing to NATS JetStream at `nats_url`
/// on `subject`, authenticated with the worker's `NATS_USER`/`NATS_PASSWORD`.
pub fn nats_spec(url: &str, nats_url: &str, subject: &str, stream: &str) -> StreamConnectionSpec {
    serde_json::from_value(json!({
        "url": url,
        "sequence": {"pointer": "/seq"},
        "keepalive": {"intervalSeconds": 1, "timeoutSeconds": 2},
        "sink": {"nats": {
            "url": nats_url, "subject": subject, "stream": stream,
            "credentials": {"user": {"env": "NATS_USER"}, "password": {"env": "NATS_PASSWORD"}},
            "maxBatchMessages": 20, "lingerMs": 20, "timeoutSeconds": 2
        }},
    }))
    .expect("a valid spec")
}
