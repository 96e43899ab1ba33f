//! The step-report half's errors (the trace analyzer has its own, `TraceError`).

/// What can go wrong building, drawing or checking a step report's outputs.
#[derive(Debug, thiserror::Error)]
pub enum ProfError {
    /// A `[prof]` value out of range; `key` is the key inside the section.
    #[error("prof.{key}: {message}")]
    InvalidConfig { key: &'static str, message: String },
    /// A plot of report.html could not be drawn.
    #[error("report.html: cannot draw the {chart} plot: {message}")]
    Plot { chart: String, message: String },
    /// `validate_chrome_trace` rejected a trace.
    #[error("not a valid Chrome trace: {reason}")]
    InvalidChromeTrace { reason: String },
    /// NVML (GPU health) could not be opened from `library`.
    #[error("GPU health metrics: {library}: {reason}")]
    GpuHealth { library: String, reason: String },
    /// `validate_exposition` rejected a Prometheus text exposition.
    #[error("not valid Prometheus exposition format: {reason}")]
    InvalidExposition { reason: String },
    /// What a rank sent rank 0 at the end of a data-parallel run is not a rank report.
    #[error("the step report rank {rank} sent cannot be read: {reason}")]
    RankReport { rank: usize, reason: String },
    /// A run's metrics.jsonl could not be read as curves (`line` is 1-based; 0 for the whole file).
    #[error("metrics of {name}, line {line}: {message}")]
    Metrics { name: String, line: usize, message: String },
}
