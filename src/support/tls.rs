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

/// The HTTP client every AWS SDK client of tether uses (DynamoDB, Kinesis):
/// rustls with ring, with the ring provider installed process-wide.
pub fn aws_http_client() -> aws_smithy_runtime_api::client::http::SharedHttpClient {
    install_crypto_provider();
    aws_smithy_http_client::Builder::new()
        .tls_provider(aws_smithy_http_client::tls::Provider::Rustls(
            aws_smithy_http_client::tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https()
}
