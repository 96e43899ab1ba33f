//! `stoke trace`: analyze PyTorch profiler (Kineto) traces, or diff two sets of them as a CI gate.
//!
//! Exit codes: 0 ok, 1 unreadable or malformed trace, 2 usage error, 3 (`diff` only) the new
//! traces' step time regressed beyond the tolerance.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use stoke_prof::{
    analyze_paths, diff, diff_markdown, diff_table, markdown, overlay_trace, prometheus, table, write_synthetic,
    AnalyzeOptions, DiffOptions, SynthOptions,
};

use super::UsageError;

/// `diff` found a step-time regression.
pub const EXIT_REGRESSION: u8 = 3;

#[derive(Debug, Args)]
pub struct TraceArgs {
    #[command(subcommand)]
    pub command: TraceCommand,
}

#[derive(Debug, Subcommand)]
pub enum TraceCommand {
    /// Per-step breakdown, GPU idle and kernel breakdowns, launches, ranks, and findings.
    Analyze(AnalyzeArgs),
    /// Compare two sets of traces; exits 3 when the step time regressed.
    Diff(DiffArgs),
    /// Write a synthetic multi-rank Kineto-style trace (for benchmarks).
    #[command(hide = true)]
    GenSynthetic(GenArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Table,
    Json,
    Markdown,
    Prometheus,
}

#[derive(Debug, Args)]
pub struct AnalyzeArgs {
    /// Trace files (`.json`, `.json.gz`) or directories of them, one per rank.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// What to print on standard output.
    #[arg(long, value_enum, default_value = "table")]
    pub format: Format,
    /// Also write the JSON report here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also write a Markdown report here.
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Also write Prometheus text here.
    #[arg(long)]
    pub prom: Option<PathBuf>,
    /// Also write an overlay Chrome trace (steps, counters, findings) here.
    #[arg(long)]
    pub overlay: Option<PathBuf>,
    /// Model FLOPs per step (forward + backward, per rank), for MFU.
    #[arg(long)]
    pub model_flops: Option<f64>,
    /// Peak FLOP/s of one device (default: from the device name when known).
    #[arg(long)]
    pub peak_flops: Option<f64>,
    /// Kernels in the kernel breakdown.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
}

#[derive(Debug, Args)]
pub struct DiffArgs {
    /// Baseline trace file or directory.
    pub base: PathBuf,
    /// New trace file or directory.
    pub new: PathBuf,
    /// Step-time increase always tolerated (0.05 = 5%); noisy steps widen it.
    #[arg(long, default_value_t = 0.05)]
    pub tolerance: f64,
    /// Rows in the op and kernel tables.
    #[arg(long, default_value_t = 20)]
    pub top: usize,
    /// What to print on standard output (table, json or markdown).
    #[arg(long, value_enum, default_value = "table")]
    pub format: Format,
    /// Also write the JSON diff here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct GenArgs {
    /// Output directory; one `rank-<r>.json` per rank.
    #[arg(long)]
    pub out: PathBuf,
    /// Ranks to write.
    #[arg(long, default_value_t = 1)]
    pub ranks: u32,
    /// Approximate size of each rank's file, in MB.
    #[arg(long, default_value_t = 100)]
    pub mb: u64,
    /// Compute kernels per step.
    #[arg(long, default_value_t = 400)]
    pub kernels_per_step: u32,
}

pub fn run(args: TraceArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        TraceCommand::Analyze(a) => run_analyze(a),
        TraceCommand::Diff(d) => run_diff(d),
        TraceCommand::GenSynthetic(g) => run_gen(g),
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
}

fn run_analyze(a: AnalyzeArgs) -> anyhow::Result<ExitCode> {
    if a.peak_flops.is_some_and(|p| p <= 0.0) || a.model_flops.is_some_and(|f| f <= 0.0) {
        return Err(anyhow::Error::new(UsageError("--model-flops and --peak-flops must be positive".into())));
    }
    for input in &a.inputs {
        if !input.exists() {
            return Err(anyhow::Error::new(UsageError(format!("{}: no such file or directory", input.display()))));
        }
    }
    let opts = AnalyzeOptions {
        top_kernels: a.top,
        model_flops_per_step: a.model_flops,
        peak_flops: a.peak_flops,
        ..AnalyzeOptions::default()
    };
    let analysis = analyze_paths(&a.inputs, &opts)?;
    let json = || serde_json::to_string_pretty(&analysis).expect("the analysis serializes");
    match a.format {
        Format::Table => print!("{}", table(&analysis)),
        Format::Json => println!("{}", json()),
        Format::Markdown => print!("{}", markdown(&analysis)),
        Format::Prometheus => print!("{}", prometheus(&analysis)),
    }
    if let Some(path) = &a.json {
        write_file(path, json().as_bytes())?;
    }
    if let Some(path) = &a.markdown {
        write_file(path, markdown(&analysis).as_bytes())?;
    }
    if let Some(path) = &a.prom {
        write_file(path, prometheus(&analysis).as_bytes())?;
    }
    if let Some(path) = &a.overlay {
        let mut out = Vec::new();
        overlay_trace(&analysis, &mut out)?;
        write_file(path, &out)?;
    }
    Ok(ExitCode::SUCCESS)
}

fn run_diff(d: DiffArgs) -> anyhow::Result<ExitCode> {
    if !(0.0..10.0).contains(&d.tolerance) {
        return Err(anyhow::Error::new(UsageError("--tolerance must be in [0, 10)".into())));
    }
    if d.format == Format::Prometheus {
        return Err(anyhow::Error::new(UsageError("diff prints table, json or markdown".into())));
    }
    for input in [&d.base, &d.new] {
        if !input.exists() {
            return Err(anyhow::Error::new(UsageError(format!("{}: no such file or directory", input.display()))));
        }
    }
    let opts = AnalyzeOptions::default();
    let base = analyze_paths(std::slice::from_ref(&d.base), &opts)?;
    let new = analyze_paths(std::slice::from_ref(&d.new), &opts)?;
    let result = diff(&base, &new, &DiffOptions { tolerance: d.tolerance, top: d.top })
        .map_err(|err| UsageError(format!("trace diff: {err}")))?;
    let json = || serde_json::to_string_pretty(&result).expect("the diff serializes");
    match d.format {
        Format::Json => println!("{}", json()),
        Format::Markdown => print!("{}", diff_markdown(&result)),
        _ => print!("{}", diff_table(&result)),
    }
    if let Some(path) = &d.json {
        write_file(path, json().as_bytes())?;
    }
    Ok(if result.regression { ExitCode::from(EXIT_REGRESSION) } else { ExitCode::SUCCESS })
}

fn run_gen(g: GenArgs) -> anyhow::Result<ExitCode> {
    std::fs::create_dir_all(&g.out).with_context(|| format!("creating {}", g.out.display()))?;
    for rank in 0..g.ranks {
        let path = g.out.join(format!("rank-{rank}.json"));
        let file = std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let opts = SynthOptions {
            rank,
            world_size: g.ranks,
            target_bytes: g.mb * 1_000_000,
            kernels_per_step: g.kernels_per_step,
            dataloader_ns_per_rank: 1_000_000,
            ..SynthOptions::default()
        };
        let n = write_synthetic(file, &opts).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {} ({:.1} MB)", path.display(), n as f64 / 1e6);
    }
    Ok(ExitCode::SUCCESS)
}
