//! The one TLS choice of the process: rustls with ring (no aws-lc, which
//! needs cmake; no OpenSSL).

/// Installs rustls's ring provider as the process default.
///
/// kube's client asks rustls for the process-level provider; with both ring and
/// aws-lc compiled in it cannot pick one and panics, so we choose explicitly, once.
pub fn install_crypto_provider() {
    // Err means a provider is already installed, which is what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The HTTP client of tether's AWS SDK sink clients (Kinesis): rustls with
/// ring, with the ring provider installed process-wide.
pub fn aws_http_client() -> aws_smithy_runtime_api::client::http::SharedHttpClient {
    rustls_ring(aws_smithy_http_client::Builder::new())
}

/// [`aws_http_client`] keeping at most `max_idle_per_host` idle connections
/// per host (the lease store's: see `MAX_STREAM_WRITES_IN_FLIGHT`).
pub fn aws_http_client_keeping(
    max_idle_per_host: usize,
) -> aws_smithy_runtime_api::client::http::SharedHttpClient {
    rustls_ring(aws_smithy_http_client::Builder::new().pool_max_idle_per_host(max_idle_per_host))
}

fn rustls_ring(
    builder: aws_smithy_http_client::Builder,
) -> aws_smithy_runtime_api::client::http::SharedHttpClient {
    install_crypto_provider();
    builder
        .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
            aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https()
}
