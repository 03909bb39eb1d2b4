//! Dialling an upstream: resume URL, host policy on resolved addresses, header
//! references resolved at connect time, TCP, TLS (rustls, verification always
//! on) and the WebSocket handshake. The socket under a session is plain TCP or
//! boxed TLS (`socket::Transport`), so a `ws://` session does not carry the
//! size of a TLS connection.

use super::socket::{Transport, Ws};
use crate::crd::StreamConnectionSpec;
use crate::egress::{HostPolicy, PolicyError};
use crate::lease::StreamKey;
use crate::secrets::SecretSource;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{self};
use tracing::Instrument;
use url::Url;

/// Read buffer per session. tungstenite's default (128 KiB) dominates an idle
/// session's memory; 4 KiB costs a few more reads for large messages only.
pub const READ_BUFFER_BYTES: usize = 4 * 1024;
/// Bound on TCP connect + TLS + WebSocket handshake.
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The text in `spec.url` replaced by the checkpoint at every connect.
pub(super) const LAST_SEQ_PLACEHOLDER: &str = "{last_seq}";

/// Why a connect failed.
#[derive(Debug)]
pub enum ConnectError {
    Policy(PolicyError),
    Header(String),
    Io(String),
    Tls(String),
    Handshake(tungstenite::Error),
    Timeout,
}

impl ConnectError {
    /// A fixed label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Policy(_) => "host_policy",
            Self::Header(_) => "header_reference",
            Self::Io(_) => "connect",
            Self::Tls(_) => "tls",
            Self::Handshake(_) => "handshake",
            Self::Timeout => "connect_timeout",
        }
    }

    /// The status reason users see.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Policy(_) => "HostRefused",
            Self::Header(_) => "HeaderUnavailable",
            Self::Tls(_) => "TLSError",
            Self::Handshake(_) => "HandshakeFailed",
            Self::Io(_) | Self::Timeout => "ConnectFailed",
        }
    }

    /// Refusals that retrying cannot fix (until the spec changes).
    pub fn is_permanent(&self) -> bool {
        matches!(self, Self::Policy(e) if e.is_permanent())
    }

    pub fn message(&self) -> String {
        match self {
            Self::Policy(e) => e.to_string(),
            Self::Header(e) | Self::Io(e) | Self::Tls(e) => e.clone(),
            Self::Handshake(e) => e.to_string(),
            Self::Timeout => format!("no handshake within {CONNECT_TIMEOUT:?}"),
        }
    }
}

/// The URL of a connect: the template with the checkpoint, or, with no
/// checkpoint yet, `initial_url` if given, else the template with the
/// placeholder removed (an empty value, never a made-up 0).
pub(super) fn resume_url(
    template: &str,
    initial_url: Option<&str>,
    checkpoint: Option<u64>,
) -> String {
    match (checkpoint, initial_url) {
        (Some(seq), _) => template.replace(LAST_SEQ_PLACEHOLDER, &seq.to_string()),
        (None, Some(initial)) => initial.to_string(),
        (None, None) => template.replace(LAST_SEQ_PLACEHOLDER, ""),
    }
}

/// What every session of a worker dials with.
#[derive(Clone)]
pub struct Dialer {
    pub policy: HostPolicy,
    pub tls: Arc<rustls::ClientConfig>,
    pub secrets: SecretSource,
    /// Paces connects per upstream host.
    pub connect_limit: super::connect_limit::ConnectLimiter,
}

impl Dialer {
    /// Opens a session for `key` at `url`.
    pub async fn dial(
        &self,
        key: &StreamKey,
        spec: &StreamConnectionSpec,
        url: &str,
    ) -> Result<Ws, ConnectError> {
        let url = Url::parse(url).map_err(|e| ConnectError::Io(format!("invalid URL: {e}")))?;
        let addrs = self
            .policy
            .resolve(&url)
            .await
            .map_err(ConnectError::Policy)?;
        let mut request = url
            .as_str()
            .into_client_request()
            .map_err(ConnectError::Handshake)?;
        for header in &spec.headers {
            let value = self
                .secrets
                .resolve(&key.namespace, &header.value_from)
                .await
                .map_err(ConnectError::Header)?;
            let name = tungstenite::http::HeaderName::from_bytes(header.name.as_bytes()).map_err(
                |_| ConnectError::Header(format!("invalid header name {}", header.name)),
            )?;
            let mut value = HeaderValue::from_str(&value).map_err(|_| {
                ConnectError::Header(format!("value of header {} is not valid", header.name))
            })?;
            // Keeps the value out of any Debug output of the request.
            value.set_sensitive(true);
            request.headers_mut().insert(name, value);
        }
        let mut last_error = String::from("no address");
        let mut tcp = None;
        for addr in addrs {
            match TcpStream::connect(addr).await {
                Ok(s) => {
                    tcp = Some(s);
                    break;
                }
                Err(e) => last_error = format!("{addr}: {e}"),
            }
        }
        let tcp = tcp.ok_or(ConnectError::Io(last_error))?;
        let _ = tcp.set_nodelay(true);
        let limits = &spec.limits;
        let config = WebSocketConfig::default()
            .read_buffer_size(READ_BUFFER_BYTES)
            .write_buffer_size(0)
            .max_message_size(Some(limits.max_message_bytes as usize))
            .max_frame_size(Some(limits.max_frame_bytes as usize));
        // TLS is done here rather than inside tungstenite so a certificate or
        // protocol failure is reported as a TLS error, not a generic I/O one.
        let stream = if url.scheme() == "wss" {
            let host = url
                .host_str()
                .unwrap_or_default()
                .trim_start_matches('[')
                .trim_end_matches(']');
            let name = rustls::pki_types::ServerName::try_from(host.to_string())
                .map_err(|e| ConnectError::Tls(format!("invalid TLS server name {host}: {e}")))?;
            let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
                .connect(name, tcp)
                .instrument(tracing::info_span!("tls", server = host))
                .await
                .map_err(|e| ConnectError::Tls(format!("TLS handshake with {host} failed: {e}")))?;
            Transport::Tls(Box::new(tls))
        } else {
            Transport::Plain(tcp)
        };
        Ws::handshake(request, stream, config)
            .await
            .map_err(ConnectError::Handshake)
    }
}

/// The TLS client configuration every session shares: Mozilla's roots (webpki)
/// plus any CA certificates in `ca_file`, verification always on, ring as the
/// provider.
pub fn tls_config(ca_file: Option<&std::path::Path>) -> Result<Arc<rustls::ClientConfig>, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    if let Some(path) = ca_file {
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| format!("cannot read --ca-file {}: {e}", path.display()))?;
        if certs.is_empty() {
            return Err(format!(
                "--ca-file {} holds no certificates",
                path.display()
            ));
        }
        for cert in certs {
            roots
                .add(cert)
                .map_err(|e| format!("--ca-file {}: {e}", path.display()))?;
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("TLS setup failed: {e}"))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resume_url_distinguishes_no_checkpoint_from_checkpoint_zero() {
        let t = "wss://feed/x?after={last_seq}";
        assert_eq!(resume_url(t, None, Some(0)), "wss://feed/x?after=0");
        assert_eq!(resume_url(t, None, Some(41)), "wss://feed/x?after=41");
        assert_eq!(resume_url(t, None, None), "wss://feed/x?after=");
        assert_eq!(resume_url(t, Some("wss://feed/x"), None), "wss://feed/x");
        assert_eq!(
            resume_url(t, Some("wss://feed/x"), Some(2)),
            "wss://feed/x?after=2"
        );
    }
}
