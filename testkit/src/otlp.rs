//! An OTLP/HTTP receiver for traces in JSON encoding (`http/json`), as a
//! collector would run it: workers export to it with the standard `OTEL_*`
//! variables and tests read back the spans.

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// One received span, its attributes as strings.
#[derive(Clone, Debug)]
pub struct Span {
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub name: String,
    pub service: String,
    pub attributes: HashMap<String, String>,
}

impl Span {
    pub fn attr(&self, key: &str) -> &str {
        self.attributes.get(key).map_or("", String::as_str)
    }
}

pub struct OtlpReceiver {
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<Span>>>,
    task: JoinHandle<()>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl OtlpReceiver {
    pub async fn start(listen: SocketAddr) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let spans = Arc::new(Mutex::new(Vec::new()));
        let app = Router::new()
            .route("/v1/traces", post(receive))
            .with_state(spans.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, spans, task })
    }

    /// What `OTEL_EXPORTER_OTLP_ENDPOINT` is set to.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

/// An attribute value as text, whichever OTLP type it has.
fn value_text(v: &serde_json::Value) -> String {
    for key in ["stringValue", "intValue", "doubleValue", "boolValue"] {
        match v.get(key) {
            Some(serde_json::Value::String(s)) => return s.clone(),
            Some(other) if !other.is_null() => return other.to_string(),
            _ => {}
        }
    }
    String::new()
}

fn attributes(list: &serde_json::Value) -> HashMap<String, String> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|kv| Some((kv["key"].as_str()?.to_string(), value_text(&kv["value"]))))
        .collect()
}

async fn receive(
    State(spans): State<Arc<Mutex<Vec<Span>>>>,
    body: axum::body::Bytes,
) -> axum::http::StatusCode {
    let Ok(request) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return axum::http::StatusCode::BAD_REQUEST;
    };
    let mut received = Vec::new();
    for resource in request["resourceSpans"].as_array().into_iter().flatten() {
        let service = attributes(&resource["resource"]["attributes"])
            .remove("service.name")
            .unwrap_or_default();
        for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
            for span in scope["spans"].as_array().into_iter().flatten() {
                received.push(Span {
                    trace_id: span["traceId"].as_str().unwrap_or_default().into(),
                    span_id: span["spanId"].as_str().unwrap_or_default().into(),
                    parent_span_id: span["parentSpanId"].as_str().unwrap_or_default().into(),
                    name: span["name"].as_str().unwrap_or_default().into(),
                    service: service.clone(),
                    attributes: attributes(&span["attributes"]),
                });
            }
        }
    }
    if let Ok(mut all) = spans.lock() {
        all.extend(received);
    }
    axum::http::StatusCode::OK
}
