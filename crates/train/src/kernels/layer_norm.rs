//! LayerNorm of the fp32 residual stream straight into bf16, and its backward with the residual's
//! gradient added in the same pass.
//!
//! Under bf16 the model normalizes in fp32 (`precision::FP32_OPS`) and casts the result to bf16
//! for the next linear layer. libtorch runs that as `layer_norm` (an fp32 output and its row
//! statistics) and a cast; its backward as the cast's (bf16 gradient to fp32), `layer_norm`'s
//! backward, and the add of the residual branch's gradient: five passes over `[rows, d]` and two
//! fp32 temporaries. The forward kernel reads each row once from memory (the second look at it
//! hits L1) and writes bf16; the backward reads the bf16 gradient and the fp32 input once and
//! writes the input's gradient, adding the residual's in place, while it sums the weight's and
//! bias's gradients per thread. The arithmetic is fp32, as libtorch's; the rows are split across
//! threads in contiguous runs, so the per-row results do not depend on the thread count (the
//! weight's and bias's sums do, by their order of addition).
//!
//! `rms_norm_bf16` is the same kernel for RMSNorm (the llama family's): the mean taken as 0, so
//! the statistic is the mean square, and no bias.

use std::ops::Range;

use tch::{Device, Kind, Tensor};

use super::{add_partial_sums, bf16_to_f32, cpu_contiguous, f32_to_bf16, parallel_rows, Bits, SharedMut, LANES};

/// An element the kernels read or write: bf16 (as its bits) or fp32, with the SIMD dispatch of
/// each pass for it.
trait Elem: Bits {
    #[allow(clippy::too_many_arguments)]
    fn forward(
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        eps: f32,
        centered: bool,
        out: &mut [Self],
        mean: &mut [f32],
        rstd: &mut [f32],
    );
}

impl Elem for u16 {
    fn forward(
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        eps: f32,
        centered: bool,
        out: &mut [u16],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) {
        forward_dispatch(x, gamma, beta, eps, centered, out, mean, rstd)
    }
}

impl Elem for f32 {
    fn forward(
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        eps: f32,
        centered: bool,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) {
        forward_dispatch_f32(x, gamma, beta, eps, centered, out, mean, rstd)
    }
}

/// What the backward needs of a forward besides its input: each row's mean and 1/std.
pub struct LayerNormStats {
    mean: Vec<f32>,
    rstd: Vec<f32>,
    /// False for an RMSNorm: the mean is not subtracted (and `mean` holds zeros).
    centered: bool,
}

/// The rows a thread takes at the least: below it a thread's start costs more than its share.
const MIN_ROWS_PER_THREAD: usize = 64;

/// `x` `[.., d]` fp32, normalized over its last dimension with `weight` and `bias` `[d]` fp32 and
/// `eps`, as bf16 of `x`'s shape; with the row statistics for `layer_norm_bf16_backward`. `None`
/// when the inputs are not what the kernel handles (not contiguous fp32 on the CPU, or shapes
/// that do not fit): the caller takes libtorch's ops.
pub fn layer_norm_bf16(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    n_threads: usize,
) -> Option<(Tensor, LayerNormStats)> {
    norm_into::<u16>(x, weight, Some(bias), eps, n_threads)
}

/// `layer_norm_bf16` with an fp32 output (an fp32 run's): the same statistics and backward
/// (`layer_norm_bf16_backward` takes the fp32 gradient).
pub fn layer_norm_f32(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    n: usize,
) -> Option<(Tensor, LayerNormStats)> {
    norm_into::<f32>(x, weight, Some(bias), eps, n)
}

/// RMSNorm of `x` `[.., d]` fp32 over its last dimension with `weight` `[d]` fp32 and `eps`
/// (`x / sqrt(mean(x^2) + eps) * weight`), as bf16 of `x`'s shape; with the row statistics for
/// `rms_norm_bf16_backward`. `None` as for `layer_norm_bf16`.
pub fn rms_norm_bf16(x: &Tensor, weight: &Tensor, eps: f64, n_threads: usize) -> Option<(Tensor, LayerNormStats)> {
    norm_into::<u16>(x, weight, None, eps, n_threads)
}

