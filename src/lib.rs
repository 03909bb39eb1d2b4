//! tether: keeps long-lived outbound WebSocket streams alive across a fleet of
//! workers, with stream ownership decided by DynamoDB conditional writes and
//! liveness proven once per worker incarnation.
#![forbid(unsafe_code)]
// `pub` means "part of the library's surface": anything only this crate uses
// is `pub(crate)`, so the compiler shows what each room exports.
#![warn(unreachable_pub)]

pub mod cli;
pub mod config;
pub mod controller;
pub mod crd;
pub mod egress;
pub mod embedded;
mod emf;
pub mod http;
pub mod lease;
mod manifest;
pub mod metrics;
mod mirror;
pub mod process_metrics;
pub mod secrets;
pub mod sink;
pub mod support;
pub mod telemetry;
pub mod worker;

pub use support::install_crypto_provider;
