//! The `spec.sink` part of a `StreamConnection`: exactly one of the sinks, each
//! with its own settings and the checks the schema cannot express.

use super::field_error::{FieldError, err};
use super::value_source::HeaderValueSource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Default number of messages per sink batch.
pub const DEFAULT_BATCH_MESSAGES: u32 = 100;
/// Default time a partial batch waits for more messages before it is sent.
pub const DEFAULT_LINGER_MS: u32 = 50;
/// Default timeout of one sink request.
pub const DEFAULT_SINK_TIMEOUT_SECONDS: u32 = 10;
/// Kinesis takes at most this many records in one PutRecords call.
pub const KINESIS_MAX_RECORDS: u32 = 500;

/// Exactly one sink.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "(has(self.http) ? 1 : 0) + (has(self.log) ? 1 : 0) + (has(self.kinesis) ? 1 : 0) + (has(self.nats) ? 1 : 0) == 1",
    "message": "set exactly one of sink.http, sink.log, sink.kinesis and sink.nats"
}]))]
pub struct SinkSpec {
    /// POST batches of messages as JSON; a 2xx response acknowledges the batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpSinkSpec>,
    /// Write one JSON line per message to the worker's standard output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log: Option<LogSinkSpec>,
    /// Put each message as a record into an Amazon Kinesis data stream
    /// (PutRecords), partition key = the stream's `namespace/name`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kinesis: Option<KinesisSinkSpec>,
    /// Publish each message to NATS JetStream and wait for the stream's
    /// acknowledgement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nats: Option<NatsSinkSpec>,
}

/// An HTTP sink. Failures are retried with backoff and reading from the socket
/// pauses meanwhile (backpressure): messages are never dropped.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HttpSinkSpec {
    /// `http://` or `https://` URL the batches are POSTed to.
    #[schemars(pattern(r"^https?://"), length(max = 2048))]
    pub url: String,
    /// Most messages in one batch.
    #[serde(default = "default_batch_messages")]
    #[schemars(range(min = 1, max = 10000))]
    pub max_batch_messages: u32,
    /// Milliseconds a partial batch waits for more messages.
    #[serde(default = "default_linger_ms")]
    #[schemars(range(max = 10000))]
    pub linger_ms: u32,
    /// Seconds before one POST is abandoned and retried.
    #[serde(default = "default_sink_timeout")]
    #[schemars(range(min = 1, max = 300))]
    pub timeout_seconds: u32,
    /// How each message travels in the body: `string` (the default) as a
    /// JSON string in `data`; `json` as the JSON value it is, in `json`.
    #[serde(default, skip_serializing_if = "DataFormat::is_default")]
    pub data_format: DataFormat,
}

/// How a message's text travels in a sink's JSON. `json` spares the
/// escaping (every `"` of a JSON message written again as `\"`) and gives
/// consumers the message as a value they need not parse twice; the worker
/// checks the whole message instead, where the default format reads it
/// only up to its sequence number. The key differs (`data` or `json`), so
/// a consumer tells the two apart by looking, also while a spec changes.
#[derive(Deserialize, Serialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum DataFormat {
    /// `"data": "<the text as a JSON string>"`: any text; a binary message
    /// is base64.
    #[default]
    String,
    /// `"json": <the text itself>`: only messages that JSON parsers take as
    /// a value are forwarded (no number out of range, no lone surrogate
    /// escape, at most 120 levels deep); any other message is skipped with a
    /// warning and counted (`tether_session_errors_total{kind="not_json"}`;
    /// a binary message with a sequence pointer, as always, `kind="sequence"`).
    Json,
}

impl DataFormat {
    fn is_default(&self) -> bool {
        *self == Self::String
    }
}

/// The log sink has no settings.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
pub struct LogSinkSpec {}

/// A Kinesis data stream. Each record's data is the JSON object
/// `{"connection","worker","token","seq","data"}`, so a consumer can drop
/// records of a superseded owner by their token. Records Kinesis refuses
/// (throttling, partial failures) are retried, only those and in order, while
/// reading pauses; the checkpoint never passes a record Kinesis has not
/// accepted. Credentials and region are the worker's (its IAM role).
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KinesisSinkSpec {
    /// Name of the data stream.
    #[schemars(pattern(r"^[a-zA-Z0-9_.-]+$"), length(min = 1, max = 128))]
    pub stream_name: String,
    /// AWS region of the stream. Default: the worker's region.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(pattern(r"^[a-z0-9-]+$"), length(max = 32))]
    pub region: Option<String>,
    /// Most records in one PutRecords call (Kinesis allows 500).
    #[serde(default = "default_kinesis_records")]
    #[schemars(range(min = 1, max = 500))]
    pub max_batch_records: u32,
    /// Milliseconds a partial batch waits for more messages.
    #[serde(default = "default_linger_ms")]
    #[schemars(range(max = 10000))]
    pub linger_ms: u32,
    /// Seconds before one PutRecords call is abandoned and retried.
    #[serde(default = "default_sink_timeout")]
    #[schemars(range(min = 1, max = 300))]
    pub timeout_seconds: u32,
    /// How each message travels in its record: `string` (the default) as a
    /// JSON string in `data`; `json` as the JSON value it is, in `json`.
    #[serde(default, skip_serializing_if = "DataFormat::is_default")]
    pub data_format: DataFormat,
}