/// `rms_norm_bf16` with an fp32 output (an fp32 run's): the same statistics and backward
/// (`rms_norm_bf16_backward` takes the fp32 gradient), one pass instead of libtorch's five ops
/// and the product it keeps for its backward.
pub fn rms_norm_f32(x: &Tensor, weight: &Tensor, eps: f64, n_threads: usize) -> Option<(Tensor, LayerNormStats)> {
    norm_into::<f32>(x, weight, None, eps, n_threads)
}

/// The forward into elements `O`: with `bias`, LayerNorm; without, RMSNorm.
fn norm_into<O: Elem>(
    x: &Tensor,
    weight: &Tensor,
    bias: Option<&Tensor>,
    eps: f64,
    n_threads: usize,
) -> Option<(Tensor, LayerNormStats)> {
    let d = *x.size().last()?;
    if !cpu_contiguous(x, Kind::Float) || !cpu_contiguous(weight, Kind::Float) || d == 0 {
        return None;
    }
    if weight.size() != [d] || bias.is_some_and(|b| !cpu_contiguous(b, Kind::Float) || b.size() != [d]) {
        return None;
    }
    let centered = bias.is_some();
    let d = d as usize;
    let rows = x.numel() / d;
    let out = Tensor::empty(x.size(), (O::KIND, Device::Cpu));
    let mut stats = LayerNormStats { mean: vec![0.0; rows], rstd: vec![0.0; rows], centered };
    let zeros;
    // SAFETY: all three are contiguous fp32 CPU tensors of the lengths given (checked above),
    // alive for this scope; `out` was just allocated and nothing else refers to it yet.
    let (x, gamma, beta, out_all) = unsafe {
        let beta = match bias {
            Some(bias) => std::slice::from_raw_parts(bias.data_ptr() as *const f32, d),
            None => {
                zeros = vec![0f32; d];
                zeros.as_slice()
            }
        };
        (
            std::slice::from_raw_parts(x.data_ptr() as *const f32, rows * d),
            std::slice::from_raw_parts(weight.data_ptr() as *const f32, d),
            beta,
            SharedMut::new(out.data_ptr() as *mut O, rows * d),
        )
    };
    let (mean_all, rstd_all) = (SharedMut::of(&mut stats.mean), SharedMut::of(&mut stats.rstd));
    parallel_rows(rows, n_threads, MIN_ROWS_PER_THREAD, |range: Range<usize>| {
        // SAFETY: `parallel_rows` hands out disjoint ranges of rows, so these slices of the
        // outputs do not overlap between threads.
        let (out, mean, rstd) = unsafe {
            (
                out_all.slice(range.start * d..range.end * d),
                mean_all.slice(range.clone()),
                rstd_all.slice(range.clone()),
            )
        };
        O::forward(&x[range.start * d..range.end * d], gamma, beta, eps as f32, centered, out, mean, rstd);
    });
    Some((out, stats))
}

/// The gradient with respect to `x` of a `layer_norm_bf16` forward, given `grad_out` (bf16, of
/// `x`'s shape), added to `residual` (fp32, of `x`'s shape) in place, which is returned; without
/// `residual`, a new tensor. The weight's and bias's gradients are added to `weight_grad` and
/// `bias_grad` (fp32 `[d]`, e.g. the parameters' views of the flat gradient buffer). With
/// `copy = Some((copy, copy_sums))` the same pass also gives what the 16-bit linear layer before
/// the norm's input needs for its own backward: the returned gradient rounded to bf16 (into
/// `copy`, bf16 of `x`'s shape) and that copy's sums over the rows in fp32 (that layer's bias
/// gradient, added to `copy_sums`, fp32 `[d]`), where a cast and a sum each took a pass of their
/// own. Panics when the tensors do not fit the forward's (a caller's bug, not bad data).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_bf16_backward(
    grad_out: &Tensor,
    x: &Tensor,
    stats: &LayerNormStats,
    weight: &Tensor,
    residual: Option<Tensor>,
    weight_grad: &Tensor,
    bias_grad: &Tensor,
    copy: Option<(&Tensor, &Tensor)>,
    n_threads: usize,
) -> Tensor {
    assert!(stats.centered, "layer_norm_bf16_backward of an RMSNorm's statistics");
    norm_bf16_backward(grad_out, x, stats, weight, residual, Some(weight_grad), Some(bias_grad), copy, n_threads)
}

