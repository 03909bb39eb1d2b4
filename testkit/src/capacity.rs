//! A capacity model of DynamoDB partitions, as an HTTP proxy in front of a
//! DynamoDB-compatible server.
//!
//! dynoxide and dynalite have no partition limits, so nothing run against them
//! can see a hot key. This proxy meters every request that passes the way
//! DynamoDB bills and limits it: each write's units (as the server computes
//! them, table and each index, by DynamoDB's rules) are charged to the
//! partition-key values they touch — the item's key in the table, and in each
//! index the old and the new index key when a write moves an item between
//! index partitions — and reads to the partition they query. A partition-key
//! value that has taken 1,000 write units (or 3,000 read units) in the current
//! second is throttled with `ProvisionedThroughputExceededException`, as
//! DynamoDB throttles a hot partition, and so is a write to an item whose
//! index partition is over its limit (DynamoDB throttles the table write when
//! an index cannot take it). It also keeps every write's outcome on the
//! ownership attributes, so a run can be checked from the store's history
//! rather than the workers' word.
//!
//! It is a model: DynamoDB's adaptive capacity, burst credits and
//! split-for-heat are left out (they only ever raise a single key's ceiling
//! up to the same 1,000/3,000 per second), and it serialises writes per item
//! to see their before and after images.

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tether::support::lock;
use tokio::net::TcpListener;

/// DynamoDB's per-partition limits.
pub const WRITE_UNITS_PER_SECOND: f64 = 1000.0;
pub const READ_UNITS_PER_SECOND: f64 = 3000.0;
/// Attributes whose before/after values the model keeps for each write.
const WATCHED: [&str; 8] = [
    "Pk",
    "holder",
    "desired_state",
    "lease_expires_at_ms",
    "lease_owner",
    "lease_counter",
    "worker_state",
    "change_shard",
];
/// Operations that write but that the model passes on unmetered.
const UNMETERED_WRITES: [&str; 7] = [
    "BatchWriteItem",
    "TransactWriteItems",
    "ExecuteStatement",
    "BatchExecuteStatement",
    "ExecuteTransaction",
    "DeleteTable",
    "CreateTable",
];
/// The indexes the model knows, with their partition-key attribute.
const INDEXES: [(&str, &str); 3] = [
    ("by_holder", "holder"),
    ("by_state", "desired_state"),
    ("by_change", "change_shard"),
];

/// A partition-key value: the table's, or one index's.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct PartitionKey {
    /// `table` or the index name.
    pub scope: String,
    pub value: String,
}

#[derive(Clone, Copy, Debug, Default)]
struct Window {
    second: u64,
    write: f64,
    read: f64,
}

/// One write as the store recorded it (after-image of the ownership attributes).
#[derive(Clone, Debug, Serialize)]
pub struct HistoryEntry {
    pub at_ms: u64,
    pub pk: String,
    pub owner: Option<String>,
    pub counter: Option<u64>,
    pub expires_at_ms: Option<u64>,
    pub worker_state: Option<String>,
    pub deleted: bool,
}

#[derive(Default)]
struct Usage {
    windows: HashMap<PartitionKey, Window>,
    /// Highest units in any one second, per key: (write, read).
    peaks: HashMap<PartitionKey, (f64, f64)>,
    throttled: HashMap<PartitionKey, u64>,
    /// Write units charged to each key since the last reset.
    write_units_by_key: HashMap<PartitionKey, f64>,
    write_units: f64,
    read_units: f64,
    requests_by_target: std::collections::BTreeMap<String, u64>,
    /// Conditional writes refused, and the write units they were billed.
    refused_writes: u64,
    refused_writes_with_item: u64,
    refused_write_units: f64,
}

/// Peak usage of the hottest keys, and totals.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CapacityReport {
    pub hottest_write_key: Option<PartitionKey>,
    pub hottest_write_units_per_s: f64,
    pub hottest_read_key: Option<PartitionKey>,
    pub hottest_read_units_per_s: f64,
    pub throttled_requests: u64,
    pub throttled_keys: Vec<(PartitionKey, u64)>,
    pub write_units: f64,
    pub read_units: f64,
    pub requests: u64,
    /// Requests by operation (`UpdateItem`, `Query`, …).
    pub requests_by_target: std::collections::BTreeMap<String, u64>,
    /// Conditional writes refused (a lost race, a fenced owner's write):
    /// DynamoDB bills each by the size of the item the condition was checked
    /// against, at least one unit; included in `write_units`.
    pub refused_writes: u64,
    /// Of them, those whose refusal carried the item (a store that does
    /// not send it, dynalite, is billed the minimum).
    pub refused_writes_with_item: u64,
    pub refused_write_units: f64,
}

struct ModelState {
    target: String,
    client: reqwest::Client,
    started: Instant,
    throttling: bool,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    usage: Mutex<Usage>,
    history: Mutex<Vec<HistoryEntry>>,
    /// Each table's first successful DescribeTable answer, once
    /// [`CapacityModel::remember_table_descriptions`] was called (`None`
    /// before: every DescribeTable goes to the server).
    descriptions: Mutex<Option<HashMap<String, Answer>>>,
    /// The watched attributes of every item of each table named in
    /// [`CapacityModel::remember_items`], by `Pk` (`None`: no such item).
    /// An item missing from a remembered table's map is read from the
    /// server, as every item is for a table not remembered.
    items: Mutex<HashMap<String, HashMap<String, Option<Value>>>>,
}

