//! Logs and traces. Logs go to standard error (text or JSON). Traces are
//! exported with OpenTelemetry over OTLP/HTTP only when an endpoint is
//! configured with the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT` or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); without one no exporter, no
//! propagator and no span data beyond the log layer's exist.
//!
//! The spans: `session` (one per upstream session of a stream, with `stream`,
//! `token`, `worker`), its children `connect` (dial, TLS, resume point) and
//! `sink.batch` (one per delivery attempt), and `lease.*` for the store's
//! stream operations (acquire, release, handoff, checkpoint).

mod propagate;

pub use propagate::{inject_http, inject_nats};

/// How log lines are written (`--log-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// The log filter without `RUST_LOG`: our own info, the SDKs' warnings.
const DEFAULT_FILTER: &str = "info,aws_config=error,aws_smithy_runtime=warn,kube=warn,dynoxide=error,async_nats=warn,opentelemetry=warn";
/// `service.name` unless `OTEL_SERVICE_NAME` or `OTEL_RESOURCE_ATTRIBUTES` says otherwise.
const SERVICE_NAME: &str = "tether";

/// Flushes and stops the trace exporter when dropped (outside the runtime).
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            eprintln!("warning: flushing traces at exit failed: {e}");
        }
    }
}

/// Where traces go, read from the standard `OTEL_*` variables.
#[derive(Debug, PartialEq, Eq)]
pub struct ExportConfig {
    pub protocol: Protocol,
}

impl ExportConfig {
    /// `None` when tracing is off: no endpoint, `OTEL_SDK_DISABLED=true` or
    /// `OTEL_TRACES_EXPORTER=none`. gRPC is not built in: said once, and off.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, String> {
        let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        if set("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
            || set("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"))
        {
            return Ok(None);
        }
        if set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            .or_else(|| set("OTEL_EXPORTER_OTLP_ENDPOINT"))
            .is_none()
        {
            return Ok(None);
        }
        let protocol = set("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .or_else(|| set("OTEL_EXPORTER_OTLP_PROTOCOL"))
            .unwrap_or_else(|| "http/protobuf".into());
        let protocol = match protocol.trim() {
            "http/protobuf" => Protocol::HttpBinary,
            "http/json" => Protocol::HttpJson,
            other => {
                return Err(format!(
                    "OTEL_EXPORTER_OTLP_PROTOCOL={other} is not supported (use http/protobuf or http/json); traces are off"
                ));
            }
        };
        Ok(Some(Self { protocol }))
    }
}

/// Starts logging, and trace export when configured. Call once, before the
/// async runtime starts (the exporter runs on a thread of its own).
pub fn init(format: LogFormat) -> Telemetry {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_FILTER));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = match format {
        LogFormat::Json => fmt.json().boxed(),
        LogFormat::Text => fmt.boxed(),
    };
    let (provider, problem) = match ExportConfig::from_env(|k| std::env::var(k).ok()) {
        Ok(Some(config)) => match provider(&config) {
            Ok(p) => (Some(p), None),
            Err(e) => (None, Some(format!("cannot start trace export: {e}"))),
        },
        Ok(None) => (None, None),
        Err(e) => (None, Some(e)),
    };
    let otel = provider.as_ref().map(|p| {
        opentelemetry::global::set_text_map_propagator(
            opentelemetry_sdk::propagation::TraceContextPropagator::new(),
        );
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer(SERVICE_NAME))
            .with_tracked_inactivity(false)
    });
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(otel.map(|l| l.with_filter(spans_only())))
        .init();
    if let Some(problem) = problem {
        tracing::warn!("{problem}");
    }
    Telemetry { provider }
}

/// The exporter sees tether's own spans, not the SDKs' internals or events.
fn spans_only() -> EnvFilter {
    EnvFilter::new("off,tether=info")
}

fn provider(config: &ExportConfig) -> Result<SdkTracerProvider, String> {
    crate::support::install_crypto_provider();
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(config.protocol)
        .build()
        .map_err(|e| e.to_string())?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none()
        && !std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|a| a.contains("service.name="))
    {
        resource = resource.with_service_name(SERVICE_NAME);
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> Result<Option<ExportConfig>, String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ExportConfig::from_env(|k| vars.get(k).cloned())
    }

    #[test]
    fn tracing_is_off_unless_an_endpoint_is_configured() {
        assert_eq!(config(&[]), Ok(None));
        assert_eq!(
            config(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_SDK_DISABLED", "true")
            ]),
            Ok(None)
        );
        assert_eq!(
            config(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_TRACES_EXPORTER", "none")
            ]),
            Ok(None)
        );
    }

    #[test]
    fn the_standard_protocol_variables_choose_the_encoding() {
        assert_eq!(
            config(&[(
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "http://c:4318/v1/traces"
            )]),
            Ok(Some(ExportConfig {
                protocol: Protocol::HttpBinary
            }))
        );
        assert_eq!(
            config(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
                ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
            ]),
            Ok(Some(ExportConfig {
                protocol: Protocol::HttpJson
            }))
        );
        assert!(
            config(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
            ])
            .unwrap_err()
            .contains("not supported")
        );
    }
}
