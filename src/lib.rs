//! tether: keeps long-lived outbound WebSocket streams alive across a fleet of
//! workers, with stream ownership decided by DynamoDB conditional writes.
#![forbid(unsafe_code)]

pub mod cli;
pub mod config;
pub mod controller;
pub mod crd;
pub mod demo;
pub mod embedded;
pub mod http;
pub mod lease;
pub mod manifest;
pub mod metrics;
pub mod sink;
pub mod testkit;
pub mod worker;

/// Installs rustls's ring provider as the process default.
///
/// kube's client asks rustls for the process-level provider; with both ring and
/// aws-lc compiled in it cannot pick one and panics, so we choose explicitly, once.
pub fn install_crypto_provider() {
    // Err means a provider is already installed, which is what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

use config::{Cli, Command, TableCommand};
use std::sync::Arc;

/// Runs one subcommand to completion.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    install_crypto_provider();
    let metrics = Arc::new(metrics::Metrics::new());
    match cli.command {
        Command::Table {
            command: TableCommand::Create,
        } => {
            let open = cli::open_store(&cli.store, metrics.store.clone()).await?;
            cli::table_create(&open.store).await
        }
        Command::Get { name, output } => {
            let open = cli::open_store(&cli.store, metrics.store.clone()).await?;
            cli::get(&open.store, name.as_deref(), output).await
        }
        Command::LocalStore { listen, data } => cli::local_store(listen, &data).await,
        Command::Apply { path } => {
            let open = cli::open_store(&cli.store, metrics.store.clone()).await?;
            cli::apply(&open.store, &path).await
        }
        Command::Delete { name } => {
            let open = cli::open_store(&cli.store, metrics.store.clone()).await?;
            cli::delete(&open.store, &name).await
        }
        Command::Demo(args) => demo::run(args).await,
        Command::Worker(args) => {
            let open = cli::open_store(&cli.store, metrics.store.clone()).await?;
            let secrets = worker::secrets::SecretSource::Standalone;
            cli::worker(open, metrics, args, secrets, shutdown_signal()).await
        }
        Command::Operator(args) => cli::operator(&cli.store, metrics, args).await,
        Command::Crd => {
            print!("{}", crd::crd_yaml()?);
            Ok(())
        }
        Command::TestUpstream { listen, rate } => {
            let upstream = testkit::upstream::TestUpstream::start(listen, rate).await?;
            println!(
                "test upstream on ws://{}/<stream>?after=<seq>",
                upstream.addr
            );
            shutdown_signal().await;
            Ok(())
        }
    }
}

/// Resolves on the first SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