/// The model's runtime threads' name (at most 15 bytes: what `/proc` keeps
/// of it). The model runs on threads of its own, so a benchmark can tell its
/// share of the machine from the store's and the workers'
/// (`crate::store::threads_cpu_seconds`).
pub const MODEL_THREAD_NAME: &str = "capacity-model";

/// The running model; stops when dropped.
pub struct CapacityModel {
    pub addr: SocketAddr,
    state: Arc<ModelState>,
    /// Dropped with the model: its server and runtime stop.
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl CapacityModel {
    /// A model in front of `target` (a DynamoDB-compatible endpoint);
    /// `throttling` off only meters.
    pub async fn start(
        listen: SocketAddr,
        target: &str,
        throttling: bool,
    ) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind(listen)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let state = Arc::new(ModelState {
            target: target.trim_end_matches('/').to_string(),
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(256)
                .build()
                .map_err(std::io::Error::other)?,
            started: Instant::now(),
            throttling,
            locks: Mutex::default(),
            usage: Mutex::default(),
            history: Mutex::default(),
            descriptions: Mutex::default(),
            items: Mutex::default(),
        });
        let app = Router::new().fallback(handle).with_state(state.clone());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(MODEL_THREAD_NAME)
            .enable_all()
            .build()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(MODEL_THREAD_NAME.into())
            .spawn(move || {
                runtime.block_on(async move {
                    let Ok(listener) = TcpListener::from_std(listener) else {
                        return;
                    };
                    // Ends when the model is dropped (the sender with it);
                    // the runtime, and every request under way, with it.
                    tokio::select! {
                        _ = std::future::IntoFuture::into_future(axum::serve(listener, app)) => {}
                        _ = stopped => {}
                    }
                });
            })?;
        Ok(Self {
            addr,
            state,
            _stop: stop,
        })
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// From now on, answers each table's DescribeTable with the first
    /// successful answer the server gave, as DynamoDB answers it from the
    /// table's metadata (its item count is refreshed about every six hours).
    /// dynoxide counts and sizes every item for each DescribeTable, so a
    /// fleet starting on a table of 100,000 items would otherwise wait on
    /// the simulation, not on anything DynamoDB does.
    pub fn remember_table_descriptions(&self) {
        lock(&self.state.descriptions).get_or_insert_default();
    }

    /// Reads every item of `table` once and from now on keeps each item's
    /// watched attributes itself, so a write costs the server one request
    /// instead of three (the write and a read on each side of it). Only
    /// exact while every write to `table` passes through this model: call
    /// it after loading a table directly and before the fleet starts. An
    /// item whose write had an unknown outcome (the server's answer lost, an
    /// error other than a failed condition) or whose image a failed read
    /// left unknown is read again at its next write; a write the model does
    /// not meter (a batch, a transaction, PartiQL) ends all remembering.
    /// Returns how many items it read.
    pub async fn remember_items(&self, table: &str) -> std::io::Result<usize> {
        let mut items = HashMap::new();
        let mut start: Option<Value> = None;
        loop {
            let mut body = json!({
                "TableName": table,
                "ProjectionExpression": WATCHED.join(", "),
                "ConsistentRead": true,
            });
            if let Some(key) = start.take() {
                body["ExclusiveStartKey"] = key;
            }
            let (status, _, bytes) = self
                .state
                .send("Scan", &body, None)
                .await
                .map_err(|s| std::io::Error::other(format!("scan of {table}: {s}")))?;
            if !status.is_success() {
                return Err(std::io::Error::other(format!(
                    "scan of {table}: {status}: {}",
                    String::from_utf8_lossy(&bytes)
                )));
            }
            let page: ScanPage = serde_json::from_slice(&bytes).map_err(std::io::Error::other)?;
            for item in page.items {
                if let Some(pk) = s_attr(Some(&item), "Pk") {
                    items.insert(pk, Some(item));
                }
            }
            match page.last_evaluated_key {
                Some(key) => start = Some(key),
                None => break,
            }
        }
        let read = items.len();
        lock(&self.state.items).insert(table.to_string(), items);
        Ok(read)
    }

    /// Forgets usage and history (e.g. after loading a table directly).
    pub fn reset(&self) {
        self.reset_usage();
        lock(&self.state.history).clear();
    }

    /// Forgets usage (peaks, totals, throttling), keeps the history.
    pub fn reset_usage(&self) {
        *lock(&self.state.usage) = Usage::default();
    }

    /// Milliseconds since the model started (the history's clock).
    pub fn now_ms(&self) -> u64 {
        self.state.started.elapsed().as_millis() as u64
    }

    pub fn report(&self) -> CapacityReport {
        let usage = lock(&self.state.usage);
        let hottest = |pick: fn(&(f64, f64)) -> f64| {
            usage
                .peaks
                .iter()
                .max_by(|a, b| pick(a.1).total_cmp(&pick(b.1)))
                .map(|(k, v)| (k.clone(), pick(v)))
        };
        let (wk, wv) = hottest(|p| p.0).map_or((None, 0.0), |(k, v)| (Some(k), v));
        let (rk, rv) = hottest(|p| p.1).map_or((None, 0.0), |(k, v)| (Some(k), v));
        let mut throttled_keys: Vec<_> = usage
            .throttled
            .iter()
            .map(|(k, n)| (k.clone(), *n))
            .collect();
        throttled_keys.sort_by_key(|k| std::cmp::Reverse(k.1));
        throttled_keys.truncate(5);
        CapacityReport {
            hottest_write_key: wk,
            hottest_write_units_per_s: wv,
            hottest_read_key: rk,
            hottest_read_units_per_s: rv,
            throttled_requests: usage.throttled.values().sum(),
            throttled_keys,
            write_units: usage.write_units,
            read_units: usage.read_units,
            requests: usage.requests_by_target.values().sum(),
            requests_by_target: usage.requests_by_target.clone(),
            refused_writes: usage.refused_writes,
            refused_writes_with_item: usage.refused_writes_with_item,
            refused_write_units: usage.refused_write_units,
        }
    }

    /// Write units charged to each partition-key value since the last reset.
    pub fn write_units_by_key(&self) -> HashMap<PartitionKey, f64> {
        lock(&self.state.usage).write_units_by_key.clone()
    }

    pub fn history(&self) -> Vec<HistoryEntry> {
        lock(&self.state.history).clone()
    }
}

impl ModelState {
    fn second(&self) -> u64 {
        self.started.elapsed().as_secs()
    }

