//! The loop's guards and monitors: non-finite values (the NaN dump, poisoning on purpose), loss
//! spikes, and per-unit gradient norms and update ratios.

use tch::Tensor;

use super::checkpoint::CheckpointTarget;
use super::device_guard::{Caught, DeviceGuard};
use super::events::{notify, Observer, TrainEvent};
use super::nan_dump::{finite_or_null, NanDump, OffendingTensor, TensorStats};
use super::state::Trainer;
use crate::executor::StepHooks;
use crate::TrainError;

/// How many standard deviations `loss` lies above the mean of `window` (None until it holds 10
/// losses, or when they do not vary).
pub(super) fn spike_z(window: &std::collections::VecDeque<f64>, loss: f64) -> Option<f64> {
    if window.len() < 10 {
        return None;
    }
    let n = window.len() as f64;
    let mean = window.iter().sum::<f64>() / n;
    let var = window.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (var > 0.0).then(|| (loss - mean) / var.sqrt())
}

impl Trainer {
    /// The guard kept on the device, where this run's step keeps its gradient norm there: `hooks`
    /// reduce nothing of it on the host (one process, or plain data parallelism), no loss scaler,
    /// no adaptive batch (it reads the norm every step), and an optimizer path that
    /// `step_on_device` runs.
    pub(super) fn device_guard(&self, hooks: &dyn StepHooks) -> Option<DeviceGuard> {
        let applies = self.scaler.is_none()
            && !self.sharded
            && self.adaptive.is_none()
            && !hooks.reduces_norm_on_host()
            && self.optimizer.steps_on_device(self.model.params(), self.kernel());
        let every = if self.train.guard_every == 0 { self.train.log_every } else { self.train.guard_every };
        applies.then(|| DeviceGuard::new(every, self.device))
    }

    /// The run stops on `caught`, read on step `detected_at`: the dump, with every checkpoint of
    /// the steps before it committed first (none of that step or later is written).
    pub(super) fn stop_non_finite(
        &self,
        caught: Caught,
        detected_at: u64,
        checkpoints: Option<&mut CheckpointTarget>,
        observers: &mut [&mut dyn Observer],
    ) -> Result<TrainError, TrainError> {
        let what = if caught.loss.is_finite() { "gradients" } else { "loss" };
        let dump = self.nan_dump(
            caught.step,
            what,
            caught.loss,
            caught.grad_norm,
            caught.last_finite_loss,
            caught.position_before,
            caught.position_after,
        );
        let mut latest = None;
        if let Some(target) = checkpoints {
            for saved in target.writer.finish()? {
                notify(observers, &TrainEvent::CheckpointSaved { step: saved.step, path: &saved.path })?;
            }
            latest = target.writer.store().latest()?;
        }
        Ok(TrainError::NonFinite(Box::new(NanDump {
            latest_checkpoint: latest,
            detected_at_step: detected_at,
            ..dump
        })))
    }

    /// `train.debug_poison_step`: a NaN written into the first block's first parameter, so this
    /// step's loss and gradients are not finite, as a diverged run's would be.
    pub(super) fn poison(&self) {
        let params = self.model.params();
        let units = params.units();
        let unit = units.get(1).unwrap_or(&units[0]);
        tch::no_grad(|| {
            let _ = params.flat().narrow(0, unit.range.start, 1).fill_(f64::NAN);
        });
    }

    /// Each unit's gradient norm (divided by the loss scale), and (`copy`) a copy of the parameters
    /// before the update, for `update_ratios`.
    pub(super) fn block_grad_norms(&self, scale: f64, copy: bool) -> (Vec<f64>, Option<Tensor>) {
        let params = self.model.params();
        let kernel = self.kernel();
        let norms = params
            .units()
            .iter()
            .map(|u| self.optimizer.grad_sq_sum(params, u.range.clone(), kernel, self.n_threads).sqrt() / scale)
            .collect();
        (norms, copy.then(|| params.flat().detach().copy()))
    }

    /// Each unit's ||Δw|| / ||w|| from the per-parameter squared norms a measured update found
    /// (`Optimizer::take_update_norms`); no update (a skipped step): 0 for every unit, as the copy's
    /// way gives.
    pub(super) fn unit_update_ratios(&self, norms: Option<&[(f64, f64)]>) -> Vec<f64> {
        self.model
            .params()
            .units()
            .iter()
            .map(|u| {
                let (change, weight) = norms.map_or((0.0, 0.0), |n| {
                    n[u.entries.clone()].iter().fold((0.0, 0.0), |(c, w), &(dc, dw)| (c + dc, w + dw))
                });
                if weight > 0.0 {
                    (change / weight).sqrt()
                } else {
                    0.0
                }
            })
            .collect()
    }

    /// ||w_after - w_before|| / ||w_before|| per unit.
    pub(super) fn update_ratios(&self, before: &Tensor) -> Vec<f64> {
        let params = self.model.params();
        tch::no_grad(|| {
            let delta = params.flat() - before;
            params
                .units()
                .iter()
                .map(|u| {
                    let len = u.range.end - u.range.start;
                    let d = crate::optim::tensor_sq_sum(&delta.narrow(0, u.range.start, len), u.range.start);
                    let w = crate::optim::tensor_sq_sum(&before.narrow(0, u.range.start, len), u.range.start);
                    if w > 0.0 {
                        (d / w).sqrt()
                    } else {
                        0.0
                    }
                })
                .collect()
        })
    }

    /// What `nan-dump.json` holds: the step, its samples, every parameter or gradient tensor that
    /// holds a NaN or an inf with its statistics, and the last finite loss.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn nan_dump(
        &self,
        step: u64,
        what: &str,
        loss: f64,
        grad_norm: f64,
        last_finite_loss: f64,
        position_before: u64,
        position_after: u64,
    ) -> NanDump {
        let params = self.model.params();
        let mut offending = Vec::new();
        for entry in params.entries() {
            let grad = params.flat_grad().narrow(0, entry.offset, entry.numel);
            let value = params.flat().narrow(0, entry.offset, entry.numel);
            for (kind, t) in [("parameter", &value), ("gradient", &grad)] {
                let stats = TensorStats::of(t);
                if stats.nan > 0 || stats.inf > 0 {
                    offending.push(OffendingTensor { name: entry.name.clone(), kind: kind.into(), stats });
                }
            }
        }
        NanDump {
            step,
            detected_at_step: step,
            detected_at: what.into(),
            loss: finite_or_null(loss),
            grad_norm: finite_or_null(grad_norm),
            last_finite_loss: finite_or_null(last_finite_loss),
            data_position_before: position_before,
            data_position_after: position_after,
            micro_batch: self.train.micro_batch,
            grad_accum: self.train.grad_accum,
            seq_len: self.model.shape().seq_len,
            offending,
            latest_checkpoint: None,
            poisoned_on_purpose: self.train.debug_poison_step == step,
        }
    }
}
