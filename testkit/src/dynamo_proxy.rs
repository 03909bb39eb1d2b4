//! An HTTP proxy in front of a DynamoDB-compatible server that can cut a worker
//! off (requests hang, as in a partition), throttle it (a share of requests
//! answered with `ProvisionedThroughputExceededException`, as DynamoDB does),
//! slow it down (a brownout), or shift the `Date` header of its answers (so the
//! worker's clock looks skewed against the store's).

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use rand::Rng;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DynamoFault {
    Pass,
    /// Requests hang until the mode changes, then fail.
    Blackhole,
    /// This fraction of requests (0.0..=1.0) is throttled.
    Throttle(f64),
    /// Every request is answered only after this long (a brownout).
    Slow(std::time::Duration),
    /// Writes reach the server but their answers are lost (HTTP 500 instead),
    /// and reads of single items fail: a writer cannot learn whether its write
    /// landed. Queries still answer.
    LoseWriteAnswers,
    /// Every request reaches the server at once; its answer comes back only
    /// after this long (the write has landed, the writer does not know yet).
    DelayAnswers(std::time::Duration),
    /// The next write reaches the server but its answer is lost (HTTP 500),
    /// then everything passes again: a writer retries a write that landed.
    LoseNextWriteAnswer,
    /// BatchGetItem reads at most this many keys per table and request and
    /// hands the rest back as `UnprocessedKeys`, with no error, as DynamoDB
    /// does past its limits or on a throttled partition (0: none at all,
    /// which DynamoDB would answer with a throttling error instead: a
    /// partition that stays throttled through every retry of the batch).
    ProcessBatchKeys(usize),
}

struct ProxyState {
    target: String,
    client: reqwest::Client,
    mode: watch::Receiver<DynamoFault>,
    /// Sets the mode (the proxy's handle, and a one-shot fault resetting itself).
    control: watch::Sender<DynamoFault>,
    throttled: AtomicU64,
    /// Seconds added to every response's `Date` header.
    date_shift: std::sync::atomic::AtomicI64,
}

/// A running proxy; stops when dropped.
pub struct DynamoFaultProxy {
    pub addr: SocketAddr,
    state: Arc<ProxyState>,
    task: JoinHandle<()>,
}

impl Drop for DynamoFaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl DynamoFaultProxy {
    pub async fn start(listen: SocketAddr, target: &str) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let (mode, receiver) = watch::channel(DynamoFault::Pass);
        let state = Arc::new(ProxyState {
            target: target.trim_end_matches('/').to_string(),
            client: reqwest::Client::new(),
            mode: receiver,
            control: mode,
            throttled: AtomicU64::new(0),
            date_shift: std::sync::atomic::AtomicI64::new(0),
        });
        let app = Router::new().fallback(forward).with_state(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, state, task })
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set(&self, fault: DynamoFault) {
        self.state.control.send_replace(fault);
    }

    /// Shifts the `Date` header of every answer by `seconds` (positive: the
    /// store's clock looks ahead, so the worker's looks behind).
    pub fn shift_date(&self, seconds: i64) {
        self.state.date_shift.store(seconds, Ordering::SeqCst);
    }

    /// Requests answered with a throttling error so far.
    pub fn throttled(&self) -> u64 {
        self.state.throttled.load(Ordering::SeqCst)
    }
}

