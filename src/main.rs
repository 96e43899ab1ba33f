//! The `stoke` binary: argument parsing, config loading and launching. The work lives in the
//! library crates; this is glue, and the only place that reads argv and the environment.

mod cli;
mod config;
mod observe;
mod profiler;
mod signals;

use std::process::ExitCode;

use clap::Parser;

/// Exit codes: 0 ok, 1 runtime failure, 2 usage or configuration error, 3 regression found by
/// `stoke trace diff` or `stoke compare`, 4 bench gate regression (`stoke bench gate`), 75 preempted by a signal
/// with a checkpoint written, resumable (`signals::EXIT_PREEMPTED`).
const EXIT_RUNTIME: u8 = 1;
const EXIT_USAGE: u8 = 2;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(code) => code,
        Err(err) => {
            if let Some(usage) = err.downcast_ref::<cli::UsageError>() {
                eprintln!("error: {usage}");
                return ExitCode::from(EXIT_USAGE);
            }
            eprintln!("error: {err:#}");
            ExitCode::from(EXIT_RUNTIME)
        }
    }
}
