//! The `StreamConnection` resource: its spec and status types, their checks
//! beyond the schema, and the CRD as generated from them.

use super::field_error::{FieldError, err};
use super::sink::SinkSpec;
#[cfg(test)]
use super::sink::{HttpSinkSpec, LogSinkSpec};
use super::value_source::HeaderValueSource;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Default keepalive ping interval.
pub const DEFAULT_PING_INTERVAL_SECONDS: u32 = 15;
/// Default time to wait for a pong before the session is declared dead.
pub const DEFAULT_PONG_TIMEOUT_SECONDS: u32 = 10;
/// Default largest message accepted from an upstream.
pub const DEFAULT_MAX_MESSAGE_BYTES: u32 = 1024 * 1024;
/// Default largest single frame accepted from an upstream.
pub const DEFAULT_MAX_FRAME_BYTES: u32 = 256 * 1024;

/// A long-lived outbound WebSocket stream that exactly one tether worker keeps
/// connected, forwarding every message to a sink and resuming from the last
/// acknowledged sequence number after any failover.
#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "tether.dev",
    version = "v1alpha1",
    kind = "StreamConnection",
    namespaced,
    shortname = "sconn",
    status = "StreamConnectionStatus",
    category = "tether",
    printcolumn = r#"{"name":"State","type":"string","jsonPath":".spec.desiredState"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Owner","type":"string","jsonPath":".status.owner"}"#,
    printcolumn = r#"{"name":"Last-Seq","type":"integer","jsonPath":".status.lastSeq"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","priority":1,"jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Reconnects","type":"integer","priority":1,"jsonPath":".status.reconnects"}"#,
    printcolumn = r#"{"name":"Lease-Expires","type":"date","priority":1,"jsonPath":".status.leaseExpiresAt"}"#,
    printcolumn = r#"{"name":"URL","type":"string","priority":1,"jsonPath":".spec.url"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct StreamConnectionSpec {
    /// Upstream WebSocket URL, `ws://` or `wss://`. The text `{last_seq}` is replaced
    /// at every connect with the last sequence number the sink acknowledged, so an
    /// upstream that can replay resumes without loss. While nothing has been
    /// acknowledged yet (a new stream) it is replaced by nothing, or `initialUrl`
    /// is used instead: "no checkpoint" and "checkpoint 0" are different.
    /// Changing `url` keeps the checkpoint: the new URL resumes after the last
    /// sequence number acknowledged on the old one (switching to a different
    /// feed skips whatever it numbers below that). To start over with no
    /// checkpoint, delete the resource and create it again; its fencing token
    /// keeps growing.
    #[schemars(pattern(r"^wss?://"), length(max = 2048))]
    pub url: String,

    /// URL of connects made while the stream has no checkpoint (nothing
    /// acknowledged yet), e.g. `wss://feed.example/x?from=0` for a feed whose first
    /// sequence number is 0. Default: `url` with `{last_seq}` replaced by nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(r"^wss?://"), length(max = 2048))]
    #[schemars(extend("x-kubernetes-validations" = [{"rule": "!self.contains('{last_seq}')", "message": "initialUrl is used when there is no checkpoint, so it cannot contain {last_seq}"}]))]
    pub initial_url: Option<String>,

    /// `Started` keeps the stream connected; `Stopped` closes the session with a
    /// normal close frame and releases its lease, keeping the checkpoint.
    #[serde(default)]
    pub desired_state: DesiredStateSpec,

    /// How each message's sequence number is found. Without it, messages are
    /// numbered by a counter that continues from the checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence: Option<SequenceSpec>,

    /// Text messages sent right after every connect (e.g. a subscribe request).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub subscribe: Vec<String>,

    /// Protocol-level ping/pong keepalive.
    #[serde(default)]
    pub keepalive: KeepaliveSpec,

    /// Where messages go.
    pub sink: SinkSpec,

    /// Extra HTTP headers for the WebSocket handshake. Values are references,
    /// resolved by the connecting worker at connect time and never copied into
    /// the lease table or logs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub headers: Vec<HeaderSpec>,

    /// Size limits for what the upstream may send.
    #[serde(default)]
    pub limits: LimitsSpec,
}

