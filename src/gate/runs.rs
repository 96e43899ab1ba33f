//! The gate's runs: the fixed model trained `repeats` times in this process, and the baseline
//! recorded from them (`--update`) or checked against them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use anyhow::{bail, Context};
use stoke_prof::{median, Phase};

use super::baseline::{
    build_profile, comparable, compare, load, machine_fingerprint, tolerance, Baseline, Check, Recorded,
};
use super::reference::{run_figures, PairedReference};
use crate::config::StokeConfig;
use crate::exit::EXIT_GATE_REGRESSION;
use crate::run::RunSpec;

/// The gate's model and run: small and fixed. One thread for libtorch and none for the loader
/// (batches are assembled on the training thread), so that a core taken away by another process
/// delays the step as a whole instead of leaving a thread spinning at a barrier; the gate then
/// measures the code, not the machine's load.
const GATE_OVERRIDES: &[&str] = &[
    "model.n_layer=2",
    "model.d_model=128",
    "model.n_head=4",
    "model.seq_len=64",
    "train.micro_batch=8",
    "train.steps=150",
    "train.threads=1",
    "data.workers=0",
    "ckpt.every=25",
    "data.builtin_bytes=500000",
    "prof.prometheus=false",
    "prof.trace=false",
    "prof.html=false",
];

/// Runs `--update` records, at the least.
const UPDATE_REPEATS: usize = 9;

/// One invocation of the gate.
#[derive(Debug, Clone)]
pub struct GateSpec {
    /// The baseline of ratios and tolerances.
    pub baseline: PathBuf,
    /// Working folder.
    pub dir: PathBuf,
    /// Runs whose medians are compared.
    pub repeats: usize,
    /// Changes to the gate's settings after `GATE_OVERRIDES`.
    pub overrides: Vec<String>,
    /// Record the measured ratios and tolerances as the new baseline instead of comparing.
    pub update: bool,
}

/// Trains the gate's model once in this process; returns its figures.
fn gate_run(dir: &Path, name: &str, settings: &[String]) -> anyhow::Result<BTreeMap<String, (Check, f64)>> {
    let run_dir = dir.join(name);
    if run_dir.exists() {
        std::fs::remove_dir_all(&run_dir).with_context(|| format!("cannot clear {}", run_dir.display()))?;
    }
    let mut overrides = settings.to_vec();
    overrides.push(format!("run.dir={}", toml::Value::String(dir.display().to_string())));
    overrides.push(format!("run.name={name}"));
    let config = StokeConfig::load(None, &overrides)?;
    let mut paired = PairedReference::new(config.prof.skip_steps);
    let mut spec = RunSpec::fresh(config)?;
    let run_dir = spec.run_dir.clone();
    spec.extra = Some(&mut paired);
    let stop = AtomicBool::new(false);
    let outcome = spec.train(&stop, None)?;
    let report = outcome.report.context("the gate run wrote no step report")?;
    // Per step: wall, forward, backward, optimizer, then the reference's forward and backward, ms.
    let rows: Vec<[f64; 6]> = paired
        .pairs
        .iter()
        .map(|p| {
            let phase = |phase| p.phases.get(phase);
            let (forward, backward) = (phase(Phase::Forward), phase(Phase::Backward));
            let r = &p.reference;
            [p.wall_ms, forward, backward, phase(Phase::Optimizer), r.forward_ms, r.backward_ms]
        })
        .collect();
    let path = run_dir.join("pairs.json");
    std::fs::write(&path, serde_json::to_string(&rows)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(run_figures(&paired.pairs, &report))
}

/// `GATE_OVERRIDES`, the precision this machine multiplies fastest in (`train.precision = "auto"`
/// resolved here, so that another revision's binary is given a precision it knows), then
/// `overrides`. On a CPU without bf16 instructions the gate's step takes fifteen times longer in
/// bf16 than in fp32, which made the self-test's 55 runs take most of an hour.
pub fn gate_settings(overrides: &[String]) -> Vec<String> {
    let device = stoke_train::parse_device("auto").unwrap_or(tch::Device::Cpu);
    let precision =
        format!("train.precision={}", toml::Value::String(stoke_train::auto_precision(device).name().into()));
    GATE_OVERRIDES.iter().map(|s| s.to_string()).chain([precision]).chain(overrides.iter().cloned()).collect()
}

/// Runs the gate: records a baseline (`update`) or compares with it (exit 4 on a regression).
pub fn gate(args: &GateSpec) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    // Once: the precision in them is resolved from the machine.
    let settings = gate_settings(&args.overrides);
    std::fs::create_dir_all(&args.dir).with_context(|| format!("cannot create {}", args.dir.display()))?;
    if !args.update {
        // Refused before the runs, not after them.
        comparable(&load(&args.baseline)?, &settings, &machine_fingerprint())
            .with_context(|| format!("baseline {}", args.baseline.display()))?;
    }
    let repeats = if args.update { args.repeats.max(UPDATE_REPEATS) } else { args.repeats.max(1) };
    let mut runs = Vec::with_capacity(repeats);
    for rep in 0..repeats {
        runs.push(gate_run(&args.dir, &format!("gate-{rep}"), &settings)?);
    }
    let mut measured: BTreeMap<String, (Check, Vec<f64>)> = BTreeMap::new();
    for run in &runs {
        for (key, &(check, value)) in run {
            measured.entry(key.clone()).or_insert((check, Vec::new())).1.push(value);
        }
    }
    let result = if args.update { record(args, &settings, &measured) } else { check(args, &settings, &measured) };
    println!("gate: {repeats} runs in {:.1} s", started.elapsed().as_secs_f64());
    result
}

