//! SwiGLU's gate, `silu(g) u`, forward and backward in one pass each, from the gate and up
//! projections' product taken as one matrix multiply (`[rows, 2f]`, the gate's `f` columns
//! first).
//!
//! Under bf16 libtorch runs `silu` (one pass, rounded to bf16), the product with `u` (another,
//! rounded again), and in the backward two products, `silu_backward` and the sum of the two
//! projections' input gradients: five passes and as many temporaries. Here the forward reads each
//! row once and writes `silu(g) u` rounded once; the backward reads the product and the output's
//! gradient once and writes both halves' gradients. The sigmoid takes one exponential
//! (`exp_for_bf16`, about 3e-6 relative), in fp32.

use std::ops::Range;

use tch::{Device, Kind, Tensor};

use super::{bf16_to_f32, cpu_contiguous, exp_for_bf16, f32_to_bf16, parallel_rows, SharedMut};

/// The rows a thread takes at the least.
const MIN_ROWS_PER_THREAD: usize = 16;

/// `silu(g) u` of `gate_up` `[.., 2f]` bf16 (`g` its first `f` columns, `u` the rest), as bf16
/// `[.., f]`. `None` when the input is not what the kernel handles (not contiguous bf16 on the
/// CPU, or an odd width): the caller takes libtorch's ops.
pub fn swiglu_bf16(gate_up: &Tensor, n_threads: usize) -> Option<Tensor> {
    let (rows, f) = fits(gate_up)?;
    let mut shape = gate_up.size();
    *shape.last_mut().expect("fits checked the width") = f as i64;
    let out = Tensor::empty(shape.as_slice(), (Kind::BFloat16, Device::Cpu));
    // SAFETY: `gate_up` is a contiguous bf16 CPU tensor of rows x 2f values (checked by `fits`),
    // alive for this scope; `out` was just allocated and nothing else refers to it.
    let (x, out_all) = unsafe {
        (
            std::slice::from_raw_parts(gate_up.data_ptr() as *const u16, rows * 2 * f),
            SharedMut::new(out.data_ptr() as *mut u16, rows * f),
        )
    };
    parallel_rows(rows, n_threads, MIN_ROWS_PER_THREAD, |range: Range<usize>| {
        // SAFETY: `parallel_rows` hands out disjoint ranges of rows.
        let out = unsafe { out_all.slice(range.start * f..range.end * f) };
        forward_dispatch(&x[range.start * 2 * f..range.end * 2 * f], f, out);
    });
    Some(out)
}

/// The gradient with respect to `gate_up` of a `swiglu_bf16` forward, given `grad_out` (bf16,
/// of the forward's output shape), as bf16 of `gate_up`'s shape. Panics when the tensors do not
/// fit the forward's (a caller's bug, not bad data).
pub fn swiglu_bf16_backward(grad_out: &Tensor, gate_up: &Tensor, n_threads: usize) -> Tensor {
    let (rows, f) = fits(gate_up).expect("swiglu_bf16_backward: the forward's input");
    let grad_out = grad_out.contiguous();
    assert!(
        grad_out.kind() == Kind::BFloat16 && grad_out.numel() == rows * f,
        "swiglu_bf16_backward: grad_out {:?} {:?}",
        grad_out.kind(),
        grad_out.size()
    );
    let grad = Tensor::empty(gate_up.size(), (Kind::BFloat16, Device::Cpu));
    // SAFETY: contiguous CPU tensors of the kinds and lengths checked above, alive for this
    // scope; `grad` is new and only written here.
    let (g, x, dx_all) = unsafe {
        (
            std::slice::from_raw_parts(grad_out.data_ptr() as *const u16, rows * f),
            std::slice::from_raw_parts(gate_up.data_ptr() as *const u16, rows * 2 * f),
            SharedMut::new(grad.data_ptr() as *mut u16, rows * 2 * f),
        )
    };
    parallel_rows(rows, n_threads, MIN_ROWS_PER_THREAD, |range: Range<usize>| {
        let span = range.start * 2 * f..range.end * 2 * f;
        // SAFETY: disjoint row ranges, as in the forward.
        let dx = unsafe { dx_all.slice(span.clone()) };
        backward_dispatch(&g[range.start * f..range.end * f], &x[span], f, dx);
    });
    grad
}

/// Rows and `f` when `gate_up` is contiguous bf16 on the CPU with an even, non-zero width.
fn fits(gate_up: &Tensor) -> Option<(usize, usize)> {
    let width = *gate_up.size().last()?;
    if !cpu_contiguous(gate_up, Kind::BFloat16) || width == 0 || width % 2 != 0 {
        return None;
    }
    Some((gate_up.numel() / width as usize, width as usize / 2))
}

simd_dispatch! {
    fn forward_dispatch(x: &[u16], f: usize, out: &mut [u16]) => forward_rows
}

simd_dispatch! {
    fn backward_dispatch(g: &[u16], x: &[u16], f: usize, dx: &mut [u16]) => backward_rows
}

/// `sigmoid(x)` from one exponential of `-|x|` (which never overflows). A NaN gives some number;
/// both callers multiply by `x`, which carries the NaN.
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    let e = exp_for_bf16(-x.abs());
    let r = 1.0 / (1.0 + e);
    if x >= 0.0 {
        r
    } else {
        e * r
    }
}