    /// Whether any of `keys` is over its limit in the current second.
    fn over_limit(&self, keys: &[PartitionKey], write: bool) -> Option<PartitionKey> {
        if !self.throttling {
            return None;
        }
        let now = self.second();
        let usage = lock(&self.usage);
        keys.iter()
            .find(|k| {
                usage.windows.get(*k).is_some_and(|w| {
                    w.second == now
                        && if write {
                            w.write >= WRITE_UNITS_PER_SECOND
                        } else {
                            w.read >= READ_UNITS_PER_SECOND
                        }
                })
            })
            .cloned()
    }

    fn charge(&self, key: PartitionKey, write: f64, read: f64) {
        let now = self.second();
        let mut usage = lock(&self.usage);
        usage.write_units += write;
        usage.read_units += read;
        if write > 0.0 {
            *usage.write_units_by_key.entry(key.clone()).or_default() += write;
        }
        let w = usage.windows.entry(key.clone()).or_default();
        if w.second != now {
            *w = Window {
                second: now,
                ..Window::default()
            };
        }
        w.write += write;
        w.read += read;
        let (ww, wr) = (w.write, w.read);
        let peak = usage.peaks.entry(key).or_default();
        peak.0 = peak.0.max(ww);
        peak.1 = peak.1.max(wr);
    }

    fn throttle(&self, key: PartitionKey) -> Response {
        *lock(&self.usage).throttled.entry(key).or_default() += 1;
        let body = r#"{"__type":"com.amazonaws.dynamodb.v20120810#ProvisionedThroughputExceededException","message":"The partition's throughput was exceeded (capacity model)"}"#;
        (
            StatusCode::BAD_REQUEST,
            [("content-type", "application/x-amz-json-1.0")],
            body,
        )
            .into_response()
    }

    async fn send(
        &self,
        target: &str,
        body: &Value,
        headers: Option<&HeaderMap>,
    ) -> Result<Answer, StatusCode> {
        let mut request = self.client.post(&self.target).body(body.to_string());
        match headers {
            Some(headers) => {
                for (name, value) in headers {
                    if name != "host" && name != "content-length" {
                        request = request.header(name, value);
                    }
                }
            }
            None => request = own_call(request, target),
        }
        let resp = request.send().await.map_err(|_| StatusCode::BAD_GATEWAY)?;
        let status = resp.status();
        let mut out = HeaderMap::new();
        for (name, value) in resp.headers() {
            if name != "content-length" && name != "transfer-encoding" {
                out.insert(name.clone(), value.clone());
            }
        }
        let bytes = resp.bytes().await.map_err(|_| StatusCode::BAD_GATEWAY)?;
        Ok((status, out, bytes))
    }

    /// The watched attributes of an item (strongly consistent): `Ok(None)`
    /// when there is no such item, `Err` when the read failed.
    async fn watched(&self, table: &str, pk: &str) -> Result<Option<Value>, ()> {
        let body = json!({
            "TableName": table,
            "Key": {"Pk": {"S": pk}},
            "ConsistentRead": true,
            "ProjectionExpression": WATCHED.join(", "),
        });
        let (status, _, bytes) = self.send("GetItem", &body, None).await.map_err(drop)?;
        if !status.is_success() {
            return Err(());
        }
        let answer = serde_json::from_slice::<Value>(&bytes).map_err(drop)?;
        Ok(answer.get("Item").cloned())
    }

    /// The item's watched attributes as this model remembers them: `None`
    /// when its table is not remembered or the item was forgotten.
    fn remembered(&self, table: &str, pk: &str) -> Option<Option<Value>> {
        lock(&self.items).get(table)?.get(pk).cloned()
    }

    /// What a write left in a remembered table: `Some(after)` when its
    /// outcome is known, `None` to forget the item until its next write
    /// reads it.
    fn note_item(&self, table: &str, pk: &str, after: Option<Option<Value>>) {
        if let Some(items) = lock(&self.items).get_mut(table) {
            match after {
                Some(after) => items.insert(pk.to_string(), after),
                None => items.remove(pk),
            };
        }
    }

    fn key_lock(&self, id: String) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.locks).entry(id).or_default().clone()
    }
}

