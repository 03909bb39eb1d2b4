//! Serving one stream: the holder task that owns it (status, control-plane
//! changes, release), the WebSocket session it runs, the dialer with its
//! host policy and connect rate, sequence numbers, batched delivery into the
//! sink, the stream's progress, and the set of streams this incarnation holds.

mod connect_limit;
mod delivery;
mod holder;
mod kinesis_scope;
mod progress;
mod registry;
mod sequence;
mod session;
mod transport;

pub use connect_limit::ConnectLimiter;
pub use holder::{Holder, HolderEnd};
pub use kinesis_scope::KinesisStreams;
pub use progress::StreamProgress;
pub use registry::{HeldStream, HolderSignals, Registry};
pub use session::{
    SessionConfig, SessionControl, SessionDeps, SessionEnd, Sessions, WebSocketSessions,
};
pub use transport::{Dialer, READ_BUFFER_BYTES, tls_config};
