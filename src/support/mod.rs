//! Small tools the domain modules share and none of them owns: the backoff
//! policy of store calls, sessions, delivery and the controller; the one TLS
//! setup of every AWS client; a lock that survives a panicked holder; the
//! nearest-rank quantile of the demo's and benchmark's figures.

mod lock;
mod quantile;
mod retry;
mod tls;

pub use lock::lock;
pub use quantile::quantile;
pub use retry::{RetryPolicy, exponential};
pub use tls::{aws_http_client, install_crypto_provider};
