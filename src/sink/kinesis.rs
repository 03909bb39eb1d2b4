//! The Kinesis sink: PutRecords, one record per message, partition key = the
//! stream's `namespace/name` so a stream's records stay in order on one shard.
//!
//! Kinesis accepts or refuses each record of a call on its own. Refused
//! records (throttling, internal errors) come back as a
//! [`SinkError::Partial`] naming exactly those, and the delivery loop retries
//! only them, in their order, after advancing the checkpoint over the
//! accepted prefix. A whole-call failure refuses every record.

use super::batch::{Batch, Batching, SinkError};
use super::clients::SinkClients;
use super::encode::record_json;
use crate::crd::{DataFormat, KinesisSinkSpec};
use aws_sdk_kinesis::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_kinesis::primitives::Blob;
use aws_sdk_kinesis::types::PutRecordsRequestEntry;
use std::sync::Arc;

/// Largest PutRecords request Kinesis takes (data and partition keys).
const MAX_REQUEST_BYTES: usize = 5 * 1024 * 1024;
/// Largest record Kinesis takes (data and partition key).
const MAX_RECORD_BYTES: usize = 1024 * 1024;
/// Error codes that mean "slow down", for metrics and status.
const THROTTLING: &[&str] = &[
    "ProvisionedThroughputExceededException",
    "KMSThrottlingException",
    "LimitExceededException",
    "ThrottlingException",
];

pub struct KinesisSink {
    clients: Arc<SinkClients>,
    /// The region's shared client, looked up once per session, not per batch.
    client: tokio::sync::OnceCell<aws_sdk_kinesis::Client>,
    stream_name: String,
    region: Option<String>,
    pub batching: Batching,
    pub data_format: DataFormat,
}

impl KinesisSink {
    pub fn new(clients: Arc<SinkClients>, spec: &KinesisSinkSpec) -> Self {
        Self {
            clients,
            client: tokio::sync::OnceCell::new(),
            stream_name: spec.stream_name.clone(),
            region: spec.region.clone(),
            batching: Batching::new(
                spec.max_batch_records.min(crate::crd::KINESIS_MAX_RECORDS),
                spec.linger_ms,
                spec.timeout_seconds,
            ),
            data_format: spec.data_format,
        }
    }

    pub async fn deliver(&self, batch: &Batch<'_>) -> Result<(), SinkError> {
        let client = self
            .client
            .get_or_init(|| self.clients.kinesis(self.region.as_deref()))
            .await;
        let mut sizes = Vec::with_capacity(batch.messages.len());
        let mut entries = Vec::with_capacity(batch.messages.len());
        for m in batch.messages {
            let data = record_json(batch, &m, self.data_format);
            let size = data.len() + batch.connection.len();
            if size > MAX_RECORD_BYTES {
                // Never dropped: the stream stops here, its status says why.
                return Err(SinkError::Refused(format!(
                    "message {} is {} bytes as a record, over Kinesis's 1 MiB; lower spec.limits.maxMessageBytes",
                    m.seq,
                    data.len()
                )));
            }
            sizes.push(size);
            entries.push(
                PutRecordsRequestEntry::builder()
                    .data(Blob::new(data))
                    .partition_key(batch.connection)
                    .build()
                    .map_err(|e| SinkError::Refused(e.to_string()))?,
            );
        }
        let mut entries = entries.into_iter();
        let mut failed = Vec::new();
        let mut detail = String::new();
        let mut start = 0;
        for end in request_ends(&sizes) {
            if !failed.is_empty() {
                // Order: nothing after a refused record is sent before it.
                failed.extend(start..end);
                start = end;
                continue;
            }
            let request: Vec<_> = entries.by_ref().take(end - start).collect();
            let call = client
                .put_records()
                .stream_name(&self.stream_name)
                .set_records(Some(request))
                .send();
            let output = match tokio::time::timeout(self.batching.timeout, call).await {
                Err(_) => Err(SinkError::Transport(format!(
                    "Kinesis PutRecords gave no answer within {:?}",
                    self.batching.timeout
                ))),
                Ok(Err(e)) => Err(call_error(&e)),
                Ok(Ok(output)) => Ok(output),
            };
            match output {
                Err(e) if start == 0 => return Err(e),
                Err(e) => {
                    detail = e.to_string();
                    failed.extend(start..end);
                }
                Ok(output) => {
                    for (i, entry) in output.records().iter().enumerate() {
                        if let Some(code) = entry.error_code() {
                            if detail.is_empty() {
                                detail = format!(
                                    "{code}: {}",
                                    entry.error_message().unwrap_or_default()
                                );
                            }
                            failed.push(start + i);
                        }
                    }
                }
            }
            start = end;
        }
        if failed.is_empty() {
            return Ok(());
        }
        let throttled = THROTTLING.iter().any(|code| detail.starts_with(code));
        if failed.len() == sizes.len() {
            return Err(if throttled {
                SinkError::Throttled(detail)
            } else {
                SinkError::Refused(detail)
            });
        }
        Err(SinkError::Partial {
            failed,
            total: sizes.len(),
            detail,
        })
    }
}

/// Splits records (their sizes: data and partition key) into PutRecords
/// requests within Kinesis's request size; returns each request's end.
fn request_ends(sizes: &[usize]) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut bytes = 0;
    for (i, &size) in sizes.iter().enumerate() {
        if bytes + size > MAX_REQUEST_BYTES && bytes > 0 {
            ends.push(i);
            bytes = 0;
        }
        bytes += size;
    }
    ends.push(sizes.len());
    ends
}

fn call_error<E, R>(e: &SdkError<E, R>) -> SinkError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    match e {
        SdkError::ServiceError(service) => {
            let code = service.err().code().unwrap_or("unknown");
            let message = format!("{code}: {}", service.err().message().unwrap_or_default());
            if THROTTLING.contains(&code) {
                SinkError::Throttled(message)
            } else {
                SinkError::Refused(message)
            }
        }
        other => SinkError::Transport(format!("Kinesis: {}", DisplayErrorContext(other))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_stay_within_five_mebibytes_and_keep_every_record() {
        assert_eq!(request_ends(&[2 * 1024 * 1024 + 10; 5]), [2, 4, 5]);
        assert_eq!(request_ends(&[20; 3]), [3]);
    }
}
