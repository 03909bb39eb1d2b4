//! The NATS JetStream sink: every message of a batch is published (pipelined),
//! then every acknowledgement awaited in order. `Nats-Msg-Id` is
//! `namespace/name:seq`, so a message published again after a failover or a
//! retry falls inside JetStream's duplicate window and is stored once.
//!
//! A message without an acknowledgement and everything after it are refused
//! ([`SinkError::Partial`]); the delivery loop advances the checkpoint over
//! the acknowledged prefix and publishes the rest again, in order.

use super::batch::{Batch, Batching, SinkError};
use super::clients::{NatsAuth, SinkClients};
use crate::crd::{HeaderValueSource, NatsSinkSpec};
use async_nats::HeaderMap;
use async_nats::jetstream;
use std::sync::Arc;

/// Headers each message carries besides `Nats-Msg-Id`.
pub const CONNECTION_HEADER: &str = "Tether-Connection";
pub const WORKER_HEADER: &str = "Tether-Worker";
pub const TOKEN_HEADER: &str = "Tether-Token";
pub const SEQ_HEADER: &str = "Tether-Seq";

pub struct NatsSink {
    clients: Arc<SinkClients>,
    /// The shared connection, looked up once per session, not per batch,
    /// and again after a delivery failed (the server may have moved: see
    /// `SinkClients::nats`).
    client: std::sync::Mutex<Option<async_nats::Client>>,
    namespace: String,
    /// Built once: every message of every batch is published to it.
    subject: async_nats::Subject,
    spec: NatsSinkSpec,
    pub batching: Batching,
}

impl NatsSink {
    pub fn new(clients: Arc<SinkClients>, namespace: &str, spec: &NatsSinkSpec) -> Self {
        Self {
            clients,
            client: std::sync::Mutex::new(None),
            namespace: namespace.to_string(),
            subject: async_nats::Subject::from(spec.subject.as_str()),
            spec: spec.clone(),
            batching: Batching::new(
                spec.max_batch_messages,
                spec.linger_ms,
                spec.timeout_seconds,
            ),
        }
    }

    async fn connect(&self) -> Result<async_nats::Client, SinkError> {
        let refs = serde_json::to_string(&self.spec.credentials).unwrap_or_default();
        let auth = async {
            let Some(c) = &self.spec.credentials else {
                return Ok(NatsAuth::None);
            };
            let resolve = |source: &Option<HeaderValueSource>, field: &str| {
                let source = source.clone();
                let field = field.to_string();
                async move {
                    match source {
                        Some(s) => self
                            .clients
                            .secrets
                            .resolve(&self.namespace, &s)
                            .await
                            .map_err(|e| format!("sink.nats.credentials.{field}: {e}")),
                        None => Err(format!("sink.nats.credentials.{field} is not set")),
                    }
                }
            };
            if c.token.is_some() {
                Ok(NatsAuth::Token(resolve(&c.token, "token").await?))
            } else {
                Ok(NatsAuth::UserPassword(
                    resolve(&c.user, "user").await?,
                    resolve(&c.password, "password").await?,
                ))
            }
        };
        self.clients
            .nats(&self.spec.url, &self.namespace, &refs, auth)
            .await
            .map_err(SinkError::Refused)
    }

    pub async fn deliver(&self, batch: &Batch<'_>) -> Result<(), SinkError> {
        let cached = crate::support::lock(&self.client).clone();
        let client = match cached {
            Some(client) => client,
            None => {
                let client = self.connect().await?;
                *crate::support::lock(&self.client) = Some(client.clone());
                client
            }
        };
        let mut js = jetstream::new(client);
        js.set_timeout(self.batching.timeout);
        let total = batch.messages.len();
        let mut pending = Vec::with_capacity(total);
        let mut refused = None;
        for m in batch.messages {
            let mut headers = HeaderMap::new();
            headers.insert(
                async_nats::header::NATS_MESSAGE_ID,
                format!("{}:{}", batch.connection, m.seq).as_str(),
            );
            if let Some(stream) = &self.spec.stream {
                headers.insert(async_nats::header::NATS_EXPECTED_STREAM, stream.as_str());
            }
            headers.insert(CONNECTION_HEADER, batch.connection);
            headers.insert(WORKER_HEADER, batch.worker);
            headers.insert(TOKEN_HEADER, batch.token.to_string().as_str());
            headers.insert(SEQ_HEADER, m.seq.to_string().as_str());
            crate::telemetry::inject_nats(&mut headers);
            match js
                .publish_with_headers(
                    self.subject.clone(),
                    headers,
                    bytes::Bytes::copy_from_slice(m.data.as_bytes()),
                )
                .await
            {
                Ok(ack) => pending.push(ack),
                Err(e) => {
                    refused = Some(e.to_string());
                    break;
                }
            }
        }
        let mut acked = 0;
        for ack in pending {
            match ack.await {
                Ok(_) if refused.is_none() => acked += 1,
                Ok(_) => {}
                Err(e) => {
                    refused.get_or_insert_with(|| e.to_string());
                }
            }
        }
        let Some(detail) = refused else {
            return Ok(());
        };
        let detail = format!("NATS {}: {detail}", self.spec.subject);
        if acked == 0 {
            // Nothing got through: look the server up again next time.
            *crate::support::lock(&self.client) = None;
            return Err(SinkError::Transport(detail));
        }
        Err(SinkError::Partial {
            failed: (acked..total).collect(),
            total,
            detail,
        })
    }
}
