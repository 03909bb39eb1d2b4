//! tether: keeps long-lived outbound WebSocket streams alive across a fleet of
//! workers, with stream ownership decided by DynamoDB conditional writes and
//! liveness proven once per worker incarnation.
#![forbid(unsafe_code)]

pub mod cli;
pub mod config;
pub mod controller;
pub mod crd;
pub mod egress;
pub mod embedded;
pub mod emf;
pub mod http;
pub mod lease;
pub mod manifest;
pub mod metrics;
mod mirror;
pub mod process_metrics;
pub mod secrets;
pub mod sink;
pub mod support;
pub mod telemetry;
pub mod worker;

pub use support::install_crypto_provider;
