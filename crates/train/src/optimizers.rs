//! LAMB and SGD over the flat parameter buffers, and `Optimizer`, the one the trainer runs.
//!
//! Both follow AdamW's shape (`optim.rs`): the state is flat like the parameters and saved by
//! parameter name, and the step is made of range primitives, so a sharded step (each rank owning a
//! range of the flat buffers) can run them:
//!
//! - SGD: `grad_sq_sum(range)` for the global norm, then `update_range(range, multiplier)`.
//! - LAMB: `grad_sq_sum(range)`, then `prepare_range(range, multiplier, &mut norms)`, which in one
//!   pass updates both moments, writes the Adam direction plus decoupled weight decay into the
//!   gradient buffer (it is not needed any more) and adds each tensor's part of ||w||² and ||u||²
//!   into `norms` (under ZeRO, `Optimizer::step_with_sq_sum`'s `whole_norms` adds every rank's
//!   partial sums per parameter, `dist/zero.rs`); then
//!   `apply_range(range, lr, &norms)` moves each tensor by lr x its trust ratio ||w|| / ||u|| and
//!   clears the gradient. By default (`LambOptions`) only the tensors with weight decay take the
//!   trust ratio; biases and norms take Adam's step, as apex's and TensorFlow Addons' LAMB do.
//!
//! On a CPU each pass is fused Rust over each parameter's slice, split across threads like
//! AdamW's; on a GPU (or with `UpdateKernel::TensorOps`) the same arithmetic runs as libtorch ops
//! per parameter slice.

use std::ops::Range;

use tch::Tensor;

use crate::config::OptimizerKind;
use crate::optim::{fused_slices, run_split, sum_of_squares, AdamW, AdamWStep, Slices, StateTensor, StepOutcome};
use crate::optim::{state_buffer, tensor_sq_sum_kept, Multiplier, UpdateKernel, MOMENTS};
use crate::params::FlatParams;
use crate::precision::{LossScaler, ScaleOutcome};

/// Hyper-parameters of one step of any of the optimizers (each reads the ones it uses).
#[derive(Debug, Clone, Copy)]
pub struct Hyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// SGD: momentum (0: plain SGD).
    pub momentum: f64,
    /// SGD: Nesterov momentum.
    pub nesterov: bool,
}

impl Hyper {
    fn adam(&self) -> AdamWStep {
        AdamWStep { lr: self.lr, beta1: self.beta1, beta2: self.beta2, eps: self.eps, weight_decay: self.weight_decay }
    }
}

/// Per-tensor sums of squares over a range, indexed like `FlatParams::entries`: the parameters'
/// and LAMB's update direction's. Partial sums of disjoint ranges add up to the whole's.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorNorms {
    pub param_sq: Vec<f64>,
    pub update_sq: Vec<f64>,
}

impl TensorNorms {
    pub fn zeros(n_entries: usize) -> TensorNorms {
        TensorNorms { param_sq: vec![0.0; n_entries], update_sq: vec![0.0; n_entries] }
    }

    /// LAMB's trust ratio of tensor `entry`: ||w|| / ||u||, 1 when either is 0.
    pub fn trust_ratio(&self, entry: usize) -> f64 {
        let (w, u) = (self.param_sq[entry].sqrt(), self.update_sq[entry].sqrt());
        if w > 0.0 && u > 0.0 {
            w / u
        } else {
            1.0
        }
    }
}

/// Which tensors LAMB adapts, and how far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LambOptions {
    /// Apply the trust ratio to every tensor (NVIDIA's "NVLAMB"); false applies it only to the
    /// tensors with weight decay (matrices and embeddings), and biases and norms take the plain
    /// Adam step (trust ratio 1), as apex's FusedLAMB (`use_nvlamb = False`) and TensorFlow
    /// Addons' LAMB (`exclude_from_layer_adaptation` defaulting to the weight-decay exclusions)
    /// do. A zero-initialized bias under the trust ratio can only grow by a factor (1 + lr) per
    /// step, and a LayerNorm gain (norm sqrt(d)) moves by lr x sqrt(d) per step. Default false.
    pub adapt_all: bool,
    /// The trust ratio is clamped into [min_trust, max_trust] (the paper's phi; DeepSpeed's
    /// min_coeff and max_coeff are 0.01 and 10). Default 0 and infinity: no clamp, as apex and
    /// TensorFlow Addons.
    pub min_trust: f64,
    pub max_trust: f64,
}

