//! AdamW with decoupled weight decay over the flat parameter buffers.
//!
//! The optimizer owns its state (the two moment buffers, laid out like the parameters, and the step
//! count) and works on ranges of the flat buffers: `grad_sq_sum` and `update_range` take a range,
//! so a sharded step can sum its shard's squares, all-reduce the sum into the global norm, and
//! update only its shard. `step` is that sequence for the whole buffer on one process.
//!
//! On a CPU the update (clipping and unscaling, decay, both moments, the step, and clearing the
//! gradient) is one fused pass in Rust over each parameter's slice, split across threads, after a
//! first pass that sums the squares for the norm: each element is read and written once per pass
//! while it is in cache, where a chain of libtorch ops would stream the multi-megabyte buffers
//! through memory ten times. On a GPU, or with `UpdateKernel::TensorOps`, the same arithmetic runs
//! as libtorch ops over the range.

use std::ops::Range;
use std::sync::Arc;

use tch::{Kind, Tensor};

use crate::params::FlatParams;
use crate::precision::{LossScaler, ScaleOutcome};
use crate::snapcopy::SaveMap;

mod kernel;

pub use kernel::UpdateKernel;
pub(crate) use kernel::{fused_slices, run_split, sum_of_squares, tensor_sq_sum, tensor_sq_sum_kept, Slices};

use kernel::{
    f32_bytes, saves_in_registers, sum_of_squared_differences, update, update_saving, RegisterSave, UpdateConsts,
    SAVE_BLOCK,
};

/// The factor an update multiplies the gradients by (clipping and loss-scale division): a number
/// on the host, or a 0-dim tensor on the parameters' device that nothing reads back (the clip
/// computed from a norm kept on the device, `train.guard_every`). Both round it to fp32 before
/// multiplying, so the same value gives the same bits.
#[derive(Clone, Copy)]
pub(crate) enum Multiplier<'a> {
    Host(f64),
    Device(&'a Tensor),
}

impl Multiplier<'_> {
    /// `grad *= self`, in place (nothing for a host 1).
    pub(crate) fn apply(self, grad: &mut Tensor) {
        match self {
            Multiplier::Host(m) if m != 1.0 => {
                let _ = grad.g_mul_scalar_(m);
            }
            Multiplier::Host(_) => {}
            Multiplier::Device(m) => {
                let _ = grad.g_mul_(m);
            }
        }
    }
}

/// Hyper-parameters of one AdamW step.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// Global gradient norm before clipping, with any loss scale divided out (inf or NaN when the
    /// gradients overflowed).
    pub grad_norm: f64,
    /// True when the fp16 scaler found an overflow and skipped the update.
    pub skipped: bool,
}

/// AdamW's state: moment estimates, flat like the parameters, and the count of steps taken. The
/// state is private; checkpoints go through `state_tensors` and `load_state`, by parameter name.
pub struct AdamW {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    n_steps: u64,
    /// A pending checkpoint's rooms: the next update saves the values it overwrites there.
    save: Option<Arc<SaveMap>>,
    /// The next fused update measures, per parameter, the squared norms of its change and of the
    /// weights before it (the monitors' update ratios), into `update_norms`.
    measure: bool,
    update_norms: Option<Vec<(f64, f64)>>,
}

/// A tensor of the optimizer's state, as a checkpoint stores it.
pub struct StateTensor {
    /// `<parameter name>.exp_avg` or `<parameter name>.exp_avg_sq`.
    pub name: String,
    pub shape: Vec<i64>,
    /// The values, a view of the optimizer's buffer.
    pub tensor: Tensor,
}

/// Suffixes of the per-parameter state tensors.
pub(crate) const MOMENTS: [&str; 2] = ["exp_avg", "exp_avg_sq"];

impl AdamW {
    pub fn new(params: &FlatParams) -> AdamW {
        AdamW {
            exp_avg: state_buffer(params),
            exp_avg_sq: state_buffer(params),
            n_steps: 0,
            save: None,
            measure: false,
            update_norms: None,
        }
    }

