//! Training dynamics in the report: the held-out evaluation curve, loss spikes, per-block gradient
//! norms and update/parameter ratios, early stopping, and the findings they raise (`loss_spike`,
//! `update_ratio`, `early_stopped`). The trainer measures; this is arithmetic on what it measured.

use serde::{Deserialize, Serialize};

use crate::findings::{Finding, RuleId};

/// One evaluation on held-out data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalPoint {
    pub step: u64,
    pub tokens_seen: u64,
    pub loss: f64,
    pub perplexity: f64,
}

/// A logged loss whose z-score over the previous window passed the threshold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Spike {
    pub step: u64,
    pub loss: f64,
    pub z: f64,
}

/// Per-block figures of one monitored step, in `Dynamics::units` order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MonitorPoint {
    pub step: u64,
    pub grad_norm: f64,
    pub block_grad_norm: Vec<f64>,
    pub update_ratio: Vec<f64>,
}

/// The adaptive batch size grew the global batch after `step`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BatchEvent {
    pub step: u64,
    pub from: usize,
    pub to: usize,
    pub noise_scale: f64,
}

/// `report.json`'s `dynamics`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Dynamics {
    /// The units (embedding, blocks, head) of `MonitorPoint`'s vectors.
    pub units: Vec<String>,
    pub eval: Vec<EvalPoint>,
    /// Every logged loss with a z-score above `spike_z`.
    pub spikes: Vec<Spike>,
    pub monitors: Vec<MonitorPoint>,
    /// The step early stopping ended the run at.
    pub early_stopped_at: Option<u64>,
    /// Adaptive batch size: every growth of the global batch.
    #[serde(default)]
    pub batch_changes: Vec<BatchEvent>,
    /// The z-score a spike must exceed, and the largest update ratio that raises no finding.
    pub spike_z: f64,
    pub update_ratio_max: f64,
}

impl Dynamics {
    /// The lowest evaluation loss: (step, loss).
    pub fn best_eval(&self) -> Option<(u64, f64)> {
        self.eval.iter().min_by(|a, b| a.loss.total_cmp(&b.loss)).map(|p| (p.step, p.loss))
    }

    /// The findings the dynamics raise (risks: no speed-up bound).
    pub fn findings(&self) -> Vec<Finding> {
        let mut out = Vec::new();
        if let Some(worst) = self.spikes.iter().max_by(|a, b| a.z.total_cmp(&b.z)) {
            out.push(Finding::new(
                RuleId::DynLossSpike,
                format!("z > {}", self.spike_z),
                worst.z,
                format!(
                    "{} logged loss(es) above {} standard deviations of the previous window; worst at step {}: \
                     loss {:.4}, z = {:.1}",
                    self.spikes.len(),
                    self.spike_z,
                    worst.step,
                    worst.loss,
                    worst.z
                ),
                None,
            ));
        }
        let worst_ratio = self
            .monitors
            .iter()
            .flat_map(|m| m.update_ratio.iter().enumerate().map(move |(u, r)| (m.step, u, *r)))
            .max_by(|a, b| a.2.total_cmp(&b.2));
        if let Some((step, unit, ratio)) = worst_ratio.filter(|w| w.2 > self.update_ratio_max) {
            let name = self.units.get(unit).cloned().unwrap_or_else(|| format!("unit {unit}"));
            out.push(Finding::new(
                RuleId::DynUpdateRatio,
                format!("> {}", self.update_ratio_max),
                ratio,
                format!("{name} moved by {ratio:.3} of its norm at step {step}"),
                None,
            ));
        }
        if let Some(step) = self.early_stopped_at {
            let best =
                self.best_eval().map_or(String::new(), |(s, l)| format!("; best evaluation loss {l:.4} at step {s}"));
            out.push(Finding::new(
                RuleId::DynEarlyStopped,
                "patience".into(),
                step as f64,
                format!("stopped at step {step}{best}"),
                None,
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn findings_fire_on_their_evidence_only() {
        let mut d = Dynamics {
            spike_z: 4.0,
            update_ratio_max: 0.01,
            units: vec!["wte".into(), "h.0".into()],
            ..Dynamics::default()
        };
        assert!(d.findings().is_empty());
        d.monitors.push(MonitorPoint {
            step: 10,
            grad_norm: 1.0,
            block_grad_norm: vec![0.5, 0.5],
            update_ratio: vec![0.001, 0.002],
        });
        assert!(d.findings().is_empty(), "ratios under the threshold");
        d.monitors.push(MonitorPoint {
            step: 20,
            grad_norm: 1.0,
            block_grad_norm: vec![0.5, 0.5],
            update_ratio: vec![0.001, 0.05],
        });
        d.spikes.push(Spike { step: 30, loss: 4.0, z: 6.5 });
        d.eval.push(EvalPoint { step: 20, tokens_seen: 100, loss: 2.0, perplexity: 2f64.exp() });
        d.early_stopped_at = Some(40);
        let ids: Vec<String> = d.findings().into_iter().map(|f| f.id).collect();
        assert_eq!(ids, ["loss_spike", "update_ratio", "early_stopped"]);
        assert!(d.findings()[1].evidence.contains("h.0"));
    }
}