impl Default for LambOptions {
    fn default() -> Self {
        LambOptions { adapt_all: false, min_trust: 0.0, max_trust: f64::INFINITY }
    }
}

/// Sum of squares of `flat_grad[range]`: the fused slices' sums in slice order, or one libtorch
/// reduction.
fn grad_sq_sum_over(params: &FlatParams, range: Range<i64>, slices: Option<Vec<Slices>>, n_threads: usize) -> f64 {
    match slices {
        Some(slices) => run_split(&slices, n_threads, |s| {
            // SAFETY: see `Slices`; this pass only reads.
            let g = unsafe { std::slice::from_raw_parts(s.grad, s.numel) };
            sum_of_squares(g)
        })
        .iter()
        .sum(),
        None => {
            let grad = params.flat_grad().narrow(0, range.start, range.end - range.start);
            crate::optim::tensor_sq_sum(&grad, range.start)
        }
    }
}

/// Each parameter's part of `range`: (entry index, start, end).
fn overlaps(params: &FlatParams, range: &Range<i64>) -> Vec<(usize, i64, i64)> {
    params
        .entries()
        .iter()
        .enumerate()
        .filter_map(|(i, e)| {
            let (lo, hi) = (e.offset.max(range.start), (e.offset + e.numel).min(range.end));
            (lo < hi).then_some((i, lo, hi))
        })
        .collect()
}

/// The state as named tensors: for every parameter, one view per (suffix, buffer).
pub(crate) fn state_views(params: &FlatParams, buffers: &[(&str, &Tensor)]) -> Vec<StateTensor> {
    let mut out = Vec::with_capacity(buffers.len() * params.entries().len());
    for entry in params.entries() {
        for (suffix, buffer) in buffers {
            out.push(StateTensor {
                name: format!("{}.{suffix}", entry.name),
                shape: entry.shape.clone(),
                tensor: buffer.narrow(0, entry.offset, entry.numel).view(entry.shape.as_slice()),
            });
        }
    }
    out
}

/// Loads `<param>.<suffix>` into each buffer; checks every name and shape before copying.
fn load_views(
    params: &FlatParams,
    buffers: &[(&str, &Tensor)],
    mut lookup: impl FnMut(&str) -> Option<(Vec<i64>, Tensor)>,
) -> Result<(), String> {
    let mut loaded = Vec::with_capacity(buffers.len() * params.entries().len());
    for entry in params.entries() {
        for (idx, (suffix, _)) in buffers.iter().enumerate() {
            let name = format!("{}.{suffix}", entry.name);
            let (shape, values) = lookup(&name).ok_or_else(|| format!("optimizer state has no tensor {name:?}"))?;
            if shape != entry.shape {
                return Err(format!(
                    "optimizer tensor {name:?} has shape {shape:?}, the parameter {:?} has {:?}",
                    entry.name, entry.shape
                ));
            }
            loaded.push((entry.offset, entry.numel, idx, values));
        }
    }
    tch::no_grad(|| {
        for (offset, numel, idx, values) in loaded {
            let buffer = buffers[idx].1;
            buffer.narrow(0, offset, numel).copy_(&values.reshape([-1]).to_device(buffer.device()));
        }
    });
    Ok(())
}

/// LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning"): Adam's bias-corrected
/// direction plus decoupled weight decay, scaled per tensor by the trust ratio ||w|| / ||u||
/// (on the tensors `LambOptions` names).
pub struct Lamb {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    n_steps: u64,
    options: LambOptions,
    /// Per entry of the parameters: whether its step takes the trust ratio.
    adapt: Vec<bool>,
}

impl Lamb {
    fn buffers(&self) -> Vec<(&'static str, Tensor)> {
        vec![(MOMENTS[0], self.exp_avg.shallow_clone()), (MOMENTS[1], self.exp_avg_sq.shallow_clone())]
    }

