//! AdamW with decoupled weight decay over the flat parameter buffer.
//!
//! On a CPU the whole update (gradient norm, clipping, decay, both moments, the step, and clearing
//! the gradient) is one fused pass in Rust over each parameter's slice, split across threads: each
//! element is read and written once while it is in cache, where a chain of libtorch ops would
//! stream the multi-megabyte buffers through memory ten times. On a GPU the same arithmetic runs
//! as vectorized libtorch ops over the flat buffers.

use tch::{Kind, Tensor};

use crate::params::FlatParams;

/// Hyper-parameters of one AdamW step.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// Moment estimates, flat like the parameters, and the count of steps taken.
pub struct AdamW {
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    pub n_steps: u64,
}

impl AdamW {
    pub fn new(params: &FlatParams) -> AdamW {
        let flat = params.flat();
        AdamW { exp_avg: flat.zeros_like(), exp_avg_sq: flat.zeros_like(), n_steps: 0 }
    }

    /// One update of every parameter from the flat gradient. The same arithmetic as PyTorch's
    /// `torch.optim.AdamW` (bias-corrected moments, decay applied to the weights before the step).
    pub fn step(&mut self, params: &mut FlatParams, grad: &Tensor, hp: AdamWStep) {
        self.n_steps += 1;
        let t = self.n_steps as i32;
        let bias_correction1 = 1.0 - hp.beta1.powi(t);
        let bias_correction2 = 1.0 - hp.beta2.powi(t);
        let n_decay = params.n_decay();
        tch::no_grad(|| {
            let mut flat = params.flat().shallow_clone();
            if hp.weight_decay > 0.0 && n_decay > 0 {
                let _ = flat.narrow(0, 0, n_decay).g_mul_scalar_(1.0 - hp.lr * hp.weight_decay);
            }
            let _ = self.exp_avg.lerp_(grad, 1.0 - hp.beta1);
            let _ = self.exp_avg_sq.lerp_(&grad.square(), 1.0 - hp.beta2);
            let mut denom = self.exp_avg_sq.sqrt();
            let _ = denom.g_div_scalar_(bias_correction2.sqrt()).g_add_scalar_(hp.eps);
            let mut update = self.exp_avg.divide(&denom);
            let _ = update.g_mul_scalar_(hp.lr / bias_correction1);
            let _ = flat.g_sub_(&update);
        });
    }
}

/// The parts of one parameter the fused CPU update touches.
struct Slices {
    grad: *mut f32,
    param: *mut f32,
    exp_avg: *mut f32,
    exp_avg_sq: *mut f32,
    numel: usize,
    decay: bool,
}

// SAFETY: each `Slices` points into buffers that no other thread reads or writes while the update
// runs, and different `Slices` never overlap (parameters are disjoint ranges of the flat buffers).
unsafe impl Send for Slices {}
// SAFETY: as above; a `&Slices` is only dereferenced by the one thread the slice is dealt to.
unsafe impl Sync for Slices {}

impl AdamW {
    /// One step from the parameters' own gradients: global-norm clipping to `max_norm` (0: none),
    /// then AdamW; the gradients are cleared for the next accumulation. Returns the norm before
    /// clipping.
    /// `fused` false always takes the chain of tensor ops (what PyTorch's default AdamW does on a
    /// CPU), for comparisons.
    pub fn step_from_grads(
        &mut self,
        params: &mut FlatParams,
        hp: AdamWStep,
        max_norm: f64,
        n_threads: usize,
        fused: bool,
    ) -> f64 {
        let cpu_f32 = |t: &Tensor| t.device() == tch::Device::Cpu && t.kind() == Kind::Float && t.is_contiguous();
        let grads: Vec<Tensor> = params.entries().iter().map(|e| e.tensor.grad()).collect();
        let fusable = fused
            && [params.flat(), &self.exp_avg, &self.exp_avg_sq].into_iter().all(cpu_f32)
            && grads.iter().all(|g| g.defined() && cpu_f32(g));
        if !fusable {
            let mut grad = params.take_flat_grad();
            let norm = clip_grad_norm(&mut grad, max_norm);
            self.step(params, &grad, hp);
            return norm;
        }
        let (flat, m, v) = (
            params.flat().data_ptr() as *mut f32,
            self.exp_avg.data_ptr() as *mut f32,
            self.exp_avg_sq.data_ptr() as *mut f32,
        );
        let slices: Vec<Slices> = params
            .entries()
            .iter()
            .zip(&grads)
            .map(|(e, g)| {
                let offset = e.offset as usize;
                // SAFETY: `offset..offset + numel` lies inside the flat buffers, which hold
                // `n_elements()` f32 each (checked by construction in `FlatParams::new`).
                unsafe {
                    Slices {
                        grad: g.data_ptr() as *mut f32,
                        param: flat.add(offset),
                        exp_avg: m.add(offset),
                        exp_avg_sq: v.add(offset),
                        numel: e.numel as usize,
                        decay: e.decay,
                    }
                }
            })
            .collect();
        // Sum of squares per parameter, then added in a fixed order: the same norm whatever the
        // thread split.
        let sums = run_split(&slices, n_threads, |s| {
            // SAFETY: see `Slices`; this pass only reads.
            let g = unsafe { std::slice::from_raw_parts(s.grad, s.numel) };
            sum_of_squares(g)
        });
        let norm = sums.iter().sum::<f64>().sqrt();
        let clip = if max_norm > 0.0 && norm > max_norm { (max_norm / (norm + 1e-6)) as f32 } else { 1.0 };
        self.n_steps += 1;
        let t = self.n_steps as i32;
        let step_size = (hp.lr / (1.0 - hp.beta1.powi(t))) as f32;
        let inv_sqrt_bc2 = (1.0 / (1.0 - hp.beta2.powi(t)).sqrt()) as f32;
        let (w1, w2, eps) = ((1.0 - hp.beta1) as f32, (1.0 - hp.beta2) as f32, hp.eps as f32);
        let decay_factor = (1.0 - hp.lr * hp.weight_decay) as f32;
        run_split(&slices, n_threads, |s| {
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
            update(g, p, m, v, &k);
        });
        norm
    }
}

