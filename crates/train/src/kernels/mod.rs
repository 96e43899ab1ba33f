//! Fused kernels written in Rust for memory-bound parts of the step, where one pass over the data
//! replaces a chain of libtorch ops (each a full pass and an allocation). Each is tested against
//! the libtorch ops it replaces, forward and backward.
//!
//! `cross_entropy_bf16`: the loss and its gradient with respect to 16-bit logits in one pass per
//! row. libtorch's path under bf16 casts the logits to fp32, takes `log_softmax`, `nll_loss`, and
//! in the backward `nll_loss_backward` (a zeroed tensor and a scatter), `log_softmax_backward` and
//! a cast back to bf16: six passes over `[rows, vocab]` and four fp32 temporaries. The kernel reads
//! each row once into an fp32 scratch row, keeps the exponentials there, and writes the bf16
//! gradient. Arithmetic is fp32 (the list in `precision::FP32_OPS`); the exponential is a
//! polynomial within about 1 ulp, written so the compiler vectorizes it. Built twice on x86-64,
//! for the baseline and for AVX-512 (AVX2 with FMA as the middle), picked at run time like the
//! fused optimizer.
//!
//! `layer_norm_bf16` (the LayerNorms, `layer_norm.rs`), `causal_softmax_bf16` (the attention's
//! masked softmax, `softmax.rs`) and `bias_gelu` (the MLP's first bias and GELU, `gelu.rs`)
//! are the others; `swiglu_bf16` (`swiglu.rs`) and `rope_split_bf16` (`rope.rs`) the llama
//! family's gate and rotary positions.

use std::ops::Range;

use tch::{Device, Kind, Tensor};

/// Defines `$name`, which runs `$body` (an `#[inline(always)]` function of the same arguments)
/// compiled for the best instruction set this CPU has: AVX-512 (F and BW), AVX2 with FMA, or the
/// baseline, picked at run time, like the fused optimizer.
macro_rules! simd_dispatch {
    ($(#[$meta:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? => $body:ident) => {
        $(#[$meta])*
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $body($($arg),*)
                }
                if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") {
                    // SAFETY: the CPU has the features the function is compiled for.
                    return unsafe { avx512($($arg),*) };
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: as above.
                    return unsafe { avx2($($arg),*) };
                }
            }
            $body($($arg),*)
        }
    };
}

mod attention_core;
mod gelu;
mod layer_norm;
mod rope;
mod softmax;
mod swiglu;

pub(crate) use attention_core::{attention_core, attention_core_backward, AttentionCore};
pub use gelu::{bias_gelu, bias_gelu_backward};
pub use layer_norm::{
    layer_norm_bf16, layer_norm_bf16_backward, layer_norm_f32, rms_norm_bf16, rms_norm_bf16_backward, rms_norm_f32,
    LayerNormStats,
};
pub use rope::{rope_split_bf16, rope_split_bf16_backward};
pub use softmax::{
    causal_softmax_backward_bf16, causal_softmax_bf16, prefix_softmax_backward_bf16, prefix_softmax_bf16, CausalBlock,
};
pub use swiglu::{swiglu_bf16, swiglu_bf16_backward};

/// The loss of a fused cross-entropy and the gradient of `loss x grad_scale` with respect to the
/// logits.
pub struct CrossEntropy {
    /// Mean over the rows, fp32 (as libtorch's), as a scalar tensor.
    pub loss: Tensor,
    /// `[rows, vocab]` bf16.
    pub grad: Tensor,
}

