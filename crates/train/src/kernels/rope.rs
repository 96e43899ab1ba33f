//! Rotary position embeddings on the product of the q, k and v projections taken as one matrix
//! multiply, forward and backward in one pass each.
//!
//! The product is `[batch, seq, q heads + 2 kv heads, head_dim]`. The forward rotates the q and k
//! heads by position (each head's two halves as the real and imaginary parts of `head_dim / 2`
//! complex numbers, Hugging Face's `rotate_half` layout) and writes q, k and v each in the
//! `[batch, heads, seq, head_dim]` layout attention takes; the backward rotates the gradients
//! back (the rotation's transpose) into the product's layout. Under bf16 libtorch's path casts the
//! tables, takes the halves, negates one, concatenates, multiplies twice and adds (each rounded to
//! bf16), and its backward as many again, for q and k, plus the layout's copies. Here the
//! arithmetic is fp32 with fp32 tables, rounded once.

use std::ops::Range;

use tch::{Device, Kind, Tensor};

use super::{bf16_to_f32, cpu_contiguous, f32_to_bf16, parallel_rows, SharedMut};

/// The (batch, position) rows a thread takes at the least.
const MIN_ROWS_PER_THREAD: usize = 8;

/// The layout of a product `[batch, seq, n_q + 2 n_kv, head_dim]`.
#[derive(Clone, Copy)]
struct Dims {
    seq: usize,
    n_q: usize,
    n_kv: usize,
    head_dim: usize,
}

impl Dims {
    fn heads(&self) -> usize {
        self.n_q + 2 * self.n_kv
    }

    /// The half tables `(cos, sin)` of row `row`'s position (`batch x seq + position`).
    fn tables_at<'t>(&self, row: usize, cos: &'t [f32], sin: &'t [f32]) -> (&'t [f32], &'t [f32]) {
        let at = (row % self.seq) * self.head_dim;
        let half = self.head_dim / 2;
        (&cos[at..at + half], &sin[at..at + half])
    }

    /// Where head `h` of row `row` (`batch x seq + position`) sits in its `[batch, heads, seq,
    /// head_dim]` output (q, k or v) and which output that is.
    fn target(&self, row: usize, h: usize) -> (usize, usize) {
        let (b, s) = (row / self.seq, row % self.seq);
        let (which, head, n) = if h < self.n_q {
            (0, h, self.n_q)
        } else if h < self.n_q + self.n_kv {
            (1, h - self.n_q, self.n_kv)
        } else {
            (2, h - self.n_q - self.n_kv, self.n_kv)
        };
        (which, ((b * n + head) * self.seq + s) * self.head_dim)
    }
}

/// q, k and v of `qkv` `[batch, seq, n_q + 2 n_kv, head_dim]` (bf16), q and k rotated by
/// position with `cos` and `sin` (`[>= seq, head_dim]` fp32, each row's two halves equal), each
/// `[batch, heads, seq, head_dim]` bf16. `None` when the inputs are not what the kernel handles
/// (not contiguous bf16 and fp32 on the CPU, an odd head width, tables too short): the caller
/// takes libtorch's ops.
pub fn rope_split_bf16(
    qkv: &Tensor,
    n_q: usize,
    n_kv: usize,
    cos: &Tensor,
    sin: &Tensor,
    n_threads: usize,
) -> Option<(Tensor, Tensor, Tensor)> {
    let (batch, dims) = fits(qkv, n_q, n_kv, cos, sin)?;
    let hd = dims.head_dim as i64;
    let out = |n: usize| Tensor::empty([batch as i64, n as i64, dims.seq as i64, hd], (Kind::BFloat16, Device::Cpu));
    let (q, k, v) = (out(n_q), out(n_kv), out(n_kv));
    let rows = batch * dims.seq;
    let width = dims.heads() * dims.head_dim;
    // SAFETY: `qkv`, `cos` and `sin` are contiguous CPU tensors of the kinds and lengths `fits`
    // checked, alive for this scope; q, k and v were just allocated, and each (row, head) writes
    // its own `head_dim` values (`Dims::target` is one to one).
    let (x, c, s, outs) = unsafe {
        (
            std::slice::from_raw_parts(qkv.data_ptr() as *const u16, rows * width),
            std::slice::from_raw_parts(cos.data_ptr() as *const f32, dims.seq * dims.head_dim),
            std::slice::from_raw_parts(sin.data_ptr() as *const f32, dims.seq * dims.head_dim),
            [&q, &k, &v].map(|t| SharedMut::new(t.data_ptr() as *mut u16, t.numel())),
        )
    };
    parallel_rows(rows, n_threads, MIN_ROWS_PER_THREAD, |range: Range<usize>| {
        forward_dispatch(&x[range.start * width..range.end * width], range.start, &dims, c, s, &outs);
    });
    Some((q, k, v))
}

