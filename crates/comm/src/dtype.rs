//! Element types, reduction operators and the reduction kernels.
//!
//! bf16 and f16 are reduced in f32: every addition widens both sides to f32 and rounds the result
//! once. The direct algorithm sums all ranks' inputs in f32 and rounds once; the ring rounds once
//! per hop, as NCCL's ring does. Sums are taken in rank order, so every rank ends with the same bits.

use half::{bf16, f16};

/// The element type of a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    F16,
    U8,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }

    /// Lower-case name (`f32`, `bf16`, `f16`, `u8`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::U8 => "u8",
        }
    }
}

/// How all-reduce and reduce-scatter combine the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// The sum (u8 wraps around).
    Sum,
    /// The sum divided by the group size (floating-point types only).
    Avg,
}

/// A Rust type that can be communicated: `f32`, `half::bf16`, `half::f16`, `u8`.
pub trait Element: Copy + Send + Sync + 'static + private::Sealed {
    /// The matching [`DType`].
    const DTYPE: DType;
}

mod private {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
    impl Sealed for u8 {}
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;
}
impl Element for bf16 {
    const DTYPE: DType = DType::BF16;
}
impl Element for f16 {
    const DTYPE: DType = DType::F16;
}
impl Element for u8 {
    const DTYPE: DType = DType::U8;
}

/// Elements widened per block in the multi-input kernel (stays in L1).
const BLOCK: usize = 1024;

/// `dst[i] = dst[i] + src[i]` for `count` elements of `dtype`.
///
/// # Safety
/// `dst` and `src` must be valid for `count` elements of `dtype` (reads; writes for `dst`) and may
/// not overlap. Neither needs any alignment.
pub(crate) unsafe fn add_into(dtype: DType, dst: *mut u8, src: *const u8, count: usize) {
    match dtype {
        DType::F32 => {
            // Slot memory is 64-byte aligned and caller buffers of f32 are 4-byte aligned, but the
            // raw API promises nothing, so read unaligned when needed.
            if (dst as usize).is_multiple_of(4) && (src as usize).is_multiple_of(4) {
                // SAFETY: aligned, valid for `count` f32 and non-overlapping (caller's contract).
                let d = unsafe { std::slice::from_raw_parts_mut(dst as *mut f32, count) };
                let s = unsafe { std::slice::from_raw_parts(src as *const f32, count) };
                for (a, b) in d.iter_mut().zip(s) {
                    *a += *b;
                }
            } else {
                for i in 0..count {
                    // SAFETY: in bounds per the caller's contract; unaligned access is explicit.
                    unsafe {
                        let p = (dst as *mut f32).add(i);
                        p.write_unaligned(p.read_unaligned() + (src as *const f32).add(i).read_unaligned());
                    }
                }
            }
        }
        DType::BF16 => unsafe { add_half::<bf16>(dst, src, count, bf16::to_f32, bf16::from_f32) },
        DType::F16 => unsafe { add_half::<f16>(dst, src, count, f16::to_f32, f16::from_f32) },
        DType::U8 => {
            // SAFETY: bytes need no alignment; valid and non-overlapping per the caller.
            let d = unsafe { std::slice::from_raw_parts_mut(dst, count) };
            let s = unsafe { std::slice::from_raw_parts(src, count) };
            for (a, b) in d.iter_mut().zip(s) {
                *a = a.wrapping_add(*b);
            }
        }
    }
}

unsafe fn add_half<H: Copy>(dst: *mut u8, src: *const u8, count: usize, widen: fn(H) -> f32, narrow: fn(f32) -> H) {
    let d = dst as *mut H;
    let s = src as *const H;
    for i in 0..count {
        // SAFETY: in bounds per the caller's contract; 2-byte types read unaligned.
        unsafe {
            let a = widen(d.add(i).read_unaligned());
            let b = widen(s.add(i).read_unaligned());
            d.add(i).write_unaligned(narrow(a + b));
        }
    }
}

