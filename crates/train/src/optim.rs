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

/// Hyper-parameters of one AdamW step.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// Which arithmetic runs the update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateKernel {
    /// One fused, threaded Rust pass per parameter slice on a CPU (falls back to `TensorOps` on a
    /// GPU).
    Fused,
    /// A chain of libtorch tensor ops over the range (what PyTorch's default AdamW does on a CPU).
    TensorOps,
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
                let step_size = (hp.lr / (1.0 - hp.beta1.powi(t))) as f32;
                let inv_sqrt_bc2 = (1.0 / (1.0 - hp.beta2.powi(t)).sqrt()) as f32;
                let (w1, w2, eps) = ((1.0 - hp.beta1) as f32, (1.0 - hp.beta2) as f32, hp.eps as f32);
                let decay_factor = (1.0 - hp.lr * hp.weight_decay) as f32;
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
                    let decay = if s.decay { decay_factor } else { 1.0 };
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
                self.update_range_tensor_ops(params, range, hp, grad_multiplier, t)
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
        grad_multiplier: f64,
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
        let neg_inv_step = -bias_correction1 / hp.lr;
        tch::no_grad(|| {
            for entry in params.entries() {
                let (lo, hi) = (entry.offset.max(range.start), (entry.offset + entry.numel).min(range.end));
                if lo >= hi {
                    continue;
                }
                let narrow = |t: &Tensor| t.narrow(0, lo, hi - lo);
                let mut flat = narrow(params.flat());
                let mut grad = narrow(params.flat_grad());
                let (mut exp_avg, mut exp_avg_sq) = (narrow(&self.exp_avg), narrow(&self.exp_avg_sq));
                if grad_multiplier != 1.0 {
                    let _ = grad.g_mul_scalar_(grad_multiplier);
                }
                if hp.weight_decay > 0.0 && entry.decay {
                    let _ = flat.g_mul_scalar_(1.0 - hp.lr * hp.weight_decay);
                }
                let _ = exp_avg.lerp_(&grad, 1.0 - hp.beta1);
                let mut scratch = grad.square();
                let _ = exp_avg_sq.lerp_(&scratch, 1.0 - hp.beta2);
                if hp.lr != 0.0 {
                    // -(sqrt(v) / sqrt(bc2) + eps) / step_size, in the squares' memory.
                    let _ = exp_avg_sq.sqrt_out(&scratch);
                    let _ = scratch.g_mul_scalar_(inv_sqrt_bc2 * neg_inv_step).g_add_scalar_(hp.eps * neg_inv_step);
                    let _ = flat.addcdiv_(&exp_avg, &scratch);
                }
                let _ = grad.zero_();
            }
        });
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

/// The fused kernel's slices of `range` over the parameters, their gradients and one or two state
/// buffers laid out like them, or None when the fused kernel does not apply (not asked for, or a
/// buffer is not contiguous CPU fp32).
pub(crate) fn fused_slices(
    params: &FlatParams,
    range: &Range<i64>,
    kernel: UpdateKernel,
    first: &Tensor,
    second: Option<&Tensor>,
) -> Option<Vec<Slices>> {
    let cpu_f32 = |t: &Tensor| t.device() == tch::Device::Cpu && t.kind() == Kind::Float && t.is_contiguous();
    let ((param_memory, params_mapped), (grad_memory, grads_mapped)) = (params.param_memory(), params.grad_memory());
    let fusable =
        kernel == UpdateKernel::Fused && [param_memory, grad_memory, first].into_iter().chain(second).all(cpu_f32);
    if !fusable {
        assert!(
            !params_mapped && !grads_mapped,
            "only the fused CPU kernel updates a shard that maps the model's buffers"
        );
        return None;
    }
    let (g, p, m) =
        (grad_memory.data_ptr() as *mut f32, param_memory.data_ptr() as *mut f32, first.data_ptr() as *mut f32);
    let v = second.map_or(std::ptr::null_mut(), |t| t.data_ptr() as *mut f32);
    let slices = params
        .entries()
        .iter()
        .enumerate()
        .filter_map(|(entry, e)| {
            let (lo, hi) = (e.offset.max(range.start), (e.offset + e.numel).min(range.end));
            (lo < hi).then(|| {
                let offset = lo as usize;
                // A mapped buffer holds the entry at its place in the model.
                let mapped = (e.source + (lo - e.offset)) as usize;
                let (param_at, grad_at) =
                    (if params_mapped { mapped } else { offset }, if grads_mapped { mapped } else { offset });
                // SAFETY: `lo..hi` lies inside the flat buffers, which all hold `n_elements()`
                // f32 (checked by construction in `FlatParams::new`; the state buffers are made
                // like the parameters); a mapped shard's pieces lie inside the model's buffers at
                // `source` (`FlatParams::shard`); a null second buffer stays null.
                unsafe {
                    Slices {
                        grad: g.add(grad_at),
                        param: p.add(param_at),
                        exp_avg: m.add(offset),
                        exp_avg_sq: if v.is_null() { v } else { v.add(offset) },
                        numel: (hi - lo) as usize,
                        decay: e.decay,
                        entry,
                    }
                }
            })
        })
        .collect();
    Some(slices)
}