    pub fn new(params: &FlatParams) -> Lamb {
        Lamb::with_options(params, LambOptions::default())
    }

    /// Panics when `min_trust` > `max_trust` or either is NaN (a programming error: they are not
    /// read from user input).
    pub fn with_options(params: &FlatParams, options: LambOptions) -> Lamb {
        assert!(
            options.min_trust <= options.max_trust,
            "LambOptions: min_trust {} must be <= max_trust {}",
            options.min_trust,
            options.max_trust
        );
        let adapt = params.entries().iter().map(|e| options.adapt_all || e.decay).collect();
        Lamb { exp_avg: state_buffer(params), exp_avg_sq: state_buffer(params), n_steps: 0, options, adapt }
    }

    /// The factor on lr for tensor `entry`: its trust ratio, clamped, or 1 when it is not adapted.
    pub fn step_ratio(&self, entry: usize, norms: &TensorNorms) -> f64 {
        if self.adapt[entry] {
            norms.trust_ratio(entry).clamp(self.options.min_trust, self.options.max_trust)
        } else {
            1.0
        }
    }

    pub fn n_steps(&self) -> u64 {
        self.n_steps
    }

    /// Counts a step (once per step, before `prepare_range` on any range).
    pub fn begin_step(&mut self) {
        self.n_steps += 1;
    }

    pub fn state_tensors(&self, params: &FlatParams) -> Vec<StateTensor> {
        state_views(params, &[(MOMENTS[0], &self.exp_avg), (MOMENTS[1], &self.exp_avg_sq)])
    }

    pub fn load_state(
        &mut self,
        params: &FlatParams,
        n_steps: u64,
        lookup: impl FnMut(&str) -> Option<(Vec<i64>, Tensor)>,
    ) -> Result<(), String> {
        load_views(params, &[(MOMENTS[0], &self.exp_avg), (MOMENTS[1], &self.exp_avg_sq)], lookup)?;
        self.n_steps = n_steps;
        Ok(())
    }

    fn slices(&self, params: &FlatParams, range: &Range<i64>, kernel: UpdateKernel) -> Option<Vec<Slices>> {
        fused_slices(params, range, kernel, &self.exp_avg, Some(&self.exp_avg_sq))
    }

    pub fn grad_sq_sum(&self, params: &FlatParams, range: Range<i64>, kernel: UpdateKernel, n_threads: usize) -> f64 {
        let slices = self.slices(params, &range, kernel);
        grad_sq_sum_over(params, range, slices, n_threads)
    }