async fn forward(
    State(state): State<Arc<ProxyState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mode = *state.mode.borrow();
    match mode {
        DynamoFault::Blackhole => {
            let mut changes = state.mode.clone();
            let _ = changes.changed().await;
            return StatusCode::SERVICE_UNAVAILABLE.into_response();
        }
        DynamoFault::Throttle(share) if rand::rng().random_bool(share.clamp(0.0, 1.0)) => {
            state.throttled.fetch_add(1, Ordering::SeqCst);
            let body = r#"{"__type":"com.amazonaws.dynamodb.v20120810#ProvisionedThroughputExceededException","message":"The level of configured provisioned throughput for the table was exceeded (injected by the test proxy)"}"#;
            return (
                StatusCode::BAD_REQUEST,
                [("content-type", "application/x-amz-json-1.0")],
                body,
            )
                .into_response();
        }
        DynamoFault::Slow(delay) => tokio::time::sleep(delay).await,
        _ => {}
    }
    let target = headers
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    // The operation after the API version (`DynamoDB_20120810.GetItem`):
    // matched whole, so `BatchGetItem` is not taken for `GetItem`.
    let operation = target.rsplit('.').next().unwrap_or_default();
    let (body, unprocessed) = match mode {
        DynamoFault::ProcessBatchKeys(at_most) if operation == "BatchGetItem" => {
            match split_batch(&body, at_most) {
                Some((_, unprocessed)) if at_most == 0 => {
                    return batch_answer(&serde_json::json!({}), unprocessed);
                }
                Some((forwarded, unprocessed)) => (Bytes::from(forwarded), Some(unprocessed)),
                None => (body, None),
            }
        }
        _ => (body, None),
    };
    let mut request = state.client.post(&state.target).body(body);
    for (name, value) in &headers {
        if name != "host" && name != "content-length" {
            request = request.header(name, value);
        }
    }
    let sent = match (unprocessed, request.send().await) {
        (Some(unprocessed), Ok(resp)) if resp.status().is_success() => {
            let body = resp.bytes().await.unwrap_or_default();
            let Ok(answer) = serde_json::from_slice::<serde_json::Value>(&body) else {
                return StatusCode::BAD_GATEWAY.into_response();
            };
            let responses = answer.get("Responses").cloned().unwrap_or_default();
            return batch_answer(&responses, unprocessed);
        }
        (_, sent) => sent,
    };
    let write_or_item_read =
        ["UpdateItem", "PutItem", "DeleteItem", "GetItem"].contains(&operation);
    if mode == DynamoFault::LoseWriteAnswers && write_or_item_read {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    if let DynamoFault::DelayAnswers(delay) = mode {
        tokio::time::sleep(delay).await;
    }
    let write = ["UpdateItem", "PutItem", "DeleteItem"].contains(&operation);
    // Once: the answer of the first write that landed is lost (of writes
    // racing, only the one that switches the mode back loses its answer).
    if mode == DynamoFault::LoseNextWriteAnswer
        && write
        && sent.is_ok()
        && state.control.send_if_modified(|m| {
            let first = *m == DynamoFault::LoseNextWriteAnswer;
            if first {
                *m = DynamoFault::Pass;
            }
            first
        })
    {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    match sent {
        Ok(resp) => {
            let status = resp.status();
            let mut out = HeaderMap::new();
            let shift = state.date_shift.load(Ordering::SeqCst);
            for (name, value) in resp.headers() {
                if name != "content-length" && name != "transfer-encoding" && name != "date" {
                    out.insert(name.clone(), value.clone());
                }
            }
            // Always answer with a Date (hyper adds none to a proxied response otherwise).
            let date = chrono_like_now(shift);
            if let Ok(v) = axum::http::HeaderValue::from_str(&date) {
                out.insert("date", v);
            }
            let bytes = resp.bytes().await.unwrap_or_default();
            (status, out, bytes).into_response()
        }
        Err(_) => StatusCode::BAD_GATEWAY.into_response(),
    }
}

/// A BatchGetItem request cut to its first `at_most` keys per table (the
/// body to forward) and the rest as `UnprocessedKeys` (each table's other
/// request fields kept). `None` when the body is not such a request.
fn split_batch(body: &[u8], at_most: usize) -> Option<(Vec<u8>, serde_json::Value)> {
    let mut request: serde_json::Value = serde_json::from_slice(body).ok()?;
    let mut unprocessed = serde_json::Map::new();
    for (table, wanted) in request.get_mut("RequestItems")?.as_object_mut()? {
        let keys = wanted.get_mut("Keys")?.as_array_mut()?;
        let rest = keys.split_off(at_most.min(keys.len()));
        if !rest.is_empty() {
            let mut left = wanted.clone();
            left["Keys"] = serde_json::Value::Array(rest);
            unprocessed.insert(table.clone(), left);
        }
    }
    Some((
        serde_json::to_vec(&request).ok()?,
        serde_json::Value::Object(unprocessed),
    ))
}

/// A BatchGetItem answer: `responses` read, `unprocessed` handed back.
fn batch_answer(responses: &serde_json::Value, unprocessed: serde_json::Value) -> Response {
    let body = serde_json::json!({"Responses": responses, "UnprocessedKeys": unprocessed});
    (
        StatusCode::OK,
        [("content-type", "application/x-amz-json-1.0")],
        body.to_string(),
    )
        .into_response()
}

/// An IMF-fixdate `Date` header value for now plus `shift` seconds.
fn chrono_like_now(shift: i64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
        + shift;
    http_date(now)
}

/// Formats epoch seconds as `Wed, 02 Dec 2026 17:54:11 GMT`.
pub fn http_date(epoch_secs: i64) -> String {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let days = epoch_secs.div_euclid(86_400);
    let secs = epoch_secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{}, {:02} {} {} {:02}:{:02}:{:02} GMT",
        DAYS[days.rem_euclid(7) as usize],
        day,
        MONTHS[(month - 1) as usize],
        year,
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn http_dates_are_imf_fixdate() {
        assert_eq!(super::http_date(0), "Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(
            super::http_date(1_796_234_051),
            "Wed, 02 Dec 2026 17:54:11 GMT"
        );
    }
}
