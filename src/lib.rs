//! tether: keeps long-lived outbound WebSocket streams alive across a fleet of
//! workers, with stream ownership decided by DynamoDB conditional writes and
//! liveness proven once per worker incarnation.
//!
//! A tour, from the bottom up (each room has one door, its `mod.rs`; nothing
//! imports back up, which `scripts/check-module-graph` keeps true):
//! - [`support`]: backoff, the TLS provider and AWS HTTP client, a lock, quantiles;
//! - [`lease`]: the table — who owns which stream, by conditional writes;
//! - [`crd`]: the `StreamConnection` resource and the one codec of its stored spec;
//! - `mirror`: what the control plane writes into the table for a resource;
//! - [`egress`] and [`secrets`]: where a tenant's stream may reach, and its secret values;
//! - [`sink`]: where messages go, each batch under the stream's fencing token;
//! - [`worker`]: liveness, acquiring, and serving streams;
//! - [`controller`]: resources mirrored into the table, status back;
//! - `manifest`: files for `tether apply`;
//! - [`metrics`], [`process_metrics`], `emf`, [`probes`], [`telemetry`],
//!   [`embedded`]: what an operator watches and runs locally;
//! - [`config`] and [`cli`]: the command line, the demo among its commands.
#![forbid(unsafe_code)]
// `pub` means "part of the library's surface": anything only this crate uses
// is `pub(crate)`, so the compiler shows what each room exports.
#![warn(unreachable_pub)]

pub mod support;

pub mod lease;

pub mod crd;
mod mirror;

pub mod egress;
pub mod secrets;

pub mod sink;

pub mod worker;

pub mod controller;

mod manifest;

mod emf;
pub mod metrics;
pub mod probes;
pub mod process_metrics;
pub mod telemetry;

pub mod embedded;

pub mod cli;
pub mod config;

pub use support::install_crypto_provider;
