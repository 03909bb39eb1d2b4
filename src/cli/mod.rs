//! The `tether` command line: one function per subcommand, and the store
//! wiring they share. `main.rs` parses and calls [`run`].

mod apply;
pub mod demo;
mod get;
mod serve;
mod settings;
mod signal;
mod store;
mod table;

pub use signal::shutdown_signal;
use store::open_store;

use crate::config::{Cli, Command, DemoArgs, DemoPart, TableCommand};
use crate::lease::Caller;
use crate::metrics::Metrics;
use std::sync::Arc;

/// Runs one subcommand to completion.
pub async fn run(cli: Cli) -> anyhow::Result<()> {
    crate::support::install_crypto_provider();
    let metrics = Arc::new(Metrics::new());
    let caller = caller_of(&cli.command);
    let open = || open_store(&cli.store, caller, metrics.store.clone());
    match cli.command {
        Command::Table {
            command: TableCommand::Create,
        } => table::create(&open().await?.store).await,
        Command::Table {
            command: TableCommand::FinishUpgrade,
        } => table::finish_upgrade(&open().await?.store).await,
        Command::Get {
            ref name,
            ref namespace,
            all_namespaces: _,
            output,
            watch,
        } => {
            let selection = get::Selection {
                name: name.as_deref(),
                namespace: namespace.as_deref(),
            };
            get::get(&open().await?.store, selection, output, watch).await
        }
        Command::LocalStore { listen, ref data } => serve::local_store(listen, data).await,
        Command::Apply {
            ref files,
            recursive,
            validate,
        } => {
            let options = crate::manifest::LoadOptions {
                recursive,
                validation: validate,
            };
            apply::apply(&open().await?.store, files, &options).await
        }
        Command::Delete {
            ref names,
            ref files,
            recursive,
            ref namespace,
            ignore_not_found,
        } => {
            apply::delete(
                &open().await?.store,
                names,
                namespace.as_deref(),
                files,
                recursive,
                ignore_not_found,
            )
            .await
        }
        Command::Completion { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "tether", &mut std::io::stdout());
            Ok(())
        }
        Command::Demo(DemoArgs {
            part: Some(DemoPart::Feed { listen, rate }),
            ..
        }) => serve::demo_feed(listen, rate).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Worker(args) => {
            let open = open().await?;
            let secrets = crate::secrets::SecretSource::Standalone;
            serve::worker(
                open,
                metrics,
                args,
                secrets,
                None,
                crate::worker::Provenance::AnyItem,
                shutdown_signal(),
            )
            .await
        }
        Command::Operator(args) => serve::operator(&cli.store, metrics, args).await,
        Command::Crd => {
            print!("{}", crate::crd::crd_yaml()?);
            Ok(())
        }
    }
}

/// Which IAM role a subcommand's DynamoDB calls belong to.
fn caller_of(command: &Command) -> Caller {
    match command {
        Command::Operator(_) => Caller::Operator,
        Command::Worker(_) => Caller::Worker,
        Command::Apply { .. } | Command::Get { .. } | Command::Delete { .. } => Caller::Cli,
        Command::Table { .. } => Caller::Admin,
        Command::Demo(_)
        | Command::LocalStore { .. }
        | Command::Completion { .. }
        | Command::Crd => Caller::Local,
    }
}