/// The headers of a call the model makes itself (not a client's, passed
/// on): a DynamoDB operation with a signature the local servers accept
/// without checking it.
fn own_call(request: reqwest::RequestBuilder, target: &str) -> reqwest::RequestBuilder {
    request
        .header("x-amz-target", format!("DynamoDB_20120810.{target}"))
        .header("content-type", "application/x-amz-json-1.0")
        .header("x-amz-date", "20260101T000000Z")
        .header(
            "authorization",
            "AWS4-HMAC-SHA256 Credential=capacity/20260101/us-east-1/dynamodb/aws4_request, SignedHeaders=host;x-amz-date, Signature=0",
        )
}

fn s_attr(item: Option<&Value>, name: &str) -> Option<String> {
    item?.get(name)?.get("S")?.as_str().map(str::to_string)
}

fn n_attr(item: Option<&Value>, name: &str) -> Option<u64> {
    item?.get(name)?.get("N")?.as_str()?.parse().ok()
}

/// `item` with only the watched attributes.
fn watched_of(item: &serde_json::Map<String, Value>) -> Value {
    Value::Object(
        WATCHED
            .iter()
            .filter_map(|&name| Some((name.to_string(), item.get(name)?.clone())))
            .collect(),
    )
}

/// The parts of a write's answer the model uses (the rest is skipped
/// unparsed).
#[derive(Deserialize)]
struct WriteAnswer {
    #[serde(rename = "ConsumedCapacity")]
    consumed: Option<Value>,
    #[serde(rename = "Attributes")]
    attributes: Option<serde_json::Map<String, Value>>,
}

/// The part of a read's answer the model uses: its items are skipped, not
/// parsed.
#[derive(Deserialize)]
struct ReadAnswer {
    #[serde(rename = "ConsumedCapacity")]
    consumed: Option<Value>,
}

/// One page of the model's own scan.
#[derive(Deserialize)]
struct ScanPage {
    #[serde(rename = "Items", default)]
    items: Vec<Value>,
    #[serde(rename = "LastEvaluatedKey")]
    last_evaluated_key: Option<Value>,
}

fn units(v: Option<&Value>) -> f64 {
    v.and_then(|c| c.get("CapacityUnits"))
        .and_then(Value::as_f64)
        .unwrap_or(0.0)
}

