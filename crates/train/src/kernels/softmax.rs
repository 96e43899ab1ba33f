//! The causal softmax of bf16 attention scores, forward and backward, in place.
//!
//! libtorch's bf16-math attention adds a `[seq, seq]` mask of -inf above the diagonal to the scores
//! (`baddbmm`: the mask, expanded to every head, is first copied into the output, one pass over
//! the scores), takes `softmax` over every key of every row, masked or not, and in the backward runs
//! `softmax_backward` over the whole square. The kernel takes the unscaled scores of a plain `bmm`
//! and, per row, only the keys the row sees: it scales, takes the maximum, the exponentials (kept
//! in an fp32 scratch row) and their sum, and writes the probabilities over the scores, zeros
//! beyond the diagonal. The backward reads the probabilities and their gradient once and writes the
//! scores' gradient (times the scale) over the latter. The arithmetic is fp32
//! (`precision::FP32_OPS`); rows are split across threads by matrix, so the results do not depend
//! on the thread count.
//!
//! `prefix_softmax_bf16` is the same over whole matrices whose row `r` sees the keys
//! `0..lengths[r]`: every mask of the vla family (none in its tower; in its backbone the prefix
//! sees the prefix, the chunk everything, and under its instruction loss each instruction token
//! the frames and the tokens up to its own) is such a per-row count.

use tch::{Device, Kind, Tensor};

use super::{bf16_to_f32, exp_nonpositive, f32_to_bf16, parallel_rows, SharedMut, LANES};

/// One query block of a causal attention's score buffer: `heads` matrices of `rows` x `cols` bf16,
/// one after another from element `offset`; row `r` is query `first + r`, which sees keys
/// `0..=first + r` (at most `cols` of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CausalBlock {
    pub first: usize,
    pub rows: usize,
    pub cols: usize,
    pub offset: usize,
}

impl CausalBlock {
    /// The blocks of a context of `seq` split into query blocks of `rows` (0, or at least `seq`:
    /// one block, the whole square), each against keys up to its last query, laid out one after
    /// another for `heads` matrices each; with the buffer's total length.
    pub fn layout(seq: usize, rows: usize, heads: usize) -> (Vec<CausalBlock>, usize) {
        let rows = if rows == 0 || rows >= seq { seq } else { rows };
        let mut blocks = Vec::with_capacity(seq.div_ceil(rows.max(1)));
        let mut offset = 0;
        let mut first = 0;
        while first < seq {
            let len = rows.min(seq - first);
            let cols = first + len;
            blocks.push(CausalBlock { first, rows: len, cols, offset });
            offset += heads * len * cols;
            first += len;
        }
        (blocks, offset)
    }

    fn len(&self, heads: usize) -> usize {
        heads * self.rows * self.cols
    }

    /// This block's `heads` matrices in `buffer`, `[heads, rows, cols]`.
    pub fn matrices(&self, buffer: &Tensor, heads: usize) -> Tensor {
        buffer.narrow(0, self.offset as i64, self.len(heads) as i64).view([
            heads as i64,
            self.rows as i64,
            self.cols as i64,
        ])
    }
}

/// The fewest matrices a thread takes: below it a thread's start costs more than its share.
const MIN_MATRICES_PER_THREAD: usize = 4;

/// Checks that `buffer` is a contiguous bf16 CPU tensor that holds `blocks` of `heads` matrices.
fn fits(buffer: &Tensor, blocks: &[CausalBlock], heads: usize) -> bool {
    buffer.kind() == Kind::BFloat16
        && buffer.device() == Device::Cpu
        && buffer.is_contiguous()
        && blocks.iter().all(|b| b.offset + b.len(heads) <= buffer.numel() && b.cols >= b.first + b.rows)
}

/// Runs `work(block, matrix data range)` for every matrix of every block, the matrices split
/// across `n_threads` head-major (each thread takes whole heads' runs of every block, so the
/// longer last blocks are shared out evenly).
fn for_each_matrix(blocks: &[CausalBlock], heads: usize, n_threads: usize, work: impl Fn(&CausalBlock, usize) + Sync) {
    let n_blocks = blocks.len();
    parallel_rows(heads * n_blocks, n_threads, MIN_MATRICES_PER_THREAD, |range| {
        for item in range {
            let (head, block) = (item / n_blocks, &blocks[item % n_blocks]);
            work(block, block.offset + head * block.rows * block.cols);
        }
    });
}

