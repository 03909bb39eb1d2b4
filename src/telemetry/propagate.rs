//! W3C trace context (`traceparent`) for what leaves the worker with a
//! delivery: HTTP sink requests and NATS message headers. With tracing off no
//! propagator is installed and nothing is added.

use opentelemetry::propagation::Injector;
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct HttpHeaders<'a>(&'a mut http::HeaderMap);

impl Injector for HttpHeaders<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

struct NatsHeaders<'a>(&'a mut async_nats::HeaderMap);

impl Injector for NatsHeaders<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value.as_str());
    }
}

/// Adds the current span's context to an HTTP request's headers.
pub fn inject_http(headers: &mut http::HeaderMap) {
    let context = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&context, &mut HttpHeaders(headers))
    });
}

/// Adds the current span's context to a NATS message's headers.
pub fn inject_nats(headers: &mut async_nats::HeaderMap) {
    let context = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&context, &mut NatsHeaders(headers))
    });
}