/// The gradient with respect to `qkv` of a `rope_split_bf16` forward with the same tables, from
/// the gradients of q, k and v (bf16, the forward's shapes), as bf16 `[batch, seq, n_q + 2 n_kv,
/// head_dim]`. Panics when the tensors do not fit (a caller's bug).
pub fn rope_split_bf16_backward(
    dq: &Tensor,
    dk: &Tensor,
    dv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    n_threads: usize,
) -> Tensor {
    let [b, n_q, seq, hd] = dq.size()[..] else { panic!("rope_split_bf16_backward: dq {:?}", dq.size()) };
    let n_kv = dk.size()[1];
    let (dq, dk, dv) = (dq.contiguous(), dk.contiguous(), dv.contiguous());
    for (t, n) in [(&dq, n_q), (&dk, n_kv), (&dv, n_kv)] {
        assert!(
            cpu_contiguous(t, Kind::BFloat16) && t.size() == [b, n, seq, hd],
            "rope_split_bf16_backward: a gradient of {:?} {:?}",
            t.kind(),
            t.size()
        );
    }
    let grad = Tensor::empty([b, seq, n_q + 2 * n_kv, hd], (Kind::BFloat16, Device::Cpu));
    let (_, dims) = fits(&grad, n_q as usize, n_kv as usize, cos, sin).expect("rope_split_bf16_backward: the tables");
    let rows = (b * seq) as usize;
    let width = dims.heads() * dims.head_dim;
    // SAFETY: as in the forward, the other way: the gradients are read, `grad` (new) is written,
    // each row its own `width` values.
    let (c, s, ins, out_all) = unsafe {
        (
            std::slice::from_raw_parts(cos.data_ptr() as *const f32, dims.seq * dims.head_dim),
            std::slice::from_raw_parts(sin.data_ptr() as *const f32, dims.seq * dims.head_dim),
            [&dq, &dk, &dv].map(|t| std::slice::from_raw_parts(t.data_ptr() as *const u16, t.numel())),
            SharedMut::new(grad.data_ptr() as *mut u16, rows * width),
        )
    };
    parallel_rows(rows, n_threads, MIN_ROWS_PER_THREAD, |range: Range<usize>| {
        // SAFETY: `parallel_rows` hands out disjoint ranges of rows.
        let out = unsafe { out_all.slice(range.start * width..range.end * width) };
        backward_dispatch(&ins, range.start, &dims, c, s, out);
    });
    grad
}

/// The batch and layout when `qkv` is contiguous bf16 `[batch, seq, n_q + 2 n_kv, head_dim]` on
/// the CPU with an even head width and the tables contiguous fp32 `[>= seq, head_dim]`.
fn fits(qkv: &Tensor, n_q: usize, n_kv: usize, cos: &Tensor, sin: &Tensor) -> Option<(usize, Dims)> {
    let [batch, seq, heads, head_dim] = qkv.size()[..] else { return None };
    let tables_fit = [cos, sin]
        .iter()
        .all(|t| cpu_contiguous(t, Kind::Float) && t.dim() == 2 && t.size()[1] == head_dim && t.size()[0] >= seq);
    if !cpu_contiguous(qkv, Kind::BFloat16) || !tables_fit || head_dim % 2 != 0 || heads as usize != n_q + 2 * n_kv {
        return None;
    }
    let dims = Dims { seq: seq as usize, n_q, n_kv, head_dim: head_dim as usize };
    Some((batch as usize, dims))
}