/// The gradient with respect to `x` of an `rms_norm_bf16` or `rms_norm_f32` forward (`grad_out`
/// bf16 or fp32, as its output), as `layer_norm_bf16_backward` gives it; the weight's gradient is
/// added to `weight_grad` when given (none for a frozen weight).
pub fn rms_norm_bf16_backward(
    grad_out: &Tensor,
    x: &Tensor,
    stats: &LayerNormStats,
    weight: &Tensor,
    residual: Option<Tensor>,
    weight_grad: Option<&Tensor>,
    n_threads: usize,
) -> Tensor {
    assert!(!stats.centered, "rms_norm_bf16_backward of a LayerNorm's statistics");
    norm_bf16_backward(grad_out, x, stats, weight, residual, weight_grad, None, None, n_threads)
}

#[allow(clippy::too_many_arguments)]
fn norm_bf16_backward(
    grad_out: &Tensor,
    x: &Tensor,
    stats: &LayerNormStats,
    weight: &Tensor,
    residual: Option<Tensor>,
    weight_grad: Option<&Tensor>,
    bias_grad: Option<&Tensor>,
    emit: Option<(&Tensor, &Tensor)>,
    n_threads: usize,
) -> Tensor {
    let d = *x.size().last().expect("a forward's input has a last dimension") as usize;
    let rows = stats.mean.len();
    let grad_out = grad_out.contiguous();
    let bf16 = grad_out.kind() == Kind::BFloat16;
    assert!(
        (bf16 || grad_out.kind() == Kind::Float) && grad_out.size() == x.size(),
        "layer_norm_bf16_backward: grad_out"
    );
    assert!(cpu_contiguous(x, Kind::Float) && x.numel() == rows * d, "layer_norm_bf16_backward: x");
    assert!(cpu_contiguous(weight, Kind::Float) && weight.numel() == d, "layer_norm_bf16_backward: weight");
    for grad in weight_grad.iter().chain(bias_grad.iter()) {
        assert!(grad.kind() == Kind::Float && grad.numel() == d, "layer_norm_bf16_backward: parameter gradient");
    }
    if let Some((copy, sums)) = emit {
        assert!(
            cpu_contiguous(copy, Kind::BFloat16) && copy.size() == x.size(),
            "layer_norm_bf16_backward: the gradient's bf16 copy"
        );
        assert!(sums.kind() == Kind::Float && sums.numel() == d, "layer_norm_bf16_backward: the copy's sums");
    }
    let accumulate = residual.is_some();
    let dx = match residual {
        Some(residual) => {
            assert!(
                cpu_contiguous(&residual, Kind::Float) && residual.size() == x.size(),
                "layer_norm_bf16_backward: residual"
            );
            residual
        }
        None => Tensor::empty(x.size(), (Kind::Float, Device::Cpu)),
    };
    // SAFETY: contiguous CPU tensors of the kinds and lengths asserted above, alive for this
    // scope; `dx` is the caller's residual gradient handed over, or new, and only written here.
    // The address as a number, which threads may share; each reads its own rows through it.
    let g_addr = grad_out.data_ptr() as usize;
    let (x, gamma, dx_all) = unsafe {
        (
            std::slice::from_raw_parts(x.data_ptr() as *const f32, rows * d),
            std::slice::from_raw_parts(weight.data_ptr() as *const f32, d),
            SharedMut::new(dx.data_ptr() as *mut f32, rows * d),
        )
    };
    // SAFETY: `copy` was checked contiguous bf16 of `rows * d` elements; the threads write
    // disjoint rows of it.
    let copy_all = emit.map(|(copy, _)| unsafe { SharedMut::new(copy.data_ptr() as *mut u16, rows * d) });
    let centered = stats.centered;
    let partials = parallel_rows(rows, n_threads, MIN_ROWS_PER_THREAD, |range: Range<usize>| {
        let mut dgamma = vec![0f32; d];
        let mut dbeta = vec![0f32; d];
        let mut sums = vec![0f32; if copy_all.is_some() { d } else { 0 }];
        let span = range.start * d..range.end * d;
        // SAFETY: disjoint row ranges, as in the forward.
        let dx = unsafe { dx_all.slice(span.clone()) };
        // SAFETY: as above.
        let copy = copy_all.as_ref().map_or(&mut [][..], |c| unsafe { c.slice(span.clone()) });
        let emit = Emit { copy, sums: &mut sums };
        let (mean, rstd) = (&stats.mean[range.clone()], &stats.rstd[range]);
        // SAFETY: `grad_out` is a contiguous tensor of `rows * d` elements of the kind `bf16`
        // says, alive for this scope; this thread reads its own rows.
        if bf16 {
            let g = unsafe { std::slice::from_raw_parts((g_addr as *const u16).add(span.start), span.len()) };
            backward_dispatch(g, &x[span], mean, rstd, gamma, centered, accumulate, dx, &mut dgamma, &mut dbeta, emit);
        } else {
            let g = unsafe { std::slice::from_raw_parts((g_addr as *const f32).add(span.start), span.len()) };
            backward_dispatch_f32(
                g,
                &x[span],
                mean,
                rstd,
                gamma,
                centered,
                accumulate,
                dx,
                &mut dgamma,
                &mut dbeta,
                emit,
            );
        }
        (dgamma, dbeta, sums)
    });
    if let Some(weight_grad) = weight_grad {
        add_partial_sums(weight_grad, d, partials.iter().map(|(g, _, _)| g.as_slice()));
    }
    if let Some(bias_grad) = bias_grad {
        add_partial_sums(bias_grad, d, partials.iter().map(|(_, b, _)| b.as_slice()));
    }
    if let Some((_, copy_sums)) = emit {
        add_partial_sums(copy_sums, d, partials.iter().map(|(_, _, s)| s.as_slice()));
    }
    dx
}