/// `out[i] = (sum over k of inputs[k][i]) / divisor`, accumulated in f32 (wrapping u8 sum, no
/// divisor for u8), inputs summed in slice order. `out` may be one of the inputs.
///
/// # Safety
/// Every pointer must be valid for `count` elements of `dtype`; `out` may alias an input but no
/// other overlap is allowed.
pub(crate) unsafe fn sum_inputs(dtype: DType, out: *mut u8, inputs: &[*const u8], count: usize, divisor: Option<f32>) {
    let size = dtype.size();
    if dtype == DType::U8 {
        let mut acc = [0u8; BLOCK];
        let mut start = 0;
        while start < count {
            let n = BLOCK.min(count - start);
            acc[..n].fill(0);
            for &input in inputs {
                for (i, a) in acc[..n].iter_mut().enumerate() {
                    // SAFETY: start + i < count, input valid for count bytes.
                    *a = a.wrapping_add(unsafe { *input.add(start + i) });
                }
            }
            // SAFETY: out valid for count bytes; acc is a local.
            unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), out.add(start), n) };
            start += n;
        }
        return;
    }
    let mut acc = [0f32; BLOCK];
    let mut start = 0;
    while start < count {
        let n = BLOCK.min(count - start);
        // SAFETY (all reads and writes below): element offsets start..start+n are < count.
        unsafe { widen_block(dtype, inputs[0].add(start * size), &mut acc[..n]) };
        for &input in &inputs[1..] {
            unsafe { add_widened(dtype, input.add(start * size), &mut acc[..n]) };
        }
        if let Some(d) = divisor {
            for a in &mut acc[..n] {
                *a /= d;
            }
        }
        unsafe { narrow_block(dtype, &acc[..n], out.add(start * size)) };
        start += n;
    }
}

/// Divides `count` floating-point elements by `divisor` in place (f32 math, one rounding).
///
/// # Safety
/// `ptr` must be valid for reads and writes of `count` elements of `dtype`.
pub(crate) unsafe fn divide(dtype: DType, ptr: *mut u8, count: usize, divisor: f32) {
    let mut acc = [0f32; BLOCK];
    let size = dtype.size();
    let mut start = 0;
    while start < count {
        let n = BLOCK.min(count - start);
        // SAFETY: offsets within count, per the caller's contract.
        unsafe { widen_block(dtype, ptr.add(start * size), &mut acc[..n]) };
        for a in &mut acc[..n] {
            *a /= divisor;
        }
        unsafe { narrow_block(dtype, &acc[..n], ptr.add(start * size)) };
        start += n;
    }
}

unsafe fn widen_block(dtype: DType, src: *const u8, acc: &mut [f32]) {
    for (i, a) in acc.iter_mut().enumerate() {
        // SAFETY: the caller guarantees acc.len() readable elements at src.
        *a = unsafe { load(dtype, src, i) };
    }
}

unsafe fn add_widened(dtype: DType, src: *const u8, acc: &mut [f32]) {
    for (i, a) in acc.iter_mut().enumerate() {
        // SAFETY: as in widen_block.
        *a += unsafe { load(dtype, src, i) };
    }
}

unsafe fn narrow_block(dtype: DType, acc: &[f32], dst: *mut u8) {
    for (i, a) in acc.iter().enumerate() {
        // SAFETY: the caller guarantees acc.len() writable elements at dst.
        unsafe {
            match dtype {
                DType::F32 => (dst as *mut f32).add(i).write_unaligned(*a),
                DType::BF16 => (dst as *mut bf16).add(i).write_unaligned(bf16::from_f32(*a)),
                DType::F16 => (dst as *mut f16).add(i).write_unaligned(f16::from_f32(*a)),
                DType::U8 => unreachable!("u8 is summed without widening"),
            }
        }
    }
}

#[inline(always)]
unsafe fn load(dtype: DType, src: *const u8, i: usize) -> f32 {
    // SAFETY: the caller guarantees element i is readable.
    unsafe {
        match dtype {
            DType::F32 => (src as *const f32).add(i).read_unaligned(),
            DType::BF16 => (src as *const bf16).add(i).read_unaligned().to_f32(),
            DType::F16 => (src as *const f16).add(i).read_unaligned().to_f32(),
            DType::U8 => f32::from(*src.add(i)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_sum_rounds_once_in_f32() {
        // 256 + 1 + 1 is 258 in f32; bf16 has 8 bits of mantissa, so adding 1 twice in bf16 would
        // leave 256, while one rounding of 258 gives 258.
        let a = [bf16::from_f32(256.0)];
        let b = [bf16::from_f32(1.0)];
        let c = [bf16::from_f32(1.0)];
        let mut out = [bf16::ZERO];
        let inputs = [a.as_ptr() as *const u8, b.as_ptr() as *const u8, c.as_ptr() as *const u8];
        // SAFETY: all buffers hold one bf16.
        unsafe { sum_inputs(DType::BF16, out.as_mut_ptr() as *mut u8, &inputs, 1, None) };
        assert_eq!(out[0].to_f32(), 258.0);
    }

    #[test]
    fn u8_sum_wraps_and_avg_divides() {
        let mut a = [250u8, 3];
        let b = [10u8, 4];
        // SAFETY: two bytes each.
        unsafe { add_into(DType::U8, a.as_mut_ptr(), b.as_ptr(), 2) };
        assert_eq!(a, [4, 7]);
        let mut f = [3.0f32, 5.0];
        // SAFETY: two f32.
        unsafe { divide(DType::F32, f.as_mut_ptr() as *mut u8, 2, 2.0) };
        assert_eq!(f, [1.5, 2.5]);
    }
}
