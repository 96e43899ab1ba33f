//! The MLP's first bias and its GELU, forward and backward, with the bias's gradient summed in
//! the backward's one pass.
//!
//! Under bf16 libtorch runs the MLP's first linear layer as `addmm` (the bias copied into the
//! output, then the product added), `gelu` (one pass, fp32 inside), and in the backward
//! `gelu_backward` (one pass) and the bias's gradient as a sum over the rows of that result
//! (another pass over `[rows, 4d]`), then the bias leaf's bf16 gradient cast and added into the
//! fp32 buffer. Here the product runs without the bias, and one pass adds the fp32 bias and takes
//! the GELU; the backward reads the product and the output's gradient once, writes the
//! product's gradient and sums the bias's per thread in fp32. The GELU is the exact one
//! (`x Phi(x)`, libtorch's `approximate="none"`), with `Phi` from the erfc approximation of
//! Abramowitz and Stegun 7.1.26 (absolute error below 1.5e-7, the one libtorch's vectorized `erf`
//! uses) and one exponential per value, which the derivative's `phi(x)` shares.
//!
//! In an fp32 run the same with fp32 in and out, and the exponential to about 1 ulp
//! (`exp_nonpositive`) instead of the one cut for bf16's rounding.

use std::ops::Range;

use tch::{Device, Kind, Tensor};

use super::{add_partial_sums, cpu_contiguous, exp_for_bf16, exp_nonpositive, parallel_rows, Bits, SharedMut};

/// The rows a thread takes at the least.
const MIN_ROWS_PER_THREAD: usize = 32;

/// An element the kernels read and write, with the exponential its precision needs.
trait Value: Bits {
    fn exp(x: f32) -> f32;
}

impl Value for u16 {
    #[inline(always)]
    fn exp(x: f32) -> f32 {
        exp_for_bf16(x)
    }
}

impl Value for f32 {
    #[inline(always)]
    fn exp(x: f32) -> f32 {
        exp_nonpositive(x)
    }
}

/// `gelu(pre + bias)` of `pre` `[.., h]` (bf16, or fp32 in an fp32 run) and `bias` `[h]` fp32, of
/// `pre`'s kind and shape. `None` when the inputs are not what the kernel handles (not
/// contiguous bf16 or fp32 and fp32 on the CPU, or a bias of another width): the caller takes
/// libtorch's ops.
pub fn bias_gelu(pre: &Tensor, bias: &Tensor, n_threads: usize) -> Option<Tensor> {
    match pre.kind() {
        Kind::BFloat16 => bias_gelu_of::<u16>(pre, bias, n_threads),
        Kind::Float => bias_gelu_of::<f32>(pre, bias, n_threads),
        _ => None,
    }
}

/// The gradient with respect to `pre` of a `bias_gelu` forward, given `grad_out` (of `pre`'s
/// kind and shape), of `pre`'s kind; the bias's gradient (the sum of that over the rows, in fp32
/// before rounding) is added to `bias_grad` (fp32 `[h]`, e.g. the bias's view of the flat
/// gradient buffer). Panics when the tensors do not fit the forward's (a caller's bug, not bad
/// data).
pub fn bias_gelu_backward(
    grad_out: &Tensor,
    pre: &Tensor,
    bias: &Tensor,
    bias_grad: &Tensor,
    n_threads: usize,
) -> Tensor {
    match pre.kind() {
        Kind::Float => bias_gelu_backward_of::<f32>(grad_out, pre, bias, bias_grad, n_threads),
        _ => bias_gelu_backward_of::<u16>(grad_out, pre, bias, bias_grad, n_threads),
    }
}