/// The parts of one parameter the fused CPU update touches.
pub(crate) struct Slices {
    pub(crate) grad: *mut f32,
    pub(crate) param: *mut f32,
    pub(crate) exp_avg: *mut f32,
    /// Null for an optimizer with one state buffer (SGD).
    pub(crate) exp_avg_sq: *mut f32,
    pub(crate) numel: usize,
    pub(crate) decay: bool,
    /// The parameter's index in `FlatParams::entries`.
    pub(crate) entry: usize,
}

// SAFETY: each `Slices` points into buffers that no other thread reads or writes while the update
// runs, and different `Slices` never overlap (parameters are disjoint ranges of the flat buffers).
unsafe impl Send for Slices {}
// SAFETY: as above; a `&Slices` is only dereferenced by the one thread the slice is dealt to.
unsafe impl Sync for Slices {}

/// Sum of squares in f64 over eight independent lanes, so the adds pipeline and vectorize (one
/// running sum waits four cycles per element); the lanes are added in a fixed order, so the
/// result does not depend on the machine.
pub(crate) fn sum_of_squares(g: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let chunks = g.chunks_exact(8);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += f64::from(x) * f64::from(x);
        }
    }
    let mut sum = lanes.iter().sum::<f64>();
    for &x in tail {
        sum += f64::from(x) * f64::from(x);
    }
    sum
}

/// Sum of squares of `a - b` (the difference taken in fp32, as a tensor subtraction would), in
/// f64 over eight lanes like `sum_of_squares`.
fn sum_of_squared_differences(a: &[f32], b: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let (chunks_a, chunks_b) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f64 = chunks_a.remainder().iter().zip(chunks_b.remainder()).map(|(x, y)| f64::from(x - y).powi(2)).sum();
    for (ca, cb) in chunks_a.zip(chunks_b) {
        for ((lane, &x), &y) in lanes.iter_mut().zip(ca).zip(cb) {
            let d = f64::from(x - y);
            *lane += d * d;
        }
    }
    lanes.iter().sum::<f64>() + tail
}

/// Elements per chunk in `tensor_sq_sum`: chunk norms taken in fp32 sum to within about 1e-9
/// of the exact value at this length (124 M elements), where one fp32 reduction over the whole
/// buffer was off by 2.6% and chunks of 65,536 by 3e-7.
const SQ_SUM_CHUNK: i64 = 1 << 10;

