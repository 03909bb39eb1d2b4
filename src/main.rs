//! The `tether` binary: parse configuration, start logging, run one subcommand.

use clap::Parser;
use std::process::ExitCode;
use tether::config::{Cli, LogFormat};

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(tether::cli::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line a person can act on, not a backtrace.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(
            "info,aws_config=error,aws_smithy_runtime=warn,kube=warn,dynoxide=error",
        )
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}
