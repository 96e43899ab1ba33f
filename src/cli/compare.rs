//! `stoke compare RUN_A RUN_B`: lines two runs' loss curves up by tokens seen, prints the largest
//! gaps, writes one HTML page with both, and exits 3 when B's final loss is worse than A's beyond
//! the tolerance.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;

use crate::exit::UsageError;

#[derive(Debug, clap::Args)]
pub struct CompareArgs {
    /// The reference run: a run folder (holding metrics.jsonl), a metrics.jsonl file, or a run name
    /// under --runs.
    pub run_a: String,
    /// The run under test, named the same ways.
    pub run_b: String,
    /// Largest relative excess of B's final loss over A's that still passes (evaluation loss when
    /// both runs evaluated, else the moving average of the training loss).
    #[arg(long, default_value_t = 0.02)]
    pub tolerance: f64,
    /// Where to write the HTML page with both curves. Default: compare-<A>-vs-<B>.html in B's
    /// run folder.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Folder holding runs named by name.
    #[arg(long, default_value = "runs")]
    pub runs: PathBuf,
    /// Print the comparison as JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// A run's metrics file from a folder, a file, or a name under `runs`.
pub fn metrics_path(spec: &str, runs: &Path) -> anyhow::Result<PathBuf> {
    let path = Path::new(spec);
    let candidates = [path.join("metrics.jsonl"), path.to_path_buf(), runs.join(spec).join("metrics.jsonl")];
    candidates.into_iter().find(|p| p.is_file()).ok_or_else(|| {
        UsageError(format!(
            "no metrics.jsonl for run {spec:?} (a run folder, a metrics file, or a name under {})",
            runs.display()
        ))
        .into()
    })
}

/// Loads a run's curves.
pub fn load_curves(spec: &str, runs: &Path) -> anyhow::Result<(stoke_prof::RunCurves, PathBuf)> {
    let path = metrics_path(spec, runs)?;
    let text = stoke_fsio::read_to_string_capped(&path, stoke_fsio::LOG_CAP)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let name =
        path.parent().and_then(Path::file_name).map_or_else(|| spec.to_string(), |n| n.to_string_lossy().into_owned());
    Ok((stoke_prof::RunCurves::from_metrics(&name, &text)?, path))
}

/// Compares, prints, writes the page; returns the comparison and the page's path.
pub fn compare_runs(
    a: &str,
    b: &str,
    tolerance: f64,
    html: Option<&Path>,
    runs: &Path,
) -> anyhow::Result<(stoke_prof::Comparison, PathBuf)> {
    if !(tolerance.is_finite() && tolerance >= 0.0) {
        return Err(UsageError(format!("--tolerance must be a finite number >= 0; got {tolerance}")).into());
    }
    let (curves_a, _) = load_curves(a, runs)?;
    let (curves_b, path_b) = load_curves(b, runs)?;
    let comparison = stoke_prof::compare(&curves_a, &curves_b, tolerance);
    let page = match html {
        Some(p) => p.to_path_buf(),
        None => path_b.parent().unwrap_or(Path::new(".")).join(format!(
            "compare-{}-vs-{}.html",
            sanitize(&curves_a.name),
            sanitize(&curves_b.name)
        )),
    };
    std::fs::write(&page, stoke_prof::render_compare_html(&curves_a, &curves_b, &comparison))
        .with_context(|| format!("cannot write {}", page.display()))?;
    Ok((comparison, page))
}

fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

pub fn run(args: CompareArgs) -> anyhow::Result<ExitCode> {
    let (comparison, page) = compare_runs(&args.run_a, &args.run_b, args.tolerance, args.html.as_deref(), &args.runs)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&comparison)?);
    } else {
        print!("{}", comparison.render_text());
        println!("  curves: {}", page.display());
    }
    Ok(if comparison.regressed { ExitCode::from(crate::exit::EXIT_REGRESSION) } else { ExitCode::SUCCESS })
}
