//! DynamoDB implementation of the lease store (also what dynoxide and dynalite serve).

use super::retry::RetryPolicy;
use super::{
    AcquireOutcome, DesiredState, DesiredStream, Lease, OwnerWrite, STREAM_PK_PREFIX,
    SessionStatus, StoreError, StreamKey, StreamRecord, UpsertOutcome, expiry_from, now_ms,
};
use crate::metrics::StoreMetrics;
use aws_config::BehaviorVersion;
use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_credential_types::Credentials;
use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::config::Region;
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, GlobalSecondaryIndex, IndexStatus,
    KeySchemaElement, KeyType, Projection, ProjectionType, ReturnConsumedCapacity, ReturnValue,
    ScalarAttributeType, TableStatus,
};
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Name of the GSI over `desired_state` / `lease_expires_at_ms` (seed schema).
pub const TABLE_GSI: &str = "by_state";

/// Attribute names of the seed-compatible schema; renaming any of them breaks users.
mod attr {
    pub const PK: &str = "Pk";
    pub const DESIRED_STATE: &str = "desired_state";
    pub const WS_URL: &str = "ws_url";
    pub const LEASE_OWNER: &str = "lease_owner";
    pub const LEASE_EXPIRES_AT_MS: &str = "lease_expires_at_ms";
    pub const LAST_SEQ: &str = "last_seq";
    pub const LEASE_COUNTER: &str = "lease_counter";
    pub const SPEC: &str = "spec";
    pub const GENERATION: &str = "generation";
    // Added by tether (new attributes are allowed by the schema contract).
    pub const PHASE: &str = "phase";
    pub const STATUS_REASON: &str = "status_reason";
    pub const STATUS_MESSAGE: &str = "status_message";
    pub const CONNECTED_SINCE_MS: &str = "connected_since_ms";
    pub const RECONNECTS: &str = "reconnects";
    pub const RELEASED_AT_MS: &str = "released_at_ms";
    pub const CREATED_AT_MS: &str = "created_at_ms";
}

/// Partition key prefix of worker membership items.
pub const MEMBER_PK_PREFIX: &str = "WORKER#";
/// The `by_state` partition holding membership items (never STARTED/STOPPED, so
/// the orphan query never sees them).
pub const MEMBER_PARTITION: &str = "WORKER";
/// Attribute of a membership item: streams the worker held at its last heartbeat.
const MEMBER_HELD: &str = "held_streams";
/// Attribute of a membership item: when it was last written.
const MEMBER_HEARTBEAT_AT_MS: &str = "heartbeat_at_ms";

/// A live worker as its membership item describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub id: String,
    pub held: u64,
    /// When the worker last wrote its item (wall-clock ms).
    pub heartbeat_at_ms: u64,
}

/// How an acquire that keeps losing the counter race gives up for this round.
const MAX_ACQUIRE_ATTEMPTS: usize = 3;
/// How long `table create` waits for the table and its index to become ACTIVE.
const TABLE_ACTIVE_TIMEOUT: Duration = Duration::from_secs(300);
/// Per-attempt timeout of one DynamoDB request (the retry deadline bounds the call).
pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

/// Where and how to reach the table.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub table: String,
    /// Explicit endpoint (the embedded store). Without it the SDK's own resolution
    /// applies: `AWS_ENDPOINT_URL_DYNAMODB`, `AWS_ENDPOINT_URL`, then AWS itself.
    pub endpoint: Option<String>,
    pub region: Option<String>,
    /// Fixed credentials, used only for the embedded store, which ignores them.
    pub static_credentials: Option<(String, String)>,
    pub retry: RetryPolicy,
    pub attempt_timeout: Duration,
    /// Page size for queries and scans; `None` lets DynamoDB pick (1 MB pages).
    pub page_size: Option<i32>,
}

impl StoreConfig {
    pub fn new(table: impl Into<String>) -> Self {
        Self {
            table: table.into(),
            endpoint: None,
            region: None,
            static_credentials: None,
            retry: RetryPolicy::default(),
            attempt_timeout: DEFAULT_ATTEMPT_TIMEOUT,
            page_size: None,
        }
    }

    /// A DynamoDB-compatible server on this machine (the embedded store,
    /// dynalite): it checks neither credentials nor region, so fixed ones are used.
    pub fn local(table: impl Into<String>, endpoint: impl Into<String>) -> Self {
        let (id, secret) = crate::embedded::EMBEDDED_CREDENTIALS;
        Self {
            endpoint: Some(endpoint.into()),
            region: Some("us-east-1".into()),
            static_credentials: Some((id.into(), secret.into())),
            ..Self::new(table)
        }
    }
}

/// The lease store. Cheap to clone; every clone shares one HTTP client.
#[derive(Clone)]
pub struct LeaseStore {
    client: Client,
    table: String,
    endpoint: String,
    retry: RetryPolicy,
    page_size: Option<i32>,
    metrics: Arc<StoreMetrics>,
    /// Whether the latest request got an answer from DynamoDB (for readiness).
    reachable: Arc<AtomicBool>,
}

/// A conditional write whose condition did not hold.
struct ConditionFailed;

enum Class {
    Condition,
    Transient(StoreError),
    Fatal(StoreError),
}