/// Desired state of a stream.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum DesiredStateSpec {
    #[default]
    Started,
    Stopped,
}

/// How to read a message's sequence number.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SequenceSpec {
    /// RFC 6901 JSON pointer to an integer in each text message, e.g. `/seq`.
    /// Messages at or below the checkpoint (replays) are skipped. The text
    /// must be JSON up to the end of the number, and of duplicate keys the
    /// first counts; with `dataFormat: json`, all of it must be JSON and the
    /// last counts. A message without one is skipped, logged and counted.
    #[schemars(pattern(r"^(/([^~]|~[01])*)*$"))]
    pub pointer: String,
}

/// Keepalive settings.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KeepaliveSpec {
    /// Seconds between protocol pings.
    #[serde(default = "default_ping_interval")]
    #[schemars(range(min = 1, max = 3600))]
    pub interval_seconds: u32,
    /// Seconds to wait for a pong (or any frame) before the session is declared
    /// dead and reconnected with jittered exponential backoff.
    #[serde(default = "default_pong_timeout")]
    #[schemars(range(min = 1, max = 600))]
    pub timeout_seconds: u32,
}

impl Default for KeepaliveSpec {
    fn default() -> Self {
        Self {
            interval_seconds: DEFAULT_PING_INTERVAL_SECONDS,
            timeout_seconds: DEFAULT_PONG_TIMEOUT_SECONDS,
        }
    }
}

fn default_ping_interval() -> u32 {
    DEFAULT_PING_INTERVAL_SECONDS
}
fn default_pong_timeout() -> u32 {
    DEFAULT_PONG_TIMEOUT_SECONDS
}

/// One handshake header whose value comes from a reference.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HeaderSpec {
    /// Header name, e.g. `Authorization`.
    #[schemars(pattern(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$"), length(max = 256))]
    pub name: String,
    /// Where the value comes from.
    pub value_from: HeaderValueSource,
}

/// Size limits.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LimitsSpec {
    /// Largest message accepted; a larger one ends the session with a clear reason.
    #[serde(default = "default_max_message")]
    #[schemars(range(min = 1024, max = 67108864))]
    pub max_message_bytes: u32,
    /// Largest frame accepted.
    #[serde(default = "default_max_frame")]
    #[schemars(range(min = 1024, max = 67108864))]
    pub max_frame_bytes: u32,
}

impl Default for LimitsSpec {
    fn default() -> Self {
        Self {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
        }
    }
}

fn default_max_message() -> u32 {
    DEFAULT_MAX_MESSAGE_BYTES
}
fn default_max_frame() -> u32 {
    DEFAULT_MAX_FRAME_BYTES
}

/// Observed state, written by the controller from the lease table.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StreamConnectionStatus {
    /// Pending, Connecting, Connected, Backoff, Stopped or Failed. Written
    /// when it changes, within `--status-refresh` (10 s) of the owner's write.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// Worker currently holding the lease. Written when it changes, within
    /// `--status-refresh` of the move (a worker's death: within the lease,
    /// once a peer declares it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// Until when the owner has proven itself alive (its last renewal plus the
    /// lease, RFC 3339; renewed every heartbeat). Progress: refreshed at most
    /// every `--status-progress-interval` (5 min), so it may be that old.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_expires_at: Option<String>,
    /// Last sequence number the sink acknowledged, as checkpointed. Progress:
    /// refreshed at most every `--status-progress-interval` (5 min) while
    /// the stream runs, and exact after a release or a handoff.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seq: Option<u64>,
    /// When the current session connected (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connected_since: Option<String>,
    /// Reconnects of the current owner's session (written with the phase).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconnects: Option<u64>,
    /// The generation this status describes: the one the owner's session
    /// runs, or the one refused; behind `metadata.generation` while a new
    /// spec waits for its session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready` (session connected, for the observed generation), `Owned` (a
    /// worker holds the lease), and while true `Reconciling` (on the way to
    /// Ready) or `Stalled` (failed until the spec changes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// The CRD as YAML, exactly as checked in under `crds/` and shipped in the chart.
pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    serde_yaml::to_string(&crd())
}

/// The CRD: the derived one, finished where the derive falls short of the API
/// conventions: a real description for the type, integer formats the API
/// server accepts (`int32`/`int64`, not `uint*`), `conditions` as a map list
/// keyed by `type`, and `phase` as an enum.
pub fn crd()
-> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use kube::CustomResourceExt;
    let mut crd = StreamConnection::crd();
    for version in &mut crd.spec.versions {
        let Some(schema) = version
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        else {
            continue;
        };
        let mut value = serde_json::to_value(&*schema).unwrap_or_default();
        value["description"] = serde_json::json!(
            "A long-lived outbound WebSocket stream that exactly one tether worker keeps connected, \
             forwarding every message to a sink and resuming from the last acknowledged sequence \
             number after any failover. `spec` is what you want; `status` is what the workers report."
        );
        integer_formats(&mut value);
        if let Some(status) = value.pointer_mut("/properties/status/properties") {
            if let Some(conditions) = status.get_mut("conditions") {
                conditions["x-kubernetes-list-type"] = serde_json::json!("map");
                conditions["x-kubernetes-list-map-keys"] = serde_json::json!(["type"]);
            }
            if let Some(phase) = status.get_mut("phase") {
                phase["enum"] =
                    serde_json::json!(crate::lease::Phase::ALL.map(crate::lease::Phase::as_str));
            }
        }
        if let Ok(finished) = serde_json::from_value(value) {
            *schema = finished;
        }
    }
    crd
}

