//! The `tether` binary: parse configuration, start logging and tracing, run one subcommand.

use clap::Parser;
use std::process::ExitCode;
use tether::config::Cli;

/// See `tether::support::Allocator` for why not the C library's.
#[global_allocator]
static ALLOCATOR: tether::support::Allocator = tether::support::Allocator;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Declared before the runtime, so it is dropped (traces flushed) after it.
    let _telemetry = tether::telemetry::init(cli.log_format);
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
