//! Serving one stream: the holder task that owns it (status, control-plane
//! changes, release), the WebSocket session it runs, the dialer with its
//! host policy and connect rate, sequence numbers, batched delivery into the
//! sink, the stream's progress, and the set of streams this incarnation holds.

mod connect_limit;
mod delivery;
mod holder;
mod progress;
mod provenance;
mod registry;
mod sequence;
mod sequence_prefix;
mod session;
mod socket;
mod transport;

pub(super) use connect_limit::ConnectLimiter;
pub(super) use holder::{Holder, HolderEnd};
pub use progress::StreamProgress;
pub use provenance::{Origin, Provenance};
pub(super) use registry::{HeldStream, Registry};
pub(super) use session::WebSocketSessions;
pub use session::{SessionConfig, SessionControl, SessionDeps, SessionEnd, Sessions};
pub(super) use transport::Dialer;
pub use transport::{READ_BUFFER_BYTES, tls_config};