/// `uint32` → `int32`-compatible `int64`, `uint64` → `int64`: the API server
/// knows only `int32` and `int64` (and warns about the others); the minimum
/// of 0 the derive adds keeps them unsigned.
fn integer_formats(schema: &mut serde_json::Value) {
    match schema {
        serde_json::Value::Object(map) => {
            if let Some(format) = map.get_mut("format")
                && matches!(format.as_str(), Some("uint32" | "uint64" | "uint"))
            {
                *format = serde_json::json!("int64");
            }
            for child in map.values_mut() {
                integer_formats(child);
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(integer_formats),
        _ => {}
    }
}

impl StreamConnectionSpec {
    /// Checks what the schema cannot express (and repeats what it can, for
    /// `tether apply`, which has no API server to enforce the schema).
    pub fn validate(&self) -> Result<(), Vec<FieldError>> {
        let mut errors = Vec::new();
        match url::Url::parse(&self.url.replace("{last_seq}", "0")) {
            Ok(u) if matches!(u.scheme(), "ws" | "wss") && u.host_str().is_some() => {}
            Ok(_) => errors.push(err("spec.url", "must be a ws:// or wss:// URL with a host")),
            Err(e) => errors.push(err("spec.url", format!("not a URL: {e}"))),
        }
        if let Some(initial) = &self.initial_url {
            match url::Url::parse(initial) {
                Ok(_) if initial.contains("{last_seq}") => errors.push(err(
                    "spec.initialUrl",
                    "is used when there is no checkpoint, so it cannot contain {last_seq}",
                )),
                Ok(u) if matches!(u.scheme(), "ws" | "wss") && u.host_str().is_some() => {}
                Ok(_) => errors.push(err(
                    "spec.initialUrl",
                    "must be a ws:// or wss:// URL with a host",
                )),
                Err(e) => errors.push(err("spec.initialUrl", format!("not a URL: {e}"))),
            }
        }
        if let Some(seq) = &self.sequence
            && !(seq.pointer.is_empty() || seq.pointer.starts_with('/'))
        {
            errors.push(err(
                "spec.sequence.pointer",
                "must be an RFC 6901 JSON pointer starting with '/'",
            ));
        }
        if self.subscribe.len() > 16 {
            errors.push(err("spec.subscribe", "at most 16 messages"));
        }
        let k = &self.keepalive;
        if !(1..=3600).contains(&k.interval_seconds) {
            errors.push(err(
                "spec.keepalive.intervalSeconds",
                "must be between 1 and 3600",
            ));
        }
        if !(1..=600).contains(&k.timeout_seconds) {
            errors.push(err(
                "spec.keepalive.timeoutSeconds",
                "must be between 1 and 600",
            ));
        }
        self.sink.validate(&mut errors);
        if self.headers.len() > 32 {
            errors.push(err("spec.headers", "at most 32 headers"));
        }
        let mut names = std::collections::HashSet::new();
        for (i, h) in self.headers.iter().enumerate() {
            // Handshake header names are case-insensitive: one entry per name.
            if !names.insert(h.name.to_ascii_lowercase()) {
                errors.push(err(
                    &format!("spec.headers[{i}].name"),
                    format!("'{}' is given more than once", h.name),
                ));
            }
            if http::HeaderName::from_bytes(h.name.as_bytes()).is_err() {
                errors.push(err(
                    &format!("spec.headers[{i}].name"),
                    "not a valid HTTP header name",
                ));
            }
            if h.value_from.secret_key_ref.is_some() == h.value_from.env.is_some() {
                errors.push(err(
                    &format!("spec.headers[{i}].valueFrom"),
                    "set exactly one of secretKeyRef and env",
                ));
            }
        }
        for (field, value) in [
            ("spec.limits.maxMessageBytes", self.limits.max_message_bytes),
            ("spec.limits.maxFrameBytes", self.limits.max_frame_bytes),
        ] {
            if !(1024..=64 * 1024 * 1024).contains(&value) {
                errors.push(err(field, "must be between 1024 and 67108864"));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// [`Self::validate`], plus what a resource in a cluster may not use:
    /// `valueFrom.env` would read the operator's own environment (its cloud
    /// credentials, for one) and send it to whatever host the resource names.
    pub fn validate_in_cluster(&self) -> Result<(), Vec<FieldError>> {
        let mut errors = self.validate().err().unwrap_or_default();
        for (i, h) in self.headers.iter().enumerate() {
            if h.value_from.env.is_some() {
                errors.push(err(
                    &format!("spec.headers[{i}].valueFrom.env"),
                    "not available to resources in Kubernetes mode (it would read the operator's own environment); use secretKeyRef",
                ));
            }
        }
        for (field, source) in self.sink.references() {
            if source.env.is_some() {
                errors.push(err(
                    &format!("{field}.env"),
                    "not available to resources in Kubernetes mode (it would read the operator's own environment); use secretKeyRef",
                ));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }
}

#[cfg(test)]
pub mod fixtures {
    //! Builders for tests.
    use super::*;

    impl StreamConnectionSpec {
        /// A valid spec with a log sink.
        pub fn test(url: &str) -> Self {
            Self {
                url: url.to_string(),
                initial_url: None,
                desired_state: DesiredStateSpec::Started,
                sequence: None,
                subscribe: Vec::new(),
                keepalive: KeepaliveSpec::default(),
                sink: SinkSpec {
                    log: Some(LogSinkSpec {}),
                    ..SinkSpec::default()
                },
                headers: Vec::new(),
                limits: LimitsSpec::default(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minimal_manifest_gets_documented_defaults() {
        let spec: StreamConnectionSpec = serde_json::from_value(
            serde_json::json!({"url": "wss://feed.example/x", "sink": {"log": {}}}),
        )
        .unwrap();
        assert_eq!(spec.desired_state, DesiredStateSpec::Started);
        assert_eq!(
            spec.keepalive.interval_seconds,
            DEFAULT_PING_INTERVAL_SECONDS
        );
        assert_eq!(spec.limits.max_message_bytes, DEFAULT_MAX_MESSAGE_BYTES);
        assert_eq!(spec.validate(), Ok(()));
    }

    #[test]
    fn validation_names_every_bad_field() {
        let mut spec = StreamConnectionSpec::test("http://not-a-websocket");
        spec.sink.http = Some(HttpSinkSpec {
            url: "ftp://x".into(),
            max_batch_messages: 0,
            linger_ms: 0,
            timeout_seconds: 5,
            data_format: Default::default(),
        });
        spec.keepalive.interval_seconds = 0;
        spec.sequence = Some(SequenceSpec {
            pointer: "seq".into(),
        });
        spec.headers.push(HeaderSpec {
            name: "Bad Header".into(),
            value_from: HeaderValueSource::default(),
        });
        let fields: Vec<String> = spec
            .validate()
            .unwrap_err()
            .into_iter()
            .map(|e| e.field)
            .collect();
        assert_eq!(
            fields,
            [
                "spec.url",
                "spec.sequence.pointer",
                "spec.keepalive.intervalSeconds",
                "spec.sink",
                "spec.headers[0].name",
                "spec.headers[0].valueFrom"
            ]
        );
    }

    #[test]
    fn the_last_seq_placeholder_is_a_valid_url() {
        assert_eq!(
            StreamConnectionSpec::test("ws://127.0.0.1:9/s?after={last_seq}").validate(),
            Ok(())
        );
    }

    #[test]
    fn a_header_given_twice_is_refused_whatever_its_case() {
        let mut spec = StreamConnectionSpec::test("wss://feed.example/a");
        let header = |name: &str| HeaderSpec {
            name: name.into(),
            value_from: HeaderValueSource {
                secret_key_ref: None,
                env: Some("TOKEN".into()),
            },
        };
        spec.headers = vec![header("Authorization"), header("authorization")];
        let errors = spec.validate().unwrap_err();
        assert!(
            errors
                .iter()
                .any(|e| e.field == "spec.headers[1].name" && e.message.contains("more than once")),
            "{errors:?}"
        );
    }

    #[test]
    fn the_crd_refuses_at_admission_what_the_schema_can_express() {
        let crd = serde_json::to_value(super::crd()).unwrap();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        let headers = &spec["properties"]["headers"];
        assert_eq!(headers["x-kubernetes-list-type"], "map");
        assert_eq!(
            headers["x-kubernetes-list-map-keys"],
            serde_json::json!(["name"])
        );
        let initial = spec["properties"]["initialUrl"]["x-kubernetes-validations"].to_string();
        assert!(initial.contains("{last_seq}"), "{initial}");
        let value_from =
            headers["items"]["properties"]["valueFrom"]["x-kubernetes-validations"].to_string();
        assert!(value_from.contains("!has(self.env)"), "{value_from}");
    }
}

#[cfg(test)]
mod drift {
    /// The checked-in CRD (and so the chart's copy) is exactly what the types generate.
    #[test]
    fn checked_in_crd_matches_the_rust_types() {
        let generated = super::crd_yaml().unwrap();
        let checked_in = include_str!("../../crds/streamconnections.tether.dev.yaml");
        assert!(
            generated == checked_in,
            "crds/ is stale: run `cargo run -- crd > crds/streamconnections.tether.dev.yaml`"
        );
    }
}

#[cfg(test)]
mod conventions {
    /// What `kubectl explain`, recent API servers and server-side apply expect.
    #[test]
    fn the_crd_follows_the_api_conventions() {
        let yaml = super::crd_yaml().unwrap();
        assert!(!yaml.contains("Auto-generated"), "a real type description");
        assert!(
            !yaml.contains("format: uint"),
            "formats the API server knows"
        );
        let crd = serde_json::to_value(super::crd()).unwrap();
        let version = &crd["spec"]["versions"][0];
        let status = &version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"];
        assert_eq!(status["conditions"]["x-kubernetes-list-type"], "map");
        assert_eq!(
            status["conditions"]["x-kubernetes-list-map-keys"][0],
            "type"
        );
        assert!(status["phase"]["enum"].as_array().unwrap().len() >= 6);
        assert_eq!(crd["spec"]["names"]["categories"][0], "tether");
        assert!(
            version["additionalPrinterColumns"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["name"] == "Ready")
        );
    }
}