/// Mean cross-entropy of `logits` `[rows, vocab]` against `targets` `[rows]`, and the gradient of
/// the mean times `grad_scale` with respect to the logits. `None` when the inputs are not what the
/// kernel handles (not bf16 contiguous logits and int64 targets on the CPU, or a target outside
/// `[0, vocab)`, such as an ignore index): the caller takes libtorch's ops, which also report
/// bad targets. `n_threads` splits the rows (contiguous runs, so the result does not depend on it
/// except for the order of the loss sum, which is in f64 per run and then in run order).
pub fn cross_entropy_bf16(
    logits: &Tensor,
    targets: &Tensor,
    grad_scale: f64,
    n_threads: usize,
) -> Option<CrossEntropy> {
    let (rows, vocab) = logits.size2().ok()?;
    if logits.kind() != Kind::BFloat16
        || logits.device() != Device::Cpu
        || !logits.is_contiguous()
        || targets.kind() != Kind::Int64
        || targets.device() != Device::Cpu
        || targets.size() != [rows]
        || rows == 0
        || vocab == 0
    {
        return None;
    }
    let targets = targets.contiguous();
    let (rows, vocab) = (rows as usize, vocab as usize);
    // SAFETY: `targets` is a contiguous int64 CPU tensor of `rows` elements, alive for this scope.
    let target_slice = unsafe { std::slice::from_raw_parts(targets.data_ptr() as *const i64, rows) };
    if target_slice.iter().any(|&t| t < 0 || t as usize >= vocab) {
        return None;
    }
    let grad = Tensor::empty([rows as i64, vocab as i64], (Kind::BFloat16, Device::Cpu));
    // SAFETY: `logits` is a contiguous bf16 CPU tensor of rows x vocab elements (checked above);
    // bf16 is 16 bits, read as u16. `grad` was just allocated with that shape and nothing else
    // refers to it yet, so this is the only access to its memory.
    let (input, output) = unsafe {
        (
            std::slice::from_raw_parts(logits.data_ptr() as *const u16, rows * vocab),
            SharedMut::new(grad.data_ptr() as *mut u16, rows * vocab),
        )
    };
    let scale = (grad_scale / rows as f64) as f32;
    let sums = parallel_rows(rows, n_threads, 64, |range: Range<usize>| {
        let span = range.start * vocab..range.end * vocab;
        // SAFETY: `parallel_rows` hands out disjoint ranges of rows.
        let output = unsafe { output.slice(span.clone()) };
        rows_dispatch(&input[span], &target_slice[range], vocab, scale, output)
    });
    let loss = sums.iter().sum::<f64>() / rows as f64;
    Some(CrossEntropy { loss: Tensor::from(loss as f32), grad })
}

/// A mutable buffer that threads write disjoint parts of (see `parallel_rows`).
#[derive(Clone, Copy)]
struct SharedMut<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: a `SharedMut` is only a pointer and a length; the code that takes slices of it from
// several threads promises their ranges are disjoint (`slice`'s contract).
unsafe impl<T: Send> Send for SharedMut<T> {}
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// # Safety
    /// `ptr` points to `len` valid, initialized elements that outlive every use of the result.
    unsafe fn new(ptr: *mut T, len: usize) -> SharedMut<T> {
        SharedMut { ptr, len }
    }

    /// Of a slice; `slice`'s callers keep it alive while they use the parts.
    fn of(slice: &mut [T]) -> SharedMut<T> {
        SharedMut { ptr: slice.as_mut_ptr(), len: slice.len() }
    }

    /// # Safety
    /// The buffer is still alive, and no two slices alive at the same time overlap.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, range: Range<usize>) -> &mut [T] {
        assert!(range.start <= range.end && range.end <= self.len, "slice {range:?} of {}", self.len);
        std::slice::from_raw_parts_mut(self.ptr.add(range.start), range.end - range.start)
    }
}

/// Whether `t` is a contiguous CPU tensor of `kind` (what the kernels read through raw slices).
fn cpu_contiguous(t: &Tensor, kind: Kind) -> bool {
    t.defined() && t.kind() == kind && t.device() == Device::Cpu && t.is_contiguous()
}

/// Adds the element-wise sum of `partials` (each thread's sums over its rows, `len` values,
/// added in order) to `grad` (fp32, `len` elements: a parameter's view of the flat gradient
/// buffer).
fn add_partial_sums<'a>(grad: &Tensor, len: usize, partials: impl IntoIterator<Item = &'a [f32]>) {
    let mut total = vec![0f32; len];
    for partial in partials {
        total.iter_mut().zip(partial).for_each(|(a, b)| *a += b);
    }
    let _guard = tch::no_grad_guard();
    let mut grad = grad.shallow_clone();
    grad += Tensor::from_slice(&total).view(grad.size().as_slice());
}

