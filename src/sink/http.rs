//! The HTTP sink: POST a JSON batch; 2xx acknowledges it.
//!
//! The fenced signal of the sink contract is HTTP 409 *with* the response
//! header `Tether-Fenced: true`: "a newer owner (a higher token) has delivered
//! for this stream". A plain 409 (many sinks answer it for a duplicate, normal
//! after a replay) is an ordinary delivery error and is retried.

use super::batch::{Batch, Batching, SinkError};
use super::encode::batch_json;
use crate::crd::{DataFormat, HttpSinkSpec};

/// Response header that, with HTTP 409, means "a newer owner exists".
pub const FENCED_HEADER: &str = "tether-fenced";

pub struct HttpSink {
    client: reqwest::Client,
    url: String,
    pub batching: Batching,
    pub data_format: DataFormat,
}

impl HttpSink {
    pub fn new(client: reqwest::Client, spec: &HttpSinkSpec) -> Self {
        Self {
            client,
            url: spec.url.clone(),
            batching: Batching::new(
                spec.max_batch_messages,
                spec.linger_ms,
                spec.timeout_seconds,
            ),
            data_format: spec.data_format,
        }
    }

    pub async fn deliver(&self, batch: &Batch<'_>) -> Result<(), SinkError> {
        let mut headers = reqwest::header::HeaderMap::new();
        crate::telemetry::inject_http(&mut headers);
        // A session's batch is its body already (`Sink::new_batch`, sealed
        // by the delivery); any other is written out here.
        let body = match batch.messages.body() {
            Some(body) => reqwest::Body::from(body.clone()),
            None => batch_json(batch, self.data_format).into(),
        };
        let response = self
            .client
            .post(&self.url)
            .timeout(self.batching.timeout)
            .headers(headers)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| SinkError::Transport(root_cause(&e)))?;
        let fenced = response
            .headers()
            .get(FENCED_HEADER)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("true"));
        match response.status().as_u16() {
            200..=299 => Ok(()),
            409 if fenced => Err(SinkError::Fenced),
            status => Err(SinkError::Status { status }),
        }
    }
}

use crate::lease::root_cause;
