//! Ranges of the flat fp32 buffers as the communicator and the fused kernels see them: a byte
//! `Region` for a collective, a slice for a pass over host memory.

use std::ops::Range;

use stoke_comm::Region;
use tch::{Kind, Tensor};

/// Elements `range` of a contiguous CPU fp32 tensor as a slice.
///
/// # Safety
/// `range` lies inside the tensor, and nothing else reads or writes it while the slice lives.
pub(super) unsafe fn f32_slice<'a>(t: &Tensor, range: Range<i64>) -> &'a mut [f32] {
    // SAFETY: the caller's contract.
    unsafe {
        std::slice::from_raw_parts_mut(
            (t.data_ptr() as *mut f32).add(range.start as usize),
            (range.end - range.start) as usize,
        )
    }
}

/// The region of elements `range` of a contiguous fp32 tensor (host memory, or device memory for
/// a device backend).
pub(super) fn f32_region(t: &Tensor, range: Range<i64>) -> Result<Region, String> {
    if t.kind() != Kind::Float || !t.is_contiguous() {
        return Err(format!("data parallelism needs a contiguous fp32 buffer, got {:?}", t.kind()));
    }
    if range.start < 0 || range.end > t.numel() as i64 || range.start > range.end {
        return Err(format!("range {range:?} is outside the buffer of {} elements", t.numel()));
    }
    let whole = Region::new(t.data_ptr() as *mut u8, t.numel(), stoke_comm::DType::F32);
    Ok(whole.slice(range.start as usize, range.end as usize))
}