/// Each request is handled in a task of its own: a client that gives up (an
/// SDK attempt timeout) must not cut the metering of a write that already
/// landed short.
async fn handle(State(state): State<Arc<ModelState>>, headers: HeaderMap, body: Bytes) -> Response {
    tokio::spawn(handle_to_completion(state, headers, body))
        .await
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn handle_to_completion(state: Arc<ModelState>, headers: HeaderMap, body: Bytes) -> Response {
    let target = headers
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok())
        .and_then(|t| t.split('.').nth(1))
        .unwrap_or("")
        .to_string();
    let Ok(mut request) = serde_json::from_slice::<Value>(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    *lock(&state.usage)
        .requests_by_target
        .entry(target.clone())
        .or_default() += 1;
    let table = request
        .get("TableName")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let response = match target.as_str() {
        "PutItem" | "UpdateItem" | "DeleteItem" => {
            let key_field = if target == "PutItem" { "Item" } else { "Key" };
            let pk = request
                .get(key_field)
                .and_then(|k| k.get("Pk"))
                .and_then(|v| v.get("S"))
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            write(&state, &headers, &mut request, &target, &table, &pk).await
        }
        "Query" | "GetItem" | "Scan" | "BatchGetItem" => {
            read(&state, &headers, &mut request, &target, &table).await
        }
        "DescribeTable" if lock(&state.descriptions).is_some() => {
            describe_remembered(&state, &headers, &request, &table).await
        }
        _ => {
            // A write the model does not meter may change items it
            // remembers: it stops remembering (exact, if slower).
            if UNMETERED_WRITES.contains(&target.as_str()) {
                lock(&state.items).clear();
            }
            state
                .send(&target, &request, Some(&headers))
                .await
                .map_err(IntoResponse::into_response)
        }
    };
    match response {
        Ok((status, headers, bytes)) => (status, headers, bytes).into_response(),
        Err(early) => early,
    }
}

/// A server's answer as the model passes it on.
type Answer = (StatusCode, HeaderMap, Bytes);
type Forwarded = Result<Answer, Response>;

/// DescribeTable answered from the table's first successful answer, which
/// is asked of the server and remembered when there is none yet.
async fn describe_remembered(
    state: &ModelState,
    headers: &HeaderMap,
    request: &Value,
    table: &str,
) -> Forwarded {
    let remembered = lock(&state.descriptions)
        .as_ref()
        .and_then(|d| d.get(table).cloned());
    if let Some(answer) = remembered {
        return Ok(answer);
    }
    let answer = state
        .send("DescribeTable", request, Some(headers))
        .await
        .map_err(IntoResponse::into_response)?;
    if answer.0.is_success()
        && let Some(d) = lock(&state.descriptions).as_mut()
    {
        d.insert(table.to_string(), answer.clone());
    }
    Ok(answer)
}

async fn write(
    state: &ModelState,
    headers: &HeaderMap,
    request: &mut Value,
    target: &str,
    table: &str,
    pk: &str,
) -> Forwarded {
    let item_lock = state.key_lock(format!("{table}/{pk}"));
    let _guard = item_lock.lock().await;
    // `Err`: the read failed, so nothing about the item is known.
    let before = match state.remembered(table, pk) {
        Some(before) => Ok(before),
        None => state.watched(table, pk).await,
    };
    let known_before = before.is_ok();
    let before = before.unwrap_or_default();
    let mut keys = vec![PartitionKey {
        scope: "table".into(),
        value: pk.to_string(),
    }];
    for (index, attribute) in INDEXES {
        if let Some(v) = s_attr(before.as_ref(), attribute) {
            keys.push(PartitionKey {
                scope: index.into(),
                value: v,
            });
        }
    }
    if let Some(hot) = state.over_limit(&keys, true) {
        return Err(state.throttle(hot));
    }
    request["ReturnConsumedCapacity"] = json!("INDEXES");
    // A refusal is billed by the item it was checked against, which the
    // server sends back only when asked: asked for here, and taken out
    // again of an answer to a client that did not ask.
    let client_wants_item =
        request.get("ReturnValuesOnConditionCheckFailure") == Some(&json!("ALL_OLD"));
    request["ReturnValuesOnConditionCheckFailure"] = json!("ALL_OLD");
    let (status, mut out_headers, bytes) = match state.send("", request, Some(headers)).await {
        Ok(answer) => answer,
        Err(code) => {
            // The write may have landed with its answer lost.
            state.note_item(table, pk, None);
            return Err(code.into_response());
        }
    };
    if !status.is_success() {
        let unchanged = String::from_utf8_lossy(&bytes).contains("ConditionalCheckFailed");
        state.note_item(table, pk, (unchanged && known_before).then_some(before));
        if !unchanged {
            return Ok((status, out_headers, bytes));
        }
        let refused = refusal(&bytes, client_wants_item);
        state.charge(keys[0].clone(), refused.units, 0.0);
        let mut usage = lock(&state.usage);
        usage.refused_writes += 1;
        usage.refused_writes_with_item += u64::from(refused.carried_item);
        usage.refused_write_units += refused.units;
        let bytes = match refused.rewritten {
            Some(body) => {
                // The server's checksum was of the body it sent.
                out_headers.remove("x-amz-crc32");
                body
            }
            None => bytes,
        };
        return Ok((status, out_headers, bytes));
    }
    let answer: Option<WriteAnswer> = serde_json::from_slice(&bytes).ok();
    let (consumed, attributes) = answer.map_or((None, None), |a| (a.consumed, a.attributes));
    // The after image from the write itself where it tells it: a put's
    // item, a delete's absence, an update's new image when it asked for
    // one; read from the server otherwise.
    let after = match target {
        "PutItem" => Ok(request
            .get("Item")
            .and_then(Value::as_object)
            .map(watched_of)),
        "DeleteItem" => Ok(None),
        _ => match attributes
            .filter(|_| request.get("ReturnValues").and_then(Value::as_str) == Some("ALL_NEW"))
        {
            Some(new) => Ok(Some(watched_of(&new))),
            None => state.watched(table, pk).await,
        },
    };
    // An after image not read (`Err`) is forgotten: the next write reads it.
    state.note_item(table, pk, after.clone().ok());
    let after = after.unwrap_or_default();
    let consumed = consumed.as_ref();
    state.charge(
        keys[0].clone(),
        units(consumed.and_then(|c| c.get("Table"))),
        0.0,
    );
    for (index, attribute) in INDEXES {
        let total = units(
            consumed
                .and_then(|c| c.get("GlobalSecondaryIndexes"))
                .and_then(|g| g.get(index)),
        );
        if total == 0.0 {
            continue;
        }
        let old = s_attr(before.as_ref(), attribute);
        let new = s_attr(after.as_ref(), attribute);
        let charges: Vec<(String, f64)> = match (old, new) {
            (Some(o), Some(n)) if o != n => vec![(o, total / 2.0), (n, total / 2.0)],
            (Some(k), _) | (None, Some(k)) => vec![(k, total)],
            (None, None) => Vec::new(),
        };
        for (value, units) in charges {
            state.charge(
                PartitionKey {
                    scope: index.into(),
                    value,
                },
                units,
                0.0,
            );
        }
    }
    lock(&state.history).push(HistoryEntry {
        at_ms: state.started.elapsed().as_millis() as u64,
        pk: pk.to_string(),
        owner: s_attr(after.as_ref(), "lease_owner"),
        counter: n_attr(after.as_ref(), "lease_counter"),
        expires_at_ms: n_attr(after.as_ref(), "lease_expires_at_ms"),
        worker_state: s_attr(after.as_ref(), "worker_state"),
        deleted: after.is_none(),
    });
    Ok((status, out_headers, bytes))
}

/// What a refused conditional write is billed (DynamoDB: the size of the
/// item the condition was checked against, at least one unit; nothing is
/// written to an index), and its answer as the client asked for it: without
/// the item unless `client_wants_item`. A server that does not send the item
/// (dynalite) is billed the minimum.
fn refusal(bytes: &Bytes, client_wants_item: bool) -> Refusal {
    let Ok(Value::Object(mut answer)) = serde_json::from_slice::<Value>(bytes) else {
        return Refusal {
            units: crate::item_size::write_units(0),
            carried_item: false,
            rewritten: None,
        };
    };
    let item = answer.get("Item").and_then(Value::as_object);
    let units = crate::item_size::write_units(item.map_or(0, crate::item_size::item_size));
    let carried_item = item.is_some();
    let rewritten = (carried_item && !client_wants_item).then(|| {
        answer.remove("Item");
        Bytes::from(Value::Object(answer).to_string())
    });
    Refusal {
        units,
        carried_item,
        rewritten,
    }
}

/// A refused write as the model bills and answers it.
struct Refusal {
    units: f64,
    /// The server sent the item the condition was checked against.
    carried_item: bool,
    /// The answer without the item, for a client that did not ask for it.
    rewritten: Option<Bytes>,
}

/// The partition a query reads: the value compared in its key condition's
/// first clause.
fn query_partition(request: &Value) -> Option<String> {
    let condition = request.get("KeyConditionExpression")?.as_str()?;
    let first = condition.split(" AND ").next()?;
    let values = request.get("ExpressionAttributeValues")?.as_object()?;
    values
        .iter()
        .find(|(placeholder, _)| first.contains(placeholder.as_str()))
        .and_then(|(_, v)| v.get("S")?.as_str().map(str::to_string))
}

async fn read(
    state: &ModelState,
    headers: &HeaderMap,
    request: &mut Value,
    target: &str,
    table: &str,
) -> Forwarded {
    let key = match target {
        "Query" => query_partition(request).map(|value| PartitionKey {
            scope: request
                .get("IndexName")
                .and_then(Value::as_str)
                .unwrap_or("table")
                .to_string(),
            value,
        }),
        "GetItem" => request
            .get("Key")
            .and_then(|k| k.get("Pk"))
            .and_then(|v| v.get("S"))
            .and_then(Value::as_str)
            .map(|pk| PartitionKey {
                scope: "table".into(),
                value: pk.to_string(),
            }),
        _ => None,
    };
    if let Some(k) = &key
        && let Some(hot) = state.over_limit(std::slice::from_ref(k), false)
    {
        return Err(state.throttle(hot));
    }
    request["ReturnConsumedCapacity"] = json!("TOTAL");
    let (status, out_headers, bytes) = state
        .send("", request, Some(headers))
        .await
        .map_err(IntoResponse::into_response)?;
    if status.is_success() {
        let consumed = serde_json::from_slice::<ReadAnswer>(&bytes)
            .ok()
            .and_then(|a| a.consumed);
        let consumed: f64 = match consumed {
            Some(Value::Array(list)) => list.iter().map(|c| units(Some(c))).sum(),
            other => units(other.as_ref()),
        };
        let key = key.unwrap_or(PartitionKey {
            scope: "table".into(),
            value: format!("{target}:{table}"),
        });
        state.charge(key, 0.0, consumed);
    }
    Ok((status, out_headers, bytes))
}

/// Ownership transfers in `history` that skipped both a release and the
/// previous owner's death: moments when two incarnations owned one stream.
/// (Applies to the incarnation protocol, whose owners are `id~suffix`.)
pub fn double_owners(history: &[HistoryEntry]) -> Vec<String> {
    let mut ended: HashMap<String, u64> = HashMap::new();
    for h in history {
        if let Some(inc) = h.pk.strip_prefix("WORKER#")
            && matches!(h.worker_state.as_deref(), Some("DEAD" | "LEFT"))
        {
            ended.entry(inc.to_string()).or_insert(h.at_ms);
        }
    }
    let mut last: HashMap<&str, &HistoryEntry> = HashMap::new();
    let mut bad = Vec::new();
    for h in history.iter().filter(|h| h.pk.starts_with("CONN#")) {
        if let Some(prev) = last.get(h.pk.as_str()) {
            let owned = |e: &HistoryEntry| e.expires_at_ms == Some(tether::lease::OWNED_EXPIRY_MS);
            if owned(prev) && owned(h) && prev.owner != h.owner {
                let previous = prev.owner.clone().unwrap_or_default();
                let ended_at = ended.get(&previous).copied();
                if ended_at.is_none_or(|t| t > h.at_ms) {
                    bad.push(format!(
                        "{}: {} → {:?} at {} ms while {} was live",
                        h.pk, previous, h.owner, h.at_ms, previous
                    ));
                }
            }
        }
        last.insert(h.pk.as_str(), h);
    }
    bad
}

/// Waits until `check` holds, polling.
pub async fn until(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !check() {
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(
        at_ms: u64,
        pk: &str,
        owner: Option<&str>,
        owned: bool,
        state: Option<&str>,
    ) -> HistoryEntry {
        HistoryEntry {
            at_ms,
            pk: pk.into(),
            owner: owner.map(Into::into),
            counter: None,
            expires_at_ms: Some(if owned {
                tether::lease::OWNED_EXPIRY_MS
            } else {
                0
            }),
            worker_state: state.map(Into::into),
            deleted: false,
        }
    }

    #[test]
    fn a_transfer_is_only_safe_after_a_release_or_the_owner_s_end() {
        let safe = vec![
            entry(1, "CONN#a/s", Some("w1~1"), true, None),
            entry(2, "WORKER#w1~1", None, false, Some("DEAD")),
            entry(3, "CONN#a/s", Some("w2~2"), true, None),
            entry(4, "CONN#a/s", Some("w2~2"), false, None),
            entry(5, "CONN#a/s", Some("w3~3"), true, None),
        ];
        assert!(double_owners(&safe).is_empty());
        let unsafe_ = vec![
            entry(1, "CONN#a/s", Some("w1~1"), true, None),
            entry(2, "CONN#a/s", Some("w2~2"), true, None),
            entry(3, "WORKER#w1~1", None, false, Some("DEAD")),
        ];
        assert_eq!(double_owners(&unsafe_).len(), 1);
    }

    #[test]
    fn queries_are_charged_to_the_partition_their_key_condition_names() {
        let q = json!({"KeyConditionExpression": "#p = :p", "ExpressionAttributeValues": {":p": {"S": "UNOWNED#3"}}});
        assert_eq!(query_partition(&q).as_deref(), Some("UNOWNED#3"));
        let v1 = json!({"KeyConditionExpression": "desired_state = :partition AND lease_expires_at_ms < :now",
            "ExpressionAttributeValues": {":partition": {"S": "STARTED"}, ":now": {"N": "5"}}});
        assert_eq!(query_partition(&v1).as_deref(), Some("STARTED"));
    }

    /// The item count in a DescribeTable answer from `endpoint`.
    async fn item_count(endpoint: &str, table: &str) -> i64 {
        let request = reqwest::Client::new()
            .post(endpoint)
            .body(json!({ "TableName": table }).to_string());
        let answer: Value = own_call(request, "DescribeTable")
            .send()
            .await
            .expect("DescribeTable is answered")
            .json()
            .await
            .expect("a JSON answer");
        answer["Table"]["ItemCount"]
            .as_i64()
            .unwrap_or_else(|| panic!("no item count in {answer}"))
    }

    #[tokio::test]
    async fn a_remembered_description_is_answered_from_memory_and_others_from_the_server() {
        let store = crate::store::fresh_store(None).await;
        let table = store.table().to_string();
        let server = crate::store::endpoint().0;
        let passed = CapacityModel::start(crate::bed::loopback(), &server, true)
            .await
            .unwrap();
        let remembering = CapacityModel::start(crate::bed::loopback(), &server, true)
            .await
            .unwrap();
        remembering.remember_table_descriptions();
        assert_eq!(item_count(&remembering.endpoint(), &table).await, 0);
        let spec = crate::fixtures::log_spec("ws://127.0.0.1:9/never-dialled");
        let desired = spec.to_desired(tether::lease::StreamKey::new("model", "s1"), 1, None);
        store.upsert_desired(&desired).await.unwrap();
        let now = item_count(&server, &table).await;
        assert!(now > 0, "the stream's item is counted");
        assert_eq!(item_count(&passed.endpoint(), &table).await, now);
        assert_eq!(
            item_count(&remembering.endpoint(), &table).await,
            0,
            "the first answer, remembered"
        );
    }

    /// Sends one DynamoDB call to `endpoint`: its status and answer.
    async fn call(endpoint: &str, target: &str, body: Value) -> (StatusCode, String) {
        let request = reqwest::Client::new().post(endpoint).body(body.to_string());
        let answer = own_call(request, target).send().await.expect("answered");
        (answer.status(), answer.text().await.unwrap_or_default())
    }

    /// A model in front of a fault proxy in front of a plain model (which
    /// counts what reaches the server) in front of the server.
    struct Chain {
        model: CapacityModel,
        faults: crate::dynamo_proxy::DynamoFaultProxy,
        counter: CapacityModel,
        table: String,
    }

    impl Chain {
        async fn start() -> Self {
            let table = crate::store::fresh_store(None).await.table().to_string();
            let server = crate::store::endpoint().0;
            let counter = CapacityModel::start(crate::bed::loopback(), &server, false)
                .await
                .unwrap();
            let faults = crate::dynamo_proxy::DynamoFaultProxy::start(
                crate::bed::loopback(),
                &counter.endpoint(),
            )
            .await
            .unwrap();
            let model = CapacityModel::start(crate::bed::loopback(), &faults.endpoint(), true)
                .await
                .unwrap();
            Self {
                model,
                faults,
                counter,
                table,
            }
        }

        /// One write through the model: its status, and how many requests
        /// reached the server for it.
        async fn write(&self, target: &str, mut body: Value) -> (StatusCode, u64) {
            body["TableName"] = json!(self.table);
            let before = self.counter.report().requests;
            let (status, _) = call(&self.model.endpoint(), target, body).await;
            (status, self.counter.report().requests - before)
        }
    }

    /// A write to one stream item; `holder` names the `by_holder` partition
    /// it moves the item to.
    fn update(holder: &str, returning: &str, only_if_holder: Option<&str>) -> Value {
        let mut body = json!({
            "Key": {"Pk": {"S": "CONN#model/t1"}},
            "UpdateExpression": "SET #h = :h, lease_owner = :o",
            "ExpressionAttributeNames": {"#h": "holder"},
            "ExpressionAttributeValues": {":h": {"S": holder}, ":o": {"S": "w~1"}},
            "ReturnValues": returning,
        });
        if let Some(h) = only_if_holder {
            body["ConditionExpression"] = json!("#h = :was");
            body["ExpressionAttributeValues"][":was"] = json!({"S": h});
        }
        body
    }

    fn put(holder: &str) -> Value {
        json!({"Item": {
            "Pk": {"S": "CONN#model/t1"},
            "holder": {"S": holder},
            "change_shard": {"S": "model#1"},
            "changed_at_ms": {"N": "1"},
            "desired_state": {"S": "STARTED"},
        }})
    }

    /// A refused conditional write is billed as DynamoDB bills it: by the
    /// size of the item the condition was checked against (here ~2.5 KB:
    /// three units) on the item's key, none to an index. The item the model
    /// asks for to size it reaches only a client that asked for it too.
    #[tokio::test]
    async fn a_refused_write_is_billed_by_the_size_of_the_item_it_was_checked_against() {
        let chain = Chain::start().await;
        let mut item = put("UNOWNED#1");
        item["Item"]["padding"] = json!({"S": "x".repeat(2500)});
        assert!(chain.write("PutItem", item).await.0.is_success());
        let before = chain.model.write_units_by_key();
        let key = PartitionKey {
            scope: "table".into(),
            value: "CONN#model/t1".into(),
        };
        let refused = || {
            let mut body = update("w~1#2", "NONE", Some("UNOWNED#9"));
            body["TableName"] = json!(chain.table);
            body
        };
        let request = reqwest::Client::new()
            .post(chain.model.endpoint())
            .body(refused().to_string());
        let answered = own_call(request, "UpdateItem").send().await.unwrap();
        // The server's checksum was of the body with the item: an answer
        // rewritten without it must not carry it (clients that check it,
        // such as botocore, would refuse the answer).
        assert!(
            answered.headers().get("x-amz-crc32").is_none(),
            "{:?}",
            answered.headers()
        );
        let (status, answer) = (answered.status(), answered.text().await.unwrap());
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert!(answer.contains("ConditionalCheckFailed"), "{answer}");
        assert!(!answer.contains("padding"), "not asked for: {answer}");
        let mut asking = refused();
        asking["ReturnValuesOnConditionCheckFailure"] = json!("ALL_OLD");
        let (_, answer) = call(&chain.model.endpoint(), "UpdateItem", asking).await;
        assert!(answer.contains("padding"), "asked for: {answer}");
        let after = chain.model.write_units_by_key();
        let charged = |units: &HashMap<PartitionKey, f64>| units.get(&key).copied().unwrap_or(0.0);
        assert_eq!(charged(&after) - charged(&before), 6.0, "{after:?}");
        assert!(
            after
                .iter()
                .all(|(k, v)| k.scope == "table" || before.get(k) == Some(v)),
            "no index is charged for a refusal: {before:?} -> {after:?}"
        );
        let report = chain.model.report();
        assert_eq!(
            (report.refused_writes, report.refused_write_units),
            (2, 6.0)
        );
    }

    /// The same writes through a model that remembers items and one that
    /// reads around every write: the same units charged to the same keys
    /// and the same history, in a third of the requests where the write
    /// tells its after image. Among them a write whose answer is lost after
    /// it landed (the remembering model must read the item again, or it
    /// would charge the next write's `by_holder` units to a partition the
    /// item has left) and one whose condition failed (nothing changed).
    #[tokio::test]
    async fn a_model_that_remembers_items_meters_exactly_as_one_that_reads_them() {
        let remembering = Chain::start().await;
        remembering
            .model
            .remember_items(&remembering.table)
            .await
            .unwrap();
        let reading = Chain::start().await;
        let mut sent = [Vec::new(), Vec::new()];
        for (chain, sent) in [&remembering, &reading].into_iter().zip(&mut sent) {
            let steps = [
                ("PutItem", put("UNOWNED#1"), true),
                (
                    "UpdateItem",
                    update("w~1#2", "ALL_NEW", Some("UNOWNED#1")),
                    true,
                ),
                (
                    "UpdateItem",
                    update("w~1#9", "ALL_NEW", Some("UNOWNED#1")),
                    false,
                ),
                ("UpdateItem", update("w~1#3", "NONE", None), true),
                ("UpdateItem", update("w~1#4", "NONE", None), false),
                ("UpdateItem", update("w~1#5", "ALL_NEW", None), true),
                (
                    "DeleteItem",
                    json!({"Key": {"Pk": {"S": "CONN#model/t1"}}}),
                    true,
                ),
                ("PutItem", put("UNOWNED#2"), true),
            ];
            for (i, (target, body, succeeds)) in steps.into_iter().enumerate() {
                if i == 4 {
                    chain
                        .faults
                        .set(crate::dynamo_proxy::DynamoFault::LoseNextWriteAnswer);
                }
                let (status, requests) = chain.write(target, body).await;
                assert_eq!(status.is_success(), succeeds, "step {i}: {status}");
                sent.push(requests);
            }
        }
        let charged = remembering.model.write_units_by_key();
        assert_eq!(charged, reading.model.write_units_by_key());
        let lost_write_left = PartitionKey {
            scope: "by_holder".into(),
            value: "w~1#4".into(),
        };
        assert!(
            charged.contains_key(&lost_write_left),
            "the write after the lost answer is charged to the partition the item left: {charged:?}"
        );
        let entries = |chain: &Chain| -> Vec<String> {
            chain
                .model
                .history()
                .iter()
                .map(|h| format!("{} {:?} {}", h.pk, h.owner, h.deleted))
                .collect()
        };
        assert_eq!(entries(&remembering), entries(&reading));
        assert_eq!(
            entries(&remembering).len(),
            6,
            "every landed write with a known answer"
        );
        // Reading: every write is read before, and after unless it told
        // its after image (a put, a delete, an update returning ALL_NEW).
        assert_eq!(sent[1], [2, 2, 2, 3, 2, 2, 2, 2]);
        // Remembering: read only an item it never saw (the first put) or
        // forgot (after the lost answer), and after an update returning
        // nothing.
        assert_eq!(sent[0], [2, 1, 1, 2, 1, 2, 1, 1]);
    }
}