/// Ranges of rows a thread takes in turn in `parallel_rows`: more than one, so that a thread that
/// starts late or runs on a busier core takes fewer and the threads end together.
const RANGES_PER_THREAD: usize = 4;

/// Runs `work` on `rows` split into contiguous ranges, each at least `min_rows` long (one range
/// when the rows are fewer), on at most `n_threads` of libtorch's OpenMP threads (see `omp`), each
/// taking the next range when it is free. The ranges depend on `rows`, `n_threads` and
/// `min_rows` alone, not on which thread takes which, so the results, which come back in range
/// order, do not either.
fn parallel_rows<R: Send>(
    rows: usize,
    n_threads: usize,
    min_rows: usize,
    work: impl Fn(Range<usize>) -> R + Sync,
) -> Vec<R> {
    let most = rows.div_ceil(min_rows.max(1));
    let threads = n_threads.clamp(1, 64).min(most).max(1);
    if threads == 1 {
        return vec![work(0..rows)];
    }
    let per = rows.div_ceil((threads * RANGES_PER_THREAD).min(most));
    crate::omp::map_tasks_on(rows.div_ceil(per), threads, |i| work(i * per..((i + 1) * per).min(rows)))
}

simd_dispatch! {
    /// `rows_portable` for the best instruction set this CPU has.
    fn rows_dispatch(input: &[u16], targets: &[i64], vocab: usize, scale: f32, output: &mut [u16]) -> f64 => rows_portable
}

/// Lanes of the hand-split reductions: wide enough for one AVX-512 register, so the compiler
/// keeps the partial maxima and sums in vector registers.
const LANES: usize = 16;

/// Every row of `input` (`targets.len()` rows of `vocab`): the row's loss added (f64) to the
/// returned sum, its gradient times `scale` written to `output`.
#[inline(always)]
fn rows_portable(input: &[u16], targets: &[i64], vocab: usize, scale: f32, output: &mut [u16]) -> f64 {
    let mut scratch = vec![0f32; vocab.next_multiple_of(LANES)];
    let mut sum = 0f64;
    for ((row, out), &target) in input.chunks_exact(vocab).zip(output.chunks_exact_mut(vocab)).zip(targets) {
        sum += row_loss_and_grad(row, target as usize, scale, &mut scratch, out) as f64;
    }
    sum
}

/// One row: widens it into `scratch` (padded to a multiple of `LANES` with -inf), takes its
/// maximum, the exponentials of `x - max` (kept in `scratch`) and their sum; the loss is
/// `ln(sum) - (x[target] - max)`, the gradient `(softmax - onehot(target)) x scale`.
#[inline(always)]
fn row_loss_and_grad(row: &[u16], target: usize, scale: f32, scratch: &mut [f32], out: &mut [u16]) -> f32 {
    let vocab = row.len();
    for (s, &b) in scratch.iter_mut().zip(row) {
        *s = bf16_to_f32(b);
    }
    for s in &mut scratch[vocab..] {
        *s = f32::NEG_INFINITY;
    }
    let mut maxima = [f32::NEG_INFINITY; LANES];
    for chunk in scratch.chunks_exact(LANES) {
        for (m, &x) in maxima.iter_mut().zip(chunk) {
            *m = if x > *m { x } else { *m };
        }
    }
    let max = maxima.iter().fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    let mut sums = [0f32; LANES];
    for chunk in scratch.chunks_exact_mut(LANES) {
        for (s, x) in sums.iter_mut().zip(chunk) {
            *x = exp_nonpositive(*x - max);
            *s += *x;
        }
    }
    let total: f32 = sums.iter().sum();
    let shifted_target = bf16_to_f32(row[target]) - max;
    let factor = scale / total;
    for (o, &e) in out.iter_mut().zip(&scratch[..vocab]) {
        *o = f32_to_bf16(e * factor);
    }
    out[target] = f32_to_bf16((scratch[target] / total - 1.0) * scale);
    total.ln() - shifted_target
}

