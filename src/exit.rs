//! The exit codes of `stoke`, and which errors of which crate map to which, in one place.
//!
//! | code | meaning | where it comes from |
//! |---|---|---|
//! | 0 | success | every subcommand |
//! | 1 | runtime failure | any error that is not a `UsageError` (I/O, a damaged checkpoint, a failed collective, `stoke plan` finding no feasible layout) |
//! | 2 | usage or configuration error | a `UsageError`: the command line, a config file or `--set` (`config::ConfigError`), ranks that disagree on the config (`stoke_train::TrainError::RanksDisagree`), an unknown `dist.backend` (`stoke_comm`), a preset or configuration the planner refuses (`stoke_plan::PlanError`: `UnknownPreset`, `InvalidConfig`, `TooFewRuns`) |
//! | 3 | regression found | `stoke trace diff` (step time), `stoke compare` (final loss) |
//! | 4 | benchmark gate regression | `stoke bench gate` |
//! | 75 | preempted by a signal with a checkpoint written, resumable | `stoke train`, `stoke launch` (sysexits' EX_TEMPFAIL) |
//! | 128 + N | a worker of `stoke launch` killed by signal N, or a second stop signal | `stoke launch`, `signals` |
//!
//! `stoke launch` exits with its first failed worker's code, so any of the above can come from a
//! worker. `stoke-trace` (the trace subcommand without libtorch) uses codes 0 to 3 the same way.

use std::process::ExitCode;

/// A runtime failure: any error that is not a usage error.
pub const EXIT_RUNTIME: u8 = 1;
/// A bad command line or configuration.
pub const EXIT_USAGE: u8 = 2;
/// `stoke trace diff` or `stoke compare` found the new run worse than the reference.
pub const EXIT_REGRESSION: u8 = 3;
/// `stoke bench gate` found a regression against its baseline.
pub const EXIT_GATE_REGRESSION: u8 = 4;
/// A run stopped by a signal after writing its checkpoint: "preempted, resumable" (`--resume`
/// continues it). 75 is sysexits' EX_TEMPFAIL, "try again later".
pub const EXIT_PREEMPTED: u8 = 75;

pub use crate::usage::UsageError;

/// Characters of one line of an error message quoting user input.
const ERROR_LINE_CHARS: usize = 400;

/// `message` as a usage error (exit code 2).
pub fn usage(message: String) -> anyhow::Error {
    anyhow::Error::new(UsageError(message))
}

/// The process's exit code for an error that ended a subcommand, after printing it: a usage
/// error prints its message alone, any other error its whole chain of context.
pub fn report(err: &anyhow::Error) -> ExitCode {
    // A value quoted in a message can be megabytes long (a config line, a name): each line is
    // clipped, so the message names it without echoing it whole.
    if let Some(usage) = err.downcast_ref::<UsageError>() {
        eprintln!("error: {}", stoke_fsio::clip_lines(&usage.to_string(), ERROR_LINE_CHARS));
        return ExitCode::from(EXIT_USAGE);
    }
    eprintln!("error: {}", stoke_fsio::clip_lines(&format!("{err:#}"), ERROR_LINE_CHARS));
    ExitCode::from(EXIT_RUNTIME)
}

/// A configuration that does not load (unknown key, wrong type, invalid value, unreadable file):
/// the user's to fix, exit 2.
pub fn config_error(err: crate::config::ConfigError) -> anyhow::Error {
    usage(err.to_string())
}

/// Ranks of one job that run different configurations are a configuration error (exit 2); every
/// other training error is a runtime failure.
pub fn train_error(err: stoke_train::TrainError) -> anyhow::Error {
    match err {
        err @ stoke_train::TrainError::RanksDisagree { .. } => usage(err.to_string()),
        other => anyhow::Error::new(other),
    }
}

/// An unknown `dist.backend`: exit 2.
pub fn comm_backend_error(err: stoke_comm::CommError) -> anyhow::Error {
    usage(format!("config key `dist.backend`: {err}"))
}

/// Preset and configuration mistakes given to the planner are the user's (exit 2); its other
/// errors are runtime failures.
pub fn plan_error(err: stoke_plan::PlanError) -> anyhow::Error {
    use stoke_plan::PlanError;
    match err {
        PlanError::UnknownPreset { .. } | PlanError::InvalidConfig { .. } | PlanError::TooFewRuns { .. } => {
            usage(err.to_string())
        }
        other => anyhow::Error::new(other),
    }
}