simd_dispatch! {
    fn forward_dispatch(x: &[u16], first_row: usize, dims: &Dims, cos: &[f32], sin: &[f32], outs: &[SharedMut<u16>; 3]) => forward_rows
}

simd_dispatch! {
    fn backward_dispatch(ins: &[&[u16]; 3], first_row: usize, dims: &Dims, cos: &[f32], sin: &[f32], out: &mut [u16]) => backward_rows
}

/// One head's two halves `x = [a, b]` rotated into `y` by the position's `c` and `s` (the half
/// tables): `[a c - b s, b c + a s]` with `direction` 1, the transpose (`[a c + b s, b c - a s]`,
/// the backward's) with -1.
#[inline(always)]
fn rotate(x: &[u16], y: &mut [u16], c: &[f32], s: &[f32], direction: f32) {
    let half = x.len() / 2;
    let (x1, x2) = x.split_at(half);
    let (y1, y2) = y.split_at_mut(half);
    for j in 0..half {
        let (a, b) = (bf16_to_f32(x1[j]), bf16_to_f32(x2[j]));
        let sine = direction * s[j];
        y1[j] = f32_to_bf16(a * c[j] - b * sine);
        y2[j] = f32_to_bf16(b * c[j] + a * sine);
    }
}

/// Rows `first_row..` of the product (`x`, whole rows): each head to its output, q and k rotated:
/// `y1 = x1 c - x2 s`, `y2 = x2 c + x1 s` over the halves.
#[inline(always)]
fn forward_rows(x: &[u16], first_row: usize, dims: &Dims, cos: &[f32], sin: &[f32], outs: &[SharedMut<u16>; 3]) {
    let hd = dims.head_dim;
    for (i, row) in x.chunks_exact(dims.heads() * hd).enumerate() {
        let row_idx = first_row + i;
        let (c, s) = dims.tables_at(row_idx, cos, sin);
        for (h, head) in row.chunks_exact(hd).enumerate() {
            let (which, at) = dims.target(row_idx, h);
            // SAFETY: `Dims::target` gives each (row, head) its own span (see the callers).
            let out = unsafe { outs[which].slice(at..at + hd) };
            if which == 2 {
                out.copy_from_slice(head);
                continue;
            }
            rotate(head, out, c, s, 1.0);
        }
    }
}