/// A NATS JetStream subject. Each message is published with its raw data as
/// the payload and the headers `Nats-Msg-Id` (`namespace/name:seq`, so
/// JetStream's duplicate window drops a replay), `Tether-Connection`,
/// `Tether-Worker`, `Tether-Token` and `Tether-Seq`; only a JetStream
/// acknowledgement advances the checkpoint.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NatsSinkSpec {
    /// Server URL, `nats://host:port` or `tls://host:port` (TLS verified).
    #[schemars(pattern(r"^(nats|tls)://"), length(max = 2048))]
    pub url: String,
    /// Subject the messages are published to; a JetStream stream must capture it.
    #[schemars(pattern(r"^[^\s*>]+$"), length(min = 1, max = 256))]
    pub subject: String,
    /// Name of the JetStream stream that must capture the subject
    /// (`Nats-Expected-Stream`): a publish that lands elsewhere is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub stream: Option<String>,
    /// How the worker authenticates; values are references, never copied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<NatsCredentials>,
    /// Most messages published before their acknowledgements are awaited.
    #[serde(default = "default_batch_messages")]
    #[schemars(range(min = 1, max = 10000))]
    pub max_batch_messages: u32,
    /// Milliseconds a partial batch waits for more messages.
    #[serde(default = "default_linger_ms")]
    #[schemars(range(max = 10000))]
    pub linger_ms: u32,
    /// Seconds to wait for a batch's acknowledgements before it is retried.
    #[serde(default = "default_sink_timeout")]
    #[schemars(range(min = 1, max = 300))]
    pub timeout_seconds: u32,
}

/// NATS credentials: a token, or a user and password.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.token) ? !(has(self.user) || has(self.password)) : (has(self.user) && has(self.password))",
    "message": "set either token, or user and password"
}]))]
pub struct NatsCredentials {
    /// An authentication token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<HeaderValueSource>,
    /// A user name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<HeaderValueSource>,
    /// The user's password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<HeaderValueSource>,
}

impl NatsCredentials {
    /// Every reference with the field it sits in.
    pub fn references(&self) -> impl Iterator<Item = (&'static str, &HeaderValueSource)> {
        [
            ("token", &self.token),
            ("user", &self.user),
            ("password", &self.password),
        ]
        .into_iter()
        .filter_map(|(field, source)| source.as_ref().map(|s| (field, s)))
    }
}

fn default_batch_messages() -> u32 {
    DEFAULT_BATCH_MESSAGES
}
fn default_kinesis_records() -> u32 {
    KINESIS_MAX_RECORDS
}
fn default_linger_ms() -> u32 {
    DEFAULT_LINGER_MS
}
fn default_sink_timeout() -> u32 {
    DEFAULT_SINK_TIMEOUT_SECONDS
}

