//! The embedded DynamoDB-compatible store (dynoxide), for the demo, local
//! development and tests. It is only ever started on explicit request
//! (`--embedded-store`, `tether local-store`, the demo), never as a fallback for
//! a real endpoint that could not be reached.

use std::net::SocketAddr;
use std::path::Path;
use thiserror::Error;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[derive(Debug, Error)]
pub enum EmbeddedError {
    #[error("cannot open the embedded store at {path}: {detail}")]
    Open { path: String, detail: String },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A running embedded store; stops when dropped or on [`EmbeddedStore::shutdown`].
pub struct EmbeddedStore {
    pub addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), String>>>,
}

impl EmbeddedStore {
    /// Serves a store on `listen` (port 0 picks a free one). `path` is a SQLite
    /// file; `None` or `":memory:"` keeps everything in memory.
    pub async fn start(path: Option<&Path>, listen: SocketAddr) -> Result<Self, EmbeddedError> {
        let db = match path.and_then(|p| p.to_str()).filter(|p| *p != ":memory:") {
            Some(p) => dynoxide::Database::new(p).map_err(|e| EmbeddedError::Open {
                path: p.to_string(),
                detail: e.to_string(),
            })?,
            None => dynoxide::Database::memory().map_err(|e| EmbeddedError::Open {
                path: ":memory:".into(),
                detail: e.to_string(),
            })?,
        };
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|source| EmbeddedError::Listen {
                addr: listen,
                source,
            })?;
        let addr = listener
            .local_addr()
            .map_err(|source| EmbeddedError::Listen {
                addr: listen,
                source,
            })?;
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(dynoxide::server::serve_with_shutdown(
            listener,
            db,
            async move {
                let _ = rx.await;
            },
        ));
        Ok(Self {
            addr,
            shutdown: Some(tx),
            task: Some(task),
        })
    }

    /// `http://127.0.0.1:PORT`, for `AWS_ENDPOINT_URL_DYNAMODB`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting requests and waits for in-flight ones.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }

    /// Resolves if the server stops by itself (it should not).
    pub async fn stopped(&mut self) -> String {
        match self.task.as_mut() {
            Some(task) => match task.await {
                Ok(Ok(())) => "embedded store stopped".into(),
                Ok(Err(e)) => e,
                Err(e) => format!("embedded store task failed: {e}"),
            },
            None => std::future::pending().await,
        }
    }
}

impl Drop for EmbeddedStore {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}
