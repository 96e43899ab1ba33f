//! The one error type of the planner.

use std::path::PathBuf;

/// Everything that can go wrong while planning or calibrating.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A preset name that is not in the table.
    #[error("unknown {kind} preset {name:?}; known: {known}")]
    UnknownPreset { kind: &'static str, name: String, known: String },
    /// A configuration value out of range; `key` names the field.
    #[error("invalid {key}: {message}")]
    InvalidConfig { key: &'static str, message: String },
    /// No layout satisfies the constraints and fits in memory.
    #[error("no layout of {n_devices} devices fits: {reason}")]
    NoFeasibleLayout { n_devices: usize, reason: String },
    /// A run report could not be read.
    #[error("reading run report {path}")]
    ReadReport { path: PathBuf, source: std::io::Error },
    /// A run report is not the JSON we expect.
    #[error("parsing run report {path}")]
    ParseReport { path: PathBuf, source: serde_json::Error },
    /// A run report that parses but cannot be used (say, a zero step time).
    #[error("run report {path}: {message}")]
    UnusableReport { path: PathBuf, message: String },
    /// Calibration needs more measured runs than it was given.
    #[error("calibration needs at least {needed} runs, got {got}")]
    TooFewRuns { needed: usize, got: usize },
}
