//! The fused CPU update's machinery, shared by AdamW, LAMB and SGD: the slices of one parameter
//! in every flat buffer, the passes dealt across threads, sums of squares that do not depend on
//! the machine, and AdamW's element loop (compiled for AVX2 with FMA and for the baseline, and a
//! variant that saves the old values from the registers it loads them into).

use std::ops::Range;

use tch::{Kind, Tensor};

use crate::params::FlatParams;

/// Which arithmetic runs the update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateKernel {
    /// One fused, threaded Rust pass per parameter slice on a CPU (falls back to `TensorOps` on a
    /// GPU).
    Fused,
    /// A chain of libtorch tensor ops over the range (what PyTorch's default AdamW does on a CPU).
    TensorOps,
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
                        lr_scale: e.lr_scale,
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
    /// The parameter's factor on the learning rate (`ParamEntry::lr_scale`).
    pub(crate) lr_scale: f64,
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
pub(super) fn sum_of_squared_differences(a: &[f32], b: &[f32]) -> f64 {
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
    tensor_sq_sum_kept(t, offset).double_value(&[])
}

/// `tensor_sq_sum` left on the tensor's device as a 0-dim f64 tensor (nothing read to the host):
/// the same reductions added in the same order, so reading it gives the same bits.
pub(crate) fn tensor_sq_sum_kept(t: &Tensor, offset: i64) -> Tensor {
    let n = t.size1().expect("tensor_sq_sum takes a 1-D tensor");
    tch::no_grad(|| {
        let head = ((SQ_SUM_CHUNK - offset.rem_euclid(SQ_SUM_CHUNK)) % SQ_SUM_CHUNK).min(n);
        let body = (n - head) / SQ_SUM_CHUNK * SQ_SUM_CHUNK;
        let f64_sum = |part: Tensor| part.to_kind(Kind::Double).square().sum(Kind::Double);
        let mut sum = Tensor::zeros([], (Kind::Double, t.device()));
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
pub(super) const SAVE_BLOCK: usize = 1 << 14;

/// The scalars of one parameter's update.
pub(super) struct UpdateConsts {
    pub(super) clip: f32,
    pub(super) w1: f32,
    pub(super) w2: f32,
    pub(super) inv_sqrt_bc2: f32,
    pub(super) eps: f32,
    pub(super) decay: f32,
    pub(super) step_size: f32,
}

/// AdamW on one parameter's slices, and the gradient cleared. Compiled twice on x86-64: for the
/// baseline (SSE2) and for AVX2 with FMA, picked at run time.
pub(super) fn update(g: &mut [f32], p: &mut [f32], m: &mut [f32], v: &mut [f32], k: &UpdateConsts) {
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
pub(super) enum RegisterSave {
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
pub(super) unsafe fn update_saving(
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
pub(super) fn saves_in_registers(rooms: [*mut f32; 3]) -> Option<RegisterSave> {
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
pub(super) fn f32_bytes(values: &[f32]) -> &[u8] {
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