/// An element a kernel reads or writes, computed in fp32: bf16 (as its bits) or fp32.
trait Bits: Copy + Send + Sync {
    const KIND: Kind;
    fn load(self) -> f32;
    fn store(v: f32) -> Self;
}

impl Bits for u16 {
    const KIND: Kind = Kind::BFloat16;
    #[inline(always)]
    fn load(self) -> f32 {
        bf16_to_f32(self)
    }
    #[inline(always)]
    fn store(v: f32) -> u16 {
        f32_to_bf16(v)
    }
}

impl Bits for f32 {
    const KIND: Kind = Kind::Float;
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(v: f32) -> f32 {
        v
    }
}

#[inline(always)]
fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Round to nearest even, as libtorch's conversion (finite inputs; the loss guard stops a step
/// whose logits are not finite).
#[inline(always)]
fn f32_to_bf16(value: f32) -> u16 {
    let bits = value.to_bits();
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

/// e^x for x <= 0 (NaN and -inf included: a NaN stays NaN, -inf gives 0), within about 1 ulp:
/// `exp_reduce`, e^r by its Taylor polynomial to degree 7, times 2^n. Inputs below -87 (whose
/// result is below f32's normal range) give 0.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    let (r, two_n, underflow) = exp_reduce(x);
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let y = p * two_n;
    if underflow {
        0.0
    } else if x.is_nan() {
        x
    } else {
        y
    }
}

/// e^x for x <= 0 to about 3e-6 relative, for results that are rounded to bf16 (2^-9):
/// `exp_reduce` and the Taylor polynomial cut to degree 5, in fused multiply-adds. Below -87 it
/// gives 0; a NaN gives some number, so the caller must carry NaN through otherwise (the GELU
/// multiplies by its input).
#[inline(always)]
fn exp_for_bf16(x: f32) -> f32 {
    let (r, two_n, underflow) = exp_reduce(x);
    let p = r.mul_add(r.mul_add(r.mul_add(r.mul_add(r.mul_add(1.0 / 120.0, 1.0 / 24.0), 1.0 / 6.0), 0.5), 1.0), 1.0);
    if underflow {
        0.0
    } else {
        p * two_n
    }
}