/// Which keys each row of a matrix sees: `0..valid(r)`.
#[derive(Clone, Copy)]
enum Keys<'a> {
    /// Row `r` is query `first + r` of a causal attention.
    Causal { first: usize },
    /// Row `r` sees `lengths[r]` keys.
    Lengths(&'a [usize]),
}

impl Keys<'_> {
    #[inline(always)]
    fn valid(&self, r: usize, cols: usize) -> usize {
        match self {
            Keys::Causal { first } => (first + r + 1).min(cols),
            Keys::Lengths(lengths) => lengths[r].min(cols),
        }
    }
}

/// Checks that `buffer` is a contiguous bf16 CPU tensor `[n, rows, cols]` with `rows` the number
/// of `lengths`, each length between 1 and `cols`; gives `(n, cols)`.
fn fits_prefix(buffer: &Tensor, lengths: &[usize]) -> Option<(usize, usize)> {
    let (n, rows, cols) = buffer.size3().ok()?;
    let ok = buffer.kind() == Kind::BFloat16
        && buffer.device() == Device::Cpu
        && buffer.is_contiguous()
        && rows as usize == lengths.len()
        && lengths.iter().all(|&l| l >= 1 && l <= cols as usize);
    ok.then_some((n as usize, cols as usize))
}

/// Softmax over the first `lengths[r]` keys of each row `r` of every matrix of `scores` (`[n,
/// rows, cols]` bf16, the unscaled products of queries and keys) times `scale`, written over
/// `scores`, zeros beyond. Panics when the buffer is not that (a caller's bug).
pub fn prefix_softmax_bf16(scores: &Tensor, lengths: &[usize], scale: f32, n_threads: usize) {
    let (n, cols) = fits_prefix(scores, lengths).expect("prefix_softmax_bf16: scores are [n, rows, cols] bf16");
    let size = lengths.len() * cols;
    // SAFETY: a contiguous bf16 CPU tensor of `n * size` elements (checked above), alive for
    // this call; the threads write disjoint matrices of it.
    let all = unsafe { SharedMut::new(scores.data_ptr() as *mut u16, n * size) };
    parallel_rows(n, n_threads, MIN_MATRICES_PER_THREAD, |range| {
        for m in range {
            // SAFETY: each matrix is handed to one thread only.
            let matrix = unsafe { all.slice(m * size..(m + 1) * size) };
            forward_dispatch(matrix, Keys::Lengths(lengths), cols, scale);
        }
    });
}

/// The gradient of `prefix_softmax_bf16`'s input (the unscaled scores) given its output `probs`
/// and the output's gradient `grad`, written over `grad`, as `causal_softmax_backward_bf16`'s.
pub fn prefix_softmax_backward_bf16(probs: &Tensor, grad: &Tensor, lengths: &[usize], scale: f32, n_threads: usize) {
    let shape = fits_prefix(probs, lengths).expect("prefix_softmax_backward_bf16: probs are [n, rows, cols] bf16");
    assert!(
        fits_prefix(grad, lengths) == Some(shape),
        "prefix_softmax_backward_bf16: the gradient is not the probabilities' shape"
    );
    let (n, cols) = shape;
    let size = lengths.len() * cols;
    // SAFETY: contiguous bf16 CPU tensors of `n * size` elements (checked above), alive for this
    // call; `probs` is only read, and the threads write disjoint matrices of `grad`.
    let (probs, all) = unsafe {
        (
            std::slice::from_raw_parts(probs.data_ptr() as *const u16, n * size),
            SharedMut::new(grad.data_ptr() as *mut u16, n * size),
        )
    };
    parallel_rows(n, n_threads, MIN_MATRICES_PER_THREAD, |range| {
        for m in range {
            let span = m * size..(m + 1) * size;
            // SAFETY: each matrix is handed to one thread only.
            let grad = unsafe { all.slice(span.clone()) };
            backward_dispatch(&probs[span], grad, Keys::Lengths(lengths), cols, scale);
        }
    });
}

