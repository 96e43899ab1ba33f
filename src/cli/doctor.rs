//! `stoke doctor`: a short profiling run of the user's own configuration, its step report with
//! findings sorted by bound, and optionally a sweep of one knob that names the best value.

use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;

use anyhow::Context;
use stoke_prof::{format_bound, RunReport};

use super::args::ConfigArgs;
use crate::exit::UsageError;
use crate::run::{timestamp, RunSpec};

#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Optimizer steps of the profiling run (replaces train.steps).
    #[arg(long, default_value_t = 200)]
    pub steps: u64,
    /// Run once per value of one key and name the fastest: `--sweep data.workers=1,2,4`.
    #[arg(long, value_name = "SECTION.KEY=V1,V2,...")]
    pub sweep: Option<String>,
    /// Also measure the profiler's own cost in the same run: it observes alternate blocks of this
    /// many steps, and the step cadence with and without it is compared (e.g. `--overhead 10`).
    #[arg(long, value_name = "BLOCK_STEPS")]
    pub overhead: Option<u64>,
    /// Show the progress bar.
    #[arg(long)]
    pub progress: bool,
}

/// One swept value and what its run measured.
#[derive(Debug, serde::Serialize)]
struct SweepPoint {
    value: String,
    run: String,
    step_ms: f64,
    tokens_per_s: f64,
    effective_compute_ratio: f64,
    mfu: f64,
    top_finding: Option<String>,
}

fn parse_sweep(spec: &str) -> anyhow::Result<(String, Vec<String>)> {
    let bad = || UsageError(format!("--sweep {spec:?}: expected section.key=v1,v2,..."));
    let (key, values) = spec.split_once('=').ok_or_else(bad)?;
    let values: Vec<String> = values.split(',').map(|v| v.trim().to_string()).filter(|v| !v.is_empty()).collect();
    if !key.contains('.') || values.is_empty() {
        return Err(bad().into());
    }
    Ok((key.trim().to_string(), values))
}

/// Profiles one configuration in its own run folder; returns the run's name and report.
fn profile(args: &DoctorArgs, extra: &[String], name: &str, stop: &AtomicBool) -> anyhow::Result<(String, RunReport)> {
    let mut overrides = vec![format!("train.steps={}", args.steps)];
    overrides.extend_from_slice(extra);
    let mut config = args.config.load(&overrides)?;
    if config.run.name.is_empty() {
        config.run.name = name.to_string();
    }
    let mut spec = RunSpec::fresh(config)?;
    spec.progress = args.progress;
    spec.overhead_block = args.overhead;
    let (run_dir, run_name) = (spec.run_dir.clone(), spec.config.run.name.clone());
    let outcome = spec.train(stop, None)?;
    outcome.print_report();
    if let Some(o) = outcome.overhead {
        println!(
            "profiler overhead, on vs off in this run: {:.3} vs {:.3} ms/step, median of {} block pairs {:+.2}%",
            o.on_ms_per_step,
            o.off_ms_per_step,
            o.n_block_pairs,
            100.0 * o.overhead_fraction
        );
        let path = run_dir.join("overhead.json");
        std::fs::write(&path, serde_json::to_string_pretty(&o)? + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    let report = outcome.report.ok_or_else(|| {
        UsageError("no step was profiled: set prof.enabled=true and --steps above prof.skip_steps".into())
    })?;
    Ok((run_name, report))
}

pub fn run(args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let stop = crate::signals::install();
    let base = format!("doctor-{}", timestamp());
    let Some(spec) = &args.sweep else {
        let (name, report) = profile(&args, &[], &base, stop)?;
        println!("doctor: {} finding(s); report: {}", report.findings.len(), report_path(&args, &name)?);
        return Ok(ExitCode::SUCCESS);
    };
    let (key, values) = parse_sweep(spec)?;
    let mut points = Vec::new();
    for value in &values {
        let config = args.config.load(&[])?;
        let name = if config.run.name.is_empty() { base.clone() } else { config.run.name.clone() };
        let run_name = format!("{name}-{}-{value}", key.replace('.', "_"));
        let extra = [format!("{key}={value}"), format!("run.name={run_name}")];
        println!("\n=== {key} = {value} ===");
        let (run, report) = profile(&args, &extra, &run_name, stop)?;
        points.push(SweepPoint {
            value: value.clone(),
            run,
            step_ms: report.step_ms,
            tokens_per_s: report.tokens_per_s,
            effective_compute_ratio: report.effective_compute_ratio,
            mfu: report.mfu,
            top_finding: report.findings.first().map(|f| format!("{} (bound {})", f.id, format_bound(f.bound))),
        });
    }
    let best = points.iter().max_by(|a, b| a.tokens_per_s.total_cmp(&b.tokens_per_s)).expect("at least one value");
    println!("\nsweep of {key}:");
    println!("  {:<12} {:>10} {:>12} {:>7} {:>7}  top finding", "value", "ms/step", "tokens/s", "ECR", "MFU");
    for p in &points {
        println!(
            "  {:<12} {:>10.2} {:>12.0} {:>7.3} {:>6.2}%  {}",
            p.value,
            p.step_ms,
            p.tokens_per_s,
            p.effective_compute_ratio,
            100.0 * p.mfu,
            p.top_finding.as_deref().unwrap_or("-")
        );
    }
    let slowest = points.iter().map(|p| p.tokens_per_s).fold(f64::INFINITY, f64::min);
    println!(
        "best: {key} = {} ({:.0} tokens/s, {:.2}x the slowest value)",
        best.value,
        best.tokens_per_s,
        best.tokens_per_s / slowest.max(1e-9)
    );
    let config = args.config.load(&[])?;
    let sweep_path = Path::new(&config.run.dir).join(format!("{base}-sweep.json"));
    let json = serde_json::json!({ "key": key, "best": best.value, "points": points });
    std::fs::write(&sweep_path, serde_json::to_string_pretty(&json)? + "\n")
        .with_context(|| format!("cannot write {}", sweep_path.display()))?;
    println!("sweep: {}", sweep_path.display());
    Ok(ExitCode::SUCCESS)
}

fn report_path(args: &DoctorArgs, name: &str) -> anyhow::Result<String> {
    let config = args.config.load(&[])?;
    Ok(Path::new(&config.run.dir).join(name).join("report.json").display().to_string())
}
