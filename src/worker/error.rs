//! Errors that stop a worker (everything else is handled, counted and logged).

use crate::lease::StoreError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum WorkerError {
    #[error("invalid worker settings: {0}")]
    Settings(String),
    #[error("TLS configuration: {0}")]
    Tls(String),
    #[error("cannot build the sink HTTP client: {0}")]
    HttpClient(String),
    #[error("lease table: {0}")]
    Store(#[from] StoreError),
    #[error("the worker's {0} task stopped unexpectedly")]
    TaskDied(&'static str),
}

impl WorkerError {
    /// A fixed label for metrics and logs.
    pub fn category(&self) -> &'static str {
        match self {
            Self::Settings(_) => "settings",
            Self::Tls(_) => "tls",
            Self::HttpClient(_) => "http_client",
            Self::Store(e) => e.category(),
            Self::TaskDied(_) => "task_died",
        }
    }
}
