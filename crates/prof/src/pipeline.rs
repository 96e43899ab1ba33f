//! A pipeline-parallel run's bubble: the share of the schedule's span each stage did not compute
//! (its own span less its time blocked on its neighbours, over the longest stage's span),
//! against the formula for equal stages and free transfers, `(p - 1) / (m + p
//! - 1)` for p stages and m micro-batches (GPipe and 1F1B alike; interleaving with v chunks per
//! stage divides the idle part by v: `(p - 1) / (v m + p - 1)`).

use serde::{Deserialize, Serialize};

/// One stage's step of the schedule (`StepSample::pipeline`): milliseconds blocked receiving or
/// sending activations and gradients, and the schedule's whole span (its forwards, backwards
/// and those waits; not the optimizer).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct StageStep {
    pub wait_ms: f64,
    pub span_ms: f64,
}

/// `report.json`'s `pipeline`: the bubble of each stage of the first model copy, measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PipelineReport {
    pub stages: usize,
    /// Model chunks per stage (1 unless interleaved).
    #[serde(default = "one")]
    pub chunks: usize,
    pub micro_batches: usize,
    pub schedule: String,
    /// `(p - 1) / (v m + p - 1)`: the share of the span each stage idles with equal stages.
    pub formula: f64,
    /// The mean over the stages of their `bubble`.
    pub bubble: f64,
    /// The schedule's span: the longest stage's, ms (the stages start together, after the
    /// previous step's collectives).
    pub span_ms: f64,
    pub per_stage: Vec<StageBubble>,
}

fn one() -> usize {
    1
}

/// One stage's medians over the measured steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageBubble {
    pub stage: usize,
    pub rank: usize,
    /// The schedule's span minus the waits: the stage's own forwards and backwards, ms.
    pub busy_ms: f64,
    pub wait_ms: f64,
    pub span_ms: f64,
    /// `1 - busy_ms / span` of the pipeline's span (the longest stage's): the share of it this
    /// stage did not compute, the formula's quantity.
    pub bubble: f64,
}

/// The formula's idle share for `stages`, `micro_batches` and `chunks` per stage (1 unless
/// interleaved).
pub fn bubble_formula(stages: usize, micro_batches: usize, chunks: usize) -> f64 {
    let (p, m, v) = (stages as f64, micro_batches as f64, chunks.max(1) as f64);
    if stages <= 1 {
        return 0.0;
    }
    (p - 1.0) / (v * m + p - 1.0)
}

impl PipelineReport {
    /// From each stage's medians `(stage, rank, step)` of the first copy; `(stages, chunks)`.
    pub fn new(
        (stages, chunks): (usize, usize),
        micro_batches: usize,
        schedule: &str,
        mut measured: Vec<(usize, usize, StageStep)>,
    ) -> Self {
        measured.sort_by_key(|(stage, rank, _)| (*stage, *rank));
        let span_ms = measured.iter().map(|(_, _, s)| s.span_ms).fold(0.0, f64::max);
        let per_stage: Vec<StageBubble> = measured
            .into_iter()
            .map(|(stage, rank, s)| {
                let busy_ms = (s.span_ms - s.wait_ms).max(0.0);
                let bubble = if span_ms > 0.0 { 1.0 - busy_ms / span_ms } else { 0.0 };
                StageBubble { stage, rank, busy_ms, wait_ms: s.wait_ms, span_ms: s.span_ms, bubble }
            })
            .collect();
        let bubble = per_stage.iter().map(|s| s.bubble).sum::<f64>() / per_stage.len().max(1) as f64;
        PipelineReport {
            stages,
            chunks,
            micro_batches,
            schedule: schedule.to_string(),
            formula: bubble_formula(stages, micro_batches, chunks),
            bubble,
            span_ms,
            per_stage,
        }
    }

    /// The report's lines.
    pub fn render_text(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "pipeline: {} stages, {} micro-batches, {}: bubble {:.1}% of the {:.2} ms schedule measured (mean over \
             stages: 1 - busy / span), {:.1}% by (p-1)/({}m+p-1)",
            self.stages,
            self.micro_batches,
            if self.chunks > 1 {
                format!("{} ({} chunks a stage)", self.schedule, self.chunks)
            } else {
                self.schedule.clone()
            },
            100.0 * self.bubble,
            self.span_ms,
            100.0 * self.formula,
            if self.chunks > 1 { format!("{}", self.chunks) } else { String::new() }
        );
        let _ = writeln!(
            out,
            "  {:>5} {:>5} {:>10} {:>10} {:>10} {:>7}",
            "stage", "rank", "busy ms", "wait ms", "span ms", "bubble"
        );
        for s in &self.per_stage {
            let _ = writeln!(
                out,
                "  {:>5} {:>5} {:>10.2} {:>10.2} {:>10.2} {:>6.1}%",
                s.stage,
                s.rank,
                s.busy_ms,
                s.wait_ms,
                s.span_ms,
                100.0 * s.bubble
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_formula_and_the_measured_share() {
        assert_eq!(bubble_formula(2, 4, 1), 0.2);
        assert_eq!(bubble_formula(4, 8, 1), 3.0 / 11.0);
        assert_eq!(bubble_formula(2, 4, 2), 1.0 / 9.0);
        assert_eq!(bubble_formula(1, 4, 1), 0.0);
        let report = PipelineReport::new(
            (2, 1),
            4,
            "1f1b",
            vec![(1, 1, StageStep { wait_ms: 2.0, span_ms: 9.0 }), (0, 0, StageStep { wait_ms: 1.0, span_ms: 10.0 })],
        );
        assert_eq!(report.per_stage[0].stage, 0);
        assert_eq!(report.span_ms, 10.0);
        // Stage 0 computed 9 of the 10 ms, stage 1 7.
        assert!((report.per_stage[1].busy_ms - 7.0).abs() < 1e-12);
        assert!((report.bubble - 0.2).abs() < 1e-12);
        assert!(report.render_text().contains("bubble 20.0% of the 10.00 ms schedule"), "{}", report.render_text());
    }
}
