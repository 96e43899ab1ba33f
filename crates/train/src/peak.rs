//! The machine's limits, measured: matmul peak FLOP/s per precision (cached), device memory.
//!
//! MFU is only as honest as its denominator, so the peak is measured on the machine itself, with
//! the run's precision, device and thread count: a large square matmul through libtorch, the median
//! of a few timed repetitions after a warm-up. The result is cached in a small JSON file (for
//! example `~/.cache/stoke/.machine-peak.json`) keyed by precision, device and threads, with when
//! and at what load it was measured: a reading older than a day, or of another load level than
//! now's, is measured again.

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
/// The largest side of the measured matrices: 8192 on a GPU, 2048 on a CPU.
fn matmul_size(device: Device) -> i64 {
    if device.is_cuda() {
        8192
    } else {
        2048
    }
}

/// Below this time a matmul is too short to time well, and the side is doubled.
const SHORT_MATMUL_S: f64 = 0.03;

fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(ordinal) => format!("cuda:{ordinal}"),
        _ => "cpu".into(),
    }
}

/// What `train.precision = "auto"` takes: bf16 on a CUDA device and on a CPU with bf16
/// instructions ([`crate::precision::cpu_has_bf16`]), fp32 on any other CPU. Decided from the
/// hardware, not from a timing, so every rank on a machine decides the same.
pub fn auto_precision(device: Device) -> Precision {
    if device.is_cuda() || crate::precision::cpu_has_bf16() {
        Precision::Bf16
    } else {
        Precision::Fp32
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
/// `precision` on `device`, after one warm-up; n is the size's search below.
pub fn measure_matmul_peak_flops(precision: Precision, device: Device, repeats: usize) -> f64 {
    let kind = crate::precision::compute_kind(precision);
    let _guard = tch::no_grad_guard();
    // From a side of 256, doubled while one matmul takes under SHORT_MATMUL_S, up to
    // `matmul_size`: the full size where the matmul is fast, and a bounded measurement where it is
    // not (bf16 on a CPU without bf16 instructions runs a scalar loop, 50x below fp32: a 2048 side
    // would take half a minute a matmul). The last matmul of the search is the warm-up. The
    // product is `linear` (a times b transposed), the op the models' layers run: on a CPU without
    // bf16 instructions libtorch sends a bf16 `linear` to oneDNN but a bf16 `matmul` to a scalar
    // loop 7x slower, and a peak from the slower op would put the run's MFU above one.
    let mut n = 256.min(matmul_size(device));
    let (a, b) = loop {
        let a = Tensor::randn([n, n], (kind, device));
        let b = Tensor::randn([n, n], (kind, device));
        let start = Instant::now();
        let _ = a.linear(&b, None::<&Tensor>);
        sync(device);
        if n >= matmul_size(device) || start.elapsed().as_secs_f64() >= SHORT_MATMUL_S {
            break (a, b);
        }
        n *= 2;
    };
    let rates: Vec<f64> = (0..repeats.max(1))
        .map(|_| {
            let start = Instant::now();
            let c = a.linear(&b, None::<&Tensor>);
            sync(device);
            let seconds = start.elapsed().as_secs_f64();
            drop(c);
            2.0 * (n as f64).powi(3) / seconds.max(1e-12)
        })
        .collect();
    stoke_stats::median(&rates)
}

/// A matmul peak and where it came from.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PeakReading {
    pub flops: f64,
    /// When it was measured, seconds since the Unix epoch.
    pub measured_at: u64,
    /// The 1-minute load average per CPU when it was measured.
    pub load_per_cpu: f64,
    /// Taken from the cache rather than measured by this process.
    #[serde(skip)]
    pub cached: bool,
}

impl PeakReading {
    /// "measured in this run", or "cached, measured N h ago at load L per CPU".
    pub fn describe(&self) -> String {
        if !self.cached {
            return format!("measured in this run (load {:.2} per CPU)", self.load_per_cpu);
        }
        let age_s = unix_now().saturating_sub(self.measured_at);
        format!("cached, measured {:.1} h ago at load {:.2} per CPU", age_s as f64 / 3600.0, self.load_per_cpu)
    }
}

/// A cached peak older than this is measured again.
pub const PEAK_MAX_AGE_S: u64 = 24 * 3600;

/// How much busier (runnable tasks per CPU, 1-minute average) than now a peak's machine may have
/// been. A peak measured on a busier machine is measured again: there the matmul got a smaller
/// share of the cores, so that peak is too low and an MFU against it too high. One measured on a
/// quieter machine is the better denominator, and is kept.
pub const PEAK_LOAD_MARGIN: f64 = 0.25;

/// The 1-minute load average over the CPUs this process may use.
pub fn load_per_cpu() -> f64 {
    let load: f64 = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0);
    load / std::thread::available_parallelism().map_or(1, |n| n.get()) as f64
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The peak for `precision` on `device`, from `dir/.machine-peak.json` when it was measured there
/// less than a day ago on a machine no busier than now (`PEAK_LOAD_MARGIN`), else measured
/// (median of 5) and written there.
/// The file is replaced atomically; entries of the older form (a bare number) are measured again.
pub fn matmul_peak_reading(precision: Precision, device: Device, dir: &Path) -> Result<PeakReading, TrainError> {
    let load = load_per_cpu();
    let fresh = read_cache(dir)
        .remove(&peak_key(precision, device))
        .and_then(|entry| serde_json::from_value::<PeakReading>(entry).ok())
        .filter(|r| r.flops.is_finite() && r.flops > 0.0)
        .filter(|r| unix_now().saturating_sub(r.measured_at) < PEAK_MAX_AGE_S)
        .filter(|r| r.load_per_cpu <= load + PEAK_LOAD_MARGIN);
    match fresh {
        Some(reading) => Ok(PeakReading { cached: true, ..reading }),
        None => remeasure_matmul_peak(precision, device, dir),
    }
}

/// Measures the peak now (median of 5) and writes it to the cache; also what an MFU above 1 calls
/// for (the cached peak was measured while something else ran).
pub fn remeasure_matmul_peak(precision: Precision, device: Device, dir: &Path) -> Result<PeakReading, TrainError> {
    let reading = PeakReading {
        flops: measure_matmul_peak_flops(precision, device, 5),
        measured_at: unix_now(),
        load_per_cpu: load_per_cpu(),
        cached: false,
    };
    let mut cache = read_cache(dir);
    cache.insert(peak_key(precision, device), serde_json::to_value(reading).expect("a reading serializes"));
    let path = dir.join(PEAK_CACHE_FILE);
    let io = |source| TrainError::Io { path: path.clone(), source };
    std::fs::create_dir_all(dir).map_err(io)?;
    let tmp = dir.join(format!("{PEAK_CACHE_FILE}.{}.tmp", std::process::id()));
    let text = serde_json::to_string_pretty(&cache).expect("a map of readings serializes");
    std::fs::write(&tmp, text).map_err(|source| TrainError::Io { path: tmp.clone(), source })?;
    std::fs::rename(&tmp, &path).map_err(io)?;
    Ok(reading)
}

/// The cache's entries; none when it is missing or unreadable.
fn read_cache(dir: &Path) -> BTreeMap<String, serde_json::Value> {
    std::fs::read_to_string(dir.join(PEAK_CACHE_FILE))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default()
}

/// [`matmul_peak_reading`]'s FLOP/s alone.
pub fn matmul_peak_flops_cached(precision: Precision, device: Device, dir: &Path) -> Result<f64, TrainError> {
    matmul_peak_reading(precision, device, dir).map(|r| r.flops)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A cache holding `reading` for fp32 on the CPU.
    fn cache_with(dir: &Path, reading: serde_json::Value) {
        let key = peak_key(Precision::Fp32, Device::Cpu);
        std::fs::write(dir.join(PEAK_CACHE_FILE), serde_json::json!({ key: reading }).to_string()).unwrap();
    }

    #[test]
    fn a_cached_peak_is_used_only_when_fresh_and_measured_no_busier_than_now() {
        let dir = tempfile::tempdir().unwrap();
        let now = unix_now();
        // Fresh, at the load of now: used as it is. (The load can cross a level between the two
        // reads; then it is measured, which the next assertion would show.)
        let load = load_per_cpu();
        cache_with(dir.path(), serde_json::json!({ "flops": 123.0, "measured_at": now, "load_per_cpu": load }));
        let reading = matmul_peak_reading(Precision::Fp32, Device::Cpu, dir.path()).unwrap();
        if load <= load_per_cpu() + PEAK_LOAD_MARGIN {
            assert!(reading.cached && reading.flops == 123.0, "{reading:?}");
            assert!(reading.describe().starts_with("cached, measured 0.0 h ago"), "{}", reading.describe());
        }
        // Measured on a quiet machine: kept whatever the load now.
        cache_with(dir.path(), serde_json::json!({ "flops": 123.0, "measured_at": now, "load_per_cpu": 0.0 }));
        assert!(matmul_peak_reading(Precision::Fp32, Device::Cpu, dir.path()).unwrap().cached);
        // Two days old, measured on a far busier machine than now's, or the
        // older bare-number form: measured again.
        for stale in [
            serde_json::json!({ "flops": 123.0, "measured_at": now - 2 * 24 * 3600, "load_per_cpu": load }),
            serde_json::json!({ "flops": 123.0, "measured_at": now, "load_per_cpu": load_per_cpu() + 50.0 }),
            serde_json::json!(123.0),
        ] {
            cache_with(dir.path(), stale.clone());
            let reading = matmul_peak_reading(Precision::Fp32, Device::Cpu, dir.path()).unwrap();
            assert!(!reading.cached && reading.flops > 1e6, "{stale}: {reading:?}");
            assert!(reading.describe().starts_with("measured in this run"));
            // And the cache now holds the new reading.
            let again = matmul_peak_reading(Precision::Fp32, Device::Cpu, dir.path()).unwrap();
            if reading.load_per_cpu <= load_per_cpu() + PEAK_LOAD_MARGIN {
                assert!(again.cached && (again.flops / reading.flops - 1.0).abs() < 1e-12, "{again:?} {reading:?}");
            }
        }
    }
}
