//! The `stoke` binary: argument parsing, config loading and launching. The work lives in the
//! library crates and in the modules beside `cli/`: `run` (what a run is), `launch`, `gate`,
//! `bench` and `planning`; `cli/` is argument glue, and `exit` maps errors to exit codes.

mod bench;
mod cli;
mod config;
mod environment;
mod exit;
mod gate;
mod gemm;
mod launch;
mod observe;
mod planning;
mod profiler;
mod run;
mod signals;
mod usage;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(code) => code,
        Err(err) => exit::report(&err),
    }
}