    /// The next `update_range` saves the parameters and moments it overwrites into `save`'s rooms
    /// (the fused kernel streams each block out just before updating it; the tensor-op path copies
    /// them all first), then marks it complete. `None` withdraws a map no update took.
    pub(crate) fn save_in_next_update(&mut self, save: Option<Arc<SaveMap>>) {
        self.save = save;
    }

    /// The next fused update measures each parameter's (||w_new - w_old||^2, ||w_old||^2) as it
    /// goes, for `take_update_norms`: the monitors' update ratios without a copy of the weights.
    pub(crate) fn measure_next_update(&mut self) {
        self.measure = true;
        self.update_norms = None;
    }

    /// Per parameter (the order of `FlatParams::entries`), the squared norms the last measured
    /// update found; None when no update ran since `measure_next_update` (a skipped step).
    pub(crate) fn take_update_norms(&mut self) -> Option<Vec<(f64, f64)>> {
        self.measure = false;
        self.update_norms.take()
    }

    /// Whether `update_range` over `params` with `kernel` runs the fused kernel, the one that saves
    /// and measures as it goes.
    pub(crate) fn updates_fused(&self, params: &FlatParams, kernel: UpdateKernel) -> bool {
        self.fused_slices(params, &(0..0), kernel).is_some()
    }

    /// Optimizer steps taken (the bias corrections' t).
    pub fn n_steps(&self) -> u64 {
        self.n_steps
    }

    pub(crate) fn buffers(&self) -> Vec<(&'static str, Tensor)> {
        vec![(MOMENTS[0], self.exp_avg.shallow_clone()), (MOMENTS[1], self.exp_avg_sq.shallow_clone())]
    }

    /// The state as named tensors: both moments of every parameter, in the parameters' order.
    pub fn state_tensors(&self, params: &FlatParams) -> Vec<StateTensor> {
        let mut out = Vec::with_capacity(2 * params.entries().len());
        for entry in params.entries() {
            for (suffix, buffer) in MOMENTS.iter().zip([&self.exp_avg, &self.exp_avg_sq]) {
                out.push(StateTensor {
                    name: format!("{}.{suffix}", entry.name),
                    shape: entry.shape.clone(),
                    tensor: buffer.narrow(0, entry.offset, entry.numel).view(entry.shape.as_slice()),
                });
            }
        }
        out
    }

    /// Restores the state saved by `state_tensors`. `lookup(name)` returns a saved tensor's shape
    /// and fp32 values. Every parameter's moments must be there with the parameter's shape: a
    /// changed layout is an error naming the tensor, never moments loaded into the wrong place.
    pub fn load_state(
        &mut self,
        params: &FlatParams,
        n_steps: u64,
        mut lookup: impl FnMut(&str) -> Option<(Vec<i64>, Tensor)>,
    ) -> Result<(), String> {
        let mut loaded = Vec::with_capacity(2 * params.entries().len());
        for entry in params.entries() {
            for suffix in MOMENTS {
                let name = format!("{}.{suffix}", entry.name);
                let (shape, values) = lookup(&name).ok_or_else(|| format!("optimizer state has no tensor {name:?}"))?;
                if shape != entry.shape {
                    return Err(format!(
                        "optimizer tensor {name:?} has shape {shape:?}, the parameter {:?} has {:?}",
                        entry.name, entry.shape
                    ));
                }
                loaded.push((entry.offset, entry.numel, suffix, values));
            }
        }
        // Only after every tensor checked out: a failed load leaves the state as it was.
        tch::no_grad(|| {
            for (offset, numel, suffix, values) in loaded {
                let buffer = if suffix == MOMENTS[0] { &self.exp_avg } else { &self.exp_avg_sq };
                buffer.narrow(0, offset, numel).copy_(&values.reshape([-1]).to_device(buffer.device()));
            }
        });
        self.n_steps = n_steps;
        Ok(())
    }