simd_dispatch! {
    #[allow(clippy::too_many_arguments)]
    fn forward_dispatch(
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        eps: f32,
        centered: bool,
        out: &mut [u16],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) => forward_rows
}

simd_dispatch! {
    #[allow(clippy::too_many_arguments)]
    fn forward_dispatch_f32(
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        eps: f32,
        centered: bool,
        out: &mut [f32],
        mean: &mut [f32],
        rstd: &mut [f32],
    ) => forward_rows
}

/// `sum_j f(a_j, b_j, c_j)` over three rows of one length, in `LANES` partial sums (which the
/// compiler keeps in vector registers), then the tail.
#[inline(always)]
fn lane_sum3<A: Copy, B: Copy, C: Copy>(a: &[A], b: &[B], c: &[C], f: impl Fn(A, B, C) -> f32) -> f32 {
    let mut sums = [0f32; LANES];
    let (ac, bc, cc) = (a.chunks_exact(LANES), b.chunks_exact(LANES), c.chunks_exact(LANES));
    let (ar, br, cr) = (ac.remainder(), bc.remainder(), cc.remainder());
    for ((a, b), c) in ac.zip(bc).zip(cc) {
        for (((s, &a), &b), &c) in sums.iter_mut().zip(a).zip(b).zip(c) {
            *s += f(a, b, c);
        }
    }
    let mut total: f32 = sums.iter().sum();
    for ((&a, &b), &c) in ar.iter().zip(br).zip(cr) {
        total += f(a, b, c);
    }
    total
}

/// Each row: its mean (0 when not `centered`), then the mean of its squared deviations (two
/// passes; the second reads the row from L1), `rstd = 1 / sqrt(var + eps)`, and the bf16 of `(x -
/// mean) rstd gamma + beta`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn forward_rows<O: Elem>(
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    eps: f32,
    centered: bool,
    out: &mut [O],
    mean: &mut [f32],
    rstd: &mut [f32],
) {
    let d = gamma.len();
    for (((row, out), mean), rstd) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)).zip(mean).zip(rstd) {
        let mu = if centered { lane_sum3(row, row, row, |v, _, _| v) / d as f32 } else { 0.0 };
        let var = lane_sum3(row, row, row, |v, _, _| (v - mu) * (v - mu)) / d as f32;
        let rs = 1.0 / (var + eps).sqrt();
        for (((o, &v), &w), &b) in out.iter_mut().zip(row).zip(gamma).zip(beta) {
            *o = O::store((v - mu) * rs * w + b);
        }
        (*mean, *rstd) = (mu, rs);
    }
}

simd_dispatch! {
    #[allow(clippy::too_many_arguments)]
    fn backward_dispatch(
        g: &[u16],
        x: &[f32],
        mean: &[f32],
        rstd: &[f32],
        gamma: &[f32],
        centered: bool,
        accumulate: bool,
        dx: &mut [f32],
        dgamma: &mut [f32],
        dbeta: &mut [f32],
        emit: Emit<'_>,
    ) => backward_rows
}

