//! `stoke-trace`: `stoke trace` without libtorch.
//!
//! The analyzer lives in `stoke-prof`, which has no libtorch; the `stoke` binary links libtorch for
//! training, and loading it costs a third of a second of CPU and 100+ MB before `main`. On small
//! traces that is most of the time, so this binary carries only the trace subcommand (same code,
//! same arguments, same exit codes: 0 ok, 1 failure, 2 usage, 3 regression in `diff`).

#[path = "../cli/trace.rs"]
mod trace;
#[path = "../usage.rs"]
mod usage;

use std::process::ExitCode;

use clap::Parser;

pub use usage::UsageError;

#[derive(Debug, Parser)]
#[command(name = "stoke-trace", version, about = "Analyze PyTorch profiler (Kineto) traces, or diff two runs.")]
struct Cli {
    #[command(flatten)]
    args: trace::TraceArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match trace::run(cli.args) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            if err.downcast_ref::<UsageError>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::from(1)
            }
        }
    }
}