/// Sum of squares in f64 over eight independent lanes, so the adds pipeline and vectorize (one
/// running sum waits four cycles per element); the lanes are added in a fixed order, so the
/// result does not depend on the machine.
fn sum_of_squares(g: &[f32]) -> f64 {
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

/// Runs `work` on every slice, the slices dealt to `n_threads` threads in contiguous runs of about
/// equal size; returns the results in slice order.
fn run_split<R: Send + Default + Clone>(
    slices: &[Slices],
    n_threads: usize,
    work: impl Fn(&Slices) -> R + Sync,
) -> Vec<R> {
    let total: usize = slices.iter().map(|s| s.numel).sum();
    let n_threads = n_threads.clamp(1, 8);
    if n_threads == 1 || total < 1 << 16 {
        return slices.iter().map(&work).collect();
    }
    let mut results = vec![R::default(); slices.len()];
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
    std::thread::scope(|scope| {
        let work = &work;
        let mut rest: &mut [R] = &mut results;
        for &(lo, hi) in &groups {
            let (mine, tail) = rest.split_at_mut(hi - lo);
            rest = tail;
            let group = &slices[lo..hi];
            scope.spawn(move || {
                for (out, s) in mine.iter_mut().zip(group) {
                    *out = work(s);
                }
            });
        }
    });
    results
}

/// Scales `grad` in place so its global L2 norm is at most `max_norm`; returns the norm before.
pub fn clip_grad_norm(grad: &mut Tensor, max_norm: f64) -> f64 {
    let norm = grad.norm().to_kind(Kind::Double).double_value(&[]);
    if max_norm > 0.0 && norm > max_norm {
        let _ = grad.g_mul_scalar_(max_norm / (norm + 1e-6));
    }
    norm
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind};

    use super::*;
    use crate::params::{Init, ParamSpec};

    /// Final parameters and the norms seen, after three steps on a fixed loss.
    fn train_three_steps(fused: bool) -> (Vec<f32>, Vec<f64>) {
        let spec = |name: &str, shape: Vec<i64>, decay: bool| ParamSpec {
            name: name.into(),
            shape,
            init: Init::Normal { std: 0.5 },
            decay,
        };
        tch::manual_seed(0);
        // Large enough that the fused path splits the work across threads.
        let mut params =
            FlatParams::new(vec![spec("w", vec![400, 200], true), spec("b", vec![200], false)], Device::Cpu);
        let mut optimizer = AdamW::new(&params);
        let hp = AdamWStep { lr: 0.01, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
        let mut norms = Vec::new();
        for step in 1..=3 {
            let w = params.get("w");
            let loss = (w.square().sum(Kind::Float) * 0.01 + params.get("b").sum(Kind::Float)) * step as f64;
            loss.backward();
            let norm = if fused {
                optimizer.step_from_grads(&mut params, hp, 5.0, 2, true)
            } else {
                let mut grad = params.take_flat_grad();
                let norm = clip_grad_norm(&mut grad, 5.0);
                optimizer.step(&mut params, &grad, hp);
                norm
            };
            norms.push(norm);
        }
        (Vec::<f32>::try_from(params.flat()).unwrap(), norms)
    }

    #[test]
    fn fused_cpu_step_matches_the_tensor_ops() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (fused, fused_norms) = train_three_steps(true);
        let (reference, reference_norms) = train_three_steps(false);
        for (a, b) in fused_norms.iter().zip(&reference_norms) {
            assert!((a - b).abs() < 1e-4 * b.abs().max(1.0), "norms {fused_norms:?} vs {reference_norms:?}");
        }
        assert!(reference_norms[2] > 5.0, "the test must exercise clipping: {reference_norms:?}");
        let worst = fused.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst < 1e-5, "fused and tensor AdamW differ by {worst}");
    }
}