/// Each value: `silu(g) u = g sigmoid(g) u`.
#[inline(always)]
fn forward_rows(x: &[u16], f: usize, out: &mut [u16]) {
    for (row, out) in x.chunks_exact(2 * f).zip(out.chunks_exact_mut(f)) {
        let (gate, up) = row.split_at(f);
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            let g = bf16_to_f32(g);
            *o = f32_to_bf16(g * sigmoid(g) * bf16_to_f32(u));
        }
    }
}

/// Each value, with `s = sigmoid(g)`: `dg = dy u s (1 + g (1 - s))`, `du = dy g s`.
#[inline(always)]
fn backward_rows(dy: &[u16], x: &[u16], f: usize, dx: &mut [u16]) {
    for ((dy, row), dx) in dy.chunks_exact(f).zip(x.chunks_exact(2 * f)).zip(dx.chunks_exact_mut(2 * f)) {
        let (gate, up) = row.split_at(f);
        let (dgate, dup) = dx.split_at_mut(f);
        for ((((&dy, &g), &u), dg), du) in dy.iter().zip(gate).zip(up).zip(dgate.iter_mut()).zip(dup.iter_mut()) {
            let (dy, g, u) = (bf16_to_f32(dy), bf16_to_f32(g), bf16_to_f32(u));
            let s = sigmoid(g);
            let silu = g * s;
            *dg = f32_to_bf16(dy * u * (s + silu * (1.0 - s)));
            *du = f32_to_bf16(dy * silu);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In f64 from the same bf16 values, rounded to bf16 as the kernel's outputs are.
    fn reference(gate_up: &Tensor, grad: &Tensor) -> [Tensor; 2] {
        let x = gate_up.to_kind(Kind::Double).detach().set_requires_grad(true);
        let f = x.size()[1] / 2;
        let out = x.narrow(1, 0, f).silu() * x.narrow(1, f, f);
        (&out * grad.to_kind(Kind::Double)).sum(Kind::Double).backward();
        [out.detach().to_kind(Kind::BFloat16), x.grad().to_kind(Kind::BFloat16)]
    }

    /// Within one bf16 ulp of the larger, or 1e-6 absolute.
    fn close_in_bf16(got: &Tensor, want: &Tensor, what: &str) {
        let (got, want) = (got.to_kind(Kind::Float), want.to_kind(Kind::Float));
        let bound = want.abs().maximum(&got.abs()) * (2.0f64.powi(-7) * 1.01) + 1e-6;
        let excess = ((&got - &want).abs() - bound).max().double_value(&[]);
        assert!(excess <= 0.0, "{what} differs by more than a bf16 ulp: {excess}");
        let equal = got.eq_tensor(&want).to_kind(Kind::Float).mean(Kind::Float).double_value(&[]);
        assert!(equal >= 0.97, "only {equal} of {what} equal the f64 reference's rounding");
    }

    fn check(rows: i64, f: i64, spread: f64, n_threads: usize) {
        let opts = (Kind::Float, Device::Cpu);
        let gate_up = (Tensor::randn([rows, 2 * f], opts) * spread).to_kind(Kind::BFloat16);
        let grad = Tensor::randn([rows, f], opts).to_kind(Kind::BFloat16);
        let [want_out, want_dx] = reference(&gate_up, &grad);
        let out = swiglu_bf16(&gate_up, n_threads).expect("bf16 on the CPU");
        assert_eq!((out.kind(), out.size()), (Kind::BFloat16, vec![rows, f]));
        close_in_bf16(&out, &want_out, "the forward");
        let dx = swiglu_bf16_backward(&grad, &gate_up, n_threads);
        assert_eq!(dx.size(), vec![rows, 2 * f]);
        close_in_bf16(&dx, &want_dx, "the gradient");
    }

    #[test]
    fn swiglu_matches_f64_forward_and_backward() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        tch::manual_seed(23);
        check(128, 512, 1.0, 1);
        check(128, 512, 1.0, 3);
        // Wide values (saturated sigmoids), a width off the lanes, fewer rows than threads.
        check(19, 100, 8.0, 4);
        check(3, 2048, 0.05, 2);
    }

    #[test]
    fn nan_stays_nan_and_other_inputs_are_left_to_libtorch() {
        let x = Tensor::from_slice(&[f32::NAN, 1.0, 2.0, f32::NAN]).view([1, 4]).to_kind(Kind::BFloat16);
        let out = swiglu_bf16(&x, 1).unwrap().to_kind(Kind::Float);
        assert!(out.isnan().all().int64_value(&[]) == 1, "{out}");
        let bf16 = (Kind::BFloat16, Device::Cpu);
        assert!(swiglu_bf16(&Tensor::zeros([4, 6], (Kind::Float, Device::Cpu)), 1).is_none());
        assert!(swiglu_bf16(&Tensor::zeros([4, 5], bf16), 1).is_none());
        assert!(swiglu_bf16(&Tensor::zeros([6, 4], bf16).transpose(0, 1), 1).is_none());
    }
}