    /// First pass over `range`: both moments from the gradients times `grad_multiplier`, the
    /// update direction u = m̂ / (sqrt(v̂) + eps) + weight_decay * w (decay on decayed tensors only)
    /// written into the gradient buffer, and each tensor's part of ||w||² and ||u||² added into
    /// `norms`.
    #[allow(clippy::too_many_arguments)]
    pub fn prepare_range(
        &mut self,
        params: &FlatParams,
        range: Range<i64>,
        hp: &Hyper,
        grad_multiplier: f64,
        kernel: UpdateKernel,
        n_threads: usize,
        norms: &mut TensorNorms,
    ) {
        let t = self.n_steps.max(1) as i32;
        let inv_bc1 = 1.0 / (1.0 - hp.beta1.powi(t));
        let inv_sqrt_bc2 = 1.0 / (1.0 - hp.beta2.powi(t)).sqrt();
        match self.slices(params, &range, kernel) {
            Some(slices) => {
                let k = (
                    grad_multiplier as f32,
                    (1.0 - hp.beta1) as f32,
                    (1.0 - hp.beta2) as f32,
                    inv_bc1 as f32,
                    inv_sqrt_bc2 as f32,
                    hp.eps as f32,
                    hp.weight_decay as f32,
                );
                let sums = run_split(&slices, n_threads, |s| {
                    // SAFETY: see `Slices`: this thread is the only one touching these four ranges.
                    let (g, p, m, v) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(s.grad, s.numel),
                            std::slice::from_raw_parts(s.param, s.numel),
                            std::slice::from_raw_parts_mut(s.exp_avg, s.numel),
                            std::slice::from_raw_parts_mut(s.exp_avg_sq, s.numel),
                        )
                    };
                    let (clip, w1, w2, inv_bc1, inv_sqrt_bc2, eps, wd) = k;
                    let wd = if s.decay { wd } else { 0.0 };
                    let (mut w_sq, mut u_sq) = (0f64, 0f64);
                    for (((g, &p), m), v) in g.iter_mut().zip(p).zip(m.iter_mut()).zip(v.iter_mut()) {
                        let grad = *g * clip;
                        *m += w1 * (grad - *m);
                        *v += w2 * (grad * grad - *v);
                        let u = (*m * inv_bc1) / (v.sqrt() * inv_sqrt_bc2 + eps) + wd * p;
                        *g = u;
                        w_sq += f64::from(p) * f64::from(p);
                        u_sq += f64::from(u) * f64::from(u);
                    }
                    (w_sq, u_sq)
                });
                for (s, (w_sq, u_sq)) in slices.iter().zip(sums) {
                    norms.param_sq[s.entry] += w_sq;
                    norms.update_sq[s.entry] += u_sq;
                }
            }
            None => tch::no_grad(|| {
                for (entry, lo, hi) in overlaps(params, &range) {
                    let narrow = |t: &Tensor| t.narrow(0, lo, hi - lo);
                    let (p, mut g) = (narrow(params.flat()), narrow(params.flat_grad()));
                    let (mut m, mut v) = (narrow(&self.exp_avg), narrow(&self.exp_avg_sq));
                    let grad = &g * grad_multiplier;
                    let _ = m.lerp_(&grad, 1.0 - hp.beta1);
                    let _ = v.lerp_(&grad.square(), 1.0 - hp.beta2);
                    let mut u = (&m * inv_bc1) / (v.sqrt() * inv_sqrt_bc2 + hp.eps);
                    if params.entries()[entry].decay && hp.weight_decay > 0.0 {
                        u += &p * hp.weight_decay;
                    }
                    g.copy_(&u);
                    norms.param_sq[entry] += crate::optim::tensor_sq_sum(&p, lo);
                    norms.update_sq[entry] += crate::optim::tensor_sq_sum(&u, lo);
                }
            }),
        }
    }

    /// Second pass over `range`: w -= lr * step_ratio(tensor) * u (the trust ratio, or 1 for a
    /// tensor that is not adapted), and the gradient buffer (holding u) cleared. `norms` must hold
    /// the whole tensors' sums (all shards added).
    pub fn apply_range(
        &mut self,
        params: &FlatParams,
        range: Range<i64>,
        lr: f64,
        norms: &TensorNorms,
        kernel: UpdateKernel,
        n_threads: usize,
    ) {
        let ratios: Vec<f64> = (0..self.adapt.len()).map(|entry| self.step_ratio(entry, norms)).collect();
        match self.slices(params, &range, kernel) {
            Some(slices) => {
                run_split(&slices, n_threads, |s| {
                    // SAFETY: see `Slices`: this thread is the only one touching these ranges.
                    let (g, p) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(s.grad, s.numel),
                            std::slice::from_raw_parts_mut(s.param, s.numel),
                        )
                    };
                    let step = (lr * s.lr_scale * ratios[s.entry]) as f32;
                    for (g, p) in g.iter_mut().zip(p.iter_mut()) {
                        *p -= step * *g;
                        *g = 0.0;
                    }
                });
            }
            None => tch::no_grad(|| {
                for (entry, lo, hi) in overlaps(params, &range) {
                    let (mut p, mut g) =
                        (params.flat().narrow(0, lo, hi - lo), params.flat_grad().narrow(0, lo, hi - lo));
                    let _ = p.g_sub_(&(&g * (lr * params.entries()[entry].lr_scale * ratios[entry])));
                    let _ = g.zero_();
                }
            }),
        }
    }
}

