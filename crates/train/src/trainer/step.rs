//! One optimizer step's work: the micro-batches' forward and backward, the adaptive batch size's
//! decision, and the update.

use stoke_data::BatchSource;
use stoke_prof::Phase;
use tch::{Kind, Tensor};

use crate::clock::StepClock;
use crate::executor::StepHooks;
use crate::optim::UpdateKernel;
use crate::optimizers::Hyper;
use crate::precision::LossScaler;
use crate::TrainError;

use super::events::{BatchChange, MemoryReport};

use super::state::Trainer;

impl Trainer {
    /// The forward and backward of every micro-batch of one step, through the executor. Returns
    /// the step's mean loss (a device scalar) and, when measured, the activation memory.
    pub(super) fn forward_backward(
        &mut self,
        source: &mut dyn BatchSource,
        step_number: u64,
        measure_memory: bool,
        clock: &mut StepClock,
        hooks: &mut dyn StepHooks,
    ) -> Result<(Tensor, Option<MemoryReport>, Option<f64>), TrainError> {
        if let Some(link) = self.stage.take() {
            let result = self.run_stage(&link, source, step_number, measure_memory, clock, hooks);
            self.stage = Some(link);
            return result;
        }
        let n_micro = self.grad_accum;
        // Adaptive batch size: the mean squared norm of the micro-batches' own gradients.
        let mut micro_sq_sum = 0.0;
        let loss_multiplier = self.scaler.as_ref().map_or(1.0, LossScaler::scale) / n_micro as f64;
        let mut loss_sum = Tensor::zeros([], (Kind::Float, self.device));
        let mut memory = None;
        // Each weight cast to the compute type once per step (not per micro-batch); a ZeRO step
        // does not keep them (stage 3 releases the parameters between uses).
        self.model.begin_step_casts(n_micro > 1 && !self.sharded);
        for micro_idx in 0..n_micro {
            let inputs = self.next_inputs(source, step_number, clock)?;
            let measure = measure_memory && micro_idx == 0;
            let before = measure.then(crate::peak::host_bytes_in_use).flatten();
            let last = micro_idx + 1 == n_micro;
            let result = self.executor.run_micro_batch(
                self.model.as_ref(),
                &inputs,
                loss_multiplier,
                last,
                measure,
                clock,
                hooks,
            )?;
            if let (Some(before), Some(per_block)) = (before, result.activation_bytes) {
                let peak = result.peak_bytes_in_use.unwrap_or(before);
                memory = Some(self.memory_report(before, per_block, peak));
            }
            loss_sum += result.loss / n_micro as f64;
            if let Some(adaptive) = &self.adaptive {
                // flat_grad holds the sum of g_i / n_micro (times the fp16 scale) so far.
                let scale = self.scaler.as_ref().map_or(1.0, LossScaler::scale);
                let flat_grad = self.model.params().flat_grad();
                let own = tch::no_grad(|| (flat_grad - &adaptive.previous_grad) * (n_micro as f64 / scale));
                micro_sq_sum += crate::optim::tensor_sq_sum(&own, 0);
                tch::no_grad(|| adaptive.previous_grad.shallow_clone().copy_(flat_grad));
            }
        }
        self.model.end_step_casts();
        if let Some(adaptive) = &self.adaptive {
            // The next step starts from cleared gradients.
            tch::no_grad(|| {
                let _ = adaptive.previous_grad.shallow_clone().zero_();
            });
        }
        let micro_sq = self.adaptive.is_some().then(|| micro_sq_sum / n_micro as f64);
        if self.inject_overflow_at == Some(step_number) {
            tch::no_grad(|| {
                let _ = self.model.params().flat_grad().narrow(0, 0, 1).fill_(f64::INFINITY);
            });
        }
        Ok((loss_sum, memory, micro_sq))
    }

    /// A micro-batch's activation memory: host bytes in use `before` its forward and at its
    /// `peak`, and each block's kept activations.
    pub(super) fn memory_report(&self, before: u64, per_block: Vec<u64>, peak: u64) -> MemoryReport {
        MemoryReport {
            recompute: self.executor.recompute(),
            activation_bytes_per_block: per_block,
            activation_bytes: peak.saturating_sub(before),
            peak_bytes_in_use: peak,
        }
    }