/// Sum of squares of a 1-D tensor whose first element sits at `offset` of its flat buffer, in
/// f64, for the tensor-op paths (a GPU, `train.fused_optimizer = false`): the norms of whole
/// chunks aligned to the buffer (a `[chunks, SQ_SUM_CHUNK]` reduction in fp32, no temporary the
/// size of the tensor), squared and added in f64, with the ragged ends in f64. A split of a range
/// at chunk boundaries sums the same chunk norms as the whole. At 124 M elements on two cores this
/// took 30 ms where `square().sum(Double)` took about 1.1 s (it allocates the squares and sums
/// them through a non-vectorized fp64 conversion).
pub(crate) fn tensor_sq_sum(t: &Tensor, offset: i64) -> f64 {
    let n = t.size1().expect("tensor_sq_sum takes a 1-D tensor");
    tch::no_grad(|| {
        let head = ((SQ_SUM_CHUNK - offset.rem_euclid(SQ_SUM_CHUNK)) % SQ_SUM_CHUNK).min(n);
        let body = (n - head) / SQ_SUM_CHUNK * SQ_SUM_CHUNK;
        let f64_sum = |part: Tensor| part.to_kind(Kind::Double).square().sum(Kind::Double).double_value(&[]);
        let mut sum = 0.0;
        if head > 0 {
            sum += f64_sum(t.narrow(0, 0, head));
        }
        if body > 0 {
            let norms = t
                .narrow(0, head, body)
                .contiguous()
                .view([body / SQ_SUM_CHUNK, SQ_SUM_CHUNK])
                .norm_scalaropt_dim_dtype(2, [1i64].as_slice(), false, Kind::Float);
            sum += f64_sum(norms);
        }
        if head + body < n {
            sum += f64_sum(t.narrow(0, head + body, n - head - body));
        }
        sum
    })
}

/// Elements per block when an update saves or measures as it goes: 64 KiB per buffer, so the block's four
/// buffers stay in the core's L2 between the streaming copy and the update.
const SAVE_BLOCK: usize = 1 << 14;

/// The scalars of one parameter's update.
struct UpdateConsts {
    clip: f32,
    w1: f32,
    w2: f32,
    inv_sqrt_bc2: f32,
    eps: f32,
    decay: f32,
    step_size: f32,
}

/// AdamW on one parameter's slices, and the gradient cleared. Compiled twice on x86-64: for the
/// baseline (SSE2) and for AVX2 with FMA, picked at run time.
fn update(g: &mut [f32], p: &mut [f32], m: &mut [f32], v: &mut [f32], k: &UpdateConsts) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has the features the function is compiled for.
            unsafe { update_avx2(g, p, m, v, k) };
            return;
        }
    }
    update_portable(g, p, m, v, k);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn update_avx2(g: &mut [f32], p: &mut [f32], m: &mut [f32], v: &mut [f32], k: &UpdateConsts) {
    update_portable(g, p, m, v, k);
}

#[inline(always)]
fn update_portable(g: &mut [f32], p: &mut [f32], m: &mut [f32], v: &mut [f32], k: &UpdateConsts) {
    for (((g, p), m), v) in g.iter_mut().zip(p.iter_mut()).zip(m.iter_mut()).zip(v.iter_mut()) {
        let grad = *g * k.clip;
        *m += k.w1 * (grad - *m);
        *v += k.w2 * (grad * grad - *v);
        let denom = v.sqrt() * k.inv_sqrt_bc2 + k.eps;
        *p = *p * k.decay - k.step_size * *m / denom;
        *g = 0.0;
    }
}

/// How `update_saving` can save a block into its rooms.
#[derive(Clone, Copy, PartialEq, Debug)]
enum RegisterSave {
    /// From the update's registers, and the rooms' CRC-32s folded from the same registers
    /// (AVX2 with 256-bit VPCLMULQDQ): no load of its own for the checksum.
    WithChecksums,
    /// From the update's registers (AVX2); the caller hashes the block first.
    Plain,
}

/// `update` that also streams the old parameters and moments into `rooms` ([p, m, v], each
/// `p.len()` f32) from the registers the update loads them into: the save costs only its stores.
/// Bit for bit `update`'s arithmetic. With `RegisterSave::WithChecksums` it also returns the
/// CRC-32 of each room's bytes, folded from those registers.
///
/// # Safety
/// Each room must be valid for `p.len()` f32 writes that nothing else reads or writes meanwhile,
/// and `way` must be what `saves_in_registers` returned for these rooms.
unsafe fn update_saving(
    g: &mut [f32],
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    k: &UpdateConsts,
    rooms: [*mut f32; 3],
    way: RegisterSave,
) -> Option<[u32; 3]> {
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (g, p, m, v, k, rooms);
        unreachable!("saves_in_registers offers no {way:?} on this target");
    }
    #[cfg(target_arch = "x86_64")]
    match way {
        // SAFETY: the CPU has AVX2, pclmulqdq, vpclmulqdq and SSE4.1 (`saves_in_registers`); the
        // rooms as the caller promised, equally aligned.
        RegisterSave::WithChecksums => Some(unsafe { update_saving_avx2_crc(g, p, m, v, k, rooms) }),
        RegisterSave::Plain => {
            // SAFETY: the CPU has AVX2; the rooms as above.
            unsafe { update_saving_avx2(g, p, m, v, k, rooms) };
            None
        }
    }
}