/// Rows `first_row..` of the product's gradient (`out`, whole rows) from q's, k's and v's:
/// `dx1 = dy1 c + dy2 s`, `dx2 = dy2 c - dy1 s`.
#[inline(always)]
fn backward_rows(ins: &[&[u16]; 3], first_row: usize, dims: &Dims, cos: &[f32], sin: &[f32], out: &mut [u16]) {
    let hd = dims.head_dim;
    for (i, row) in out.chunks_exact_mut(dims.heads() * hd).enumerate() {
        let row_idx = first_row + i;
        let (c, s) = dims.tables_at(row_idx, cos, sin);
        for (h, head) in row.chunks_exact_mut(hd).enumerate() {
            let (which, at) = dims.target(row_idx, h);
            let dy = &ins[which][at..at + hd];
            if which == 2 {
                head.copy_from_slice(dy);
                continue;
            }
            rotate(dy, head, c, s, -1.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tables as the llama family's (`[seq, hd]`, the half table twice).
    fn tables(seq: i64, hd: i64) -> (Tensor, Tensor) {
        let inv = Tensor::arange(hd / 2, (Kind::Float, Device::Cpu)).multiply_scalar(-2.0 / hd as f64).exp2() * 0.7;
        let freqs = Tensor::arange(seq, (Kind::Float, Device::Cpu)).unsqueeze(1).matmul(&inv.unsqueeze(0));
        let angles = Tensor::cat(&[&freqs, &freqs], 1);
        (angles.cos(), angles.sin())
    }

    /// `x * cos + rotate_half(x) * sin` in f64 on `[b, heads, seq, hd]`.
    fn rotate(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let half = x.size()[3] / 2;
        let rotated = Tensor::cat(&[&x.narrow(3, half, half).neg(), &x.narrow(3, 0, half)], 3);
        x * cos + rotated * sin
    }

    fn check(b: i64, seq: i64, n_q: i64, n_kv: i64, hd: i64, n_threads: usize) {
        let (cos, sin) = tables(seq + 3, hd);
        let qkv = Tensor::randn([b, seq, n_q + 2 * n_kv, hd], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
        let (q, k, v) = rope_split_bf16(&qkv, n_q as usize, n_kv as usize, &cos, &sin, n_threads).expect("fits");
        let x = qkv.to_kind(Kind::Double).detach().set_requires_grad(true);
        let heads = |from: i64, n: i64| x.narrow(2, from, n).transpose(1, 2);
        let (c, s) = (cos.narrow(0, 0, seq).to_kind(Kind::Double), sin.narrow(0, 0, seq).to_kind(Kind::Double));
        let want = [rotate(&heads(0, n_q), &c, &s), rotate(&heads(n_q, n_kv), &c, &s), heads(n_q + n_kv, n_kv)];
        let bound = |t: &Tensor| t.abs() * 2.0f64.powi(-8) + 1e-6;
        for (got, want) in [&q, &k, &v].iter().zip(&want) {
            assert_eq!(got.size(), want.size());
            let excess = ((got.to_kind(Kind::Double) - want).abs() - bound(want)).max().double_value(&[]);
            assert!(excess <= 0.0, "forward off by {excess}");
        }
        let grads: Vec<Tensor> =
            want.iter().map(|w| Tensor::randn(w.size(), (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16)).collect();
        let total: Tensor = want.iter().zip(&grads).map(|(w, g)| (w * g.to_kind(Kind::Double)).sum(Kind::Double)).sum();
        total.backward();
        let got = rope_split_bf16_backward(&grads[0], &grads[1], &grads[2], &cos, &sin, n_threads);
        let want = x.grad();
        let excess = ((got.to_kind(Kind::Double) - &want).abs() - bound(&want)).max().double_value(&[]);
        assert!(excess <= 0.0, "backward off by {excess}");
    }

    #[test]
    fn rope_split_matches_f64_forward_and_backward() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        tch::manual_seed(29);
        check(2, 16, 4, 2, 8, 1);
        check(2, 16, 4, 2, 8, 3);
        check(3, 7, 6, 6, 64, 2);
        check(1, 1, 2, 1, 4, 4);
    }

    #[test]
    fn other_inputs_are_left_to_libtorch() {
        let (cos, sin) = tables(8, 8);
        let bf16 = (Kind::BFloat16, Device::Cpu);
        assert!(rope_split_bf16(&Tensor::zeros([1, 8, 4, 8], bf16), 2, 1, &cos, &sin, 1).is_some());
        assert!(rope_split_bf16(&Tensor::zeros([1, 8, 4, 8], bf16), 2, 2, &cos, &sin, 1).is_none());
        assert!(rope_split_bf16(&Tensor::zeros([1, 9, 4, 8], bf16), 2, 1, &cos, &sin, 1).is_none());
        assert!(
            rope_split_bf16(&Tensor::zeros([1, 8, 4, 8], (Kind::Float, Device::Cpu)), 2, 1, &cos, &sin, 1).is_none()
        );
    }
}