simd_dispatch! {
    #[allow(clippy::too_many_arguments)]
    fn backward_dispatch_f32(
        g: &[f32],
        x: &[f32],
        mean: &[f32],
        rstd: &[f32],
        gamma: &[f32],
        centered: bool,
        accumulate: bool,
        dx: &mut [f32],
        dgamma: &mut [f32],
        dbeta: &mut [f32],
        emit: Emit<'_>,
    ) => backward_rows
}

/// Each row, with `xhat = (x - mean) rstd` and `gg = g gamma`: `dx = rstd (gg - mean(gg) - xhat
/// mean(gg xhat))` (without the `mean(gg)` term when not `centered`: the mean was not subtracted),
/// added to what `dx` holds when `accumulate`; `dgamma += g xhat`, `dbeta += g`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn backward_rows<G: Elem>(
    g: &[G],
    x: &[f32],
    mean: &[f32],
    rstd: &[f32],
    gamma: &[f32],
    centered: bool,
    accumulate: bool,
    dx: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
    emit: Emit<'_>,
) {
    let d = gamma.len();
    let inv_d = 1.0 / d as f32;
    let (dgamma, dbeta) = (&mut dgamma[..d], &mut dbeta[..d]);
    for (i, ((((g, x), dx), &mu), &rs)) in
        g.chunks_exact(d).zip(x.chunks_exact(d)).zip(dx.chunks_exact_mut(d)).zip(mean).zip(rstd).enumerate()
    {
        let a = if centered { lane_sum3(g, gamma, x, |g, w, _| g.load() * w) * inv_d } else { 0.0 };
        let b = lane_sum3(g, gamma, x, |g, w, x| g.load() * w * ((x - mu) * rs)) * inv_d;
        let terms = g.iter().zip(x).zip(gamma).zip(dx.iter_mut()).zip(dgamma.iter_mut()).zip(dbeta.iter_mut());
        for (((((&g, &x), &w), dx), dw), db) in terms {
            let (g, xhat) = (g.load(), (x - mu) * rs);
            let grad = rs * (g * w - a - xhat * b);
            *dx = if accumulate { *dx + grad } else { grad };
            *dw += g * xhat;
            *db += g;
        }
        if !emit.copy.is_empty() {
            // The row just written, from L1: its bf16 and that bf16's sums.
            for ((c, s), &v) in emit.copy[i * d..(i + 1) * d].iter_mut().zip(emit.sums.iter_mut()).zip(&*dx) {
                *c = f32_to_bf16(v);
                *s += bf16_to_f32(*c);
            }
        }
    }
}

/// What `backward_rows` also writes of the gradient it gives: its bf16 (`copy`, empty for
/// none) and that bf16's sums over the rows (`sums`, `[d]`).
struct Emit<'a> {
    copy: &'a mut [u16],
    sums: &'a mut [f32],
}

#[cfg(test)]
mod tests {
    use super::*;

    /// libtorch's path, as the model runs it without the kernel: fp32 LayerNorm, cast to bf16;
    /// backward from `grad` through both, plus `residual` added to the input's gradient.
    fn reference(x: &Tensor, w: &Tensor, b: &Tensor, grad: &Tensor, residual: &Tensor) -> [Tensor; 4] {
        let (x, w, b) = (
            x.detach().set_requires_grad(true),
            w.detach().set_requires_grad(true),
            b.detach().set_requires_grad(true),
        );
        let d = *x.size().last().unwrap();
        let out = x.layer_norm([d], Some(&w), Some(&b), 1e-5, true).to_kind(Kind::BFloat16);
        out.view([-1]).dot(&grad.view([-1])).backward();
        [out.detach(), x.grad() + residual, w.grad(), b.grad()]
    }