/// How `update_saving` can save into `rooms`: None where it cannot (no AVX2, or rooms not equally
/// aligned), and the caller saves another way.
fn saves_in_registers(rooms: [*mut f32; 3]) -> Option<RegisterSave> {
    #[cfg(target_arch = "x86_64")]
    {
        let offset = |d: *mut f32| d as usize % 32;
        let fits = std::is_x86_feature_detected!("avx2")
            && offset(rooms[0]) % 4 == 0
            && offset(rooms[0]) == offset(rooms[1])
            && offset(rooms[0]) == offset(rooms[2]);
        if !fits {
            None
        } else if stoke_ckpt::crc32x256_available() {
            Some(RegisterSave::WithChecksums)
        } else {
            Some(RegisterSave::Plain)
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = rooms;
        None
    }
}

/// The bytes of `values`, as a checkpoint stores them (little-endian f32 on every target stoke
/// builds for).
fn f32_bytes(values: &[f32]) -> &[u8] {
    // SAFETY: any initialized f32 memory is valid as bytes; the length covers exactly `values`,
    // whose borrow the result keeps.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn update_saving_avx2(
    g: &mut [f32],
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    k: &UpdateConsts,
    rooms: [*mut f32; 3],
) {
    // SAFETY: as the caller promised; this context has AVX2, all the body needs without CRC.
    unsafe { update_saving_body::<false>(g, p, m, v, k, rooms) };
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,pclmulqdq,vpclmulqdq,sse4.1")]
unsafe fn update_saving_avx2_crc(
    g: &mut [f32],
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    k: &UpdateConsts,
    rooms: [*mut f32; 3],
) -> [u32; 3] {
    // SAFETY: as the caller promised; this context has what the CRC's folding needs.
    unsafe { update_saving_body::<true>(g, p, m, v, k, rooms) }
}

/// The saving update's loop, inlined into each `#[target_feature]` wrapper. With `CRC`, the old
/// values' bytes are also folded into one CRC-32 per room as they pass through the registers (the
/// unaligned head and the tail hashed apart and joined), and those are returned; without, zeros.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn update_saving_body<const CRC: bool>(
    g: &mut [f32],
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    k: &UpdateConsts,
    rooms: [*mut f32; 3],
) -> [u32; 3] {
    use std::arch::x86_64::*;
    use stoke_ckpt::Crc32x256;
    let n = p.len();
    assert!(g.len() == n && m.len() == n && v.len() == n);
    let [dp, dm, dv] = rooms;
    // Plain stores up to the rooms' first 32-byte boundary (the same place in all three), 8
    // lanes with streaming stores after it, plain stores for the rest.
    let head = ((32 - dp as usize % 32) % 32 / 4).min(n);
    let body_end = head + (n - head) / 8 * 8;
    let scalar = |range: Range<usize>, g: &mut [f32], p: &mut [f32], m: &mut [f32], v: &mut [f32]| {
        for i in range.clone() {
            // SAFETY: i < n, inside each room (the caller's promise).
            unsafe {
                *dp.add(i) = p[i];
                *dm.add(i) = m[i];
                *dv.add(i) = v[i];
            }
        }
        update_portable(&mut g[range.clone()], &mut p[range.clone()], &mut m[range.clone()], &mut v[range], k);
    };
    // The CRC-32s of a range's old values, taken before `scalar` overwrites them.
    let hashed = |range: Range<usize>, p: &[f32], m: &[f32], v: &[f32]| {
        [p, m, v].map(|x| (stoke_ckpt::checksum(f32_bytes(&x[range.clone()])), 4 * range.len()))
    };
    let head_crcs = if CRC { hashed(0..head, p, m, v) } else { [(0, 0); 3] };
    scalar(0..head, g, p, m, v);
    // SAFETY (for the folds' calls): with `CRC` this is inlined into `update_saving_avx2_crc`,
    // whose caller checked the features they need; without, they are never called.
    let mut folds = if CRC { Some(unsafe { [Crc32x256::new(); 3] }) } else { None };
    let (clip, w1, w2) = (_mm256_set1_ps(k.clip), _mm256_set1_ps(k.w1), _mm256_set1_ps(k.w2));
    let (inv_sqrt_bc2, eps) = (_mm256_set1_ps(k.inv_sqrt_bc2), _mm256_set1_ps(k.eps));
    let (decay, step_size) = (_mm256_set1_ps(k.decay), _mm256_set1_ps(k.step_size));
    let (gp, pp, mp, vp) = (g.as_mut_ptr(), p.as_mut_ptr(), m.as_mut_ptr(), v.as_mut_ptr());
    let mut i = head;
    while i < body_end {
        // SAFETY: i + 8 <= n: in bounds of the four slices (unaligned loads and stores) and of the
        // rooms, whose `i` is 32-byte aligned past `head`, as `_mm256_stream_ps` requires; the
        // folds as above.
        unsafe {
            let grad = _mm256_mul_ps(_mm256_loadu_ps(gp.add(i)), clip);
            let (old_p, old_m, old_v) =
                (_mm256_loadu_ps(pp.add(i)), _mm256_loadu_ps(mp.add(i)), _mm256_loadu_ps(vp.add(i)));
            _mm256_stream_ps(dp.add(i), old_p);
            _mm256_stream_ps(dm.add(i), old_m);
            _mm256_stream_ps(dv.add(i), old_v);
            if let Some([fp, fm, fv]) = &mut folds {
                fp.absorb(_mm256_castps_si256(old_p));
                fm.absorb(_mm256_castps_si256(old_m));
                fv.absorb(_mm256_castps_si256(old_v));
            }
            // `update_portable`'s operations in its order (no fused multiply-adds).
            let new_m = _mm256_add_ps(old_m, _mm256_mul_ps(w1, _mm256_sub_ps(grad, old_m)));
            let new_v = _mm256_add_ps(old_v, _mm256_mul_ps(w2, _mm256_sub_ps(_mm256_mul_ps(grad, grad), old_v)));
            let denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(new_v), inv_sqrt_bc2), eps);
            let step = _mm256_div_ps(_mm256_mul_ps(step_size, new_m), denom);
            let new_p = _mm256_sub_ps(_mm256_mul_ps(old_p, decay), step);
            _mm256_storeu_ps(pp.add(i), new_p);
            _mm256_storeu_ps(mp.add(i), new_m);
            _mm256_storeu_ps(vp.add(i), new_v);
            _mm256_storeu_ps(gp.add(i), _mm256_setzero_ps());
        }
        i += 8;
    }
    // Orders the streaming stores before this thread's later stores (and the join that hands
    // the snapshot to the writer).
    _mm_sfence();
    let tail_crcs = if CRC { hashed(body_end..n, p, m, v) } else { [(0, 0); 3] };
    scalar(body_end..n, g, p, m, v);
    let Some(folds) = folds else { return [0; 3] };
    let mut out = [0; 3];
    for (j, fold) in folds.into_iter().enumerate() {
        let body_bytes = fold.bytes() as usize;
        // SAFETY: as above.
        let body = unsafe { fold.finish() };
        out[j] = stoke_ckpt::checksum_concat([head_crcs[j], (body, body_bytes), tail_crcs[j]]);
    }
    out
}

