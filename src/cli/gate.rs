//! `stoke bench gate`: the arguments of the regression gate (`crate::gate`).

use std::path::PathBuf;
use std::process::ExitCode;

use crate::gate::GateSpec;

#[derive(Debug, clap::Args)]
pub struct GateArgs {
    /// The baseline of ratios and tolerances (the committed one is the development machine's).
    #[arg(long, default_value = "benches/baseline.json")]
    pub baseline: PathBuf,
    /// Working folder.
    #[arg(long, default_value = "runs/gate")]
    pub dir: PathBuf,
    /// Runs whose medians are compared.
    #[arg(long, default_value_t = 9)]
    pub repeats: usize,
    /// Change one of the gate's settings (`--set model.d_model=256`, repeatable); a baseline is
    /// compared only with runs of the settings it was recorded with.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Record the measured ratios and tolerances as the new baseline instead of comparing; uses
    /// at least `UPDATE_REPEATS` runs, so the recorded spread means something.
    #[arg(long)]
    pub update: bool,
}

pub fn run(args: GateArgs) -> anyhow::Result<ExitCode> {
    crate::gate::gate(&GateSpec {
        baseline: args.baseline,
        dir: args.dir,
        repeats: args.repeats,
        overrides: args.overrides,
        update: args.update,
    })
}