    fn check(shape: &[i64], n_threads: usize) {
        let opts = (Kind::Float, Device::Cpu);
        let d = *shape.last().unwrap();
        // Rows with an offset and a scale of their own, as a residual stream has.
        let x = Tensor::randn(shape, opts) * 3.0 + Tensor::randn([d], opts);
        let (w, b) = (Tensor::randn([d], opts) * 0.5 + 1.0, Tensor::randn([d], opts) * 0.1);
        let grad = Tensor::randn(shape, opts).to_kind(Kind::BFloat16);
        let residual = Tensor::randn(shape, opts);
        let [want_out, want_dx, want_dw, want_db] = reference(&x, &w, &b, &grad, &residual);

        let (out, stats) = layer_norm_bf16(&x, &w, &b, 1e-5, n_threads).expect("fp32 contiguous on the CPU");
        assert_eq!(out.kind(), Kind::BFloat16);
        assert_eq!(out.size(), shape);
        let (got, want) = (out.to_kind(Kind::Float), want_out.to_kind(Kind::Float));
        // The fp32 values differ by rounding, so a result may land on the neighbouring bf16
        // value: one bf16 ulp, 2^-8 to 2^-7 of the value.
        let excess = ((&got - &want).abs() - want.abs() * (2.0f64.powi(-7) * 1.01)).max().double_value(&[]);
        assert!(excess <= 1e-6, "forward differs by more than a bf16 ulp (shape {shape:?}): {excess}");
        let exact = got.eq_tensor(&want).to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
        assert!(exact >= 0.98, "only {exact} of the outputs equal libtorch's (shape {shape:?})");

        // The parameters' gradients are added to what their buffers hold.
        let start_w = Tensor::full([d], 2.0, opts);
        let (dw, db) = (start_w.copy(), Tensor::zeros([d], opts));
        let dx = layer_norm_bf16_backward(&grad, &x, &stats, &w, Some(residual.copy()), &dw, &db, None, n_threads);
        let rel = |got: &Tensor, want: &Tensor| ((got - want).abs().max() / want.abs().max()).double_value(&[]);
        assert!(rel(&dx, &want_dx) <= 1e-5, "dx (shape {shape:?}): {}", rel(&dx, &want_dx));
        assert!(
            rel(&(&dw - &start_w), &want_dw) <= 1e-4,
            "dweight (shape {shape:?}): {}",
            rel(&(&dw - &start_w), &want_dw)
        );
        assert!(rel(&db, &want_db) <= 1e-4, "dbias (shape {shape:?}): {}", rel(&db, &want_db));
        // Without a residual the input's gradient is the LayerNorm's alone.
        let (dw2, db2) = (Tensor::zeros([d], opts), Tensor::zeros([d], opts));
        let alone = layer_norm_bf16_backward(&grad, &x, &stats, &w, None, &dw2, &db2, None, n_threads);
        assert!(rel(&alone, &(&want_dx - &residual)) <= 1e-5, "dx without residual (shape {shape:?})");
        // With the copy: the same gradient, its bf16 to the bit, and that bf16's sums over the
        // rows added to what the sums' buffer holds.
        let (dw3, db3, copy) =
            (Tensor::zeros([d], opts), Tensor::zeros([d], opts), Tensor::empty(shape, (Kind::BFloat16, Device::Cpu)));
        let start_sums = Tensor::full([d], -1.0, opts);
        let sums = start_sums.copy();
        let with_copy = layer_norm_bf16_backward(
            &grad,
            &x,
            &stats,
            &w,
            Some(residual.copy()),
            &dw3,
            &db3,
            Some((&copy, &sums)),
            n_threads,
        );
        assert!(with_copy.equal(&dx) && dw3.equal(&dw2) && db3.equal(&db2), "the gradients with the copy");
        assert!(copy.equal(&dx.to_kind(Kind::BFloat16)), "the copy is the gradient's bf16 (shape {shape:?})");
        let want_sums = copy.to_kind(Kind::Float).view([-1, d]).sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
        assert!(rel(&(&sums - &start_sums), &want_sums) <= 1e-5, "the copy's sums (shape {shape:?})");
    }