/// SGD with momentum (PyTorch's `torch.optim.SGD` arithmetic, dampening 0): the gradient plus
/// L2 weight decay g + wd * w, the buffer b = momentum * b + g, the step along b, or along
/// g + momentum * b with Nesterov.
pub struct Sgd {
    momentum_buffer: Tensor,
    n_steps: u64,
}

/// The suffix of SGD's state tensors.
const MOMENTUM: &str = "momentum_buffer";

impl Sgd {
    pub fn new(params: &FlatParams) -> Sgd {
        Sgd { momentum_buffer: state_buffer(params), n_steps: 0 }
    }

    pub fn n_steps(&self) -> u64 {
        self.n_steps
    }

    pub fn begin_step(&mut self) {
        self.n_steps += 1;
    }

    pub fn state_tensors(&self, params: &FlatParams) -> Vec<StateTensor> {
        state_views(params, &[(MOMENTUM, &self.momentum_buffer)])
    }

    pub fn load_state(
        &mut self,
        params: &FlatParams,
        n_steps: u64,
        lookup: impl FnMut(&str) -> Option<(Vec<i64>, Tensor)>,
    ) -> Result<(), String> {
        load_views(params, &[(MOMENTUM, &self.momentum_buffer)], lookup)?;
        self.n_steps = n_steps;
        Ok(())
    }

    fn slices(&self, params: &FlatParams, range: &Range<i64>, kernel: UpdateKernel) -> Option<Vec<Slices>> {
        fused_slices(params, range, kernel, &self.momentum_buffer, None)
    }

    pub fn grad_sq_sum(&self, params: &FlatParams, range: Range<i64>, kernel: UpdateKernel, n_threads: usize) -> f64 {
        let slices = self.slices(params, &range, kernel);
        grad_sq_sum_over(params, range, slices, n_threads)
    }

    /// SGD on `range` from the gradients times `grad_multiplier`; clears those gradients.
    pub fn update_range(
        &mut self,
        params: &FlatParams,
        range: Range<i64>,
        hp: &Hyper,
        grad_multiplier: f64,
        kernel: UpdateKernel,
        n_threads: usize,
    ) {
        match self.slices(params, &range, kernel) {
            Some(slices) => {
                let (clip, lr, mu, wd) =
                    (grad_multiplier as f32, hp.lr as f32, hp.momentum as f32, hp.weight_decay as f32);
                let nesterov = hp.nesterov;
                run_split(&slices, n_threads, |s| {
                    // SAFETY: see `Slices`: this thread is the only one touching these ranges.
                    let (g, p, b) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(s.grad, s.numel),
                            std::slice::from_raw_parts_mut(s.param, s.numel),
                            std::slice::from_raw_parts_mut(s.exp_avg, s.numel),
                        )
                    };
                    let wd = if s.decay { wd } else { 0.0 };
                    let lr = lr * s.lr_scale as f32;
                    for ((g, p), b) in g.iter_mut().zip(p.iter_mut()).zip(b.iter_mut()) {
                        let grad = *g * clip + wd * *p;
                        *b = mu * *b + grad;
                        let d = if nesterov { grad + mu * *b } else { *b };
                        *p -= lr * d;
                        *g = 0.0;
                    }
                });
            }
            None => self.update_range_tensor_ops(params, range, hp, Multiplier::Host(grad_multiplier)),
        }
    }

    /// `update_range` over the whole buffer on the tensor-op path, the gradients multiplied by a
    /// 0-dim tensor on the device: nothing is read to the host.
    pub(crate) fn update_on_device(&mut self, params: &FlatParams, hp: &Hyper, grad_multiplier: &Tensor) {
        self.update_range_tensor_ops(params, 0..params.n_elements(), hp, Multiplier::Device(grad_multiplier))
    }

    /// Whether `update_range` over `params` runs the fused CPU kernel.
    pub(crate) fn runs_fused(&self, params: &FlatParams, kernel: UpdateKernel) -> bool {
        self.slices(params, &(0..params.n_elements()), kernel).is_some()
    }

    fn update_range_tensor_ops(
        &mut self,
        params: &FlatParams,
        range: Range<i64>,
        hp: &Hyper,
        grad_multiplier: Multiplier<'_>,
    ) {
        tch::no_grad(|| {
            for (entry, lo, hi) in overlaps(params, &range) {
                let narrow = |t: &Tensor| t.narrow(0, lo, hi - lo);
                let (mut p, mut g, mut b) =
                    (narrow(params.flat()), narrow(params.flat_grad()), narrow(&self.momentum_buffer));
                let mut grad = g.copy();
                grad_multiplier.apply(&mut grad);
                if params.entries()[entry].decay && hp.weight_decay > 0.0 {
                    grad += &p * hp.weight_decay;
                }
                let _ = b.g_mul_scalar_(hp.momentum).g_add_(&grad);
                let d = if hp.nesterov { &grad + &b * hp.momentum } else { b.shallow_clone() };
                let _ = p.g_sub_(&(d * (hp.lr * params.entries()[entry].lr_scale)));
                let _ = g.zero_();
            }
        })
    }
}

