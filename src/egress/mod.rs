//! Where a tenant's stream may reach: the hosts its upstream and its sink may
//! be dialled at (checked on the addresses actually dialled), and the Kinesis
//! data streams its sink may write with the worker's own role.

mod hosts;
mod kinesis;

pub use hosts::{HostPolicy, PolicyError, PolicyResolver};
pub use kinesis::KinesisStreams;
