//! Small tools the domain modules share and none of them owns: the backoff
//! policy of store calls, sessions, delivery and the controller; the one TLS
//! setup of every AWS client; a lock that survives a panicked holder; the
//! nearest-rank quantile of the demo's and benchmark's figures; the
//! binaries' memory allocator.

mod allocator;
mod lock;
mod quantile;
mod retry;
mod tls;

pub use allocator::Allocator;
pub use lock::lock;
pub use quantile::quantile;
pub use retry::{RetryPolicy, exponential};
pub use tls::{aws_http_client, aws_http_client_keeping, install_crypto_provider};

/// For tests: an address that counts every connection it is offered (a
/// forbidden target that must see none).
#[cfg(test)]
pub(crate) async fn counting_listener() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let offered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = offered.clone();
    tokio::spawn(async move {
        while let Ok((_socket, _)) = listener.accept().await {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    (addr, offered)
}
