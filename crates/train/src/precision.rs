//! Mixed precision: which element type each kind of op runs in, and dynamic loss scaling for fp16.
//!
//! tch's `autocast` is CUDA-only, so stoke casts per op the way autocast does: matrix multiplies
//! (linear layers, attention's batched products) run in the compute type, everything listed in
//! `FP32_OPS` stays fp32, and master weights, gradients and optimizer state are always fp32.

use tch::Kind;

use crate::config::{LossScaleConfig, Precision};

/// Ops that run in fp32 whatever the precision, because their sums or exponentials lose too
/// much in 16 bits. This list is the policy; the model's code follows it.
pub const FP32_OPS: &[&str] = &["layer_norm", "softmax (inside, even when its output is 16-bit)", "cross_entropy"];

/// The element type of the matrix multiplies under `precision`.
pub fn compute_kind(precision: Precision) -> Kind {
    match precision {
        Precision::Fp32 => Kind::Float,
        Precision::Bf16 => Kind::BFloat16,
        Precision::Fp16 => Kind::Half,
    }
}

/// Dynamic loss scaling (what `torch.cuda.amp.GradScaler` does): the loss is multiplied by
/// `scale` before the backward so small fp16 gradients do not flush to zero; the optimizer divides
/// it out. A step whose gradients hold an inf or NaN is skipped and the scale backs off; after
/// `interval` clean steps it grows.
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    config: LossScaleConfig,
    scale: f64,
    clean_steps: u64,
    skipped_steps: u64,
}

/// What the scaler decided about one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleOutcome {
    /// The gradients were finite; the update goes ahead.
    Applied,
    /// The gradients overflowed; the update is skipped and the scale backed off.
    Skipped,
}

impl LossScaler {
    pub fn new(config: LossScaleConfig) -> LossScaler {
        LossScaler { config, scale: config.init, clean_steps: 0, skipped_steps: 0 }
    }

    pub fn scale(&self) -> f64 {
        self.scale
    }

    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    /// Records one step whose (scaled) gradient norm is `scaled_norm`; a non-finite norm means an
    /// inf or NaN somewhere in the gradients.
    pub fn update(&mut self, scaled_norm: f64) -> ScaleOutcome {
        if !scaled_norm.is_finite() {
            self.scale *= self.config.backoff;
            self.clean_steps = 0;
            self.skipped_steps += 1;
            return ScaleOutcome::Skipped;
        }
        self.clean_steps += 1;
        if self.clean_steps >= self.config.interval {
            self.scale *= self.config.growth;
            self.clean_steps = 0;
        }
        ScaleOutcome::Applied
    }

    /// The scaler's state for a checkpoint: scale, clean steps in a row, skipped steps.
    pub fn state(&self) -> (f64, u64, u64) {
        (self.scale, self.clean_steps, self.skipped_steps)
    }

    pub fn restore(&mut self, scale: f64, clean_steps: u64, skipped_steps: u64) {
        self.scale = scale;
        self.clean_steps = clean_steps;
        self.skipped_steps = skipped_steps;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_skips_backs_off_and_grows_back() {
        let mut scaler = LossScaler::new(LossScaleConfig { init: 1024.0, growth: 2.0, backoff: 0.5, interval: 3 });
        assert_eq!(scaler.update(1.0), ScaleOutcome::Applied);
        assert_eq!(scaler.update(f64::INFINITY), ScaleOutcome::Skipped);
        assert_eq!(scaler.scale(), 512.0);
        assert_eq!(scaler.update(f64::NAN), ScaleOutcome::Skipped);
        assert_eq!(scaler.scale(), 256.0);
        assert_eq!(scaler.skipped_steps(), 2);
        for _ in 0..2 {
            assert_eq!(scaler.update(3.0), ScaleOutcome::Applied);
            assert_eq!(scaler.scale(), 256.0, "grows only after `interval` clean steps");
        }
        assert_eq!(scaler.update(3.0), ScaleOutcome::Applied);
        assert_eq!(scaler.scale(), 512.0);
    }
}