/// For x <= 0 clamped at -87: x = n ln2 + r with n an integer and |r| <= ln2/2; gives r, 2^n
/// (built in the exponent bits) and whether x was below -87.
#[inline(always)]
fn exp_reduce(x: f32) -> (f32, f32, bool) {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, so n x LN2_HI is exact for |n| < 2^10.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and subtracting 1.5 x 2^23 rounds to the nearest integer for |v| < 2^22.
    const ROUND: f32 = 12_582_912.0;
    let underflow = x < -87.0;
    let clamped = if underflow { -87.0 } else { x };
    let shifted = clamped * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = (clamped - n * LN2_HI) - n * LN2_LO;
    // `shifted` is 1.5 x 2^23 + n, whose bits are those of 1.5 x 2^23 plus n: so n + 127 in
    // integer arithmetic, which vectorizes (`n as i32` saturates, which the compiler did lane
    // by lane).
    let two_n = f32::from_bits(shifted.to_bits().wrapping_sub(ROUND.to_bits() - 127) << 23);
    (r, two_n, underflow)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_matches_the_standard_library() {
        let mut worst = 0f32;
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let (got, want) = (exp_nonpositive(x), x.exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 4e-7, "relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert!(exp_nonpositive(f32::NAN).is_nan());
        let mut worst = 0f32;
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            worst = worst.max(((exp_for_bf16(x) - x.exp()) / x.exp()).abs());
        }
        assert!(worst < 4e-6, "exp_for_bf16's relative error {worst}");
        assert_eq!(exp_for_bf16(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn bf16_rounding_matches_libtorch() {
        let values = Tensor::randn([4096], (Kind::Float, Device::Cpu)) * 100.0;
        let values = Tensor::cat(&[values, Tensor::from_slice(&[0.0f32, -0.0, 1e-40, 65504.0, 3.4e38])], 0);
        let want = values.to_kind(Kind::BFloat16);
        let n = values.numel();
        // SAFETY: both are contiguous CPU tensors of n elements of the read types.
        let (input, want) = unsafe {
            (
                std::slice::from_raw_parts(values.data_ptr() as *const f32, n),
                std::slice::from_raw_parts(want.data_ptr() as *const u16, n),
            )
        };
        for (x, w) in input.iter().zip(want) {
            assert_eq!(f32_to_bf16(*x), *w, "{x}");
        }
    }

    /// libtorch's path, as the model ran it before the kernel: fp32 cross-entropy of the bf16
    /// logits, backward from the loss times `grad_scale`.
    fn reference(logits: &Tensor, targets: &Tensor, grad_scale: f64) -> (f64, Tensor) {
        let leaf = logits.detach().set_requires_grad(true);
        let loss = leaf.to_kind(Kind::Float).cross_entropy_for_logits(targets);
        (&loss * grad_scale).backward();
        (loss.double_value(&[]), leaf.grad())
    }

    fn check(rows: i64, vocab: i64, spread: f64, grad_scale: f64, n_threads: usize, min_exact: f64) {
        let logits = (Tensor::randn([rows, vocab], (Kind::Float, Device::Cpu)) * spread).to_kind(Kind::BFloat16);
        let targets = Tensor::randint(vocab, [rows], (Kind::Int64, Device::Cpu));
        let fused = cross_entropy_bf16(&logits, &targets, grad_scale, n_threads).expect("bf16 logits on the CPU");
        let (want_loss, want_grad) = reference(&logits, &targets, grad_scale);
        let loss = fused.loss.double_value(&[]);
        assert!((loss - want_loss).abs() <= 1e-5 * want_loss.abs().max(1.0), "loss {loss} against {want_loss}");
        assert_eq!(fused.grad.kind(), Kind::BFloat16);
        let (got, want) = (fused.grad.to_kind(Kind::Float), want_grad.to_kind(Kind::Float));
        // Both round an fp32 value to bf16; the fp32 values differ by a few ulp, so a result may
        // land on the neighbouring bf16 value: one bf16 ulp (2^-8 relative) of the larger.
        let bound = want.abs().max() * (2.0f64.powi(-8) * 1.01);
        let worst = (&got - &want).abs().max().double_value(&[]);
        assert!(worst <= bound.double_value(&[]), "gradient differs by {worst} (rows {rows}, vocab {vocab})");
        let exact = got.eq_tensor(&want).to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
        assert!(
            exact >= min_exact,
            "only {exact} of the gradient's elements equal libtorch's (rows {rows}, vocab {vocab})"
        );
    }

    #[test]
    fn cross_entropy_matches_libtorch_forward_and_backward() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        tch::manual_seed(5);
        check(512, 256, 1.0, 1.0, 1, 0.99);
        check(512, 256, 1.0, 1.0, 3, 0.99);
        // A vocabulary that is not a multiple of the lanes, large logits, a loss multiplier.
        check(300, 1000, 8.0, 0.25, 2, 0.99);
        // Logits 87 or more below their row's maximum: the kernel's exponential gives 0 where
        // libtorch's gives a subnormal, which the multiplier lifts into bf16's normal range; both
        // are below 1e-37 of the largest gradient, inside the bound.
        check(7, 50, 30.0, 65536.0, 4, 0.5);
    }

    #[test]
    fn other_inputs_are_left_to_libtorch() {
        let targets = Tensor::from_slice(&[1i64, 2]);
        let float = Tensor::zeros([2, 4], (Kind::Float, Device::Cpu));
        assert!(cross_entropy_bf16(&float, &targets, 1.0, 1).is_none());
        let logits = float.to_kind(Kind::BFloat16);
        assert!(cross_entropy_bf16(&logits.transpose(0, 1), &targets, 1.0, 1).is_none());
        assert!(cross_entropy_bf16(&logits, &Tensor::from_slice(&[1i64, 4]), 1.0, 1).is_none());
        assert!(cross_entropy_bf16(&logits, &Tensor::from_slice(&[-100i64, 0]), 1.0, 1).is_none());
        assert!(cross_entropy_bf16(&logits, &targets, 1.0, 1).is_some());
    }
}
