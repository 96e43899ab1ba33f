//! The machine's limits, measured: matmul peak FLOP/s per precision (cached), device memory.
//!
//! MFU is only as honest as its denominator, so the peak is measured on the machine itself, with
//! the run's precision, device and thread count: a large square matmul through libtorch, the median
//! of a few timed repetitions after a warm-up. The result is cached in a small JSON file (for
//! example `~/.cache/stoke/.machine-peak.json`) keyed by precision, device and threads, so a machine pays the
//! measurement once.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use tch::{Device, Tensor};

use crate::config::Precision;
use crate::TrainError;

/// Name of the cache file that `matmul_peak_flops_cached` keeps in the folder it is given.
pub const PEAK_CACHE_FILE: &str = ".machine-peak.json";

/// Side of the square matrices: large enough to reach the plateau, small enough to take well
/// under a second per repetition on two CPU cores.
fn matmul_size(device: Device) -> i64 {
    if device.is_cuda() {
        8192
    } else {
        2048
    }
}

fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(ordinal) => format!("cuda:{ordinal}"),
        _ => "cpu".into(),
    }
}

/// The cache key: precision, device and intra-op threads.
pub fn peak_key(precision: Precision, device: Device) -> String {
    format!("{}-{}-t{}", precision.name(), device_name(device), tch::get_num_threads())
}

fn sync(device: Device) {
    if let Device::Cuda(ordinal) = device {
        tch::Cuda::synchronize(ordinal as i64);
    }
}

/// Measures the peak: the median FLOP/s of `repeats` matmuls of two n x n matrices in
/// `precision` on `device`, after one warm-up.
pub fn measure_matmul_peak_flops(precision: Precision, device: Device, repeats: usize) -> f64 {
    let n = matmul_size(device);
    let kind = crate::precision::compute_kind(precision);
    let _guard = tch::no_grad_guard();
    let a = Tensor::randn([n, n], (kind, device));
    let b = Tensor::randn([n, n], (kind, device));
    let _ = a.matmul(&b);
    sync(device);
    let rates: Vec<f64> = (0..repeats.max(1))
        .map(|_| {
            let start = Instant::now();
            let c = a.matmul(&b);
            sync(device);
            let seconds = start.elapsed().as_secs_f64();
            drop(c);
            2.0 * (n as f64).powi(3) / seconds.max(1e-12)
        })
        .collect();
    stoke_stats::median(&rates)
}

/// The peak for `precision` on `device`, from `dir/.machine-peak.json` when measured before,
/// else measured (median of 5) and added to that file. The file is replaced atomically.
pub fn matmul_peak_flops_cached(precision: Precision, device: Device, dir: &Path) -> Result<f64, TrainError> {
    let path = dir.join(PEAK_CACHE_FILE);
    let key = peak_key(precision, device);
    let mut cache: BTreeMap<String, f64> =
        std::fs::read_to_string(&path).ok().and_then(|text| serde_json::from_str(&text).ok()).unwrap_or_default();
    if let Some(&flops) = cache.get(&key).filter(|f| f.is_finite() && **f > 0.0) {
        return Ok(flops);
    }
    let flops = measure_matmul_peak_flops(precision, device, 5);
    cache.insert(key, flops);
    let io = |source| TrainError::Io { path: path.clone(), source };
    std::fs::create_dir_all(dir).map_err(io)?;
    let tmp = dir.join(format!("{PEAK_CACHE_FILE}.{}.tmp", std::process::id()));
    let text = serde_json::to_string_pretty(&cache).expect("a map of numbers serializes");
    std::fs::write(&tmp, text).map_err(|source| TrainError::Io { path: tmp.clone(), source })?;
    std::fs::rename(&tmp, &path).map_err(io)?;
    Ok(flops)
}

/// Memory the run can use, in bytes: physical RAM on the CPU (`MemTotal`), the device's memory on
/// a GPU (from the CUDA runtime); None when it cannot be read.
pub fn memory_capacity_bytes(device: Device) -> Option<u64> {
    match device {
        Device::Cuda(_) => cuda_mem_info().map(|(_, total)| total),
        _ => proc_kib("/proc/meminfo", "MemTotal:"),
    }
}

/// Memory in use now, for peak tracking: on a GPU, device memory in use (total - free: what the
/// caching allocator holds plus the context), on the CPU the process's peak RSS (getrusage's
/// `ru_maxrss`, one system call: cheap enough to read every step).
pub fn memory_in_use_bytes(device: Device) -> Option<u64> {
    match device {
        Device::Cuda(_) => cuda_mem_info().map(|(free, total)| total.saturating_sub(free)),
        _ => {
            // SAFETY: getrusage writes into the zeroed struct we pass and reads nothing else.
            let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
            let status = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
            (status == 0).then(|| usage.ru_maxrss as u64 * 1024)
        }
    }
}

/// Memory the system could give this process now without swapping (`MemAvailable`), in bytes.
pub fn memory_available_bytes() -> Option<u64> {
    proc_kib("/proc/meminfo", "MemAvailable:")
}

fn proc_kib(path: &str, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line[field.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kib * 1024)
}

/// (free, total) bytes of the current CUDA device, through `cudaMemGetInfo` of the CUDA runtime
/// that libtorch already loaded (tch has no binding for it).
pub(crate) fn cuda_mem_info() -> Option<(u64, u64)> {
    type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> i32;
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name only looks a symbol up.
    let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"cudaMemGetInfo".as_ptr()) };
    if symbol.is_null() {
        return None;
    }
    // SAFETY: cudaMemGetInfo has this signature in every CUDA runtime (cudaError_t is an int enum).
    let mem_get_info: MemGetInfo = unsafe { std::mem::transmute(symbol) };
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: both pointers are to live locals.
    let status = unsafe { mem_get_info(&mut free, &mut total) };
    (status == 0).then_some((free as u64, total as u64))
}

/// Bytes the C allocator has handed out and not taken back (glibc's `mallinfo2`: arena chunks in
/// use plus mmapped chunks). libtorch allocates CPU tensors through it, so the difference across a
/// block's forward is the memory that block's kept activations hold. None off glibc.
pub fn host_bytes_in_use() -> Option<u64> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 takes no arguments and returns a plain struct by value.
        let info = unsafe { libc::mallinfo2() };
        Some((info.uordblks + info.hblkhd) as u64)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// Starts a new measurement of the process's peak resident set: gives free heap memory back to the
/// kernel (glibc's `malloc_trim`), then resets `VmHWM` (writing 5 to `/proc/self/clear_refs`).
/// Returns the resident bytes then. None where either is unavailable.
pub fn reset_peak_rss() -> Option<u64> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only returns free memory to the kernel; no pointer is invalidated.
        unsafe {
            libc::malloc_trim(0);
        }
    }
    std::fs::write("/proc/self/clear_refs", "5").ok()?;
    status_bytes("VmRSS:")
}

/// The process's peak resident set since start or the last `reset_peak_rss` (`VmHWM`), bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    status_bytes("VmHWM:")
}

/// A `kB` line of `/proc/self/status`, in bytes.
fn status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line[key.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}
