//! Time to the same quality: a run's held-out loss curve against its wall time, and the wall time
//! each configuration needs to reach the naive run's final held-out loss. A faster configuration
//! that learns less per token is not faster at this; one that never reaches the loss has no time.

use std::path::Path;

use anyhow::Context;
use serde::Serialize;
use serde_json::Value;

/// One evaluation of a run: tokens trained before it, wall time of the steps up to and including
/// its step (the evaluations' own time included: both configurations evaluate as often in tokens),
/// and the held-out loss.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct EvalPoint {
    pub step: u64,
    pub tokens: u64,
    pub wall_ms: f64,
    pub eval_loss: f64,
}

/// The evaluations of a run, from its metrics.jsonl.
pub fn eval_curve(metrics: &Path) -> anyhow::Result<Vec<EvalPoint>> {
    let text = std::fs::read_to_string(metrics).with_context(|| format!("cannot read {}", metrics.display()))?;
    let (mut wall_ms, mut tokens) = (0.0, 0u64);
    let mut points = Vec::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else { continue };
        wall_ms += v["step_ms"].as_f64().unwrap_or(0.0);
        tokens += v["tokens"].as_u64().unwrap_or(0);
        if let Some(eval_loss) = v["eval_loss"].as_f64() {
            points.push(EvalPoint { step: v["step"].as_u64().unwrap_or(0), tokens, wall_ms, eval_loss });
        }
    }
    Ok(points)
}

/// The wall time at the first evaluation at or below `target`; None when the run never gets there.
pub fn time_to(curve: &[EvalPoint], target: f64) -> Option<f64> {
    curve.iter().find(|p| p.eval_loss <= target).map(|p| p.wall_ms)
}

/// One seed's naive and optimized runs.
#[derive(Debug, Clone, Serialize)]
pub struct SeedResult {
    pub seed: u64,
    /// The naive run's final held-out loss: the target.
    pub target_loss: f64,
    /// The naive run's wall time to it (all of its evaluated steps).
    pub naive_ms: f64,
    /// The optimized run's wall time to the same loss, if it got there.
    pub optimized_ms: Option<f64>,
    pub optimized_final_loss: f64,
    /// Tokens/s over the whole runs, optimized over naive.
    pub tokens_per_s_ratio: f64,
}

impl SeedResult {
    pub fn of(seed: u64, naive: &[EvalPoint], optimized: &[EvalPoint], tokens_per_s_ratio: f64) -> Option<Self> {
        let last = naive.last()?;
        Some(SeedResult {
            seed,
            target_loss: last.eval_loss,
            naive_ms: last.wall_ms,
            optimized_ms: time_to(optimized, last.eval_loss),
            optimized_final_loss: optimized.last().map_or(f64::NAN, |p| p.eval_loss),
            tokens_per_s_ratio,
        })
    }

    /// The time-to-loss speed-up, naive over optimized.
    pub fn speedup(&self) -> Option<f64> {
        self.optimized_ms.filter(|&t| t > 0.0).map(|t| self.naive_ms / t)
    }
}

/// The lines of the time-to-loss section: each seed, then the median and spread of the speed-ups
/// (seeds where the optimized run never reached the loss counted as none).
pub fn render(results: &[SeedResult]) -> String {
    let mut out = String::from("time to the naive run's final held-out loss (per seed):\n");
    for r in results {
        let optimized = match r.optimized_ms {
            Some(ms) => format!("{:.1} s", ms / 1e3),
            None => format!("never (its final held-out loss {:.4})", r.optimized_final_loss),
        };
        out.push_str(&format!(
            "  seed {}: target {:.4}; naive {:.1} s, optimized {optimized}; speed-up {}; tokens/s ratio {:.2}x\n",
            r.seed,
            r.target_loss,
            r.naive_ms / 1e3,
            r.speedup().map_or("-".into(), |s| format!("{s:.2}x")),
            r.tokens_per_s_ratio
        ));
    }
    let speedups: Vec<f64> = results.iter().filter_map(SeedResult::speedup).collect();
    let ratios: Vec<f64> = results.iter().map(|r| r.tokens_per_s_ratio).collect();
    if !speedups.is_empty() {
        let spread =
            |v: &[f64]| v.iter().copied().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
        let (lo, hi) = spread(&speedups);
        let (rlo, rhi) = spread(&ratios);
        out.push_str(&format!(
            "time-to-loss speed-up, optimized over naive: median {:.2}x [{lo:.2}, {hi:.2}] over {} of {} seeds; \
             tokens/s ratio median {:.2}x [{rlo:.2}, {rhi:.2}]\n",
            stoke_prof::median(&speedups),
            speedups.len(),
            results.len(),
            stoke_prof::median(&ratios),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(step: u64, wall_ms: f64, eval_loss: f64) -> EvalPoint {
        EvalPoint { step, tokens: step * 1024, wall_ms, eval_loss }
    }

    #[test]
    fn the_speedup_is_the_time_to_the_naive_runs_final_loss() {
        let naive = [point(10, 1000.0, 3.0), point(20, 2000.0, 2.5), point(30, 3000.0, 2.2)];
        // Faster per token and learning as well: reaches 2.2 at 1200 ms.
        let fast = [point(3, 600.0, 2.6), point(6, 1200.0, 2.2), point(9, 1800.0, 2.1)];
        let r = SeedResult::of(1, &naive, &fast, 2.4).unwrap();
        assert_eq!((r.target_loss, r.naive_ms, r.optimized_ms), (2.2, 3000.0, Some(1200.0)));
        assert_eq!(r.speedup(), Some(2.5));
        // Faster per token but never as good: no speed-up, whatever its tokens/s.
        let sloppy = [point(3, 500.0, 2.9), point(6, 1000.0, 2.5), point(9, 1500.0, 2.3)];
        let r2 = SeedResult::of(2, &naive, &sloppy, 3.0).unwrap();
        assert_eq!(r2.speedup(), None);
        let text = render(&[r, r2]);
        assert!(text.contains("never (its final held-out loss 2.3000)") && text.contains("median 2.50x"), "{text}");
    }

    #[test]
    fn the_curve_adds_up_the_steps_before_each_evaluation() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        let lines = [
            r#"{"step":1,"step_ms":10.0,"tokens":100,"loss":5.0}"#,
            r#"{"step":2,"step_ms":30.0,"tokens":100,"loss":4.0,"eval_loss":4.5}"#,
            r#"{"step":3,"step_ms":10.0,"tokens":100,"loss":3.5}"#,
            r#"{"step":4,"step_ms":12.0,"tokens":100,"loss":3.0,"eval_loss":3.2}"#,
        ];
        std::fs::write(&metrics, lines.join("\n")).unwrap();
        let curve = eval_curve(&metrics).unwrap();
        assert_eq!(curve, vec![point2(2, 200, 40.0, 4.5), point2(4, 400, 62.0, 3.2)]);
    }

    fn point2(step: u64, tokens: u64, wall_ms: f64, eval_loss: f64) -> EvalPoint {
        EvalPoint { step, tokens, wall_ms, eval_loss }
    }
}
