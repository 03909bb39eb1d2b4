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

/// Idle connections the store's client keeps per host. A worker's steady
/// state (a renewal per heartbeat, a pass's reads, the odd owner write)
/// uses a few; a burst (a thousand sessions writing their status, 32 at a
/// time, beside acquires and reads) opened about 60, and the pool kept them
/// all until they timed out: at about 50 KiB each (dispatch channel,
/// buffers), 2–3 KiB per session of a thousand just connected. Connections
/// over this are closed as they come back; a sustained burst keeps its own
/// busy. Sinks keep the default: their concurrency is the traffic's.
const STORE_MAX_IDLE_CONNECTIONS_PER_HOST: usize = 8;

/// The HTTP client of tether's AWS SDK sink clients (Kinesis): rustls with
/// ring, with the ring provider installed process-wide.
pub fn aws_http_client() -> aws_smithy_runtime_api::client::http::SharedHttpClient {
    rustls_ring(aws_smithy_http_client::Builder::new())
}

/// [`aws_http_client`] for the lease store (DynamoDB): at most
/// [`STORE_MAX_IDLE_CONNECTIONS_PER_HOST`] idle connections kept.
pub fn store_http_client() -> aws_smithy_runtime_api::client::http::SharedHttpClient {
    rustls_ring(
        aws_smithy_http_client::Builder::new()
            .pool_max_idle_per_host(STORE_MAX_IDLE_CONNECTIONS_PER_HOST),
    )
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