impl SinkSpec {
    /// The chosen sink's name, as metrics and messages call it.
    pub fn kind(&self) -> Option<&'static str> {
        let set = [
            (self.http.is_some(), "http"),
            (self.log.is_some(), "log"),
            (self.kinesis.is_some(), "kinesis"),
            (self.nats.is_some(), "nats"),
        ];
        match set.iter().filter(|(is, _)| *is).collect::<Vec<_>>()[..] {
            [(_, kind)] => Some(kind),
            _ => None,
        }
    }

    /// Every value reference the sink holds, with its field path.
    pub fn references(&self) -> Vec<(String, &HeaderValueSource)> {
        self.nats
            .iter()
            .filter_map(|n| n.credentials.as_ref())
            .flat_map(|c| c.references())
            .map(|(field, source)| (format!("spec.sink.nats.credentials.{field}"), source))
            .collect()
    }

    /// Checks the schema's rules again (for `tether apply`) and what it cannot say.
    pub(super) fn validate(&self, errors: &mut Vec<FieldError>) {
        if self.kind().is_none() {
            errors.push(err(
                "spec.sink",
                "set exactly one of sink.http, sink.log, sink.kinesis and sink.nats",
            ));
            return;
        }
        if let Some(http) = &self.http {
            match url::Url::parse(&http.url) {
                Ok(u) if matches!(u.scheme(), "http" | "https") => {}
                _ => errors.push(err(
                    "spec.sink.http.url",
                    "must be an http:// or https:// URL",
                )),
            }
            batching(
                errors,
                "spec.sink.http",
                ("maxBatchMessages", http.max_batch_messages, 10000),
                http.linger_ms,
                http.timeout_seconds,
            );
        }
        if let Some(kinesis) = &self.kinesis {
            let name = &kinesis.stream_name;
            if !(1..=128).contains(&name.len())
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
            {
                errors.push(err(
                    "spec.sink.kinesis.streamName",
                    "must be 1-128 characters of a-z, A-Z, 0-9, '_', '.' and '-'",
                ));
            }
            batching(
                errors,
                "spec.sink.kinesis",
                (
                    "maxBatchRecords",
                    kinesis.max_batch_records,
                    KINESIS_MAX_RECORDS,
                ),
                kinesis.linger_ms,
                kinesis.timeout_seconds,
            );
        }
        if let Some(nats) = &self.nats {
            match url::Url::parse(&nats.url) {
                Ok(u) if matches!(u.scheme(), "nats" | "tls") && u.host_str().is_some() => {
                    if !u.username().is_empty() || u.password().is_some() {
                        errors.push(err(
                            "spec.sink.nats.url",
                            "must not hold credentials: use sink.nats.credentials",
                        ));
                    }
                }
                _ => errors.push(err(
                    "spec.sink.nats.url",
                    "must be a nats:// or tls:// URL with a host",
                )),
            }
            let subject = &nats.subject;
            if subject.is_empty()
                || subject.len() > 256
                || subject
                    .chars()
                    .any(|c| c.is_whitespace() || c == '*' || c == '>')
                || subject.split('.').any(str::is_empty)
            {
                errors.push(err(
                    "spec.sink.nats.subject",
                    "must be a NATS subject without wildcards or empty tokens",
                ));
            }
            if let Some(c) = &nats.credentials {
                let ok = if c.token.is_some() {
                    c.user.is_none() && c.password.is_none()
                } else {
                    c.user.is_some() && c.password.is_some()
                };
                if !ok {
                    errors.push(err(
                        "spec.sink.nats.credentials",
                        "set either token, or user and password",
                    ));
                }
            }
            batching(
                errors,
                "spec.sink.nats",
                ("maxBatchMessages", nats.max_batch_messages, 10000),
                nats.linger_ms,
                nats.timeout_seconds,
            );
        }
        for (field, source) in self.references() {
            if source.secret_key_ref.is_some() == source.env.is_some() {
                errors.push(err(&field, "set exactly one of secretKeyRef and env"));
            }
        }
    }
}

/// The batch size, linger and timeout rules every batching sink shares.
fn batching(
    errors: &mut Vec<FieldError>,
    at: &str,
    (size_field, size, max_size): (&str, u32, u32),
    linger_ms: u32,
    timeout_seconds: u32,
) {
    if !(1..=max_size).contains(&size) {
        errors.push(err(
            &format!("{at}.{size_field}"),
            format!("must be between 1 and {max_size}"),
        ));
    }
    if linger_ms > 10000 {
        errors.push(err(&format!("{at}.lingerMs"), "must be at most 10000"));
    }
    if !(1..=300).contains(&timeout_seconds) {
        errors.push(err(
            &format!("{at}.timeoutSeconds"),
            "must be between 1 and 300",
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(sink: serde_json::Value) -> Vec<String> {
        let sink: SinkSpec = serde_json::from_value(sink).unwrap();
        let mut errors = Vec::new();
        sink.validate(&mut errors);
        errors.into_iter().map(|e| e.field).collect()
    }

    #[test]
    fn exactly_one_sink_is_required() {
        assert_eq!(fields(serde_json::json!({})), ["spec.sink"]);
        assert_eq!(
            fields(serde_json::json!({"log": {}, "kinesis": {"streamName": "s"}})),
            ["spec.sink"]
        );
        assert!(fields(serde_json::json!({"kinesis": {"streamName": "s"}})).is_empty());
    }

    #[test]
    fn kinesis_and_nats_settings_are_checked_field_by_field() {
        assert_eq!(
            fields(
                serde_json::json!({"kinesis": {"streamName": "no spaces", "maxBatchRecords": 501}})
            ),
            [
                "spec.sink.kinesis.streamName",
                "spec.sink.kinesis.maxBatchRecords"
            ]
        );
        assert_eq!(
            fields(serde_json::json!({"nats": {
                "url": "nats://user:pw@nats:4222", "subject": "feeds.>",
                "credentials": {"token": {"env": "T"}, "user": {"env": "U"}}
            }})),
            [
                "spec.sink.nats.url",
                "spec.sink.nats.subject",
                "spec.sink.nats.credentials"
            ]
        );
        assert!(
            fields(serde_json::json!({"nats": {
                "url": "tls://nats.example:4222", "subject": "feeds.audio",
                "credentials": {"user": {"env": "U"}, "password": {"secretKeyRef": {"name": "n", "key": "p"}}}
            }}))
            .is_empty()
        );
    }
}
