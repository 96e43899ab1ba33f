//! `stoke bench gate`: the arguments of the regression gate (`crate::gate`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

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
    #[arg(long, conflicts_with_all = ["against", "self_test"])]
    pub update: bool,
    /// Compare with another revision instead of a baseline: a git revision of the repository in
    /// the current folder (built from a worktree into this binary's target folder, cached per
    /// commit) or the path of a `stoke` binary. Both train the gate's model in turn, `--pairs`
    /// times each; exit 4 when a phase, the step or the peak memory regressed.
    #[arg(long, value_name = "REV|BINARY")]
    pub against: Option<String>,
    /// Runs of each side with `--against` and `--self-test`.
    #[arg(long, default_value_t = 5)]
    pub pairs: usize,
    /// Runs side by side with `--against` and `--self-test` (at most one a core): the gate's
    /// model trains on one thread.
    #[arg(long, default_value_t = 2)]
    pub jobs: usize,
    /// Check the gate itself: this binary against itself, five unchanged series and five with an
    /// injected slowdown each (forward, backward, optimizer 10%, 2 ms data wait, 10% memory);
    /// exit 0 when every unchanged series passes and every injection is caught.
    #[arg(long, conflicts_with = "against")]
    pub self_test: bool,
}

pub fn run(args: GateArgs) -> anyhow::Result<ExitCode> {
    let settings = crate::gate::gate_settings(&args.overrides);
    if args.self_test {
        return crate::gate::self_test(
            &args.dir.join("self-test"),
            args.pairs,
            crate::gate::jobs_for(args.jobs),
            &settings,
        );
    }
    if let Some(rev) = &args.against {
        // Taken first: building another revision replaces this binary's file for a while.
        let this = std::env::current_exe().context("cannot locate this stoke binary")?;
        let (binary, name) = crate::gate::binary_of(rev)?;
        return crate::gate::against(
            &this,
            &binary,
            &name,
            &args.dir.join("against"),
            args.pairs,
            crate::gate::jobs_for(args.jobs),
            &settings,
        );
    }
    crate::gate::gate(&GateSpec {
        baseline: args.baseline,
        dir: args.dir,
        repeats: args.repeats,
        overrides: args.overrides,
        update: args.update,
    })
}
