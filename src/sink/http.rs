//! The HTTP sink: POST a JSON batch; 2xx acknowledges it.

use super::{Batch, SinkError};
use crate::crd::HttpSinkSpec;
use std::time::Duration;

pub struct HttpSink {
    client: reqwest::Client,
    url: String,
    max_batch: usize,
    linger: Duration,
    timeout: Duration,
}

impl HttpSink {
    pub fn new(client: reqwest::Client, spec: &HttpSinkSpec) -> Self {
        Self {
            client,
            url: spec.url.clone(),
            max_batch: spec.max_batch_messages.max(1) as usize,
            linger: Duration::from_millis(spec.linger_ms.into()),
            timeout: Duration::from_secs(spec.timeout_seconds.max(1).into()),
        }
    }

    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    pub fn linger(&self) -> Duration {
        self.linger
    }

    pub async fn deliver(&self, batch: &Batch<'_>) -> Result<(), SinkError> {
        let response = self
            .client
            .post(&self.url)
            .timeout(self.timeout)
            .json(batch)
            .send()
            .await
            .map_err(|e| SinkError::Transport(root_cause(&e)))?;
        match response.status().as_u16() {
            200..=299 => Ok(()),
            409 => Err(SinkError::Fenced),
            status => Err(SinkError::Status { status }),
        }
    }
}

fn root_cause(err: &(dyn std::error::Error + 'static)) -> String {
    let mut current = err;
    while let Some(next) = current.source() {
        current = next;
    }
    current.to_string()
}