fn bias_gelu_of<V: Value + Dispatch>(pre: &Tensor, bias: &Tensor, n_threads: usize) -> Option<Tensor> {
    let (rows, h) = fits(pre, bias, V::KIND)?;
    let out = Tensor::empty(pre.size(), (V::KIND, Device::Cpu));
    // SAFETY: `pre` and `bias` are contiguous CPU tensors of the kinds and lengths checked by
    // `fits`, alive for this scope; `out` was just allocated and nothing else refers to it.
    let (x, b, out_all) = unsafe {
        (
            std::slice::from_raw_parts(pre.data_ptr() as *const V, rows * h),
            std::slice::from_raw_parts(bias.data_ptr() as *const f32, h),
            SharedMut::new(out.data_ptr() as *mut V, rows * h),
        )
    };
    parallel_rows(rows, n_threads, MIN_ROWS_PER_THREAD, |range: Range<usize>| {
        let span = range.start * h..range.end * h;
        // SAFETY: `parallel_rows` hands out disjoint ranges of rows.
        let out = unsafe { out_all.slice(span.clone()) };
        V::forward(&x[span], b, out);
    });
    Some(out)
}

fn bias_gelu_backward_of<V: Value + Dispatch>(
    grad_out: &Tensor,
    pre: &Tensor,
    bias: &Tensor,
    bias_grad: &Tensor,
    n_threads: usize,
) -> Tensor {
    let (rows, h) = fits(pre, bias, V::KIND).expect("bias_gelu backward: the forward's inputs");
    let grad_out = grad_out.contiguous();
    assert!(grad_out.kind() == V::KIND && grad_out.size() == pre.size(), "bias_gelu backward: grad_out");
    assert!(bias_grad.kind() == Kind::Float && bias_grad.numel() == h, "bias_gelu backward: bias_grad");
    let grad_pre = Tensor::empty(pre.size(), (V::KIND, Device::Cpu));
    // SAFETY: contiguous CPU tensors of the kinds and lengths checked above, alive for this
    // scope; `grad_pre` is new and only written here.
    let (g, x, b, dx_all) = unsafe {
        (
            std::slice::from_raw_parts(grad_out.data_ptr() as *const V, rows * h),
            std::slice::from_raw_parts(pre.data_ptr() as *const V, rows * h),
            std::slice::from_raw_parts(bias.data_ptr() as *const f32, h),
            SharedMut::new(grad_pre.data_ptr() as *mut V, rows * h),
        )
    };
    let partials = parallel_rows(rows, n_threads, MIN_ROWS_PER_THREAD, |range: Range<usize>| {
        let span = range.start * h..range.end * h;
        let mut db = vec![0f32; h];
        // SAFETY: disjoint row ranges, as in the forward.
        let dx = unsafe { dx_all.slice(span.clone()) };
        V::backward(&g[span.clone()], &x[span], b, dx, &mut db);
        db
    });
    add_partial_sums(bias_grad, h, partials.iter().map(Vec::as_slice));
    grad_pre
}

/// `pre`'s rows and width when `pre` is contiguous of `kind` and `bias` contiguous fp32 of its
/// width, both on the CPU.
fn fits(pre: &Tensor, bias: &Tensor, kind: Kind) -> Option<(usize, usize)> {
    let h = *pre.size().last()?;
    if !cpu_contiguous(pre, kind) || !cpu_contiguous(bias, Kind::Float) || h == 0 || bias.size() != [h] {
        return None;
    }
    Some((pre.numel() / h as usize, h as usize))
}

/// The rows' kernels of an element type, compiled for the best instruction set this CPU has.
trait Dispatch: Sized {
    fn forward(x: &[Self], b: &[f32], out: &mut [Self]);
    fn backward(g: &[Self], x: &[Self], b: &[f32], dx: &mut [Self], db: &mut [f32]);
}

impl Dispatch for u16 {
    fn forward(x: &[u16], b: &[f32], out: &mut [u16]) {
        forward_dispatch(x, b, out)
    }
    fn backward(g: &[u16], x: &[u16], b: &[f32], dx: &mut [u16], db: &mut [f32]) {
        backward_dispatch(g, x, b, dx, db)
    }
}

impl Dispatch for f32 {
    fn forward(x: &[f32], b: &[f32], out: &mut [f32]) {
        forward_dispatch_f32(x, b, out)
    }
    fn backward(g: &[f32], x: &[f32], b: &[f32], dx: &mut [f32], db: &mut [f32]) {
        backward_dispatch_f32(g, x, b, dx, db)
    }
}

simd_dispatch! {
    fn forward_dispatch(x: &[u16], b: &[f32], out: &mut [u16]) => forward_rows
}

