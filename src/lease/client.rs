//! The DynamoDB client behind the store: connection settings, one call path
//! with jittered retries inside a deadline, error classification, consumed
//! capacity, and the clock measurement every response feeds.

use super::clock::{ClockGauge, ClockInterceptor};
use super::codec::Malformed;
use super::error::StoreError;
use crate::metrics::StoreMetrics;
use crate::support::{RetryPolicy, aws_http_client_keeping};
use aws_config::BehaviorVersion;
use aws_config::retry::RetryConfig;
use aws_config::stalled_stream_protection::StalledStreamProtectionConfig;
use aws_config::timeout::TimeoutConfig;
use aws_credential_types::Credentials;
use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::config::Region;
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::types::ConsumedCapacity;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Per-attempt timeout of one DynamoDB request (the retry deadline bounds the call).
pub(super) const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
/// Most stream-item writes (acquires, status, checkpoint folds, releases) in
/// flight at once per store. Each one in flight needs an HTTP connection of
/// its own, and the pool keeps them: a thousand streams connecting at once
/// (a failover) would otherwise open a thousand connections to DynamoDB and
/// hold ~28 KiB each for good. Worker-item writes (renewals, death marks)
/// never wait for this: they keep the fence open.
///
/// It is also how many idle connections the store's client keeps per host.
/// Unbounded, a burst left ~60 open after it was over (the turns, acquires,
/// reads), tens of KiB each. Bounded at 8, a burst churned: connections
/// coming back while more than 8 sat idle were closed and opened again a
/// moment later (84 opened for 150 streams, against at most 64 before). At
/// the number of turns the writes in flight keep theirs.
pub(super) const MAX_STREAM_WRITES_IN_FLIGHT: usize = 32;
/// Region used for a local endpoint, which ignores it.
const LOCAL_REGION: &str = "us-east-1";
/// Credentials a local DynamoDB-compatible server is reached with; it does not
/// check them.
pub const LOCAL_CREDENTIALS: (&str, &str) = ("tether-local", "tether-local");

/// Where and how to reach the table.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    pub table: String,
    /// Explicit endpoint (a local store). Without it the SDK's own resolution
    /// applies: `AWS_ENDPOINT_URL_DYNAMODB`, `AWS_ENDPOINT_URL`, then AWS itself.
    pub endpoint: Option<String>,
    pub region: Option<String>,
    /// Fixed credentials, used only for a local store, which ignores them.
    pub static_credentials: Option<(String, String)>,
    pub retry: RetryPolicy,
    pub attempt_timeout: Duration,
    /// Page size for queries and scans; `None` lets DynamoDB pick (1 MB pages).
    pub page_size: Option<i32>,
    /// Which part of tether makes the calls ([`Caller`]), sent as the SDK's
    /// app name: `app/tether-operator` in every request's User-Agent, so
    /// CloudTrail (and the test suite's recorder) can tell the roles apart
    /// and each role's calls can be held against its IAM policy.
    pub caller: Option<Caller>,
}

/// The roles that call DynamoDB, each with its own IAM policy in `deploy/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// `tether operator`: the controller and a worker (the pod's policy).
    Operator,
    /// `tether worker`: a standalone worker (the worker policy).
    Worker,
    /// `tether apply`, `get`, `delete` (the CLI policy).
    Cli,
    /// `tether table create` and `finish-upgrade` (whoever manages the table).
    Admin,
    /// `tether demo` and `local-store` (this machine only).
    Local,
}

impl Caller {
    /// The app name sent with every request.
    pub fn app_name(self) -> &'static str {
        match self {
            Self::Operator => "tether-operator",
            Self::Worker => "tether-worker",
            Self::Cli => "tether-cli",
            Self::Admin => "tether-admin",
            Self::Local => "tether-local",
        }
    }
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
            caller: None,
        }
    }

    /// A DynamoDB-compatible server on this machine (the embedded store,
    /// dynalite): it checks neither credentials nor region, so fixed ones are used.
    pub fn local(table: impl Into<String>, endpoint: impl Into<String>) -> Self {
        let (id, secret) = LOCAL_CREDENTIALS;
        Self {
            endpoint: Some(endpoint.into()),
            region: Some(LOCAL_REGION.into()),
            static_credentials: Some((id.into(), secret.into())),
            ..Self::new(table)
        }
    }
}

/// The lease store. Cheap to clone; every clone shares one HTTP client, one
/// clock estimate and one reachability flag.
#[derive(Clone)]
pub struct LeaseStore {
    pub(super) client: Client,
    pub(super) table: String,
    endpoint: String,
    retry: RetryPolicy,
    pub(super) page_size: Option<i32>,
    pub(super) metrics: Arc<StoreMetrics>,
    /// Whether the latest request got an answer from DynamoDB (for readiness).
    reachable: Arc<AtomicBool>,
    clock: Arc<ClockGauge>,
    /// Bounds stream-item writes in flight ([`MAX_STREAM_WRITES_IN_FLIGHT`]).
    stream_writes: Arc<tokio::sync::Semaphore>,
    /// Coalesces this process's moves of the change counter.
    pub(super) announcer: Arc<super::announcer::Announcer>,
}

/// A conditional write whose condition did not hold: an expected outcome.
pub(super) struct ConditionFailed;

