//! How the C allocator treats the host memory libtorch frees between steps.
//!
//! A training step on the CPU allocates and frees the same activation- and gradient-sized blocks
//! every step. glibc's defaults hand blocks above a dynamic threshold (128 KiB at first) straight
//! to `mmap` and give freed memory at the heap's top back to the kernel, so each step faults in
//! and zeroes pages it held a moment earlier: `clear_page_erms` and `exc_page_fault` in a `perf`
//! profile of a bf16 step, 10-15% of its time on the development machine. Retaining keeps freed
//! blocks in the heap for the next step, what tcmalloc or jemalloc do for tuned PyTorch CPU jobs.
//! glibc's mmap threshold stops at 32 MiB, and a block above it (gpt2-124m's logits and their
//! gradient, 100 MB each at 1,024 tokens; the head's weight cast and its gradient, 77 MB) was still
//! mapped and faulted in anew every step (12% of a gpt2-124m bf16 step's samples in the kernel on
//! 2026-12-02, 6.7% without), so `Retain` also turns mmap off: every block comes from the heap.

use crate::config::HostMemory;

/// glibc refuses an mmap threshold above half its largest heap (64 MiB on 64-bit targets).
const MMAP_THRESHOLD_MAX: i32 = 32 << 20;
/// Never give the heap's top back to the kernel.
const TRIM_THRESHOLD: i32 = i32::MAX;
/// Grow the heap in steps this large.
const TOP_PAD: i32 = 64 << 20;

/// The environment that gives another glibc process (a PyTorch peer, say) the `Retain` policy.
pub fn retain_env() -> [(&'static str, String); 4] {
    [
        ("MALLOC_MMAP_MAX_", "0".to_string()),
        ("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD_MAX.to_string()),
        ("MALLOC_TRIM_THRESHOLD_", TRIM_THRESHOLD.to_string()),
        ("MALLOC_TOP_PAD_", TOP_PAD.to_string()),
    ]
}

/// Applies `policy` to the whole process; returns whether the C library took it (always true for
/// `System`, which changes nothing; false off glibc).
pub fn apply(policy: HostMemory) -> bool {
    match policy {
        HostMemory::System => true,
        HostMemory::Retain => retain(),
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn retain() -> bool {
    // SAFETY: mallopt only sets allocator parameters; it is safe to call at any time, from any
    // thread, and returns 0 for a value it refuses.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0) == 1
            && libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
            && libc::mallopt(libc::M_TOP_PAD, TOP_PAD) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn retain() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibc_takes_the_retain_policy() {
        assert!(apply(HostMemory::System));
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        assert!(apply(HostMemory::Retain), "glibc refused the thresholds");
    }
}