simd_dispatch! {
    fn backward_dispatch(g: &[u16], x: &[u16], b: &[f32], dx: &mut [u16], db: &mut [f32]) => backward_rows
}

simd_dispatch! {
    fn forward_dispatch_f32(x: &[f32], b: &[f32], out: &mut [f32]) => forward_rows
}

simd_dispatch! {
    fn backward_dispatch_f32(g: &[f32], x: &[f32], b: &[f32], dx: &mut [f32], db: &mut [f32]) => backward_rows
}

/// `z^2` past which `normal_cdf_pdf_with` takes the tail and density as 0 (`e^-80` is 1.8e-35).
const SUBNORMAL_FREE: f32 = 80.0;

/// `Phi(x)` and `phi(x)`, the standard normal's distribution and density at `x`, with the
/// exponential `exp`. NaN gives NaN.
#[inline(always)]
fn normal_cdf_pdf_with(x: f32, exp: impl Fn(f32) -> f32) -> (f32, f32) {
    // Abramowitz and Stegun 7.1.26: erfc(z) ~ t (a1 + t (a2 + ...)) e^(-z^2), t = 1 / (1 + p z), z >= 0.
    const P: f32 = 0.327_591_1;
    const A: [f32; 5] = [0.254_829_6, -0.284_496_74, 1.421_413_8, -1.453_152_1, 1.061_405_4];
    const INV_SQRT_2PI: f32 = 0.398_942_3;
    let z = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / P.mul_add(z, 1.0);
    let poly = t * t.mul_add(t.mul_add(t.mul_add(t.mul_add(A[4], A[3]), A[2]), A[1]), A[0]);
    // Past |x| = sqrt(160) the tail is below 1e-35 and is taken as 0: nearer the exponential's
    // underflow its products with the polynomial came out subnormal, and a vector with one
    // subnormal lane costs a microcode assist; pre-activations of 20 (a product of unit-scale
    // rows and weights over 384 inputs) ran the forward at half its speed.
    let zz = z * z;
    let e = if zz > SUBNORMAL_FREE { 0.0 } else { exp(-zz) };
    // Phi(-|x|) = erfc(|x| / sqrt 2) / 2.
    let tail = 0.5 * poly * e;
    let cdf = if x >= 0.0 { 1.0 - tail } else { tail };
    (cdf, e * INV_SQRT_2PI)
}

/// `normal_cdf_pdf_with` bf16's exponential.
#[cfg(test)]
fn normal_cdf_pdf(x: f32) -> (f32, f32) {
    normal_cdf_pdf_with(x, exp_for_bf16)
}

/// Each value: `gelu(x + b) = (x + b) Phi(x + b)`.
#[inline(always)]
fn forward_rows<V: Value>(x: &[V], b: &[f32], out: &mut [V]) {
    let h = b.len();
    for (row, out) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        for ((o, &x), &b) in out.iter_mut().zip(row).zip(b) {
            let v = x.load() + b;
            let (cdf, _) = normal_cdf_pdf_with(v, V::exp);
            *o = V::store(v * cdf);
        }
    }
}

