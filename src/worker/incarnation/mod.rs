//! Being alive: the liveness task renews this incarnation's worker item every
//! heartbeat (carrying the packed checkpoints of the streams it holds and
//! reading its inbox), and the container-restart proof lets a restarted
//! container declare its predecessor dead at once.

mod checkpoints;
mod liveness;
mod restart;
mod slot_book;

pub(super) use liveness::{Liveness, LivenessEnd};
pub use restart::PodLookup;
