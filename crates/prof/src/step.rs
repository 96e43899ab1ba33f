//! The step report of a run: its figures (`report`), then its findings (`rules`).

use crate::input::{ProfConfig, RunFacts, StepSample};
use crate::report::{measure_report, RunReport};
use crate::rules::diagnose;

/// Builds the report of a run from its steps: figures, then findings sorted by bound.
/// `profiler_ms` is the total time the profiler's observers spent; `peak_memory_bytes` the run's
/// peak.
pub fn build_report(
    facts: &RunFacts,
    steps: &[StepSample],
    peak_memory_bytes: u64,
    profiler_ms: f64,
    config: &ProfConfig,
) -> RunReport {
    let mut report = measure_report(facts, steps, peak_memory_bytes, profiler_ms, config);
    report.findings = diagnose(&report, steps, config);
    report
}