/// Each value, with `v = x + b`: `dx = g (Phi(v) + v phi(v))`, and `db += dx` before rounding.
#[inline(always)]
fn backward_rows<V: Value>(g: &[V], x: &[V], b: &[f32], dx: &mut [V], db: &mut [f32]) {
    let h = b.len();
    let db = &mut db[..h];
    for ((g, x), dx) in g.chunks_exact(h).zip(x.chunks_exact(h)).zip(dx.chunks_exact_mut(h)) {
        for ((((&g, &x), &b), dx), db) in g.iter().zip(x).zip(b).zip(dx.iter_mut()).zip(db.iter_mut()) {
            let v = x.load() + b;
            let (cdf, pdf) = normal_cdf_pdf_with(v, V::exp);
            let grad = g.load() * (cdf + v * pdf);
            *dx = V::store(grad);
            *db += grad;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// libtorch's ops on the same values in f64: `pre + bias` (its fp32 sum, as the kernel
    /// takes it), the exact GELU, and the backward from the bf16 `grad`; the outputs rounded to
    /// bf16 as the kernel's are. In f64 so that the kernel's own error is what is measured:
    /// libtorch's fp32 GELU, `x (1 + erf(x / sqrt 2)) / 2`, cancels below about x = -4
    /// (gelu(-7) comes out 0), and the kernel's erfc, accurate to 1.5e-7 absolute, is not
    /// accurate relative to a Phi below about 1e-5 either: both are within 1e-6 absolute there.
    fn reference(pre: &Tensor, bias: &Tensor, grad: &Tensor) -> [Tensor; 3] {
        let v = (pre.to_kind(Kind::Float) + bias).to_kind(Kind::Double).detach().set_requires_grad(true);
        let out = v.gelu("none");
        (&out * grad.to_kind(Kind::Double)).sum(Kind::Double).backward();
        let dv = v.grad();
        let db = dv.sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
        [out.detach().to_kind(Kind::BFloat16), dv.to_kind(Kind::BFloat16), db]
    }

    /// Within one bf16 ulp of the larger (the fp32 values differ in their last bits, and the
    /// rounding may land either side), or 1e-6 absolute in the far tail; at least `min_exact`
    /// equal among the values of magnitude 1e-3 or more (the tail's are within the bound).
    fn close_in_bf16(got: &Tensor, want: &Tensor, what: &str, min_exact: f64) {
        let (got, want) = (got.to_kind(Kind::Float), want.to_kind(Kind::Float));
        let bound = want.abs().maximum(&got.abs()) * (2.0f64.powi(-7) * 1.01) + 1e-6;
        let excess = ((&got - &want).abs() - bound).max().double_value(&[]);
        assert!(excess <= 0.0, "{what} differs by more than a bf16 ulp: {excess}");
        let body = want.abs().ge(1e-3);
        let equal = got.eq_tensor(&want).logical_and(&body).sum(Kind::Float).double_value(&[]);
        let exact = equal / body.sum(Kind::Float).double_value(&[]).max(1.0);
        assert!(exact >= min_exact, "only {exact} of {what} equal libtorch's");
    }

    fn check(rows: i64, h: i64, spread: f64, n_threads: usize) {
        let opts = (Kind::Float, Device::Cpu);
        let pre = (Tensor::randn([rows, h], opts) * spread).to_kind(Kind::BFloat16);
        let bias = Tensor::randn([h], opts) * 0.5;
        let grad = Tensor::randn([rows, h], opts).to_kind(Kind::BFloat16);
        let [want_out, want_dx, want_db] = reference(&pre, &bias, &grad);

        let out = bias_gelu(&pre, &bias, n_threads).expect("bf16 and fp32 on the CPU");
        assert_eq!((out.kind(), out.size()), (Kind::BFloat16, vec![rows, h]));
        close_in_bf16(&out, &want_out, "the forward", 0.99);

        let start = Tensor::full([h], 0.25, opts);
        let bias_grad = start.copy();
        let dx = bias_gelu_backward(&grad, &pre, &bias, &bias_grad, n_threads);
        close_in_bf16(&dx, &want_dx, "the input's gradient", 0.98);
        let db = &bias_grad - &start;
        let rel = ((&db - &want_db).abs().max() / want_db.abs().max()).double_value(&[]);
        assert!(rel <= 1e-4, "the bias's gradient (rows {rows}, width {h}): {rel}");
    }

    #[test]
    fn bias_gelu_matches_libtorch_forward_and_backward() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        tch::manual_seed(17);
        check(256, 1024, 1.0, 1);
        check(256, 1024, 1.0, 3);
        // Wide values (the tails of Phi), a width that is not a multiple of the lanes, fewer rows
        // than the threads would take.
        check(37, 100, 6.0, 4);
        check(5, 3072, 0.1, 2);
    }

    /// The fp32 kernel against libtorch's ops in f64: within 4e-7 (1 + |v|) absolute, the erfc
    /// approximation's 1.5e-7 carried through `v Phi(v)` and its derivative, plus fp32 rounding.
    #[test]
    fn bias_gelu_in_fp32_matches_libtorch_forward_and_backward() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        tch::manual_seed(18);
        let opts = (Kind::Float, Device::Cpu);
        for (rows, h, spread, n_threads) in [(256, 1024, 1.0, 2), (37, 100, 6.0, 4)] {
            let pre = Tensor::randn([rows, h], opts) * spread;
            let bias = Tensor::randn([h], opts) * 0.5;
            let grad = Tensor::randn([rows, h], opts);
            let v = (&pre + &bias).to_kind(Kind::Double).set_requires_grad(true);
            let want = v.gelu("none");
            (&want * grad.to_kind(Kind::Double)).sum(Kind::Double).backward();
            let (want_dx, bound) = (v.grad(), v.detach().abs() * 4e-7 + 4e-7);
            let out = bias_gelu(&pre, &bias, n_threads).expect("fp32 on the CPU");
            let excess = ((out.to_kind(Kind::Double) - want.detach()).abs() - &bound).max().double_value(&[]);
            assert!(excess <= 0.0, "the forward (rows {rows}): {excess}");
            let bias_grad = Tensor::zeros([h], opts);
            let dx = bias_gelu_backward(&grad, &pre, &bias, &bias_grad, n_threads);
            let excess = ((dx.to_kind(Kind::Double) - &want_dx).abs() - &bound * grad.to_kind(Kind::Double).abs())
                .max()
                .double_value(&[]);
            assert!(excess <= 0.0, "the input's gradient (rows {rows}): {excess}");
            let want_db = want_dx.sum_dim_intlist([0i64].as_slice(), false, Kind::Double);
            let rel =
                ((bias_grad.to_kind(Kind::Double) - &want_db).abs().max() / want_db.abs().max()).double_value(&[]);
            assert!(rel <= 1e-5, "the bias's gradient (rows {rows}): {rel}");
        }
    }

    /// No value of the forward or backward is subnormal (each would cost the vector its lane is in
    /// a microcode assist), however far out `x` is.
    #[test]
    fn no_value_is_subnormal() {
        let subnormal = |v: f32| v != 0.0 && !v.is_normal();
        for i in -40_000..=40_000 {
            let x = i as f32 * 1e-3;
            for exp in [exp_for_bf16 as fn(f32) -> f32, exp_nonpositive] {
                let (cdf, pdf) = normal_cdf_pdf_with(x, exp);
                let values = [cdf, pdf, 1.0 - cdf, x * cdf, x * pdf, cdf + x * pdf];
                assert!(!values.into_iter().any(subnormal), "a subnormal at x = {x}: {values:?}");
            }
        }
    }

    #[test]
    fn the_tails_and_nan() {
        for (x, want) in [(0.0f32, 0.0f32), (10.0, 10.0), (-10.0, 0.0)] {
            let (cdf, _) = normal_cdf_pdf(x);
            assert!((x * cdf - want).abs() <= 1e-6, "gelu({x}) = {}", x * cdf);
        }
        for x in [f32::NAN, -f32::NAN] {
            let (cdf, pdf) = normal_cdf_pdf(x);
            assert!((x * cdf).is_nan() && (cdf + x * pdf).is_nan(), "the GELU and its derivative at {x}");
        }
        let (cdf, pdf) = normal_cdf_pdf(f32::NEG_INFINITY);
        assert_eq!((cdf, pdf), (0.0, 0.0));
    }

    #[test]
    fn other_inputs_are_left_to_libtorch() {
        let opts = (Kind::Float, Device::Cpu);
        let pre = Tensor::zeros([4, 8], (Kind::BFloat16, Device::Cpu));
        let bias = Tensor::zeros([8], opts);
        assert!(bias_gelu(&pre, &bias, 1).is_some());
        assert!(bias_gelu(&pre.to_kind(Kind::Float), &bias, 1).is_some_and(|out| out.kind() == Kind::Float));
        assert!(bias_gelu(&pre.to_kind(Kind::Double), &bias, 1).is_none());
        assert!(bias_gelu(&pre, &bias.to_kind(Kind::BFloat16), 1).is_none());
        assert!(bias_gelu(&Tensor::zeros([8, 4], (Kind::BFloat16, Device::Cpu)).transpose(0, 1), &bias, 1).is_none());
        assert!(bias_gelu(&pre, &Tensor::zeros([4], opts), 1).is_none());
    }
}