/// DynamoDB's own table-name rule, checked before any request is sent.
pub fn validate_table_name(name: &str) -> Result<(), StoreError> {
    let ok = (3..=255).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if ok {
        Ok(())
    } else {
        Err(StoreError::InvalidTableName(name.to_string()))
    }
}

fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

fn n(v: impl ToString) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

impl LeaseStore {
    /// Builds the client. No request is sent; [`LeaseStore::check_table`] verifies reachability.
    pub async fn connect(cfg: StoreConfig, metrics: Arc<StoreMetrics>) -> Result<Self, StoreError> {
        validate_table_name(&cfg.table)?;
        crate::install_crypto_provider();
        let http = aws_smithy_http_client::Builder::new()
            .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
                aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
            ))
            .build_https();
        let env_endpoint = std::env::var("AWS_ENDPOINT_URL_DYNAMODB")
            .or_else(|_| std::env::var("AWS_ENDPOINT_URL"))
            .ok()
            .filter(|e| !e.is_empty());
        let endpoint = cfg.endpoint.clone().or(env_endpoint);
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .http_client(http)
            .retry_config(RetryConfig::disabled())
            .timeout_config(
                TimeoutConfig::builder()
                    .connect_timeout(cfg.attempt_timeout)
                    .operation_attempt_timeout(cfg.attempt_timeout)
                    .build(),
            );
        if let Some(ep) = &cfg.endpoint {
            loader = loader.endpoint_url(ep);
        }
        if let Some(region) = &cfg.region {
            loader = loader.region(Region::new(region.clone()));
        }
        if let Some((id, secret)) = &cfg.static_credentials {
            loader = loader.credentials_provider(Credentials::new(
                id.clone(),
                secret.clone(),
                None,
                None,
                "tether-static",
            ));
        }
        let sdk = loader.load().await;
        let mut builder = aws_sdk_dynamodb::config::Builder::from(&sdk);
        let region = match sdk.region() {
            Some(r) => r.to_string(),
            // A local endpoint ignores the region, so do not make users invent one.
            None if endpoint.is_some() => {
                builder = builder.region(Region::new("us-east-1"));
                "us-east-1".to_string()
            }
            None => return Err(StoreError::NoRegion),
        };
        let endpoint =
            endpoint.unwrap_or_else(|| format!("https://dynamodb.{region}.amazonaws.com"));
        Ok(Self {
            client: Client::from_conf(builder.build()),
            table: cfg.table,
            endpoint,
            retry: cfg.retry,
            page_size: cfg.page_size,
            metrics,
            reachable: Arc::new(AtomicBool::new(true)),
        })
    }

    /// A flag that is `false` while the latest DynamoDB request failed to get a
    /// usable answer (timeout, refused connection, bad credentials, throttling).
    pub fn reachability(&self) -> Arc<AtomicBool> {
        self.reachable.clone()
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Runs one request with jittered retries of transient failures inside the deadline.
    async fn call<T, E, Fut>(
        &self,
        operation: &'static str,
        key: Option<&StreamKey>,
        mut send: impl FnMut() -> Fut,
    ) -> Result<Result<T, ConditionFailed>, StoreError>
    where
        Fut: Future<Output = Result<T, SdkError<E, aws_smithy_runtime_api::http::Response>>>,
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            let sent = Instant::now();
            let result = send().await;
            let elapsed = sent.elapsed();
            let error = match result {
                Ok(v) => {
                    self.metrics.observe(operation, "ok", elapsed);
                    self.reachable.store(true, Ordering::SeqCst);
                    return Ok(Ok(v));
                }
                Err(err) => err,
            };
            match self.classify(operation, key, error) {
                Class::Condition => {
                    self.metrics.observe(operation, "condition_failed", elapsed);
                    self.reachable.store(true, Ordering::SeqCst);
                    return Ok(Err(ConditionFailed));
                }
                Class::Fatal(e) => {
                    self.metrics.observe(operation, e.category(), elapsed);
                    let usable = matches!(
                        e,
                        StoreError::ItemTooLarge { .. } | StoreError::Rejected { .. }
                    );
                    self.reachable.store(usable, Ordering::SeqCst);
                    return Err(e);
                }
                Class::Transient(e) => {
                    self.metrics.observe(operation, e.category(), elapsed);
                    self.reachable.store(false, Ordering::SeqCst);
                    let delay = self.retry.delay(attempt);
                    if started.elapsed() + delay >= self.retry.deadline {
                        return Err(e);
                    }
                    tracing::debug!(operation, attempt, error = %e, "retrying DynamoDB call");
                    tokio::time::sleep(delay).await;
                    attempt += 1;
                }
            }
        }
    }

    fn classify<E>(
        &self,
        operation: &'static str,
        key: Option<&StreamKey>,
        err: SdkError<E, aws_smithy_runtime_api::http::Response>,
    ) -> Class
    where
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        let unreachable = |detail: String| StoreError::Unreachable {
            endpoint: self.endpoint.clone(),
            detail,
        };
        match &err {
            SdkError::ServiceError(ctx) => {
                let code = ctx.err().code().unwrap_or_default().to_string();
                let message = ctx.err().message().unwrap_or_default().to_string();
                let status = ctx.raw().status().as_u16();
                match code.as_str() {
                    "ConditionalCheckFailedException" => Class::Condition,
                    "ResourceNotFoundException" => Class::Fatal(StoreError::TableNotFound {
                        table: self.table.clone(),
                    }),
                    "ProvisionedThroughputExceededException"
                    | "ThrottlingException"
                    | "RequestLimitExceeded" => Class::Transient(StoreError::Throttled {
                        operation,
                        detail: format!("{code}: {message}"),
                    }),
                    "UnrecognizedClientException"
                    | "InvalidSignatureException"
                    | "MissingAuthenticationTokenException"
                    | "IncompleteSignatureException"
                    | "ExpiredTokenException"
                    | "AccessDeniedException" => {
                        Class::Fatal(StoreError::Credentials(format!("{code}: {message}")))
                    }
                    "ValidationException" if message.contains("Item size") => {
                        Class::Fatal(StoreError::ItemTooLarge {
                            key: key.map(ToString::to_string).unwrap_or_default(),
                        })
                    }
                    _ if status >= 500 => {
                        Class::Transient(unreachable(format!("HTTP {status} {code}: {message}")))
                    }
                    _ => Class::Fatal(StoreError::Rejected {
                        operation,
                        detail: format!("{code}: {message}"),
                    }),
                }
            }
            SdkError::TimeoutError(_) => Class::Transient(unreachable("request timed out".into())),
            SdkError::DispatchFailure(_)
            | SdkError::ResponseError(_)
            | SdkError::ConstructionFailure(_) => {
                let full = DisplayErrorContext(&err).to_string();
                if full.contains("credentials") {
                    Class::Fatal(StoreError::Credentials(
                        "no usable credentials from the default chain (environment, profile, web identity, container, instance metadata)".into(),
                    ))
                } else if matches!(err, SdkError::ConstructionFailure(_)) {
                    Class::Fatal(StoreError::Rejected {
                        operation,
                        detail: root_cause(&err),
                    })
                } else {
                    Class::Transient(unreachable(root_cause(&err)))
                }
            }
            _ => Class::Fatal(StoreError::Rejected {
                operation,
                detail: DisplayErrorContext(&err).to_string(),
            }),
        }
    }

    fn record_write_capacity(
        &self,
        operation: &'static str,
        consumed: Option<&aws_sdk_dynamodb::types::ConsumedCapacity>,
    ) {
        if let Some(units) = consumed.and_then(|c| c.capacity_units()) {
            self.metrics.consumed_write_units(operation, units);
        }
    }

    // ---- table management -------------------------------------------------

    /// Creates the table and its GSI (on-demand billing) if missing, and waits
    /// until both are ACTIVE. Returns `true` when this call created the table.
    pub async fn create_table(&self) -> Result<bool, StoreError> {
        let key = |name: &str, kind: KeyType| {
            KeySchemaElement::builder()
                .attribute_name(name)
                .key_type(kind)
                .build()
                .expect("key schema fields are set") // both required fields are set above
        };
        let def = |name: &str, t: ScalarAttributeType| {
            AttributeDefinition::builder()
                .attribute_name(name)
                .attribute_type(t)
                .build()
                .expect("attribute definition fields are set")
        };
        let gsi = GlobalSecondaryIndex::builder()
            .index_name(TABLE_GSI)
            .key_schema(key(attr::DESIRED_STATE, KeyType::Hash))
            .key_schema(key(attr::LEASE_EXPIRES_AT_MS, KeyType::Range))
            .projection(
                Projection::builder()
                    .projection_type(ProjectionType::All)
                    .build(),
            )
            .build()
            .expect("GSI fields are set");
        let request = self
            .client
            .create_table()
            .table_name(&self.table)
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(def(attr::PK, ScalarAttributeType::S))
            .attribute_definitions(def(attr::DESIRED_STATE, ScalarAttributeType::S))
            .attribute_definitions(def(attr::LEASE_EXPIRES_AT_MS, ScalarAttributeType::N))
            .key_schema(key(attr::PK, KeyType::Hash))
            .global_secondary_indexes(gsi);
        let created = match request.clone().send().await {
            Ok(_) => true,
            Err(err) if err.code() == Some("ResourceInUseException") => false,
            Err(err) => match self.classify("create_table", None, err) {
                Class::Fatal(e) | Class::Transient(e) => return Err(e),
                Class::Condition => false,
            },
        };
        self.wait_active().await?;
        Ok(created)
    }

    /// Confirms the table exists, is usable and has the `by_state` index.
    pub async fn check_table(&self) -> Result<(), StoreError> {
        let (table_active, gsi) = self.describe().await?;
        if gsi.is_none() {
            return Err(StoreError::Rejected {
                operation: "describe_table",
                detail: format!(
                    "table '{}' has no GSI '{TABLE_GSI}'; it was not created by `tether table create`",
                    self.table
                ),
            });
        }
        if !table_active {
            tracing::warn!(table = %self.table, "table is not ACTIVE yet");
        }
        Ok(())
    }

    /// `(table is ACTIVE, GSI status if the GSI exists)`.
    async fn describe(&self) -> Result<(bool, Option<bool>), StoreError> {
        let out = self
            .call("describe_table", None, || {
                self.client.describe_table().table_name(&self.table).send()
            })
            .await?
            .map_err(|_| StoreError::TableNotFound {
                table: self.table.clone(),
            })?;
        let table = out.table();
        let active = table.and_then(|t| t.table_status()) == Some(&TableStatus::Active);
        let gsi = table
            .map(|t| t.global_secondary_indexes())
            .unwrap_or_default()
            .iter()
            .find(|g| g.index_name() == Some(TABLE_GSI))
            // dynalite and some emulators omit the index status: treat it as ACTIVE.
            .map(|g| matches!(g.index_status(), None | Some(IndexStatus::Active)));
        Ok((active, gsi))
    }

    async fn wait_active(&self) -> Result<(), StoreError> {
        let started = Instant::now();
        loop {
            match self.describe().await? {
                (true, Some(true)) => return Ok(()),
                (_, None) if started.elapsed() > Duration::from_secs(5) => {
                    return self.check_table().await;
                }
                _ if started.elapsed() > TABLE_ACTIVE_TIMEOUT => {
                    return Err(StoreError::Rejected {
                        operation: "create_table",
                        detail: format!("table '{}' did not become ACTIVE in time", self.table),
                    });
                }
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    // ---- reads ---------------------------------------------------------------

    /// One stream, strongly consistent.
    pub async fn get(&self, key: &StreamKey) -> Result<Option<StreamRecord>, StoreError> {
        let out = self
            .call("get_item", Some(key), || {
                self.client
                    .get_item()
                    .table_name(&self.table)
                    .key(attr::PK, s(key.pk()))
                    .consistent_read(true)
                    .send()
            })
            .await?
            .map_err(|_| self.unexpected_condition("get_item"))?;
        out.item().map(|item| self.parse(item)).transpose()
    }

    /// Every stream item (a paginated scan; for the CLI, not for hot paths).
    pub async fn list(&self) -> Result<Vec<StreamRecord>, StoreError> {
        let mut records = Vec::new();
        let mut start: Option<HashMap<String, AttributeValue>> = None;
        loop {
            let out = self
                .call("scan", None, || {
                    self.client
                        .scan()
                        .table_name(&self.table)
                        .filter_expression("begins_with(#pk, :prefix)")
                        .expression_attribute_names("#pk", attr::PK)
                        .expression_attribute_values(":prefix", s(STREAM_PK_PREFIX))
                        .set_exclusive_start_key(start.clone())
                        .set_limit(self.page_size)
                        .send()
                })
                .await?
                .map_err(|_| self.unexpected_condition("scan"))?;
            for item in out.items() {
                records.push(self.parse(item)?);
            }
            match out.last_evaluated_key() {
                Some(k) if !k.is_empty() => start = Some(k.clone()),
                _ => break,
            }
        }
        records.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(records)
    }

    /// STARTED streams whose lease lapsed before `now_ms` (including never-owned and
    /// released ones, whose expiry is 0), across all pages of the `by_state` index.
    ///
    /// The index is eventually consistent: treat the result as candidates; the
    /// acquire's condition is what decides.
    pub async fn orphans(&self, now_ms: u64) -> Result<Vec<StreamRecord>, StoreError> {
        let items = self
            .query_by_state(
                "query_orphans",
                DesiredState::Started.as_str(),
                "lease_expires_at_ms < :now",
                now_ms,
            )
            .await?;
        items.iter().map(|item| self.parse(item)).collect()
    }

    /// Every item of one `by_state` partition whose expiry satisfies
    /// `expiry_condition` (against `:now`), across all pages.
    async fn query_by_state(
        &self,
        operation: &'static str,
        partition: &str,
        expiry_condition: &str,
        now_ms: u64,
    ) -> Result<Vec<HashMap<String, AttributeValue>>, StoreError> {
        let condition = format!("desired_state = :partition AND {expiry_condition}");
        let mut items = Vec::new();
        let mut start: Option<HashMap<String, AttributeValue>> = None;
        loop {
            let out = self
                .call(operation, None, || {
                    self.client
                        .query()
                        .table_name(&self.table)
                        .index_name(TABLE_GSI)
                        .key_condition_expression(&condition)
                        .expression_attribute_values(":partition", s(partition))
                        .expression_attribute_values(":now", n(now_ms))
                        .set_exclusive_start_key(start.clone())
                        .set_limit(self.page_size)
                        .send()
                })
                .await?
                .map_err(|_| self.unexpected_condition("query"))?;
            items.extend(out.items().iter().cloned());
            match out.last_evaluated_key() {
                Some(k) if !k.is_empty() => start = Some(k.clone()),
                _ => break,
            }
        }
        Ok(items)
    }

    // ---- worker writes ---------------------------------------------------------

    /// Takes the stream if it is STARTED and free, expired, or never owned.
    ///
    /// `observed` is the item as the caller last saw it: the write is a
    /// compare-and-swap on its `lease_counter`, so a retry of an acquire that in
    /// fact succeeded is recognised (the item then shows us as owner with exactly
    /// the counter we wrote) instead of being reported as somebody else's.
    pub async fn acquire(
        &self,
        observed: &StreamRecord,
        owner: &str,
        lease_duration: Duration,
    ) -> Result<AcquireOutcome, StoreError> {
        let key = &observed.key;
        let mut expected = observed.lease_counter;
        for _ in 0..MAX_ACQUIRE_ATTEMPTS {
            let now = now_ms();
            let expires_at_ms = expiry_from(now, lease_duration);
            let counter_guard = if expected == 0 {
                "(attribute_not_exists(lease_counter) OR lease_counter = :expected)"
            } else {
                "lease_counter = :expected"
            };
            let condition = format!(
                "desired_state = :started AND {counter_guard} AND \
                 (attribute_not_exists(lease_owner) OR lease_expires_at_ms < :now)"
            );
            let result = self
                .call("acquire", Some(key), || {
                    self.client
                        .update_item()
                        .table_name(&self.table)
                        .key(attr::PK, s(key.pk()))
                        .update_expression(
                            "SET lease_owner = :me, lease_expires_at_ms = :exp, \
                             lease_counter = :next, phase = :pending \
                             REMOVE status_reason, status_message, connected_since_ms",
                        )
                        .condition_expression(&condition)
                        .expression_attribute_values(":started", s(DesiredState::Started.as_str()))
                        .expression_attribute_values(":expected", n(expected))
                        .expression_attribute_values(":next", n(expected + 1))
                        .expression_attribute_values(":now", n(now))
                        .expression_attribute_values(":me", s(owner))
                        .expression_attribute_values(":exp", n(expires_at_ms))
                        .expression_attribute_values(":pending", s("Pending"))
                        .return_values(ReturnValue::AllNew)
                        .return_consumed_capacity(ReturnConsumedCapacity::Total)
                        .send()
                })
                .await?;
            let current = match result {
                Ok(out) => {
                    self.record_write_capacity("acquire", out.consumed_capacity());
                    let record = self.parse_attrs(key, out.attributes())?;
                    let lease = Lease {
                        key: key.clone(),
                        owner: owner.to_string(),
                        counter: expected + 1,
                        expires_at_ms,
                    };
                    return Ok(AcquireOutcome::Acquired {
                        lease,
                        record: Box::new(record),
                    });
                }
                Err(ConditionFailed) => self.get(key).await?,
            };
            let Some(current) = current else {
                return Ok(AcquireOutcome::Gone);
            };
            if current.lease_owner.as_deref() == Some(owner)
                && current.lease_counter == expected + 1
            {
                let lease = Lease {
                    key: key.clone(),
                    owner: owner.to_string(),
                    counter: current.lease_counter,
                    expires_at_ms: current.lease_expires_at_ms,
                };
                return Ok(AcquireOutcome::Acquired {
                    lease,
                    record: Box::new(current),
                });
            }
            if current.desired_state != DesiredState::Started {
                return Ok(AcquireOutcome::NotStarted);
            }
            if let Some(holder) = current.live_owner(now_ms()) {
                return Ok(AcquireOutcome::Held {
                    owner: holder.to_string(),
                    expires_at_ms: current.lease_expires_at_ms,
                });
            }
            // Free, but the counter moved since we looked: try again with the fresh one.
            expected = current.lease_counter;
        }
        let current = self.get(key).await?;
        Ok(match current {
            None => AcquireOutcome::Gone,
            Some(c) => AcquireOutcome::Held {
                owner: c.lease_owner.unwrap_or_default(),
                expires_at_ms: c.lease_expires_at_ms,
            },
        })
    }

    /// Extends the lease; may carry a checkpoint and the session status in the same
    /// write, so a checkpoint costs no extra write. Returns the renewed lease and the
    /// item after the write (so the owner sees STOPPED or a new generation at once).
    pub async fn renew(
        &self,
        lease: &Lease,
        lease_duration: Duration,
        checkpoint: Option<u64>,
        status: Option<&SessionStatus>,
    ) -> Result<OwnerWrite<(Lease, StreamRecord)>, StoreError> {
        let expires_at_ms = expiry_from(now_ms(), lease_duration);
        let mut set = vec!["lease_expires_at_ms = :exp".to_string()];
        let mut values = vec![(":exp", n(expires_at_ms))];
        push_status(&mut set, &mut values, status);
        let out = self
            .owner_update("renew", lease, set, values, checkpoint)
            .await?;
        Ok(match out {
            OwnerWrite::Done(record) => OwnerWrite::Done((
                Lease {
                    expires_at_ms,
                    ..lease.clone()
                },
                record,
            )),
            OwnerWrite::Lost => OwnerWrite::Lost,
        })
    }

    /// Advances `last_seq` to `seq` (never backwards). Returns the stored value
    /// afterwards, which is at least `seq`.
    pub async fn checkpoint(&self, lease: &Lease, seq: u64) -> Result<OwnerWrite<u64>, StoreError> {
        let out = self
            .owner_update("checkpoint", lease, Vec::new(), Vec::new(), Some(seq))
            .await?;
        Ok(match out {
            OwnerWrite::Done(record) => OwnerWrite::Done(record.last_seq.unwrap_or(seq)),
            OwnerWrite::Lost => OwnerWrite::Lost,
        })
    }

    /// Gives the stream up at once (`lease_expires_at_ms = 0`), keeping `last_seq`
    /// (advanced to `checkpoint` if given), so the next owner resumes where we stopped.
    pub async fn release(
        &self,
        lease: &Lease,
        checkpoint: Option<u64>,
        status: Option<&SessionStatus>,
    ) -> Result<OwnerWrite<()>, StoreError> {
        let mut set = vec![
            "lease_expires_at_ms = :zero".to_string(),
            format!("{} = :released", attr::RELEASED_AT_MS),
        ];
        let mut values = vec![(":zero", n(0)), (":released", n(now_ms()))];
        push_status(&mut set, &mut values, status);
        let out = self
            .owner_update("release", lease, set, values, checkpoint)
            .await?;
        Ok(match out {
            OwnerWrite::Done(_) => OwnerWrite::Done(()),
            OwnerWrite::Lost => OwnerWrite::Lost,
        })
    }

    /// An update guarded by `lease_owner = :me AND lease_counter = :c`, optionally
    /// advancing `last_seq` monotonically. If only the checkpoint guard failed (the
    /// stored value is already past ours) the write is retried without it; if the
    /// ownership guard failed, nothing changed and the outcome is `Lost`.
    async fn owner_update(
        &self,
        operation: &'static str,
        lease: &Lease,
        set: Vec<String>,
        values: Vec<(&'static str, AttributeValue)>,
        checkpoint: Option<u64>,
    ) -> Result<OwnerWrite<StreamRecord>, StoreError> {
        let key = &lease.key;
        let mut checkpoint = checkpoint;
        loop {
            let mut set = set.clone();
            let mut condition = "lease_owner = :me AND lease_counter = :c".to_string();
            if checkpoint.is_some() {
                set.push("last_seq = :seq".into());
                condition.push_str(" AND (attribute_not_exists(last_seq) OR last_seq <= :seq)");
            }
            if set.is_empty() {
                return Ok(OwnerWrite::Lost);
            }
            let update = format!("SET {}", set.join(", "));
            let result = self
                .call(operation, Some(key), || {
                    let mut req = self
                        .client
                        .update_item()
                        .table_name(&self.table)
                        .key(attr::PK, s(key.pk()))
                        .update_expression(&update)
                        .condition_expression(&condition)
                        .expression_attribute_values(":me", s(&lease.owner))
                        .expression_attribute_values(":c", n(lease.counter))
                        .return_values(ReturnValue::AllNew)
                        .return_consumed_capacity(ReturnConsumedCapacity::Total);
                    for (name, value) in &values {
                        req = req.expression_attribute_values(*name, value.clone());
                    }
                    if let Some(seq) = checkpoint {
                        req = req.expression_attribute_values(":seq", n(seq));
                    }
                    req.send()
                })
                .await?;
            match result {
                Ok(out) => {
                    self.record_write_capacity(operation, out.consumed_capacity());
                    return Ok(OwnerWrite::Done(self.parse_attrs(key, out.attributes())?));
                }
                Err(ConditionFailed) => {
                    let current = self.get(key).await?;
                    let ours = current.as_ref().is_some_and(|c| {
                        c.lease_owner.as_deref() == Some(lease.owner.as_str())
                            && c.lease_counter == lease.counter
                    });
                    match (ours, checkpoint) {
                        // Still ours: only the monotonic checkpoint guard failed.
                        (true, Some(_)) if operation == "checkpoint" => {
                            return Ok(OwnerWrite::Done(current.expect("checked above")));
                        }
                        (true, Some(_)) => checkpoint = None,
                        _ => return Ok(OwnerWrite::Lost),
                    }
                }
            }
        }
    }

    // ---- fleet membership ------------------------------------------------------------

    /// Writes this worker's membership item: `WORKER#<id>`, in the `by_state`
    /// index under partition `WORKER` with its expiry as sort key, so live workers
    /// are one cheap query (never a table scan). Only its own worker writes it.
    pub async fn heartbeat_member(
        &self,
        member: &Member,
        lease_duration: Duration,
    ) -> Result<(), StoreError> {
        let expires = expiry_from(now_ms(), lease_duration);
        let out = self
            .call("heartbeat_member", None, || {
                self.client
                    .put_item()
                    .table_name(&self.table)
                    .item(attr::PK, s(format!("{MEMBER_PK_PREFIX}{}", member.id)))
                    .item(attr::DESIRED_STATE, s(MEMBER_PARTITION))
                    .item(attr::LEASE_EXPIRES_AT_MS, n(expires))
                    .item(attr::LEASE_OWNER, s(&member.id))
                    .item(MEMBER_HELD, n(member.held))
                    .item(MEMBER_HEARTBEAT_AT_MS, n(now_ms()))
                    .return_consumed_capacity(ReturnConsumedCapacity::Total)
                    .send()
            })
            .await?
            .map_err(|_| self.unexpected_condition("put_item"))?;
        self.record_write_capacity("heartbeat_member", out.consumed_capacity());
        Ok(())
    }

    /// Removes this worker's membership item (graceful shutdown).
    pub async fn remove_member(&self, id: &str) -> Result<(), StoreError> {
        self.call("remove_member", None, || {
            self.client
                .delete_item()
                .table_name(&self.table)
                .key(attr::PK, s(format!("{MEMBER_PK_PREFIX}{id}")))
                .send()
        })
        .await?
        .map_err(|_| self.unexpected_condition("delete_item"))?;
        Ok(())
    }

    /// Workers whose membership has not lapsed at `now_ms`.
    pub async fn live_members(&self, now_ms: u64) -> Result<Vec<Member>, StoreError> {
        let items = self
            .query_by_state(
                "query_members",
                MEMBER_PARTITION,
                "lease_expires_at_ms > :now",
                now_ms,
            )
            .await?;
        Ok(items
            .iter()
            .filter_map(|item| {
                let id = item.get(attr::LEASE_OWNER)?.as_s().ok()?.clone();
                let held = item
                    .get(MEMBER_HELD)
                    .and_then(|v| v.as_n().ok())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                let heartbeat_at_ms = item
                    .get(MEMBER_HEARTBEAT_AT_MS)
                    .and_then(|v| v.as_n().ok())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                Some(Member {
                    id,
                    held,
                    heartbeat_at_ms,
                })
            })
            .collect())
    }

    // ---- control-plane writes ----------------------------------------------------

    /// Mirrors desired state into the item, creating it if needed. Never touches
    /// `lease_*` or `last_seq`, except that a new item gets `lease_expires_at_ms = 0`
    /// so the orphan query (whose sort key it is) can see it. Monotonic on
    /// `generation`: an older generation never overwrites a newer one.
    pub async fn upsert_desired(
        &self,
        desired: &DesiredStream,
    ) -> Result<UpsertOutcome, StoreError> {
        let key = &desired.key;
        let spec = serde_json::to_string(&desired.spec).map_err(|e| StoreError::Rejected {
            operation: "upsert_desired",
            detail: format!("spec is not serialisable: {e}"),
        })?;
        let result = self
            .call("upsert_desired", Some(key), || {
                self.client
                    .update_item()
                    .table_name(&self.table)
                    .key(attr::PK, s(key.pk()))
                    .update_expression(
                        "SET desired_state = :d, ws_url = :u, spec = :spec, #gen = :g, \
                         lease_expires_at_ms = if_not_exists(lease_expires_at_ms, :zero), \
                         created_at_ms = if_not_exists(created_at_ms, :now)",
                    )
                    .condition_expression("attribute_not_exists(#gen) OR #gen <= :g")
                    .expression_attribute_names("#gen", attr::GENERATION)
                    .expression_attribute_values(":d", s(desired.desired_state.as_str()))
                    .expression_attribute_values(":u", s(&desired.ws_url))
                    .expression_attribute_values(":spec", s(&spec))
                    .expression_attribute_values(":g", n(desired.generation))
                    .expression_attribute_values(":zero", n(0))
                    .expression_attribute_values(":now", n(now_ms()))
                    .return_consumed_capacity(ReturnConsumedCapacity::Total)
                    .send()
            })
            .await?;
        match result {
            Ok(out) => {
                self.record_write_capacity("upsert_desired", out.consumed_capacity());
                Ok(UpsertOutcome::Applied)
            }
            Err(ConditionFailed) => {
                let stored = self
                    .get(key)
                    .await?
                    .map(|r| r.generation)
                    .unwrap_or_default();
                Ok(UpsertOutcome::StaleGeneration { stored })
            }
        }
    }

    /// Removes the item. An owner notices on its next renewal (the guard fails)
    /// and closes its session. Returns whether an item existed.
    pub async fn delete(&self, key: &StreamKey) -> Result<bool, StoreError> {
        let out = self
            .call("delete_item", Some(key), || {
                self.client
                    .delete_item()
                    .table_name(&self.table)
                    .key(attr::PK, s(key.pk()))
                    .return_values(ReturnValue::AllOld)
                    .return_consumed_capacity(ReturnConsumedCapacity::Total)
                    .send()
            })
            .await?
            .map_err(|_| self.unexpected_condition("delete_item"))?;
        self.record_write_capacity("delete_item", out.consumed_capacity());
        Ok(out.attributes().is_some_and(|a| !a.is_empty()))
    }

    fn unexpected_condition(&self, operation: &'static str) -> StoreError {
        StoreError::Rejected {
            operation,
            detail: "unexpected conditional-check failure".into(),
        }
    }

    // ---- parsing ------------------------------------------------------------------

    fn parse_attrs(
        &self,
        key: &StreamKey,
        item: Option<&HashMap<String, AttributeValue>>,
    ) -> Result<StreamRecord, StoreError> {
        match item {
            Some(item) => self.parse(item),
            None => Err(self.malformed(&key.pk(), "write returned no attributes")),
        }
    }

    fn malformed(&self, pk: &str, detail: impl Into<String>) -> StoreError {
        StoreError::Malformed {
            table: self.table.clone(),
            pk: pk.to_string(),
            detail: detail.into(),
        }
    }

    fn parse(&self, item: &HashMap<String, AttributeValue>) -> Result<StreamRecord, StoreError> {
        let get_s = |name: &str| item.get(name).and_then(|v| v.as_s().ok()).cloned();
        let get_n = |name: &str| -> Result<Option<i128>, StoreError> {
            match item.get(name) {
                None | Some(AttributeValue::Null(_)) => Ok(None),
                Some(v) => v
                    .as_n()
                    .ok()
                    .and_then(|s| s.parse::<i128>().ok())
                    .map(Some)
                    .ok_or_else(|| {
                        self.malformed(
                            &get_s(attr::PK).unwrap_or_default(),
                            format!("{name} is not a number"),
                        )
                    }),
            }
        };
        let pk = get_s(attr::PK).ok_or_else(|| self.malformed("?", "missing Pk"))?;
        let key = StreamKey::from_pk(&pk)
            .ok_or_else(|| self.malformed(&pk, "Pk is not CONN#<namespace>/<name>"))?;
        let desired_state = get_s(attr::DESIRED_STATE)
            .as_deref()
            .and_then(DesiredState::parse)
            .ok_or_else(|| self.malformed(&pk, "desired_state is not STARTED or STOPPED"))?;
        // The seed stored `spec` as a string; a map is accepted too.
        let spec = match item.get(attr::SPEC) {
            Some(AttributeValue::S(text)) => serde_json::from_str(text).ok(),
            Some(AttributeValue::M(map)) => Some(attr_map_to_json(map)),
            _ => None,
        };
        let clamp = |v: Option<i128>| v.map(|x| x.clamp(0, u64::MAX as i128) as u64);
        let status = get_s(attr::PHASE).map(|phase| SessionStatus {
            phase,
            reason: get_s(attr::STATUS_REASON),
            message: get_s(attr::STATUS_MESSAGE),
            connected_since_ms: clamp(get_n(attr::CONNECTED_SINCE_MS).unwrap_or(None)),
            reconnects: clamp(get_n(attr::RECONNECTS).unwrap_or(None)).unwrap_or(0),
        });
        Ok(StreamRecord {
            key,
            desired_state,
            ws_url: get_s(attr::WS_URL).unwrap_or_default(),
            spec,
            generation: get_n(attr::GENERATION)?.unwrap_or(0) as i64,
            lease_owner: get_s(attr::LEASE_OWNER),
            lease_expires_at_ms: clamp(get_n(attr::LEASE_EXPIRES_AT_MS)?).unwrap_or(0),
            lease_counter: clamp(get_n(attr::LEASE_COUNTER)?).unwrap_or(0),
            last_seq: clamp(get_n(attr::LAST_SEQ)?),
            released_at_ms: clamp(get_n(attr::RELEASED_AT_MS).unwrap_or(None)),
            created_at_ms: clamp(get_n(attr::CREATED_AT_MS).unwrap_or(None)),
            status,
        })
    }
}

/// The innermost error message: "Connection refused (os error 111)" rather than
/// the SDK's whole chain, so errors stay one readable line.
fn root_cause(err: &(dyn std::error::Error + 'static)) -> String {
    let mut current = err;
    while let Some(next) = current.source() {
        current = next;
    }
    current.to_string()
}

/// Adds the session status attributes to a SET clause.
fn push_status(
    set: &mut Vec<String>,
    values: &mut Vec<(&'static str, AttributeValue)>,
    status: Option<&SessionStatus>,
) {
    let Some(status) = status else { return };
    set.push(format!("{} = :phase", attr::PHASE));
    values.push((":phase", s(&status.phase)));
    set.push(format!("{} = :reconnects", attr::RECONNECTS));
    values.push((":reconnects", n(status.reconnects)));
    // Absent values are written as empty strings / 0 rather than REMOVEd, to keep
    // the update a single SET clause.
    set.push(format!("{} = :reason", attr::STATUS_REASON));
    values.push((":reason", s(status.reason.clone().unwrap_or_default())));
    set.push(format!("{} = :message", attr::STATUS_MESSAGE));
    values.push((":message", s(status.message.clone().unwrap_or_default())));
    set.push(format!("{} = :since", attr::CONNECTED_SINCE_MS));
    values.push((":since", n(status.connected_since_ms.unwrap_or(0))));
}

fn attr_map_to_json(map: &HashMap<String, AttributeValue>) -> serde_json::Value {
    fn one(v: &AttributeValue) -> serde_json::Value {
        match v {
            AttributeValue::S(s) => serde_json::Value::String(s.clone()),
            AttributeValue::N(n) => serde_json::from_str(n).unwrap_or(serde_json::Value::Null),
            AttributeValue::Bool(b) => serde_json::Value::Bool(*b),
            AttributeValue::M(m) => attr_map_to_json(m),
            AttributeValue::L(l) => serde_json::Value::Array(l.iter().map(one).collect()),
            _ => serde_json::Value::Null,
        }
    }
    serde_json::Value::Object(map.iter().map(|(k, v)| (k.clone(), one(v))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_follow_dynamodb_rules() {
        assert!(validate_table_name("tether-leases").is_ok());
        assert!(validate_table_name("a.b_c-1").is_ok());
        assert!(validate_table_name("ab").is_err());
        assert!(validate_table_name("has space").is_err());
        assert!(validate_table_name("bad/slash").is_err());
        assert!(validate_table_name(&"x".repeat(256)).is_err());
    }
}