fn record(
    args: &GateSpec,
    settings: &[String],
    measured: &BTreeMap<String, (Check, Vec<f64>)>,
) -> anyhow::Result<ExitCode> {
    let mut figures = BTreeMap::new();
    for (key, (check, values)) in measured {
        if values.iter().any(|v| !v.is_finite()) {
            bail!("cannot record {key}: a run measured {values:?}");
        }
        let value = median(values);
        let deviations: Vec<f64> = values.iter().map(|v| (v - value).abs()).collect();
        let mad = median(&deviations);
        let tolerance = tolerance(key, *check, value, mad);
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        println!("{key:<22} {value:>9.4} (runs {min:.4}..{max:.4}, MAD {mad:.4}) tolerance {tolerance:.4}");
        if key == "forward_over_gemm" && tolerance >= 0.10 {
            println!(
                "warning: the forward's tolerance is {:.0}%: this baseline cannot see a 10% slower forward; \
                 record it on a quieter machine",
                100.0 * tolerance
            );
        }
        figures.insert(key.clone(), Recorded { check: *check, value, runs: values.clone(), tolerance });
    }
    let baseline = Baseline {
        overrides: settings.to_vec(),
        profile: build_profile().into(),
        machine: machine_fingerprint(),
        repeats: measured.values().next().map_or(0, |(_, v)| v.len()),
        figures,
    };
    std::fs::write(&args.baseline, serde_json::to_string_pretty(&baseline)? + "\n")
        .with_context(|| format!("cannot write {}", args.baseline.display()))?;
    println!("baseline written to {}", args.baseline.display());
    Ok(ExitCode::SUCCESS)
}

fn check(
    args: &GateSpec,
    settings: &[String],
    measured: &BTreeMap<String, (Check, Vec<f64>)>,
) -> anyhow::Result<ExitCode> {
    let path = &args.baseline;
    let regressions = compare(&load(path)?, settings, &machine_fingerprint(), measured)
        .with_context(|| format!("baseline {}", path.display()))?;
    if regressions.is_empty() {
        println!("gate: no regression");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("gate: regression in {}", regressions.join(", "));
        Ok(ExitCode::from(EXIT_GATE_REGRESSION))
    }
}
