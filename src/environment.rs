//! What a run ran on: the versions (stoke's commit, libtorch, CUDA and NCCL when present, Open
//! MPI, the kernel, the CPU and GPU models) and the environment variables that change performance.
//! `stoke env` prints it; every run writes it to its folder's `environment.json`, to report.json
//! (`environment`) and to each checkpoint's manifest (`meta.environment`), so a figure can always
//! be traced to the set-up that produced it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;

/// Prefixes of the environment variables recorded: the thread pools (OpenMP, MKL, Intel's OpenMP,
/// GNU's), the collective libraries, CUDA, PyTorch's allocator and knobs, and glibc's malloc.
const RECORDED_PREFIXES: &[&str] =
    &["OMP_", "MKL_", "KMP_", "GOMP_", "NCCL_", "CUDA_", "PYTORCH_", "TORCH_", "MALLOC_", "OMPI_MCA_", "STOKE_"];
/// Single variables recorded: a preloaded allocator and the library search path change what runs.
const RECORDED_NAMES: &[&str] = &["LD_PRELOAD", "LD_LIBRARY_PATH"];
/// Recorded variables whose values are never written (they may hold credentials).
const SECRET_PARTS: &[&str] = &["SECRET", "TOKEN", "PASSWORD", "KEY"];

#[derive(Debug, Clone, Serialize)]
pub struct Environment {
    pub stoke_version: String,
    /// The commit the binary was built from ("debug build" for a debug build without STOKE_COMMIT).
    pub stoke_commit: String,
    pub libtorch: Libtorch,
    /// CUDA runtime and driver versions, as "13.0"; None where the library or driver is absent.
    pub cuda_runtime: Option<String>,
    pub cuda_driver: Option<String>,
    /// NCCL's version when libnccl.so.2 loads on a machine with a CUDA device.
    pub nccl: Option<String>,
    /// `mpirun --version`'s first line, when Open MPI is on PATH.
    pub open_mpi: Option<String>,
    pub kernel: Option<String>,
    pub os: Option<String>,
    pub cpu_model: Option<String>,
    /// CPUs this process may run on.
    pub cpus: usize,
    pub memory_bytes: Option<u64>,
    pub gpus: Vec<String>,
    pub hostname: Option<String>,
    /// The performance-relevant variables that are set (see `RECORDED_PREFIXES`).
    pub variables: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Libtorch {
    /// The version of the libtorch loaded now (from its `version.py`, or the file `cargo xtask
    /// install` writes beside it), else the one the binary was built against.
    pub version: String,
    /// The libtorch_cpu.so this process loaded.
    pub path: Option<PathBuf>,
    pub cuda_devices: i64,
}

impl Environment {
    /// Reads the machine and this process. Costs a few milliseconds (one `mpirun --version`).
    pub fn capture() -> Environment {
        let libtorch_path = loaded_library("libtorch_cpu.so");
        let version = libtorch_path.as_deref().and_then(libtorch_version).unwrap_or_else(|| {
            format!("{} (built against)", option_env!("STOKE_LIBTORCH_VERSION").unwrap_or("unknown"))
        });
        let cuda_devices = if tch::Cuda::is_available() { tch::Cuda::device_count() } else { 0 };
        let (cuda_runtime, cuda_driver) = cuda_versions();
        Environment {
            stoke_version: env!("CARGO_PKG_VERSION").to_string(),
            stoke_commit: env!("STOKE_COMMIT").to_string(),
            libtorch: Libtorch { version, path: libtorch_path, cuda_devices },
            cuda_runtime,
            cuda_driver,
            nccl: if cuda_devices > 0 { nccl_version() } else { None },
            open_mpi: first_line_of(&["mpirun", "--version"]),
            kernel: read_trimmed("/proc/sys/kernel/osrelease"),
            os: os_release(),
            cpu_model: cpu_model(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_bytes: mem_total(),
            gpus: if cuda_devices > 0 { gpu_names() } else { Vec::new() },
            hostname: read_trimmed("/proc/sys/kernel/hostname"),
            variables: recorded_variables(std::env::vars()),
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("the environment serializes")
    }

    /// The text `stoke env` prints: a line per fact, then the variables.
    pub fn to_text(&self) -> String {
        let or_none = |v: &Option<String>| v.clone().unwrap_or_else(|| "none".into());
        let mut lines = vec![
            format!("stoke        {} ({})", self.stoke_version, self.stoke_commit),
            format!("libtorch     {}", self.libtorch.version),
            format!(
                "  loaded     {}",
                self.libtorch.path.as_ref().map_or("unknown".into(), |p| p.display().to_string())
            ),
            format!("cuda         runtime {}, driver {}", or_none(&self.cuda_runtime), or_none(&self.cuda_driver)),
            format!("  devices    {}", self.libtorch.cuda_devices),
            format!("nccl         {}", or_none(&self.nccl)),
            format!("open mpi     {}", or_none(&self.open_mpi)),
            format!("kernel       {}", or_none(&self.kernel)),
            format!("os           {}", or_none(&self.os)),
            format!("cpu          {} ({} usable)", or_none(&self.cpu_model), self.cpus),
            format!(
                "memory       {}",
                self.memory_bytes.map_or("unknown".into(), |b| format!("{:.1} GiB", b as f64 / 1024f64.powi(3)))
            ),
            format!("gpus         {}", if self.gpus.is_empty() { "none".into() } else { self.gpus.join(", ") }),
            format!("host         {}", or_none(&self.hostname)),
        ];
        if self.variables.is_empty() {
            lines.push("variables    none of OMP_*, MKL_*, NCCL_*, CUDA_*, PYTORCH_*, MALLOC_*, ... set".into());
        } else {
            lines.push("variables".into());
            lines.extend(self.variables.iter().map(|(k, v)| format!("  {k}={v}")));
        }
        lines.join("\n") + "\n"
    }
}

/// The performance-relevant variables among `vars`, secrets' values withheld.
fn recorded_variables(vars: impl Iterator<Item = (String, String)>) -> BTreeMap<String, String> {
    vars.filter(|(name, _)| {
        RECORDED_NAMES.contains(&name.as_str()) || RECORDED_PREFIXES.iter().any(|p| name.starts_with(p))
    })
    .map(|(name, value)| {
        let secret = SECRET_PARTS.iter().any(|part| name.contains(part));
        let value =
            if secret { "(set; value not recorded)".to_string() } else { stoke_fsio::clip(&value).into_owned() };
        (name, value)
    })
    .collect()
}

fn read_trimmed(path: &str) -> Option<String> {
    let text = stoke_fsio::read_to_string_capped(Path::new(path), 4096).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

fn os_release() -> Option<String> {
    let text = stoke_fsio::read_to_string_capped(Path::new("/etc/os-release"), 64 * 1024).ok()?;
    text.lines().find_map(|line| line.strip_prefix("PRETTY_NAME=")).map(|v| v.trim_matches('"').to_string())
}

fn cpu_model() -> Option<String> {
    let text = stoke_fsio::read_to_string_capped(Path::new("/proc/cpuinfo"), 1 << 20).ok()?;
    text.lines()
        .find(|line| line.starts_with("model name"))
        .and_then(|line| line.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

fn mem_total() -> Option<u64> {
    let text = stoke_fsio::read_to_string_capped(Path::new("/proc/meminfo"), 64 * 1024).ok()?;
    let line = text.lines().find(|line| line.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The path of a shared library this process has mapped, from /proc/self/maps.
/// The folder of the libtorch this process loaded (for a process started with another binary
/// that must find the same one).
pub fn libtorch_dir() -> Option<PathBuf> {
    loaded_library("libtorch_cpu.so").and_then(|p| p.parent().map(Path::to_path_buf))
}

fn loaded_library(name: &str) -> Option<PathBuf> {
    let maps = stoke_fsio::read_to_string_capped(Path::new("/proc/self/maps"), 16 << 20).ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| Path::new(path).file_name().is_some_and(|f| f == name))
        .map(PathBuf::from)
}

/// The loaded libtorch's version: `../version.py` in a PyTorch wheel's layout, or the
/// `libtorch-version` file that `cargo xtask install` writes beside the library.
fn libtorch_version(library: &Path) -> Option<String> {
    let dir = library.parent()?;
    if let Some(version) = read_trimmed(&dir.join("libtorch-version").to_string_lossy()) {
        return Some(version);
    }
    let text = stoke_fsio::read_to_string_capped(&dir.join("../version.py"), 64 * 1024).ok()?;
    let line = text.lines().find(|line| line.starts_with("__version__"))?;
    Some(line.split_once('=')?.1.trim().trim_matches('\'').trim_matches('"').to_string())
}

fn first_line_of(command: &[&str]) -> Option<String> {
    let output = std::process::Command::new(command[0])
        .args(&command[1..])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    output.status.success().then(|| text.lines().next().unwrap_or("").trim().to_string()).filter(|l| !l.is_empty())
}

fn gpu_names() -> Vec<String> {
    let Ok(output) = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    let text = String::from_utf8_lossy(&output.stdout);
    text.lines().map(|l| l.trim().to_string()).filter(|l| !l.is_empty()).collect()
}

/// A version number of CUDA's form (1000 * major + 10 * minor) as "major.minor".
fn cuda_version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// Calls `int f(int*)` from `library` (already loaded, or loadable), or None.
fn versioned_call(library: &str, symbol: &str) -> Option<i32> {
    let library = std::ffi::CString::new(library).ok()?;
    let symbol = std::ffi::CString::new(symbol).ok()?;
    // SAFETY: dlopen/dlsym by name; the symbol is called with the signature its library documents
    // (`int f(int*)`: cudaRuntimeGetVersion, cudaDriverGetVersion, ncclGetVersion), on a local.
    unsafe {
        let handle = libc::dlopen(library.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            return None;
        }
        let f = libc::dlsym(handle, symbol.as_ptr());
        let result = if f.is_null() {
            None
        } else {
            let f: extern "C" fn(*mut i32) -> i32 = std::mem::transmute(f);
            let mut version = 0i32;
            (f(&mut version) == 0 && version > 0).then_some(version)
        };
        libc::dlclose(handle);
        result
    }
}

fn cuda_versions() -> (Option<String>, Option<String>) {
    let runtime = versioned_call("libcudart.so.13", "cudaRuntimeGetVersion").map(cuda_version_text);
    let driver = versioned_call("libcudart.so.13", "cudaDriverGetVersion").map(cuda_version_text);
    (runtime, driver)
}

fn nccl_version() -> Option<String> {
    // ncclGetVersion: 10000 * major + 100 * minor + patch since 2.9.
    let v = versioned_call("libnccl.so.2", "ncclGetVersion")?;
    Some(format!("{}.{}.{}", v / 10000, (v % 10000) / 100, v % 100))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_performance_variables_are_recorded_and_secrets_are_withheld() {
        let vars = [
            ("OMP_NUM_THREADS", "2"),
            ("HOME", "/root"),
            ("NCCL_IB_DISABLE", "1"),
            ("STOKE_S3_SECRET_KEY", "hunter2"),
            ("LD_PRELOAD", "libjemalloc.so"),
            ("PATH", "/bin"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let recorded = recorded_variables(vars.into_iter());
        assert_eq!(
            recorded.keys().collect::<Vec<_>>(),
            ["LD_PRELOAD", "NCCL_IB_DISABLE", "OMP_NUM_THREADS", "STOKE_S3_SECRET_KEY"]
        );
        assert_eq!(recorded["STOKE_S3_SECRET_KEY"], "(set; value not recorded)");
        assert_eq!(recorded["OMP_NUM_THREADS"], "2");
    }

    #[test]
    fn cuda_and_nccl_version_numbers_read_as_their_releases() {
        assert_eq!(cuda_version_text(13000), "13.0");
        assert_eq!(cuda_version_text(12040), "12.4");
    }

    #[test]
    fn this_process_has_libtorch_loaded_and_names_its_version() {
        let env = Environment::capture();
        let path = env.libtorch.path.as_ref().expect("libtorch_cpu.so is mapped in a test of the binary crate");
        assert!(path.ends_with("libtorch_cpu.so"));
        assert!(env.libtorch.version.starts_with("2."), "{}", env.libtorch.version);
        assert!(env.cpus >= 1);
        assert!(env.to_text().contains("libtorch"));
    }
}