impl ConditionFailed {
    /// The error for a write that had no condition to fail.
    pub(super) fn unexpected(self, operation: &'static str) -> StoreError {
        StoreError::Rejected {
            operation,
            detail: "unexpected conditional-check failure".into(),
        }
    }
}

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

impl LeaseStore {
    /// Builds the client. No request is sent; `check_table` verifies reachability.
    pub async fn connect(cfg: StoreConfig, metrics: Arc<StoreMetrics>) -> Result<Self, StoreError> {
        validate_table_name(&cfg.table)?;
        let http = aws_http_client_keeping(MAX_STREAM_WRITES_IN_FLIGHT);
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
            )
            // Its check (under a byte a second for 5 s) adds nothing to the
            // attempt timeout (2 s unless a caller sets one), and it wraps
            // every request and answer body in a throughput monitor: 2% of
            // the CPU in a failover's profile.
            .stalled_stream_protection(StalledStreamProtectionConfig::disabled());
        if let Some(ep) = &cfg.endpoint {
            loader = loader.endpoint_url(ep);
        }
        if let Some(caller) = cfg.caller {
            // The names are constants of the form the SDK accepts.
            if let Ok(name) = aws_config::AppName::new(caller.app_name()) {
                loader = loader.app_name(name);
            }
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
        let clock = Arc::new(ClockGauge::default());
        let mut builder = aws_sdk_dynamodb::config::Builder::from(&sdk)
            .interceptor(ClockInterceptor(clock.clone()));
        let region = match sdk.region() {
            Some(r) => r.to_string(),
            // A local endpoint ignores the region, so do not make users invent one.
            None if endpoint.is_some() => {
                builder = builder.region(Region::new(LOCAL_REGION));
                LOCAL_REGION.to_string()
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
            clock,
            stream_writes: Arc::new(tokio::sync::Semaphore::new(MAX_STREAM_WRITES_IN_FLIGHT)),
            announcer: Arc::default(),
        })
    }

    /// Waits for a turn to write a stream item (see [`MAX_STREAM_WRITES_IN_FLIGHT`]).
    pub(super) async fn stream_write_turn(&self) -> Option<tokio::sync::SemaphorePermit<'_>> {
        // The semaphore is never closed; `None` would only mean "go ahead".
        self.stream_writes.acquire().await.ok()
    }

    /// A flag that is `false` while the latest DynamoDB request failed to get a
    /// usable answer (timeout, refused connection, bad credentials, throttling).
    pub fn reachability(&self) -> Arc<AtomicBool> {
        self.reachable.clone()
    }

    /// This machine's clock measured against DynamoDB's.
    pub fn clock(&self) -> Arc<ClockGauge> {
        self.clock.clone()
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Which table this is, anywhere: `<table>@<endpoint host>` (for AWS the
    /// host names the region), so two tables of one name in two regions or
    /// on two local servers are told apart.
    pub fn identity(&self) -> String {
        let host = self
            .endpoint
            .split_once("://")
            .map_or(self.endpoint.as_str(), |(_, rest)| rest)
            .trim_end_matches('/');
        format!("{}@{host}", self.table)
    }

    pub fn metrics(&self) -> &Arc<StoreMetrics> {
        &self.metrics
    }

    /// Runs one request with jittered retries of transient failures inside the
    /// deadline. A lost condition is `Ok(Err(ConditionFailed))`.
    pub(super) async fn call<T, E, Fut>(
        &self,
        operation: &'static str,
        subject: Option<&str>,
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
            match self.classify(operation, subject, error) {
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

    /// [`LeaseStore::call`] for requests without a condition.
    pub(super) async fn call_plain<T, E, Fut>(
        &self,
        operation: &'static str,
        subject: Option<&str>,
        send: impl FnMut() -> Fut,
    ) -> Result<T, StoreError>
    where
        Fut: Future<Output = Result<T, SdkError<E, aws_smithy_runtime_api::http::Response>>>,
        E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    {
        self.call(operation, subject, send)
            .await?
            .map_err(|c| c.unexpected(operation))
    }

    fn classify<E>(
        &self,
        operation: &'static str,
        subject: Option<&str>,
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
                            key: subject.unwrap_or_default().to_string(),
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

    /// Counts the write units DynamoDB reported (table plus indexes).
    pub(super) fn record_capacity(
        &self,
        operation: &'static str,
        consumed: Option<&ConsumedCapacity>,
    ) {
        if let Some(units) = consumed.and_then(|c| c.capacity_units()) {
            self.metrics.consumed_write_units(operation, units);
        }
    }

    /// Counts the read units DynamoDB reported.
    pub(super) fn record_reads(
        &self,
        operation: &'static str,
        consumed: Option<&ConsumedCapacity>,
    ) {
        if let Some(units) = consumed.and_then(|c| c.capacity_units()) {
            self.metrics.consumed_read_units(operation, units);
        }
    }

    pub(super) fn malformed(&self, m: Malformed) -> StoreError {
        StoreError::Malformed {
            table: self.table.clone(),
            pk: m.pk,
            detail: m.detail,
        }
    }
}

/// The innermost error message: "Connection refused (os error 111)" rather than
/// the SDK's whole chain, so errors stay one readable line.
pub fn root_cause(err: &(dyn std::error::Error + 'static)) -> String {
    let mut current = err;
    while let Some(next) = current.source() {
        current = next;
    }
    current.to_string()
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
