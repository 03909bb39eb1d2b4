//! tether: keeps long-lived outbound WebSocket streams alive across a fleet of
//! workers, with stream ownership decided by DynamoDB conditional writes and
//! liveness proven once per worker incarnation.
#![forbid(unsafe_code)]

pub mod cli;
pub mod config;
pub mod controller;
pub mod crd;
pub mod demo;
pub mod embedded;
pub mod emf;
pub mod http;
pub mod lease;
pub mod manifest;
pub mod metrics;
mod mirror;
pub mod process_metrics;
pub mod sink;
pub mod telemetry;
pub mod worker;

/// Installs rustls's ring provider as the process default.
///
/// kube's client asks rustls for the process-level provider; with both ring and
/// aws-lc compiled in it cannot pick one and panics, so we choose explicitly, once.
pub fn install_crypto_provider() {
    // Err means a provider is already installed, which is what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
}
