//! Errors from the lease store that an operator has to act on.

use thiserror::Error;

/// A store failure. Lost conditional writes are *not* errors: see
/// [`super::OwnerWrite`] and [`super::AcquireOutcome`].
#[derive(Debug, Error)]
pub enum StoreError {
    #[error("table '{table}' does not exist: create it with `tether table create --table {table}`")]
    TableNotFound { table: String },
    #[error("invalid table name '{0}': use 3-255 characters of a-z, A-Z, 0-9, '_', '-', '.'")]
    InvalidTableName(String),
    #[error(
        "cannot reach DynamoDB at {endpoint}: {detail} (check AWS_ENDPOINT_URL_DYNAMODB / AWS_REGION and the network)"
    )]
    Unreachable { endpoint: String, detail: String },
    #[error(
        "DynamoDB rejected the credentials: {0} (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or a role)"
    )]
    Credentials(String),
    #[error("DynamoDB kept throttling '{operation}' past the retry deadline: {detail}")]
    Throttled {
        operation: &'static str,
        detail: String,
    },
    #[error("item for '{key}' is larger than DynamoDB's 400 KB item limit; shrink the spec")]
    ItemTooLarge { key: String },
    #[error("DynamoDB rejected '{operation}': {detail}")]
    Rejected {
        operation: &'static str,
        detail: String,
    },
    #[error(
        "no AWS region configured: set AWS_REGION (or AWS_ENDPOINT_URL_DYNAMODB for a local store)"
    )]
    NoRegion,
    #[error(
        "table '{table}' was created by tether 0.1 and lacks the by_holder index: run `tether table create --table {table}` to upgrade it in place"
    )]
    NeedsUpgrade { table: String },
    #[error("table '{table}' item '{pk}' is malformed: {detail}")]
    Malformed {
        table: String,
        pk: String,
        detail: String,
    },
}

impl StoreError {
    /// A fixed, low-cardinality label for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            Self::TableNotFound { .. } => "table_not_found",
            Self::InvalidTableName(_) => "invalid_table_name",
            Self::Unreachable { .. } => "unreachable",
            Self::Credentials(_) => "credentials",
            Self::Throttled { .. } => "throttled",
            Self::ItemTooLarge { .. } => "item_too_large",
            Self::Rejected { .. } => "rejected",
            Self::NoRegion => "no_region",
            Self::Malformed { .. } => "malformed",
            Self::NeedsUpgrade { .. } => "needs_upgrade",
        }
    }
}