/// The scaler's verdict and the clip: Ok((grad norm, gradient multiplier)), or Err(grad norm)
/// when the fp16 scaler skips the step (its gradients are cleared).
fn clip_and_scale(
    params: &FlatParams,
    sq_sum: f64,
    max_norm: f64,
    scaler: Option<&mut LossScaler>,
) -> Result<(f64, f64), f64> {
    let scaled_norm = sq_sum.sqrt();
    let scale = scaler.as_ref().map_or(1.0, |s| s.scale());
    let grad_norm = scaled_norm / scale;
    if let Some(scaler) = scaler {
        if scaler.update(scaled_norm) == ScaleOutcome::Skipped {
            params.zero_grad();
            return Err(grad_norm);
        }
    }
    let clip = if max_norm > 0.0 && grad_norm > max_norm { max_norm / (grad_norm + 1e-6) } else { 1.0 };
    Ok((grad_norm, clip / scale))
}

/// The optimizer a run uses (`train.optimizer`).
pub enum Optimizer {
    AdamW(AdamW),
    Lamb(Lamb),
    Sgd(Sgd),
}

impl Optimizer {
    /// The optimizer `train` names, with its options (LAMB's), over `params`.
    pub fn for_config(train: &crate::TrainConfig, params: &FlatParams) -> Optimizer {
        match train.optimizer {
            OptimizerKind::Lamb => {
                let max_trust = if train.lamb_max_trust > 0.0 { train.lamb_max_trust } else { f64::INFINITY };
                let options =
                    LambOptions { adapt_all: train.lamb_adapt_all, min_trust: train.lamb_min_trust, max_trust };
                Optimizer::Lamb(Lamb::with_options(params, options))
            }
            kind => Optimizer::new(kind, params),
        }
    }

    pub fn new(kind: OptimizerKind, params: &FlatParams) -> Optimizer {
        match kind {
            OptimizerKind::AdamW => Optimizer::AdamW(AdamW::new(params)),
            OptimizerKind::Lamb => Optimizer::Lamb(Lamb::new(params)),
            OptimizerKind::Sgd => Optimizer::Sgd(Sgd::new(params)),
        }
    }

    pub fn n_steps(&self) -> u64 {
        match self {
            Optimizer::AdamW(o) => o.n_steps(),
            Optimizer::Lamb(o) => o.n_steps(),
            Optimizer::Sgd(o) => o.n_steps(),
        }
    }

    pub fn state_tensors(&self, params: &FlatParams) -> Vec<StateTensor> {
        match self {
            Optimizer::AdamW(o) => o.state_tensors(params),
            Optimizer::Lamb(o) => o.state_tensors(params),
            Optimizer::Sgd(o) => o.state_tensors(params),
        }
    }

    pub fn load_state(
        &mut self,
        params: &FlatParams,
        n_steps: u64,
        lookup: impl FnMut(&str) -> Option<(Vec<i64>, Tensor)>,
    ) -> Result<(), String> {
        match self {
            Optimizer::AdamW(o) => o.load_state(params, n_steps, lookup),
            Optimizer::Lamb(o) => o.load_state(params, n_steps, lookup),
            Optimizer::Sgd(o) => o.load_state(params, n_steps, lookup),
        }
    }

