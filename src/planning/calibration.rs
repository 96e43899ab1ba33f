//! `stoke plan --calibrate`: this machine's efficiencies fitted on measured runs, and the
//! held-out runs predicted with them.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use stoke_plan::{calibrate, compare, merge_repeats, ClusterConfig, Efficiency, MeasuredRun, PlanError, RunFit};

use super::output::emit;

/// What to calibrate on.
#[derive(Debug, Clone)]
pub struct Calibration {
    /// The runs' report.json files to fit on.
    pub calibrate: Vec<PathBuf>,
    /// Runs held out of the fit, predicted and compared.
    pub holdout: Vec<PathBuf>,
    /// Merge runs of the same shape into one at their median step time.
    pub merge_repeats: bool,
    /// Write the fitted efficiencies to this JSON file.
    pub save: Option<PathBuf>,
    /// Print JSON instead of text.
    pub json: bool,
}

/// Efficiencies written by `--calibrate --save`, checked (`stoke plan --efficiency`, `stoke launch
/// --plan best --efficiency`).
pub fn read_efficiency(path: &Path) -> anyhow::Result<Efficiency> {
    let text = stoke_fsio::read_to_string_capped(path, stoke_fsio::TABLE_CAP)
        .with_context(|| format!("reading {}", path.display()))?;
    let efficiency: Efficiency = serde_json::from_str(&text)
        .map_err(|err| crate::exit::usage(format!("{}: not an efficiency file: {err}", path.display())))?;
    efficiency.validate().map_err(crate::exit::plan_error)?;
    Ok(efficiency)
}

fn load_runs(paths: &[PathBuf], cluster: &ClusterConfig) -> anyhow::Result<Vec<MeasuredRun>> {
    paths
        .iter()
        .map(|path| {
            MeasuredRun::from_report_file(path, cluster).map_err(|err| match err {
                PlanError::ReadReport { .. } => anyhow::Error::new(err),
                other => crate::exit::usage(other.to_string()),
            })
        })
        .collect()
}

fn write_fits(out: &mut String, title: &str, fits: &[RunFit]) -> std::fmt::Result {
    writeln!(out, "{title}")?;
    writeln!(out, "  {:<24} {:>12} {:>12} {:>8}", "run", "measured", "predicted", "error")?;
    for fit in fits {
        writeln!(
            out,
            "  {:<24} {:>9.1} ms {:>9.1} ms {:>+7.1}%",
            fit.name,
            fit.measured_step_s * 1e3,
            fit.predicted_step_s * 1e3,
            100.0 * fit.relative_error
        )?;
    }
    Ok(())
}

/// Fits the efficiencies and prints the fits.
pub fn run_calibration(args: &Calibration, cluster: &ClusterConfig) -> anyhow::Result<ExitCode> {
    let mut runs = load_runs(&args.calibrate, cluster)?;
    let mut held_out = load_runs(&args.holdout, cluster)?;
    if args.merge_repeats {
        runs = merge_repeats(runs);
        held_out = merge_repeats(held_out);
    }
    let calibration = calibrate(&runs, &cluster.efficiency).map_err(crate::exit::plan_error)?;
    let held_out_fits = compare(&held_out, &calibration.efficiency);
    let worst_held_out = held_out_fits.iter().map(|fit| fit.relative_error.abs()).fold(0.0, f64::max);
    let mut out = String::new();
    if let Some(path) = &args.save {
        let text = serde_json::to_string_pretty(&calibration.efficiency)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        let json = serde_json::json!({
            "efficiency": calibration.efficiency,
            "calibration": calibration.fits,
            "held_out": held_out_fits,
            "worst_held_out_error": if held_out_fits.is_empty() { None } else { Some(worst_held_out) },
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&json)?)?;
        return emit(&out);
    }
    let eff = &calibration.efficiency;
    writeln!(
        out,
        "fitted on {} runs: compute {:.3}, memory {:.3}, optimizer {:.3} of peak; {:.3} ms per block pass, {:.2} ms per step; leave-one-out error {:.1}%",
        runs.len(),
        eff.compute,
        eff.memory,
        eff.optimizer,
        eff.layer_overhead_s * 1e3,
        eff.step_overhead_s * 1e3,
        100.0 * eff.relative_error
    )?;
    write_fits(&mut out, "calibration runs:", &calibration.fits)?;
    if !held_out_fits.is_empty() {
        write_fits(&mut out, "held-out runs:", &held_out_fits)?;
        writeln!(out, "worst held-out error: {:.1}%", 100.0 * worst_held_out)?;
    }
    if let Some(path) = &args.save {
        writeln!(out, "efficiency written to {} (use with --efficiency)", path.display())?;
    }
    emit(&out)
}