    /// One step on one process: the global norm, the loss scaler's verdict (fp16), clipping to
    /// `max_norm` (0: none), the update, and the gradients cleared for the next step.
    pub fn step(
        &mut self,
        params: &FlatParams,
        hp: AdamWStep,
        max_norm: f64,
        scaler: Option<&mut LossScaler>,
        kernel: UpdateKernel,
        n_threads: usize,
    ) -> StepOutcome {
        let all = 0..params.n_elements();
        let scaled_norm = self.grad_sq_sum(params, all.clone(), kernel, n_threads).sqrt();
        let scale = scaler.as_ref().map_or(1.0, |s| s.scale());
        let grad_norm = scaled_norm / scale;
        if let Some(scaler) = scaler {
            if scaler.update(scaled_norm) == ScaleOutcome::Skipped {
                params.zero_grad();
                return StepOutcome { grad_norm, skipped: true };
            }
        }
        let clip = if max_norm > 0.0 && grad_norm > max_norm { max_norm / (grad_norm + 1e-6) } else { 1.0 };
        self.begin_step();
        self.update_range(params, all, hp, clip / scale, kernel, n_threads);
        StepOutcome { grad_norm, skipped: false }
    }

    /// Counts a step (call once per step, before `update_range` on any range).
    pub fn begin_step(&mut self) {
        self.n_steps += 1;
    }

    /// Sum of squares of `flat_grad[range]` in f64, in an order that does not depend on threads.
    pub fn grad_sq_sum(&self, params: &FlatParams, range: Range<i64>, kernel: UpdateKernel, n_threads: usize) -> f64 {
        match self.fused_slices(params, &range, kernel) {
            Some(slices) => run_split(&slices, n_threads, |s| {
                // SAFETY: see `Slices`; this pass only reads.
                let g = unsafe { std::slice::from_raw_parts(s.grad, s.numel) };
                sum_of_squares(g)
            })
            .iter()
            .sum(),
            None => {
                let grad = params.flat_grad().narrow(0, range.start, range.end - range.start);
                tensor_sq_sum(&grad, range.start)
            }
        }
    }

