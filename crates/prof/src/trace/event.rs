//! The in-memory form of one rank's trace: compact events with interned names.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::path::PathBuf;

/// What an event is, from its `cat` (current Kineto names and the legacy profiler's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Kind {
    /// `cpu_op`, legacy `Operator`.
    CpuOp,
    /// `user_annotation` (including `ProfilerStep#N`).
    UserAnnotation,
    /// `python_function`.
    PythonFunction,
    /// `cuda_runtime`, `cuda_driver`, legacy `Runtime`.
    Runtime,
    /// `kernel`, legacy `Kernel`.
    Kernel,
    /// `gpu_memcpy`, legacy `Memcpy`.
    Memcpy,
    /// `gpu_memset`, legacy `Memset`.
    Memset,
    /// `cuda_sync`: stream and event synchronisation shown on the GPU timeline.
    Sync,
    /// `gpu_user_annotation`.
    GpuAnnotation,
    /// Anything else with a duration (`Trace` spans, unknown categories).
    Other,
}

impl Kind {
    pub(crate) fn from_cat(cat: &[u8]) -> Kind {
        match cat {
            b"cpu_op" | b"Operator" | b"operator" => Kind::CpuOp,
            b"user_annotation" => Kind::UserAnnotation,
            b"python_function" => Kind::PythonFunction,
            b"cuda_runtime" | b"cuda_driver" | b"Runtime" | b"runtime" | b"hip_runtime" => Kind::Runtime,
            b"kernel" | b"Kernel" => Kind::Kernel,
            b"gpu_memcpy" | b"Memcpy" => Kind::Memcpy,
            b"gpu_memset" | b"Memset" => Kind::Memset,
            b"cuda_sync" => Kind::Sync,
            b"gpu_user_annotation" => Kind::GpuAnnotation,
            _ => Kind::Other,
        }
    }

    /// Runs on a device stream (HTA's "GPU kernel" set, without synchronisation).
    pub fn is_gpu_work(self) -> bool {
        matches!(self, Kind::Kernel | Kind::Memcpy | Kind::Memset)
    }

    pub fn is_cpu(self) -> bool {
        matches!(self, Kind::CpuOp | Kind::UserAnnotation | Kind::PythonFunction | Kind::Runtime)
    }
}

/// One complete (`ph: "X"`) event. Times are integer nanoseconds as written in the file (without
/// `baseTimeNanoseconds`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub ts: i64,
    pub dur: i64,
    /// `args.correlation`, linking a runtime launch to its GPU work; 0 when absent.
    pub correlation: u64,
    /// `args.bytes` for memcpy and memset; 0 when absent.
    pub bytes: u64,
    /// Index into `RankTrace::names`.
    pub name: u32,
    /// Interned (pid, tid) of CPU events; unused for GPU events.
    pub thread: u32,
    /// `args.stream` (or the tid of legacy GPU events); -1 on the CPU.
    pub stream: i32,
    /// `args.device` (or the pid of GPU events); -1 when unknown.
    pub device: i16,
    pub kind: Kind,
}

impl Event {
    pub fn end(&self) -> i64 {
        self.ts.saturating_add(self.dur)
    }
}

/// A `[memory]` instant event: the caching allocator's totals after an allocation or free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemorySample {
    pub ts: i64,
    pub device: i16,
    pub total_allocated: i64,
    pub total_reserved: i64,
}

/// A device from the trace's `deviceProperties`.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct DeviceInfo {
    pub id: i64,
    pub name: String,
    pub total_memory_bytes: u64,
    pub compute_major: i64,
    pub compute_minor: i64,
}

/// Counts kept while reading, for the report and for sanity checks.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct IngestStats {
    /// Bytes of JSON read (after decompression).
    pub bytes: u64,
    /// Entries of `traceEvents`.
    pub n_entries: u64,
    /// Complete events kept for analysis.
    pub n_events: u64,
    /// Flow (`s`, `f`), metadata (`M`) and other entries read but not kept.
    pub n_skipped: u64,
    /// Complete events dropped: without a usable `ts` or `dur` (absent, or not a number).
    pub n_without_time: u64,
    /// Complete events dropped: a negative `dur` (a broken clock or writer; never clamped to 0).
    pub n_negative_duration: u64,
}

impl IngestStats {
    /// Complete events read but not analyzed, for any reason.
    pub fn n_dropped(&self) -> u64 {
        self.n_without_time + self.n_negative_duration
    }

    /// Why events were dropped, "" when none were: "12 without a numeric ts/dur, 3 with a
    /// negative dur".
    pub fn dropped_reasons(&self) -> String {
        let mut reasons = Vec::new();
        if self.n_without_time > 0 {
            reasons.push(format!("{} without a numeric ts/dur", self.n_without_time));
        }
        if self.n_negative_duration > 0 {
            reasons.push(format!("{} with a negative dur", self.n_negative_duration));
        }
        reasons.join(", ")
    }
}

/// One rank's trace, ready for analysis.
#[derive(Clone, Debug)]
pub struct RankTrace {
    pub rank: u32,
    /// Where the rank came from: `distributedInfo`, the file name, or the order of the files.
    pub rank_source: &'static str,
    pub path: PathBuf,
    pub world_size: Option<u32>,
    /// `baseTimeNanoseconds` when present: add it to event times for wall-clock time.
    pub base_time_ns: i64,
    pub devices: Vec<DeviceInfo>,
    pub names: Vec<String>,
    /// Sorted by (ts, longer first).
    pub events: Vec<Event>,
    pub memory: Vec<MemorySample>,
    pub stats: IngestStats,
}

impl RankTrace {
    pub fn name(&self, event: &Event) -> &str {
        &self.names[event.name as usize]
    }
}

/// A small fast hasher for interning (the FxHash mixing step); names are not attacker-chosen
/// keys of a long-lived service, so collision resistance is not needed.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let word = u64::from_le_bytes(chunk.try_into().expect("chunks of 8"));
            self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
        for &b in chunks.remainder() {
            self.0 = (self.0.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }

    #[inline]
    fn write_u64(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) type FxBuild = BuildHasherDefault<FxHasher>;

/// Byte strings to dense ids; invalid UTF-8 becomes U+FFFD in the stored name.
#[derive(Default)]
pub(crate) struct Interner {
    map: HashMap<Box<[u8]>, u32, FxBuild>,
    pub(crate) names: Vec<String>,
}

impl Interner {
    #[inline]
    pub(crate) fn intern(&mut self, bytes: &[u8]) -> u32 {
        if let Some(&id) = self.map.get(bytes) {
            return id;
        }
        let id = self.names.len() as u32;
        self.names.push(String::from_utf8_lossy(bytes).into_owned());
        self.map.insert(bytes.into(), id);
        id
    }
}
