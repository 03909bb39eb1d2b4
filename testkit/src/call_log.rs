//! Records which DynamoDB operations each part of tether calls, so
//! `scripts/check-iam` can hold them against the IAM policies in `deploy/`.
//!
//! When `TETHER_DYNAMODB_CALL_LOG` names a directory, the test binaries'
//! embedded store is reached through this recorder: it forwards every request
//! unchanged and appends one line per request to a file of its own in that
//! directory: the caller (the `app/…` name tether sends in its User-Agent,
//! one per role), the operation (`X-Amz-Target`), and the table and index the
//! body names. Requests without an app name (the tests' own clients) are
//! recorded as `-` and judged by nobody.

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;

/// The environment variable naming the directory to record into.
pub const CALL_LOG_ENV: &str = "TETHER_DYNAMODB_CALL_LOG";

struct Recorder {
    target: String,
    client: reqwest::Client,
    out: Mutex<std::fs::File>,
}

/// Starts a recorder in front of `target` on `listen`, writing into `dir`;
/// serves until the runtime ends. Returns its endpoint.
pub async fn start(listen: SocketAddr, target: &str, dir: &Path) -> std::io::Result<String> {
    std::fs::create_dir_all(dir)?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!(
            "{}-{:08x}.tsv",
            std::process::id(),
            rand::random::<u32>()
        )))?;
    let listener = TcpListener::bind(listen).await?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    let recorder = Arc::new(Recorder {
        target: target.trim_end_matches('/').to_string(),
        client: reqwest::Client::new(),
        out: Mutex::new(file),
    });
    let app = Router::new().fallback(forward).with_state(recorder);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(endpoint)
}

/// `app/NAME` from an AWS SDK User-Agent, `-` when there is none.
fn caller(headers: &HeaderMap) -> String {
    ["x-amz-user-agent", "user-agent"]
        .iter()
        .filter_map(|h| headers.get(*h)?.to_str().ok())
        .flat_map(str::split_whitespace)
        .find_map(|token| token.strip_prefix("app/"))
        .unwrap_or("-")
        .to_string()
}

async fn forward(State(rec): State<Arc<Recorder>>, headers: HeaderMap, body: Bytes) -> Response {
    let operation = headers
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok())
        .and_then(|t| t.rsplit('.').next())
        .unwrap_or("-")
        .to_string();
    let names: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let field = |name: &str| names[name].as_str().unwrap_or("-").to_string();
    let line = format!(
        "{}\t{operation}\t{}\t{}\n",
        caller(&headers),
        field("TableName"),
        field("IndexName")
    );
    if let Ok(mut out) = rec.out.lock() {
        let _ = out.write_all(line.as_bytes());
    }
    let mut request = rec.client.post(&rec.target).body(body);
    for (name, value) in &headers {
        if name != "host" && name != "content-length" {
            request = request.header(name, value);
        }
    }
    crate::relay::relay(request.send().await).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_caller_is_the_app_name_in_the_user_agent() {
        let mut headers = HeaderMap::new();
        headers.insert(
            "x-amz-user-agent",
            "aws-sdk-rust/1.3 ua/2.1 api/dynamodb/1.136 os/linux lang/rust/1.95.0 app/tether-cli"
                .parse()
                .unwrap(),
        );
        assert_eq!(caller(&headers), "tether-cli");
        assert_eq!(caller(&HeaderMap::new()), "-");
    }
}
