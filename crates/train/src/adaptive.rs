//! Adaptive batch size: the gradient noise scale and when to grow the accumulation.
//!
//! McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", appendix A.1): for
//! gradients estimated from batches of B_small and B_big samples, E|G_B|² = |G|² + tr(Σ)/B, so
//!   |G|²   ≈ (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small)
//!   tr(Σ)  ≈ (|G_small|² - |G_big|²) / (1/B_small - 1/B_big)
//! and the simple noise scale B_noise = tr(Σ) / |G|² is the batch beyond which a larger batch
//! stops paying for itself. The trainer has both for free: each micro-batch's gradient (B_small =
//! its rows) and the accumulated step's (B_big = all rows of the step). Both estimates are noisy,
//! so each is smoothed by an exponential moving average before the ratio, as the paper does.
//!
//! The rule: every `every` steps, when the phase is stable (no logged loss z-score above
//! `stable_z` since the last decision) and B_noise exceeds the current global batch, double the
//! accumulation, never past `max_batch` sequences. Accumulating more micro-batches keeps the
//! step's memory where it was (one micro-batch's activations live at a time), so the budget is the
//! global batch itself.

use serde::{Deserialize, Serialize};

use crate::TrainError;

/// `[adaptive]`: adaptive batch size through gradient accumulation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdaptiveConfig {
    /// Grow the global batch (train.grad_accum) while the gradient noise scale says a larger batch
    /// pays and the loss is stable; the learning rate follows train.lr_scaling. Needs
    /// train.grad_accum >= 2 (the estimate compares micro-batch and step gradients). Default false.
    pub enabled: bool,
    /// Steps between decisions. Default 50.
    pub every: u64,
    /// The budget: the largest global batch in sequences (micro_batch x grad_accum x processes);
    /// 0 takes 8 times the starting one. Default 0.
    pub max_batch: usize,
    /// A phase is stable when no logged loss since the last decision had a spike z-score above
    /// this. Default 3.0.
    pub stable_z: f64,
    /// Weight of the past in the moving averages of |G|² and tr(Σ). Default 0.95.
    pub ema: f64,
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        AdaptiveConfig { enabled: false, every: 50, max_batch: 0, stable_z: 3.0, ema: 0.95 }
    }
}

impl AdaptiveConfig {
    pub fn validate(&self, grad_accum: usize) -> Result<(), TrainError> {
        let bad = |key: &'static str, message: String| Err(TrainError::InvalidConfig { key, message });
        if !self.enabled {
            return Ok(());
        }
        if grad_accum < 2 {
            return bad(
                "adaptive.enabled",
                format!("needs train.grad_accum >= 2 to estimate the noise scale; got {grad_accum}"),
            );
        }
        if self.every == 0 {
            return bad("adaptive.every", "must be at least 1; got 0".into());
        }
        if !(self.ema >= 0.0 && self.ema < 1.0) {
            return bad("adaptive.ema", format!("must be in [0, 1); got {}", self.ema));
        }
        if !(self.stable_z.is_finite() && self.stable_z > 0.0) {
            return bad("adaptive.stable_z", format!("must be a finite number > 0; got {}", self.stable_z));
        }
        Ok(())
    }
}

/// The smoothed estimates of |G|² and tr(Σ).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct NoiseScale {
    pub g2: Option<f64>,
    pub trace: Option<f64>,
}

impl NoiseScale {
    /// One step's measurement: the mean squared norm of its micro-batch gradients (each of
    /// `b_small` rows) and the squared norm of their mean (`b_big` rows).
    pub fn observe(&mut self, ema: f64, b_small: f64, small_sq: f64, b_big: f64, big_sq: f64) {
        if !(b_big > b_small && small_sq.is_finite() && big_sq.is_finite()) {
            return;
        }
        let g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small);
        let trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big);
        let smooth = |old: Option<f64>, new: f64| Some(old.map_or(new, |o| ema * o + (1.0 - ema) * new));
        self.g2 = smooth(self.g2, g2);
        self.trace = smooth(self.trace, trace);
    }

    /// B_noise = tr(Σ) / |G|², when |G|² is positive.
    pub fn estimate(&self) -> Option<f64> {
        match (self.g2, self.trace) {
            (Some(g2), Some(trace)) if g2 > 0.0 => Some(trace / g2),
            _ => None,
        }
    }
}

/// The accumulation to grow to, if any: double `accum` when `stable` and the noise scale exceeds
/// the current global batch, capped so that `rows_per_micro` x accum stays within `max_batch`.
pub fn grown_accum(
    accum: usize,
    rows_per_micro: usize,
    max_batch: usize,
    noise_scale: Option<f64>,
    stable: bool,
) -> Option<usize> {
    let noise_scale = noise_scale?;
    let batch = accum * rows_per_micro;
    if !stable || noise_scale <= batch as f64 {
        return None;
    }
    let cap = max_batch / rows_per_micro.max(1);
    let next = (accum * 2).min(cap);
    (next > accum).then_some(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_recovers_the_noise_scale_from_expected_norms() {
        // E|G_B|² = |G|² + tr(Σ)/B with |G|² = 2 and tr(Σ) = 300: B_noise = 150.
        let (g2, trace) = (2.0, 300.0);
        let mut n = NoiseScale::default();
        for _ in 0..5 {
            n.observe(0.9, 8.0, g2 + trace / 8.0, 32.0, g2 + trace / 32.0);
        }
        assert!((n.estimate().unwrap() - 150.0).abs() < 1e-9, "{n:?}");
        // One batch size alone says nothing.
        let mut single = NoiseScale::default();
        single.observe(0.9, 8.0, 1.0, 8.0, 1.0);
        assert_eq!(single.estimate(), None);
    }

    #[test]
    fn growth_doubles_within_the_budget_only_when_stable_and_noisy() {
        assert_eq!(grown_accum(2, 8, 64, Some(100.0), true), Some(4));
        assert_eq!(grown_accum(4, 8, 48, Some(100.0), true), Some(6), "capped by the budget");
        assert_eq!(grown_accum(6, 8, 48, Some(100.0), true), None, "at the budget");
        assert_eq!(grown_accum(2, 8, 64, Some(100.0), false), None, "not in an unstable phase");
        assert_eq!(grown_accum(2, 8, 64, Some(10.0), true), None, "the batch already exceeds the noise scale");
        assert_eq!(grown_accum(2, 8, 64, None, true), None);
    }
}
