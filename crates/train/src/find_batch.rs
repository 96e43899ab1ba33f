//! `stoke train --find-batch`: the largest micro-batch whose step fits a memory budget.
//!
//! Each probe builds the model and optimizer and runs one real step (forward, backward, update)
//! at a candidate micro-batch on random tokens, measuring the host bytes in use at the step's peak
//! (the end of the forward pass and the head's backward, when every activation is alive). Memory
//! is affine in the micro-batch (parameters, gradients and optimizer state, plus activations per
//! sample), so two small probes predict the answer and probes near it confirm it. No probe is run
//! at a size predicted to exceed the budget.

use std::sync::atomic::AtomicBool;

use tch::Device;

use crate::config::{CkptConfig, ModelConfig, Recompute, TrainConfig};
use crate::trainer::Trainer;
use crate::TrainError;

/// The answer of a search.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchFit {
    /// The largest micro-batch that fits.
    pub micro_batch: usize,
    /// Its measured peak bytes in use.
    pub peak_bytes: u64,
    pub budget_bytes: u64,
    /// The recomputation policy every probe ran with.
    pub recompute: Recompute,
    /// Measured (micro-batch, peak bytes) of every probe, in order.
    pub probes: Vec<(usize, u64)>,
}

/// Peak host bytes in use during one training step at `micro_batch` (CPU only).
pub fn measure_step_memory(model: &ModelConfig, train: &TrainConfig, micro_batch: usize) -> Result<u64, TrainError> {
    let shape = model.shape()?;
    let train = TrainConfig { micro_batch, steps: 1, grad_accum: 1, warmup_steps: 1, ..train.clone() };
    let ckpt = CkptConfig { every: 0, at_end: false, ..CkptConfig::default() };
    let mut trainer = Trainer::new(model, &train, &ckpt, Device::Cpu)?;
    let tokens: Vec<u8> =
        (0..(micro_batch + 2) * (shape.seq_len + 1)).map(|i| (i * 7919 % shape.vocab_size.min(256)) as u8).collect();
    let mut source = stoke_data::RandomWindows::from_bytes(&tokens, shape.seq_len, micro_batch, train.seed)?;
    let summary = trainer.run(&mut source, &mut [], None, &AtomicBool::new(false))?;
    summary.memory.map(|m| m.peak_bytes_in_use).ok_or_else(|| TrainError::InvalidConfig {
        key: "run.device",
        message: "--find-batch measures host memory through glibc's allocator; this build cannot read it".into(),
    })
}

/// The largest micro-batch (at most `max_micro_batch`) whose step peaks within `budget_bytes`.
pub fn find_micro_batch(
    model: &ModelConfig,
    train: &TrainConfig,
    budget_bytes: u64,
    max_micro_batch: usize,
) -> Result<BatchFit, TrainError> {
    let mut probes = Vec::new();
    let probe = |micro_batch: usize, probes: &mut Vec<(usize, u64)>| -> Result<u64, TrainError> {
        let bytes = measure_step_memory(model, train, micro_batch)?;
        probes.push((micro_batch, bytes));
        Ok(bytes)
    };
    let (m1, m2) = (probe(1, &mut probes)?, probe(2, &mut probes)?);
    if m1 > budget_bytes {
        return Err(TrainError::InvalidConfig {
            key: "train.micro_batch",
            message: format!("even a micro-batch of 1 needs {m1} bytes, over the budget of {budget_bytes}"),
        });
    }
    // `fits` is the largest probe known to fit, `too_big` the smallest known not to. Each round
    // predicts the budget's micro-batch from a line through the two probes nearest to it, and
    // probes there.
    let mut fits = (1usize, m1);
    let mut too_big: Option<(usize, u64)> = None;
    let (mut lower, mut upper) = ((1usize, m1), (2usize, m2));
    if m2 <= budget_bytes {
        fits = (2, m2);
    } else {
        too_big = Some((2, m2));
    }
    // Invariant: `fits.1 <= budget_bytes`, and every probe larger than `too_big` is skipped.
    for _ in 0..8 {
        let slope = (upper.1 as f64 - lower.1 as f64) / (upper.0 - lower.0) as f64;
        let predicted = lower.0 as f64 + (budget_bytes as f64 - lower.1 as f64) / slope.max(1.0);
        let ceiling = too_big.map_or(max_micro_batch, |(b, _)| b - 1);
        let candidate = (predicted.floor().max(0.0) as usize).min(ceiling);
        if candidate <= fits.0 {
            // The prediction lands on what is known to fit: try one more only if unknown.
            if too_big.is_some_and(|(b, _)| b == fits.0 + 1) || fits.0 >= max_micro_batch {
                break;
            }
            let next = fits.0 + 1;
            let bytes = probe(next, &mut probes)?;
            if bytes <= budget_bytes {
                fits = (next, bytes);
            } else {
                break;
            }
            continue;
        }
        let bytes = probe(candidate, &mut probes)?;
        if bytes <= budget_bytes {
            (lower, upper) = (fits, (candidate, bytes));
            fits = (candidate, bytes);
        } else {
            too_big = Some((candidate, bytes));
            (lower, upper) = (fits, (candidate, bytes));
        }
        if fits.0 >= max_micro_batch || too_big.is_some_and(|(b, _)| b == fits.0 + 1) {
            break;
        }
    }
    let best = fits;
    Ok(BatchFit { micro_batch: best.0, peak_bytes: best.1, budget_bytes, recompute: train.recompute, probes })
}
