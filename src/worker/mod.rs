//! The worker: one incarnation at a time registers its worker item, renews it
//! every heartbeat, acquires streams, and runs one holder task per held
//! stream. On shutdown it stops acquiring, drains every session within a
//! bound, releases every stream with its last acknowledged checkpoint, audits
//! its own partitions, and leaves. If a peer declares it dead (it was cut off
//! longer than a lease), everything it held has moved: it starts over as a
//! new incarnation.
//!
//! Three concerns, one room each, and the loop that runs them:
//! - `incarnation/`: being alive — the heartbeat (liveness), the packed
//!   checkpoints it carries, and the container-restart proof;
//! - `acquirer/`: taking streams — fair share, reading peers, declaring the
//!   overdue dead, and what the departed left;
//! - `stream/`: serving one stream — the holder, its session, delivery,
//!   sequence numbers, progress, and the set of streams held;
//! - `run` (the main loop), `context` and `shared` (what the tasks are given),
//!   `fence` (when this incarnation must stop acting), `pokes` (telling
//!   peers a change is waiting), `settings`, `error`.

mod acquirer;
mod context;
mod error;
mod fence;
mod incarnation;
mod pokes;
mod run;
mod settings;
mod shared;
mod stream;

pub use context::WorkerCtx;
pub use error::WorkerError;
pub use fence::fence_window;
pub use incarnation::PodLookup;
pub use pokes::Pokes;
pub use run::run;
pub use settings::{WorkerSettings, default_worker_id};
pub use stream::{
    Origin, Provenance, READ_BUFFER_BYTES, SessionConfig, SessionControl, SessionDeps, SessionEnd,
    Sessions, StreamProgress, tls_config,
};