    #[test]
    fn layer_norm_matches_libtorch_forward_and_backward() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        tch::manual_seed(11);
        check(&[4, 64, 256], 1);
        check(&[4, 64, 256], 3);
        // A width that is not a multiple of the lanes, fewer rows than threads would take.
        check(&[3, 7, 100], 4);
        check(&[2, 384], 2);
    }

    #[test]
    fn rms_norm_matches_libtorch_forward_and_backward() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        tch::manual_seed(12);
        let opts = (Kind::Float, Device::Cpu);
        for (shape, n_threads) in [(&[4i64, 64, 256][..], 3), (&[3, 7, 100][..], 4), (&[2, 384][..], 1)] {
            let d = *shape.last().unwrap();
            let x = Tensor::randn(shape, opts) * 3.0 + Tensor::randn([d], opts);
            let w = Tensor::randn([d], opts) * 0.5 + 1.0;
            let grad = Tensor::randn(shape, opts).to_kind(Kind::BFloat16);
            let residual = Tensor::randn(shape, opts);
            // libtorch's ops as the llama family runs them: fp32 RMSNorm, then the cast.
            let (xl, wl) = (x.detach().set_requires_grad(true), w.detach().set_requires_grad(true));
            let ms = xl.square().mean_dim([-1i64].as_slice(), true, Kind::Float);
            let want = (&xl * (ms + 1e-5).rsqrt() * &wl).to_kind(Kind::BFloat16);
            want.view([-1]).dot(&grad.view([-1])).backward();

            let (out, stats) = rms_norm_bf16(&x, &w, 1e-5, n_threads).expect("fp32 contiguous on the CPU");
            let (got, want) = (out.to_kind(Kind::Float), want.detach().to_kind(Kind::Float));
            let excess = ((&got - &want).abs() - want.abs() * (2.0f64.powi(-7) * 1.01)).max().double_value(&[]);
            assert!(excess <= 1e-6, "forward differs by more than a bf16 ulp (shape {shape:?}): {excess}");
            let start_w = Tensor::full([d], 2.0, opts);
            let dw = start_w.copy();
            let dx = rms_norm_bf16_backward(&grad, &x, &stats, &w, Some(residual.copy()), Some(&dw), n_threads);
            let rel = |got: &Tensor, want: &Tensor| ((got - want).abs().max() / want.abs().max()).double_value(&[]);
            assert!(rel(&dx, &(xl.grad() + &residual)) <= 1e-5, "dx (shape {shape:?})");
            assert!(rel(&(&dw - &start_w), &wl.grad()) <= 1e-4, "dweight (shape {shape:?})");
            // A frozen weight: no gradient of its own, the same input gradient.
            let alone = rms_norm_bf16_backward(&grad, &x, &stats, &w, None, None, n_threads);
            assert!(rel(&alone, &xl.grad()) <= 1e-5, "dx without residual (shape {shape:?})");
        }
    }

    #[test]
    fn rms_norm_into_fp32_matches_libtorch() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        tch::manual_seed(13);
        let opts = (Kind::Float, Device::Cpu);
        let (shape, d) = ([3i64, 5, 100], 100);
        let x = Tensor::randn(shape, opts) * 3.0 + Tensor::randn([d], opts);
        let w = Tensor::randn([d], opts) * 0.5 + 1.0;
        let grad = Tensor::randn(shape, opts);
        let (xl, wl) = (x.detach().set_requires_grad(true), w.detach().set_requires_grad(true));
        let ms = xl.square().mean_dim([-1i64].as_slice(), true, Kind::Float);
        let want = &xl * (ms + 1e-5).rsqrt() * &wl;
        want.view([-1]).dot(&grad.view([-1])).backward();
        let (out, stats) = rms_norm_f32(&x, &w, 1e-5, 3).expect("fp32 contiguous on the CPU");
        assert_eq!(out.kind(), Kind::Float);
        let rel = |got: &Tensor, want: &Tensor| ((got - want).abs().max() / want.abs().max()).double_value(&[]);
        assert!(rel(&out, &want.detach()) <= 1e-6, "forward: {}", rel(&out, &want.detach()));
        let dw = Tensor::zeros([d], opts);
        let dx = rms_norm_bf16_backward(&grad, &x, &stats, &w, None, Some(&dw), 3);
        assert!(rel(&dx, &xl.grad()) <= 1e-5, "dx: {}", rel(&dx, &xl.grad()));
        assert!(rel(&dw, &wl.grad()) <= 1e-5, "dweight: {}", rel(&dw, &wl.grad()));
    }

    #[test]
    fn other_inputs_are_left_to_libtorch() {
        let opts = (Kind::Float, Device::Cpu);
        let (w, b) = (Tensor::ones([8], opts), Tensor::zeros([8], opts));
        let x = Tensor::randn([4, 8], opts);
        assert!(layer_norm_bf16(&x, &w, &b, 1e-5, 1).is_some());
        assert!(layer_norm_bf16(&x.to_kind(Kind::BFloat16), &w, &b, 1e-5, 1).is_none());
        assert!(layer_norm_bf16(&Tensor::randn([8, 4], opts).transpose(0, 1), &w, &b, 1e-5, 1).is_none());
        assert!(layer_norm_bf16(&x, &Tensor::ones([4], opts), &b, 1e-5, 1).is_none());
    }
}
