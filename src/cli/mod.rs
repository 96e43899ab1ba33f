//! Subcommands. Each lives in its own module with its clap `Args` and a `run` function that
//! turns them into a call of the module that does the work (`crate::run`, `crate::launch`,
//! `crate::gate`, `crate::bench`, `crate::planning` or a library crate).

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod args;
mod bench;
mod bench_ckpt;
mod ckpt;
pub mod compare;
mod config;
mod corpus;
mod doctor;
mod env;
mod export;
mod find_batch;
mod gate;
mod launch;
mod plan;
mod prep;
mod sched;
mod sched_serve;
mod trace;
mod train;

/// The usage error (exit code 2) under the name `trace.rs` uses in both binaries that build it.
pub use crate::exit::UsageError;

#[derive(Debug, Parser)]
#[command(name = "stoke", version, about = "Train neural networks and see where every millisecond goes.")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Train a model (the default: the tiny GPT on the built-in corpus).
    Train(train::TrainArgs),
    /// Profile a short run of a configuration: where each step's milliseconds go, what to change
    /// and what it can gain (findings sorted by bound); `--sweep key=a,b,c` names the best value.
    Doctor(doctor::DoctorArgs),
    /// Print the resolved configuration, or every key with its default (`--defaults`).
    Config(config::ConfigCmdArgs),
    /// Whole-run benchmarks against PyTorch and a naive baseline, machine limits, a regression gate.
    Bench(bench::BenchArgs),
    /// Write the built-in corpus to a file (for peers and other tools).
    Corpus(corpus::CorpusArgs),
    /// Rank parallel layouts by predicted memory and step time, or calibrate on measured runs.
    Plan(Box<plan::PlanArgs>),
    /// Analyze PyTorch profiler (Kineto) traces, or diff two runs (exit 3 on a regression).
    Trace(trace::TraceArgs),
    /// Start N workers on this machine with torchrun's variables (`stoke launch --nproc 2 -- train`).
    Launch(launch::LaunchArgs),
    /// Prepare data offline: tokenize text into shards, pack records, verify a prepared directory.
    Prep(prep::PrepArgs),
    /// Checkpoints: `verify` checks every file's size and checksum (exit 1 on damage).
    Ckpt(ckpt::CkptArgs),
    /// Write a run's model in another tool's format: `hf` (config.json + model.safetensors that
    /// transformers' `from_pretrained` loads).
    Export(export::ExportArgs),
    /// Scheduling of elastic jobs: `simulate` compares policies on a job list or generated workloads.
    Sched(sched::SchedArgs),
    /// The versions (stoke, libtorch, CUDA, NCCL, Open MPI, kernel, CPU/GPU) and the environment
    /// variables that change performance; every run records the same in environment.json.
    Env(env::EnvArgs),
    /// Compare two runs' loss curves by tokens seen; exit 3 when B's final loss is worse than A's
    /// beyond --tolerance (default 2%).
    Compare(compare::CompareArgs),
}

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Train(args) => train::run(args),
        Command::Doctor(args) => doctor::run(args),
        Command::Config(args) => config::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Corpus(args) => corpus::run(args),
        Command::Plan(args) => plan::run(*args),
        Command::Trace(args) => trace::run(args),
        Command::Prep(args) => prep::run(args),
        Command::Launch(args) => launch::run(args),
        Command::Ckpt(args) => ckpt::run(args),
        Command::Export(args) => export::run(args),
        Command::Sched(args) => sched::run(args),
        Command::Compare(args) => compare::run(args),
        Command::Env(args) => env::run(args),
    }
}