/// Softmax over the keys each query sees, of `scores` times `scale`, written over `scores`
/// (zeros beyond the diagonal). Panics when the buffer does not hold the blocks (a caller's bug).
pub fn causal_softmax_bf16(scores: &Tensor, blocks: &[CausalBlock], heads: usize, scale: f32, n_threads: usize) {
    assert!(fits(scores, blocks, heads), "causal_softmax_bf16: the score buffer does not hold the blocks");
    // SAFETY: a contiguous bf16 CPU tensor of `numel` elements (checked above), alive for this
    // call; the threads write disjoint matrices of it.
    let all = unsafe { SharedMut::new(scores.data_ptr() as *mut u16, scores.numel()) };
    for_each_matrix(blocks, heads, n_threads, |block, start| {
        // SAFETY: each matrix is handed to one thread only.
        let matrix = unsafe { all.slice(start..start + block.rows * block.cols) };
        forward_dispatch(matrix, Keys::Causal { first: block.first }, block.cols, scale);
    });
}

/// The gradient of `causal_softmax_bf16`'s input (the unscaled scores) given its output `probs`
/// and the output's gradient `grad`, written over `grad`: per row `scale x p x (g - <g, p>)` over
/// the keys the row sees, zeros beyond. Panics when a buffer does not hold the blocks.
pub fn causal_softmax_backward_bf16(
    probs: &Tensor,
    grad: &Tensor,
    blocks: &[CausalBlock],
    heads: usize,
    scale: f32,
    n_threads: usize,
) {
    assert!(fits(probs, blocks, heads), "causal_softmax_backward_bf16: the probabilities do not hold the blocks");
    assert!(fits(grad, blocks, heads), "causal_softmax_backward_bf16: the gradient does not hold the blocks");
    // SAFETY: contiguous bf16 CPU tensors (checked above), alive for this call; `probs` is only
    // read, and the threads write disjoint matrices of `grad`.
    let (probs, all) = unsafe {
        (
            std::slice::from_raw_parts(probs.data_ptr() as *const u16, probs.numel()),
            SharedMut::new(grad.data_ptr() as *mut u16, grad.numel()),
        )
    };
    for_each_matrix(blocks, heads, n_threads, |block, start| {
        let range = start..start + block.rows * block.cols;
        // SAFETY: each matrix is handed to one thread only.
        let grad = unsafe { all.slice(range.clone()) };
        backward_dispatch(&probs[range], grad, Keys::Causal { first: block.first }, block.cols, scale);
    });
}