    /// AdamW on `range` of the parameters from the gradients times `grad_multiplier` (clipping and
    /// loss-scale division folded into one factor); clears those gradients. The same arithmetic as
    /// PyTorch's `torch.optim.AdamW` (bias-corrected moments, decay applied to the weights before
    /// the step).
    pub fn update_range(
        &mut self,
        params: &FlatParams,
        range: Range<i64>,
        hp: AdamWStep,
        grad_multiplier: f64,
        kernel: UpdateKernel,
        n_threads: usize,
    ) {
        let t = self.n_steps.max(1) as i32;
        let save = self.save.take();
        match self.fused_slices(params, &range, kernel) {
            Some(slices) => {
                let bias_correction1 = 1.0 - hp.beta1.powi(t);
                let inv_sqrt_bc2 = (1.0 / (1.0 - hp.beta2.powi(t)).sqrt()) as f32;
                let (w1, w2, eps) = ((1.0 - hp.beta1) as f32, (1.0 - hp.beta2) as f32, hp.eps as f32);
                let clip = grad_multiplier as f32;
                let measure = std::mem::take(&mut self.measure);
                let sums = run_split(&slices, n_threads, |s| {
                    // SAFETY: see `Slices`: this thread is the only one touching these four ranges.
                    let (g, p, m, v) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(s.grad, s.numel),
                            std::slice::from_raw_parts_mut(s.param, s.numel),
                            std::slice::from_raw_parts_mut(s.exp_avg, s.numel),
                            std::slice::from_raw_parts_mut(s.exp_avg_sq, s.numel),
                        )
                    };
                    // The parameter's own rate (`train.lr_multipliers`) scales its step and decay.
                    let lr = hp.lr * s.lr_scale;
                    let step_size = (lr / bias_correction1) as f32;
                    let decay = if s.decay { (1.0 - lr * hp.weight_decay) as f32 } else { 1.0 };
                    let k = UpdateConsts { clip, w1, w2, inv_sqrt_bc2, eps, decay, step_size };
                    if save.is_none() && !measure {
                        update(g, p, m, v, &k);
                        return (0.0, 0.0);
                    }
                    // A block at a time: its old values streamed into the rooms (and the old
                    // weights kept for the norms) while the update reads them into cache, then
                    // the block updated from there.
                    let mut old = if measure { vec![0f32; SAVE_BLOCK.min(s.numel)] } else { Vec::new() };
                    // (room address, bytes, CRC-32) of what the register path saved.
                    let mut checksums = Vec::new();
                    let (mut change_sq, mut weight_sq) = (0.0, 0.0);
                    let mut at = 0;
                    while at < s.numel {
                        let n = SAVE_BLOCK.min(s.numel - at);
                        let r = at..at + n;
                        if let Some(save) = &save {
                            if !measure {
                                let rooms = [
                                    save.room_of(p[r.clone()].as_ptr(), n),
                                    save.room_of(m[r.clone()].as_ptr(), n),
                                    save.room_of(v[r.clone()].as_ptr(), n),
                                ];
                                let way = match rooms {
                                    [Some(dp), Some(dm), Some(dv)] => {
                                        saves_in_registers([dp, dm, dv]).map(|way| (way, [dp, dm, dv]))
                                    }
                                    _ => None,
                                };
                                if let Some((way, [dp, dm, dv])) = way {
                                    // Without folding in registers, the old values' CRC-32s are
                                    // taken first: that reads the block into cache, where the
                                    // update then loads it, so the writer need not read the rooms.
                                    let hashed = (way == RegisterSave::Plain).then(|| {
                                        [&p[r.clone()], &m[r.clone()], &v[r.clone()]]
                                            .map(|x| stoke_ckpt::checksum(f32_bytes(x)))
                                    });
                                    // SAFETY: each room holds `n` f32 (`room_of`), lies in the
                                    // pending snapshot's buffer, which outlives the update, and
                                    // no other thread writes it (the blocks are this thread's);
                                    // `way` is `saves_in_registers`'s for them.
                                    let folded = unsafe {
                                        update_saving(
                                            &mut g[r.clone()],
                                            &mut p[r.clone()],
                                            &mut m[r.clone()],
                                            &mut v[r.clone()],
                                            &k,
                                            [dp, dm, dv],
                                            way,
                                        )
                                    };
                                    let crcs = hashed.or(folded).expect("one way or the other hashes the block");
                                    save.count_saved(3 * 4 * n);
                                    checksums.extend(
                                        [dp, dm, dv]
                                            .into_iter()
                                            .zip(crcs)
                                            .map(|(room, crc)| (room as usize, 4 * n, crc)),
                                    );
                                    at += n;
                                    continue;
                                }
                            }
                            // SAFETY: these blocks are this thread's alone (see `Slices`) and
                            // nothing writes them until `update` below, on this thread.
                            unsafe {
                                save.save(p[r.clone()].as_ptr(), n);
                                save.save(m[r.clone()].as_ptr(), n);
                                save.save(v[r.clone()].as_ptr(), n);
                            }
                        }
                        if measure {
                            old[..n].copy_from_slice(&p[r.clone()]);
                        }
                        update(&mut g[r.clone()], &mut p[r.clone()], &mut m[r.clone()], &mut v[r.clone()], &k);
                        if measure {
                            weight_sq += sum_of_squares(&old[..n]);
                            change_sq += sum_of_squared_differences(&p[r], &old[..n]);
                        }
                        at += n;
                    }
                    if let Some(save) = &save {
                        save.add_checksums(checksums);
                    }
                    (change_sq, weight_sq)
                });
                if measure {
                    let mut per_entry = vec![(0.0, 0.0); params.entries().len()];
                    for (s, (change_sq, weight_sq)) in slices.iter().zip(sums) {
                        per_entry[s.entry].0 += change_sq;
                        per_entry[s.entry].1 += weight_sq;
                    }
                    self.update_norms = Some(per_entry);
                }
            }
            None => {
                if let Some(save) = &save {
                    // Not the fused kernel: everything saved before anything changes.
                    let all = |t: &Tensor| (t.data_ptr() as *const f32, t.numel());
                    for (ptr, n) in [all(params.param_memory().0), all(&self.exp_avg), all(&self.exp_avg_sq)] {
                        // SAFETY: whole contiguous CPU buffers (a `SaveMap` is only made for
                        // such sources), not written until the update below, on this thread.
                        unsafe { save.save(ptr, n) };
                    }
                }
                self.update_range_tensor_ops(params, range, hp, Multiplier::Host(grad_multiplier), t)
            }
        }
        if let Some(save) = save {
            save.mark_complete();
        }
    }

    fn update_range_tensor_ops(
        &mut self,
        params: &FlatParams,
        range: Range<i64>,
        hp: AdamWStep,
        grad_multiplier: Multiplier<'_>,
        t: i32,
    ) {
        let bias_correction1 = 1.0 - hp.beta1.powi(t);
        let bias_correction2 = 1.0 - hp.beta2.powi(t);
        // One parameter's part of the range at a time, as PyTorch's single-tensor AdamW does, so
        // the temporary is the size of one tensor, not of the whole buffer (500 MB at 124 M
        // parameters, far beyond the caches). One temporary per tensor: the squared gradient,
        // whose memory then holds the denominator. The arithmetic is the fused kernel's
        // (`update_portable`), with the step size folded into the denominator so one `addcdiv_`
        // applies the update. Every op is element-wise, so the values do not depend on the cut.
        let inv_sqrt_bc2 = 1.0 / bias_correction2.sqrt();
        tch::no_grad(|| {
            for entry in params.entries() {
                let (lo, hi) = (entry.offset.max(range.start), (entry.offset + entry.numel).min(range.end));
                if lo >= hi {
                    continue;
                }
                let lr = hp.lr * entry.lr_scale;
                let neg_inv_step = -bias_correction1 / lr;
                let narrow = |t: &Tensor| t.narrow(0, lo, hi - lo);
                let mut flat = narrow(params.flat());
                let mut grad = narrow(params.flat_grad());
                let (mut exp_avg, mut exp_avg_sq) = (narrow(&self.exp_avg), narrow(&self.exp_avg_sq));
                grad_multiplier.apply(&mut grad);
                if hp.weight_decay > 0.0 && entry.decay {
                    let _ = flat.g_mul_scalar_(1.0 - lr * hp.weight_decay);
                }
                let _ = exp_avg.lerp_(&grad, 1.0 - hp.beta1);
                let mut scratch = grad.square();
                let _ = exp_avg_sq.lerp_(&scratch, 1.0 - hp.beta2);
                if lr != 0.0 {
                    // -(sqrt(v) / sqrt(bc2) + eps) / step_size, in the squares' memory.
                    let _ = exp_avg_sq.sqrt_out(&scratch);
                    let _ = scratch.g_mul_scalar_(inv_sqrt_bc2 * neg_inv_step).g_add_scalar_(hp.eps * neg_inv_step);
                    let _ = flat.addcdiv_(&exp_avg, &scratch);
                }
                let _ = grad.zero_();
            }
        });
    }

    /// `update_range` over the whole buffer on the tensor-op path, the gradients multiplied by a
    /// 0-dim tensor on the device (`Multiplier::Device`): nothing is read to the host. Only where
    /// the fused kernel does not apply (`runs_fused` false), and with no checkpoint saving.
    pub(crate) fn update_on_device(&mut self, params: &FlatParams, hp: AdamWStep, grad_multiplier: &Tensor) {
        debug_assert!(self.save.is_none() && !self.measure, "the device path neither saves nor measures");
        let t = self.n_steps.max(1) as i32;
        self.update_range_tensor_ops(params, 0..params.n_elements(), hp, Multiplier::Device(grad_multiplier), t)
    }

    /// Whether `update_range` over `params` runs the fused CPU kernel.
    pub(crate) fn runs_fused(&self, params: &FlatParams, kernel: UpdateKernel) -> bool {
        self.fused_slices(params, &(0..params.n_elements()), kernel).is_some()
    }

    /// The fused kernel's slices of `range` (each parameter's part of it), or None when the fused
    /// kernel does not apply (not asked for, or the buffers are not contiguous CPU fp32).
    fn fused_slices(&self, params: &FlatParams, range: &Range<i64>, kernel: UpdateKernel) -> Option<Vec<Slices>> {
        fused_slices(params, range, kernel, &self.exp_avg, Some(&self.exp_avg_sq))
    }
}

/// A zeroed fp32 state buffer laid out like `params` (a shard's own layout when it is one).
pub(crate) fn state_buffer(params: &FlatParams) -> Tensor {
    Tensor::zeros([params.n_elements()], (Kind::Float, params.device()))
}

#[cfg(test)]
mod tests;
