//! Subcommands. Each lives in its own module with its clap `Args` and a `run` function.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod plan;
mod trace;

/// A bad command line or configuration: exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

#[derive(Debug, Parser)]
#[command(name = "stoke", version, about = "Train neural networks and see where every millisecond goes.")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Rank parallel layouts by predicted memory and step time, or calibrate on measured runs.
    Plan(plan::PlanArgs),
    /// Analyze PyTorch profiler (Kineto) traces, or diff two runs (exit 3 on a regression).
    Trace(trace::TraceArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Plan(args) => plan::run(args),
        Command::Trace(args) => trace::run(args),
    }
}