simd_dispatch! {
    /// `forward_matrix` for the best instruction set this CPU has.
    fn forward_dispatch(matrix: &mut [u16], keys: Keys<'_>, cols: usize, scale: f32) => forward_matrix
}

#[inline(always)]
fn forward_matrix(matrix: &mut [u16], keys: Keys<'_>, cols: usize, scale: f32) {
    let mut scratch = vec![0f32; cols.next_multiple_of(LANES)];
    for (r, row) in matrix.chunks_exact_mut(cols).enumerate() {
        let valid = keys.valid(r, cols);
        let padded = valid.next_multiple_of(LANES);
        for (s, &b) in scratch.iter_mut().zip(&row[..valid]) {
            *s = bf16_to_f32(b) * scale;
        }
        for s in &mut scratch[valid..padded] {
            *s = f32::NEG_INFINITY;
        }
        let mut maxima = [f32::NEG_INFINITY; LANES];
        for chunk in scratch[..padded].chunks_exact(LANES) {
            for (m, &x) in maxima.iter_mut().zip(chunk) {
                *m = if x > *m { x } else { *m };
            }
        }
        let max = maxima.iter().fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
        let mut sums = [0f32; LANES];
        for chunk in scratch[..padded].chunks_exact_mut(LANES) {
            for (s, x) in sums.iter_mut().zip(chunk) {
                *x = exp_nonpositive(*x - max);
                *s += *x;
            }
        }
        let inverse = 1.0 / sums.iter().sum::<f32>();
        for (o, &e) in row[..valid].iter_mut().zip(&scratch[..valid]) {
            *o = f32_to_bf16(e * inverse);
        }
        row[valid..].fill(0);
    }
}

simd_dispatch! {
    /// `backward_matrix` for the best instruction set this CPU has.
    fn backward_dispatch(probs: &[u16], grad: &mut [u16], keys: Keys<'_>, cols: usize, scale: f32) => backward_matrix
}

#[inline(always)]
fn backward_matrix(probs: &[u16], grad: &mut [u16], keys: Keys<'_>, cols: usize, scale: f32) {
    let width = cols.next_multiple_of(LANES);
    let (mut p32, mut g32) = (vec![0f32; width], vec![0f32; width]);
    for (r, (p_row, g_row)) in probs.chunks_exact(cols).zip(grad.chunks_exact_mut(cols)).enumerate() {
        let valid = keys.valid(r, cols);
        let padded = valid.next_multiple_of(LANES);
        for ((p, g), (&pb, &gb)) in p32.iter_mut().zip(g32.iter_mut()).zip(p_row[..valid].iter().zip(&g_row[..valid])) {
            *p = bf16_to_f32(pb);
            *g = bf16_to_f32(gb);
        }
        p32[valid..padded].fill(0.0);
        g32[valid..padded].fill(0.0);
        let mut dots = [0f32; LANES];
        for (pc, gc) in p32[..padded].chunks_exact(LANES).zip(g32[..padded].chunks_exact(LANES)) {
            for ((d, &p), &g) in dots.iter_mut().zip(pc).zip(gc) {
                *d += p * g;
            }
        }
        let dot: f32 = dots.iter().sum();
        for ((o, &p), &g) in g_row[..valid].iter_mut().zip(&p32[..valid]).zip(&g32[..valid]) {
            *o = f32_to_bf16(scale * (p * (g - dot)));
        }
        g_row[valid..].fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// libtorch's ops on the bf16 values, in fp32 (the kernel's arithmetic; the model's libtorch
    /// path rounds the scaled scores to bf16 first, in `baddbmm`, which changes nothing when the
    /// scale is a power of two, as with a head size of 64): the masked scores times the scale and
    /// `softmax`, rounded to bf16; `_softmax_backward_data` from those bf16 probabilities (what
    /// autograd saves) and `grad`, times the scale: the gradient of the unscaled scores.
    fn reference(scores: &Tensor, first: i64, scale: f64, grad: &Tensor) -> (Tensor, Tensor) {
        let (_, rows, cols) = scores.size3().unwrap();
        let mask =
            Tensor::full([cols, cols], f64::NEG_INFINITY, (Kind::Float, Device::Cpu)).triu(1).narrow(0, first, rows);
        masked_reference(scores, &mask, scale, grad)
    }

    /// `reference` under the additive mask `mask` `[rows, cols]` (0 or -inf).
    fn masked_reference(scores: &Tensor, mask: &Tensor, scale: f64, grad: &Tensor) -> (Tensor, Tensor) {
        let (heads, rows, cols) = scores.size3().unwrap();
        let probs = (mask.expand([heads, rows, cols], false) + scores.to_kind(Kind::Float) * scale)
            .softmax(-1, None)
            .to_kind(Kind::BFloat16);
        let p = probs.to_kind(Kind::Float);
        let grad = Tensor::internal_softmax_backward_data(&grad.to_kind(Kind::Float), &p, -1, Kind::Float) * scale;
        (probs, grad)
    }

    /// At most `ulps` bf16 ulps (2^-8 relative) of the larger magnitude in `want` apart: both
    /// round fp32 values to bf16 from slightly different fp32 values.
    fn close(got: &Tensor, want: &Tensor, ulps: f64, what: &str) {
        let (got, want) = (got.to_kind(Kind::Float), want.to_kind(Kind::Float));
        let bound = (want.abs().max() * 2.0f64.powi(-8) * ulps * 1.01).double_value(&[]);
        let worst = (&got - &want).abs().max().double_value(&[]);
        assert!(worst <= bound, "{what}: differs by {worst} (bound {bound})");
    }

    fn check(seq: usize, rows: usize, heads: usize, scale: f32, n_threads: usize) {
        let (blocks, total) = CausalBlock::layout(seq, rows, heads);
        let buffer = (Tensor::randn([total as i64], (Kind::Float, Device::Cpu)) * 3.0).to_kind(Kind::BFloat16);
        let upstream = Tensor::randn([total as i64], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
        let view = |t: &Tensor, b: &CausalBlock| b.matrices(t, heads);
        let wants: Vec<(Tensor, Tensor)> = blocks
            .iter()
            .map(|b| reference(&view(&buffer, b), b.first as i64, scale as f64, &view(&upstream, b)))
            .collect();
        let probs = buffer.copy();
        causal_softmax_bf16(&probs, &blocks, heads, scale, n_threads);
        let grad = upstream.copy();
        causal_softmax_backward_bf16(&probs, &grad, &blocks, heads, scale, n_threads);
        for (b, (want_p, want_g)) in blocks.iter().zip(&wants) {
            let case = format!("seq {seq}, rows {rows}, block at {}", b.first);
            close(&view(&probs, b), want_p, 1.0, &format!("{case}: probabilities"));
            // Masked entries are exact zeros on both sides.
            let masked = want_p.eq(0.0).logical_and(&view(&probs, b).ne(0.0)).any().int64_value(&[]);
            assert_eq!(masked, 0, "{case}: a key beyond the diagonal got a probability");
            // The backward's inputs differ where the probabilities did, by one bf16 ulp.
            close(&view(&grad, b), want_g, 2.0, &format!("{case}: gradient"));
        }
    }

    #[test]
    fn causal_softmax_matches_libtorch_forward_and_backward() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        tch::manual_seed(11);
        // The whole square, one thread and several.
        check(64, 0, 6, 0.125, 1);
        check(64, 64, 6, 0.125, 3);
        // Query blocks, the last shorter; a scale that is not a power of two; a width that is not a
        // multiple of the lanes.
        check(100, 32, 5, 0.17, 2);
        check(37, 16, 3, 1.0, 4);
    }

    /// Per-row key counts (the vla's masks: everything; a prefix and a chunk; a causal run in the
    /// middle) against libtorch's masked softmax, forward and backward, on one thread and several.
    #[test]
    fn prefix_softmax_matches_libtorch_forward_and_backward() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        tch::manual_seed(12);
        let (heads, rows) = (7usize, 37usize);
        let whole = vec![rows; rows];
        let prefix: Vec<usize> = (0..rows).map(|r| if r < 29 { 29 } else { rows }).collect();
        let causal_middle: Vec<usize> = (0..rows)
            .map(|r| {
                if r < 10 {
                    10
                } else if r < 20 {
                    r + 1
                } else if r < 29 {
                    29
                } else {
                    rows
                }
            })
            .collect();
        for (lengths, scale, n_threads) in [(&whole, 0.125f32, 1), (&prefix, 0.17, 3), (&causal_middle, 1.0, 2)] {
            let f32s = (Kind::Float, Device::Cpu);
            let scores = (Tensor::randn([heads as i64, rows as i64, rows as i64], f32s) * 3.0).to_kind(Kind::BFloat16);
            let upstream = Tensor::randn([heads as i64, rows as i64, rows as i64], f32s).to_kind(Kind::BFloat16);
            let seen: Vec<f32> = lengths
                .iter()
                .flat_map(|&l| (0..rows).map(move |c| if c < l { 0.0 } else { f32::NEG_INFINITY }))
                .collect();
            let mask = Tensor::from_slice(&seen).view([rows as i64, rows as i64]);
            let (want_p, want_g) = masked_reference(&scores, &mask, scale as f64, &upstream);
            let probs = scores.copy();
            prefix_softmax_bf16(&probs, lengths, scale, n_threads);
            let grad = upstream.copy();
            prefix_softmax_backward_bf16(&probs, &grad, lengths, scale, n_threads);
            close(&probs, &want_p, 1.0, "probabilities");
            let masked = want_p.eq(0.0).logical_and(&probs.ne(0.0)).any().int64_value(&[]);
            assert_eq!(masked, 0, "a key beyond a row's count got a probability");
            close(&grad, &want_g, 2.0, "gradient");
        }
    }

    #[test]
    fn layout_covers_the_causal_triangle_once() {
        let (blocks, total) = CausalBlock::layout(10, 4, 2);
        let want = [
            CausalBlock { first: 0, rows: 4, cols: 4, offset: 0 },
            CausalBlock { first: 4, rows: 4, cols: 8, offset: 32 },
            CausalBlock { first: 8, rows: 2, cols: 10, offset: 96 },
        ];
        assert_eq!(blocks, want);
        assert_eq!(total, 136);
        assert_eq!(CausalBlock::layout(10, 0, 2).0, vec![CausalBlock { first: 0, rows: 10, cols: 10, offset: 0 }]);
    }
}
