//! The one way the test kit's HTTP proxies hand an upstream answer back.

use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

/// `resp` as the proxy's own answer: status, headers (less the framing ones,
/// which the proxy's server sets itself) and body; 502 when there is none.
pub async fn relay(resp: Result<reqwest::Response, reqwest::Error>) -> Response {
    let Ok(resp) = resp else {
        return StatusCode::BAD_GATEWAY.into_response();
    };
    let status = resp.status();
    let mut out = HeaderMap::new();
    for (name, value) in resp.headers() {
        if name != "content-length" && name != "transfer-encoding" {
            out.insert(name.clone(), value.clone());
        }
    }
    (status, out, resp.bytes().await.unwrap_or_default()).into_response()
}