    /// The next micro-batch from `source` as the model's inputs on the device (`data_wait`, then
    /// `h2d`); the batch's buffer goes back to the source.
    pub(super) fn next_inputs(
        &self,
        source: &mut dyn BatchSource,
        step_number: u64,
        clock: &mut StepClock,
    ) -> Result<crate::models::Inputs, TrainError> {
        let batch = source.next_batch()?;
        clock.lap(Phase::DataWait);
        let inputs = super::inputs::inputs_of(
            &batch,
            self.model.shape(),
            self.episode_shape.as_ref(),
            self.train.micro_batch,
            step_number,
            self.device,
        )?;
        // The inputs are copies: the buffer goes back to the source for a later batch.
        source.recycle(batch);
        clock.lap(Phase::H2d);
        Ok(inputs)
    }

    /// Adaptive batch size after a step: feeds the noise-scale estimate and, every
    /// `adaptive.every` steps, grows the accumulation when the phase is stable and the noise
    /// scale exceeds the batch.
    pub(super) fn adapt_batch(
        &mut self,
        step: u64,
        outcome: &crate::optim::StepOutcome,
        micro_sq: Option<f64>,
        loss_z: Option<f64>,
    ) -> Option<BatchChange> {
        let rows = self.train.micro_batch * self.train.world_size.max(1);
        let accum = self.grad_accum;
        let adaptive = self.adaptive.as_mut()?;
        if let (Some(small_sq), false) = (micro_sq, outcome.skipped) {
            let (b_small, b_big) = (self.train.micro_batch as f64, (self.train.micro_batch * accum) as f64);
            let big_sq = outcome.grad_norm * outcome.grad_norm;
            adaptive.noise.observe(adaptive.config.ema, b_small, small_sq, b_big, big_sq);
        }
        if loss_z.is_some_and(|z| z > adaptive.config.stable_z) {
            adaptive.unstable = true;
        }
        if step % adaptive.config.every != 0 {
            return None;
        }
        let stable = !std::mem::replace(&mut adaptive.unstable, false);
        let noise_scale = adaptive.noise.estimate();
        let next = crate::adaptive::grown_accum(accum, rows, adaptive.max_batch, noise_scale, stable)?;
        self.grad_accum = next;
        Some(BatchChange { from: rows * accum, to: rows * next, noise_scale: noise_scale.unwrap_or(f64::NAN) })
    }

    /// The optimizer's step at learning rate `lr` (clipping, fp16 unscaling and skipping inside);
    /// Ok(Err(gradient norm)) when the loss or the gradients are not finite (nothing updated).
    /// Under ZeRO the norm is the whole model's (the hooks add the shards') and the update runs
    /// on this rank's shard; the hooks then gather the updated parameters.
    pub(super) fn optimizer_step(
        &mut self,
        lr: f64,
        loss_finite: bool,
        hooks: &mut dyn StepHooks,
        clock: &mut StepClock,
    ) -> Result<Result<crate::optim::StepOutcome, f64>, TrainError> {
        let hp = self.hyper(lr);
        let kernel = self.kernel();
        let local = {
            let params = hooks.optimizer_params().unwrap_or(self.model.params());
            self.optimizer.grad_sq_sum(params, 0..params.n_elements(), kernel, self.n_threads)
        };
        // A rank whose loss is not finite makes every rank's norm NaN, so all stop together.
        let sq_sum = hooks.global_sq_sum(if loss_finite { local } else { f64::NAN })?;
        if !loss_finite {
            return Ok(Err(f64::NAN));
        }
        let params = hooks.optimizer_params().unwrap_or(self.model.params());
        let outcome = self.optimizer.step_with_sq_sum(
            params,
            sq_sum,
            &hp,
            self.train.grad_clip,
            self.scaler.as_mut(),
            kernel,
            self.n_threads,
            |norms| hooks.whole_tensor_norms(norms),
        )?;
        if outcome.is_ok() {
            hooks.after_optimizer(clock)?;
        }
        Ok(outcome)
    }

    /// `optimizer_step` with the norm kept on the device (see `device_guard`): nothing read back;
    /// the squared norm is returned for the guard.
    pub(super) fn optimizer_step_on_device(&mut self, lr: f64) -> tch::Tensor {
        let hp = self.hyper(lr);
        self.optimizer.step_on_device(self.model.params(), &hp, self.train.grad_clip, self.kernel())
    }

    fn hyper(&self, lr: f64) -> Hyper {
        Hyper {
            lr,
            beta1: self.train.beta1,
            beta2: self.train.beta2,
            eps: self.train.eps,
            weight_decay: self.train.weight_decay,
            momentum: self.train.momentum,
            nesterov: self.train.nesterov,
        }
    }

    pub(super) fn kernel(&self) -> UpdateKernel {
        if self.train.fused_optimizer {
            UpdateKernel::Fused
        } else {
            UpdateKernel::TensorOps
        }
    }
}