    /// The state buffers, laid out like the parameters they were made for, with the suffix of
    /// their tensors' names (`<param>.<suffix>`).
    pub fn buffers(&self) -> Vec<(&'static str, Tensor)> {
        match self {
            Optimizer::AdamW(o) => o.buffers(),
            Optimizer::Lamb(o) => o.buffers(),
            Optimizer::Sgd(o) => vec![(MOMENTUM, o.momentum_buffer.shallow_clone())],
        }
    }

    /// Sum of squares of `flat_grad[range]` (per-block gradient norms).
    pub fn grad_sq_sum(&self, params: &FlatParams, range: Range<i64>, kernel: UpdateKernel, n_threads: usize) -> f64 {
        match self {
            Optimizer::AdamW(o) => o.grad_sq_sum(params, range, kernel, n_threads),
            Optimizer::Lamb(o) => o.grad_sq_sum(params, range, kernel, n_threads),
            Optimizer::Sgd(o) => o.grad_sq_sum(params, range, kernel, n_threads),
        }
    }

    /// One step on one process: the global norm, the fp16 scaler's verdict, clipping to
    /// `max_norm` (0: none), the update, the gradients cleared. Without a scaler, a non-finite
    /// norm is `Err(norm)` before anything is updated: parameters, state and gradients are left
    /// as they are, for the caller to inspect. For AdamW this is exactly `AdamW::step`'s sequence.
    pub fn step(
        &mut self,
        params: &FlatParams,
        hp: &Hyper,
        max_norm: f64,
        scaler: Option<&mut LossScaler>,
        kernel: UpdateKernel,
        n_threads: usize,
    ) -> Result<StepOutcome, f64> {
        let sq_sum = self.grad_sq_sum(params, 0..params.n_elements(), kernel, n_threads);
        let whole = |_: &mut TensorNorms| Ok::<(), std::convert::Infallible>(());
        match self.step_with_sq_sum(params, sq_sum, hp, max_norm, scaler, kernel, n_threads, whole) {
            Ok(outcome) => outcome,
            Err(never) => match never {},
        }
    }

    /// Whether the next update runs AdamW's fused CPU kernel over `params`, the one that can save a
    /// pending checkpoint's state (`save_in_next_update`) and measure its change
    /// (`measure_next_update`) as it goes.
    pub(crate) fn is_fused_adamw(&self, params: &FlatParams, kernel: UpdateKernel) -> bool {
        matches!(self, Optimizer::AdamW(o) if o.updates_fused(params, kernel))
    }

    /// Asks AdamW's next fused update to measure its change per parameter (`take_update_norms`);
    /// call only where `is_fused_adamw` holds.
    pub(crate) fn measure_next_update(&mut self) {
        if let Optimizer::AdamW(o) = self {
            o.measure_next_update();
        }
    }

    /// Per parameter, (||change||^2, ||weights before||^2) of the last measured update; None when
    /// no update ran (a skipped step) or none was asked for.
    pub(crate) fn take_update_norms(&mut self) -> Option<Vec<(f64, f64)>> {
        match self {
            Optimizer::AdamW(o) => o.take_update_norms(),
            _ => None,
        }
    }

    /// Hands AdamW's next update the rooms to save into (`None`: withdraws them); the other
    /// optimizers never take one (`is_fused_adamw` is false for them).
    pub(crate) fn save_in_next_update(&mut self, save: Option<std::sync::Arc<crate::snapcopy::SaveMap>>) {
        if let Optimizer::AdamW(o) = self {
            o.save_in_next_update(save);
        } else {
            assert!(save.is_none(), "only AdamW saves a checkpoint in its update");
        }
    }