/// Runs `work` on every slice, the slices dealt to `n_threads` threads in contiguous runs of about
/// equal size; returns the results in slice order.
pub(crate) fn run_split<R: Send>(slices: &[Slices], n_threads: usize, work: impl Fn(&Slices) -> R + Sync) -> Vec<R> {
    let total: usize = slices.iter().map(|s| s.numel).sum();
    let n_threads = n_threads.clamp(1, 8);
    if n_threads == 1 || total < 1 << 16 {
        return slices.iter().map(&work).collect();
    }
    let target = total.div_ceil(n_threads);
    let mut groups: Vec<(usize, usize)> = Vec::new();
    let (mut start, mut acc) = (0, 0);
    for (idx, s) in slices.iter().enumerate() {
        acc += s.numel;
        if acc >= target || idx + 1 == slices.len() {
            groups.push((start, idx + 1));
            start = idx + 1;
            acc = 0;
        }
    }
    // On libtorch's OpenMP threads (see `omp`), a group to a task.
    crate::omp::map_tasks(groups.len(), |g| {
        let (lo, hi) = groups[g];
        slices[lo..hi].iter().map(&work).collect::<Vec<R>>()
    })
    .into_iter()
    .flatten()
    .collect()
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind};

    use super::*;
    use crate::params::{Init, ParamSpec, UnitSpec};

    fn params() -> FlatParams {
        let spec = |name: &str, shape: Vec<i64>, decay: bool| ParamSpec {
            name: name.into(),
            shape,
            init: Init::Normal { std: 0.5 },
            decay,
        };
        tch::manual_seed(0);
        // Large enough that the fused path splits the work across threads.
        FlatParams::new(
            vec![UnitSpec {
                name: "u".into(),
                params: vec![spec("b", vec![200], false), spec("w", vec![400, 200], true)],
            }],
            Device::Cpu,
        )
    }

    /// Final parameters and the norms seen, after three steps on a fixed loss.
    fn train_three_steps(kernel: UpdateKernel) -> (Vec<f32>, Vec<f64>) {
        let params = params();
        let mut optimizer = AdamW::new(&params);
        let hp = AdamWStep { lr: 0.01, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
        let mut norms = Vec::new();
        for step in 1..=3 {
            let w = params.get("w");
            let loss = (w.square().sum(Kind::Float) * 0.01 + params.get("b").sum(Kind::Float)) * step as f64;
            loss.backward();
            norms.push(optimizer.step(&params, hp, 5.0, None, kernel, 2).grad_norm);
        }
        (Vec::<f32>::try_from(params.flat()).unwrap(), norms)
    }

    #[test]
    fn an_update_that_saves_and_measures_leaves_the_old_state_in_the_rooms_and_updates_as_one_that_does_not() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let hp = AdamWStep { lr: 0.01, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
        // Segments shorter than a block (saved block by block), and whole buffers (saved from the
        // update's registers).
        let cases = [(UpdateKernel::Fused, 5003), (UpdateKernel::Fused, usize::MAX), (UpdateKernel::TensorOps, 5003)];
        for (kernel, segment) in cases {
            let (plain, saving) = (params(), params());
            let (mut plain_opt, mut saving_opt) = (AdamW::new(&plain), AdamW::new(&saving));
            let mut rooms = vec![0f32; 3 * plain.n_elements() as usize + 1];
            for step in 1..=3 {
                for (p, o) in [(&plain, &mut plain_opt), (&saving, &mut saving_opt)] {
                    let loss =
                        (p.get("w").square().sum(Kind::Float) * 0.01 + p.get("b").sum(Kind::Float)) * step as f64;
                    loss.backward();
                    if step == 3 && std::ptr::eq(p, &saving) {
                        // Rooms one element off 16-byte alignment, in segments that do not
                        // line up with the blocks or the parameters.
                        let n = p.n_elements() as usize;
                        let sources = [p.flat(), &o.exp_avg, &o.exp_avg_sq].map(|t| t.data_ptr() as usize);
                        let mut segments = Vec::new();
                        for (i, src) in sources.into_iter().enumerate() {
                            let mut at = 0;
                            while at < n {
                                let len = segment.min(n - at);
                                let dst = rooms[1 + i * n + at..].as_mut_ptr() as usize;
                                segments.push((src + 4 * at, 4 * len, dst));
                                at += len;
                            }
                        }
                        let before: Vec<f32> = [p.flat(), &o.exp_avg, &o.exp_avg_sq]
                            .iter()
                            .flat_map(|t| Vec::<f32>::try_from(*t).unwrap())
                            .collect();
                        let save = Arc::new(SaveMap::new(segments));
                        o.save_in_next_update(Some(Arc::clone(&save)));
                        // Measuring takes the block-by-block way: not with whole buffers.
                        let measure = segment != usize::MAX;
                        if measure {
                            o.measure_next_update();
                        }
                        o.step(p, hp, 5.0, None, kernel, 2);
                        assert!(save.is_complete(), "{kernel:?}: the update marked the rooms filled");
                        // The measured norms: each parameter's change and weights, as from copies.
                        let norms = o.take_update_norms();
                        if kernel == UpdateKernel::Fused && measure {
                            let norms = norms.expect("the fused update measured");
                            let after = Vec::<f32>::try_from(p.flat()).unwrap();
                            for (e, &(change, weight)) in p.entries().iter().zip(&norms) {
                                let r = e.offset as usize..(e.offset + e.numel) as usize;
                                let w: f64 = before[r.clone()].iter().map(|&x| f64::from(x).powi(2)).sum();
                                let c: f64 = after[r.clone()]
                                    .iter()
                                    .zip(&before[r])
                                    .map(|(&a, &b)| f64::from(a - b).powi(2))
                                    .sum();
                                assert!(
                                    (weight - w).abs() <= 1e-12 * w && (change - c).abs() <= 1e-12 * c,
                                    "{}",
                                    e.name
                                );
                                assert!(c > 0.0);
                            }
                        } else {
                            assert!(norms.is_none(), "{kernel:?}: no norms where none were measured");
                        }
                        assert!(rooms[1..] == before[..], "{kernel:?}: the rooms hold the state before the update");
                        assert_eq!(rooms[0], 0.0);
                        // The CRC-32s handed to the writer cover every room's byte once and are
                        // those of the bytes in the rooms.
                        let mut checksums = save.take_checksums();
                        checksums.sort_unstable();
                        let base = rooms[1..].as_ptr() as usize;
                        let mut at = base;
                        for &(address, len, crc) in &checksums {
                            assert_eq!(address, at, "{kernel:?}: the checksummed pieces tile the rooms");
                            // SAFETY: `address..address + len` lies in `rooms` (checked by the
                            // tiling: it starts where the last ended and ends by the rooms' end).
                            assert!(address + len <= base + 4 * (rooms.len() - 1));
                            let bytes = unsafe { std::slice::from_raw_parts(address as *const u8, len) };
                            assert_eq!(crc, stoke_ckpt::checksum(bytes), "{kernel:?}: a piece's CRC-32");
                            at += len;
                        }
                        assert_eq!(at, base + 4 * (rooms.len() - 1), "{kernel:?}: every room's bytes checksummed");
                    } else {
                        o.step(p, hp, 5.0, None, kernel, 2);
                    }
                }
            }
            let flat = |p: &FlatParams| Vec::<f32>::try_from(p.flat()).unwrap();
            assert!(flat(&plain) == flat(&saving), "{kernel:?}: saving changed the update");
            let moments = |o: &AdamW| Vec::<f32>::try_from(&o.exp_avg_sq).unwrap();
            assert!(moments(&plain_opt) == moments(&saving_opt));
        }
    }

    #[test]
    fn the_saving_update_folds_each_rooms_crc_from_its_registers_and_updates_as_update_does() {
        let k =
            UpdateConsts { clip: 0.5, w1: 0.1, w2: 0.01, inv_sqrt_bc2: 1.2, eps: 1e-8, decay: 0.999, step_size: 0.01 };
        let values = |seed: usize, n: usize| -> Vec<f32> {
            (0..n).map(|i| ((i * 7919 + seed * 104_729) % 1000) as f32 / 250.0 - 2.0).collect()
        };
        // Lengths with and without a tail; rooms at every offset from 32-byte alignment.
        for (n, offset) in [(1000, 0), (1003, 1), (17, 5), (5, 3), (4099, 7)] {
            let ways = [Some(RegisterSave::Plain), saves_in_registers([std::ptr::null_mut(); 3])];
            for way in ways.into_iter().flatten() {
                // The second moment is never negative.
                let v: Vec<f32> = values(4, n).iter().map(|x| x.abs()).collect();
                let (mut g, mut p, mut m, mut v) = (values(1, n), values(2, n), values(3, n), v);
                let old = [p.clone(), m.clone(), v.clone()];
                let (mut g2, mut p2, mut m2, mut v2) = (g.clone(), p.clone(), m.clone(), v.clone());
                update(&mut g2, &mut p2, &mut m2, &mut v2, &k);
                // Room space aligned to 32 bytes, each room `offset` f32 past a boundary.
                let stride = n.div_ceil(8) * 8 + 8;
                let mut space = vec![0f32; 3 * stride + 8];
                let base = space.as_mut_ptr().align_offset(32);
                let rooms: [*mut f32; 3] = std::array::from_fn(|j| space[base + j * stride + offset..].as_mut_ptr());
                if saves_in_registers(rooms).is_none() {
                    eprintln!("skipped: this CPU saves no block from registers");
                    return;
                }
                // SAFETY: each room has `n` f32 of `space`, which nothing else touches.
                let crcs = unsafe { update_saving(&mut g, &mut p, &mut m, &mut v, &k, rooms, way) };
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert!(
                    bits(&p) == bits(&p2) && bits(&m) == bits(&m2) && bits(&v) == bits(&v2) && bits(&g) == bits(&g2),
                    "{way:?} n {n}: the update is update's"
                );
                for (j, old) in old.iter().enumerate() {
                    let start = base + j * stride + offset;
                    assert!(space[start..start + n] == old[..], "{way:?} n {n}: room {j} holds the old values");
                }
                match way {
                    RegisterSave::Plain => assert_eq!(crcs, None),
                    RegisterSave::WithChecksums => {
                        let expected = old.clone().map(|x| stoke_ckpt::checksum(f32_bytes(&x)));
                        assert_eq!(crcs, Some(expected), "n {n} offset {offset}");
                    }
                }
            }
        }
    }

    #[test]
    fn fused_cpu_step_matches_the_tensor_ops() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (fused, fused_norms) = train_three_steps(UpdateKernel::Fused);
        let (reference, reference_norms) = train_three_steps(UpdateKernel::TensorOps);
        for (a, b) in fused_norms.iter().zip(&reference_norms) {
            assert!((a - b).abs() < 1e-4 * b.abs().max(1.0), "norms {fused_norms:?} vs {reference_norms:?}");
        }
        assert!(reference_norms[2] > 5.0, "the test must exercise clipping: {reference_norms:?}");
        let worst = fused.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-5, "fused and tensor AdamW differ by {worst}");
    }

    #[test]
    fn ranges_add_up_to_the_whole() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let params = params();
        params.get("w").square().sum(Kind::Float).backward();
        let optimizer = AdamW::new(&params);
        for kernel in [UpdateKernel::Fused, UpdateKernel::TensorOps] {
            let whole = optimizer.grad_sq_sum(&params, 0..params.n_elements(), kernel, 2);
            // A split that cuts through the middle of a parameter, as a ZeRO shard would.
            let parts = optimizer.grad_sq_sum(&params, 0..30_000, kernel, 2)
                + optimizer.grad_sq_sum(&params, 30_000..params.n_elements(), kernel, 2);
            assert!((whole - parts).abs() < 1e-9 * whole, "{kernel:?}: {whole} vs {parts}");
        }
    }

    #[test]
    fn state_loads_by_name_and_refuses_another_layout() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let params = params();
        params.get("w").square().sum(Kind::Float).backward();
        let mut optimizer = AdamW::new(&params);
        let hp = AdamWStep { lr: 0.01, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
        optimizer.step(&params, hp, 0.0, None, UpdateKernel::Fused, 1);
        let saved: Vec<(String, Vec<i64>, Tensor)> =
            optimizer.state_tensors(&params).into_iter().map(|s| (s.name, s.shape, s.tensor.copy())).collect();
        let mut restored = AdamW::new(&params);
        let find = |saved: &[(String, Vec<i64>, Tensor)], name: &str| {
            saved.iter().find(|s| s.0 == name).map(|s| (s.1.clone(), s.2.shallow_clone()))
        };
        restored.load_state(&params, 1, |name| find(&saved, name)).unwrap();
        assert!(restored.exp_avg.equal(&optimizer.exp_avg) && restored.exp_avg_sq.equal(&optimizer.exp_avg_sq));
        // Another model whose "w" has another shape: the error names the tensor.
        let other = FlatParams::new(
            vec![UnitSpec {
                name: "u".into(),
                params: vec![
                    ParamSpec { name: "b".into(), shape: vec![200], init: Init::Zeros, decay: false },
                    ParamSpec { name: "w".into(), shape: vec![200, 400], init: Init::Zeros, decay: true },
                ],
            }],
            Device::Cpu,
        );
        let err = AdamW::new(&other).load_state(&other, 1, |name| find(&saved, name)).unwrap_err();
        assert!(err.contains("\"w.exp_avg\"") && err.contains("[400, 200]"), "{err}");
    }
}