    /// `step`, given the sum of squared gradients of the whole model (under ZeRO, the ranks' shard
    /// sums added), over all of `params` (under ZeRO, the shard). `whole_norms` turns LAMB's
    /// per-tensor sums over `params` into the whole tensors' (under ZeRO, every rank's pieces
    /// added; on one process, nothing to do); it is called once per LAMB step, between the two
    /// passes, and only by LAMB. Its error ends the step with the moments updated and the
    /// parameters not: the run cannot go on from there.
    #[allow(clippy::too_many_arguments)]
    pub fn step_with_sq_sum<E>(
        &mut self,
        params: &FlatParams,
        sq_sum: f64,
        hp: &Hyper,
        max_norm: f64,
        scaler: Option<&mut LossScaler>,
        kernel: UpdateKernel,
        n_threads: usize,
        whole_norms: impl FnOnce(&mut TensorNorms) -> Result<(), E>,
    ) -> Result<Result<StepOutcome, f64>, E> {
        let all = 0..params.n_elements();
        if scaler.is_none() && !sq_sum.is_finite() {
            return Ok(Err(sq_sum.sqrt()));
        }
        let (grad_norm, multiplier) = match clip_and_scale(params, sq_sum, max_norm, scaler) {
            Ok(found) => found,
            Err(grad_norm) => return Ok(Ok(StepOutcome { grad_norm, skipped: true })),
        };
        match self {
            Optimizer::AdamW(o) => {
                o.begin_step();
                o.update_range(params, all, hp.adam(), multiplier, kernel, n_threads);
            }
            Optimizer::Lamb(o) => {
                o.begin_step();
                let mut norms = TensorNorms::zeros(params.entries().len());
                o.prepare_range(params, all.clone(), hp, multiplier, kernel, n_threads, &mut norms);
                whole_norms(&mut norms)?;
                o.apply_range(params, all, hp.lr, &norms, kernel, n_threads);
            }
            Optimizer::Sgd(o) => {
                o.begin_step();
                o.update_range(params, all, hp, multiplier, kernel, n_threads);
            }
        }
        Ok(Ok(StepOutcome { grad_norm, skipped: false }))
    }

    /// Whether `step_on_device` can run over `params`: AdamW or SGD on the tensor-op path (a
    /// GPU, or `train.fused_optimizer = false`). LAMB's trust ratios and the fused CPU kernel
    /// read their norms on the host.
    pub fn steps_on_device(&self, params: &FlatParams, kernel: UpdateKernel) -> bool {
        match self {
            Optimizer::AdamW(o) => !o.runs_fused(params, kernel),
            Optimizer::Sgd(o) => !o.runs_fused(params, kernel),
            Optimizer::Lamb(_) => false,
        }
    }

    /// One process's step with nothing read to the host (no loss scaler): the squared gradient
    /// norm stays a 0-dim f64 tensor on the device, the clip is computed from it there, and the
    /// update multiplies the gradients by it. The arithmetic is `step_with_sq_sum`'s on the
    /// tensor-op path, bit for bit; a non-finite norm is not caught here (the caller's guard
    /// reads it later). Returns the squared norm.
    pub fn step_on_device(&mut self, params: &FlatParams, hp: &Hyper, max_norm: f64, kernel: UpdateKernel) -> Tensor {
        assert!(self.steps_on_device(params, kernel), "step_on_device on a path that reads its norm on the host");
        let sq_sum = tensor_sq_sum_kept(&params.flat_grad().narrow(0, 0, params.n_elements()), 0);
        tch::no_grad(|| {
            let multiplier = if max_norm > 0.0 {
                let norm = sq_sum.sqrt();
                // `max_norm` filled on the device, not copied there (a copy would wait for the queue).
                let clipped = Tensor::full([], max_norm, (tch::Kind::Double, norm.device())) / (&norm + 1e-6);
                clipped.where_scalarother(&norm.gt(max_norm), 1.0)
            } else {
                Tensor::ones([], (tch::Kind::Double, sq_sum.device()))
            };
            match self {
                Optimizer::AdamW(o) => {
                    o.begin_step();
                    o.update_on_device(params, hp.adam(), &multiplier);
                }
                Optimizer::Sgd(o) => {
                    o.begin_step();
                    o.update_on_device(params, hp, &multiplier);
                }
                Optimizer::Lamb(_) => unreachable!("checked by steps_on_device"),
            }
        });
        sq_sum
    }
}

#[cfg(test)]
mod tests;
