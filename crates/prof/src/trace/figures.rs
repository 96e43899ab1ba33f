//! What the per-rank analysis of a trace reports: the step categories and every figure of a
//! rank's report (`RankReport`), as `analyze` fills them.

use std::collections::HashMap;

use serde::Serialize;

use crate::findings::Finding;

/// The TensorBoard profiler plugin's step categories, in priority order: where several are
/// active at once, the time goes to the first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Category {
    Kernel,
    Memcpy,
    Memset,
    Communication,
    Runtime,
    DataLoader,
    CpuOp,
    Other,
}

impl Category {
    pub const PRIORITY: [Category; 8] = [
        Category::Kernel,
        Category::Memcpy,
        Category::Memset,
        Category::Communication,
        Category::Runtime,
        Category::DataLoader,
        Category::CpuOp,
        Category::Other,
    ];

    pub fn key(self) -> &'static str {
        match self {
            Category::Kernel => "kernel",
            Category::Memcpy => "memcpy",
            Category::Memset => "memset",
            Category::Communication => "communication",
            Category::Runtime => "runtime",
            Category::DataLoader => "dataloader",
            Category::CpuOp => "cpu_op",
            Category::Other => "other",
        }
    }
}

/// Nanoseconds per category; the fields sum to the step's wall time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Categories {
    pub kernel: i64,
    pub memcpy: i64,
    pub memset: i64,
    pub communication: i64,
    pub runtime: i64,
    pub dataloader: i64,
    pub cpu_op: i64,
    pub other: i64,
}

impl Categories {
    pub fn get(&self, c: Category) -> i64 {
        match c {
            Category::Kernel => self.kernel,
            Category::Memcpy => self.memcpy,
            Category::Memset => self.memset,
            Category::Communication => self.communication,
            Category::Runtime => self.runtime,
            Category::DataLoader => self.dataloader,
            Category::CpuOp => self.cpu_op,
            Category::Other => self.other,
        }
    }

    pub(super) fn slot(&mut self, c: Category) -> &mut i64 {
        match c {
            Category::Kernel => &mut self.kernel,
            Category::Memcpy => &mut self.memcpy,
            Category::Memset => &mut self.memset,
            Category::Communication => &mut self.communication,
            Category::Runtime => &mut self.runtime,
            Category::DataLoader => &mut self.dataloader,
            Category::CpuOp => &mut self.cpu_op,
            Category::Other => &mut self.other,
        }
    }

    pub fn sum(&self) -> i64 {
        Category::PRIORITY.iter().map(|&c| self.get(c)).sum()
    }

    pub(super) fn add(&mut self, other: &Categories) {
        for c in Category::PRIORITY {
            *self.slot(c) += other.get(c);
        }
    }
}

/// One `ProfilerStep#N` (or the whole trace when it has none).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepReport {
    /// N of `ProfilerStep#N`; `None` for a trace without steps.
    pub step: Option<u64>,
    pub start_ns: i64,
    pub wall_ns: i64,
    pub categories: Categories,
    /// Time any GPU work (kernels, memcpy, memset) runs.
    pub gpu_busy_ns: i64,
    /// Time compute kernels run.
    pub compute_ns: i64,
    /// Time matrix multiply and convolution kernels run: over `wall_ns`, the effective compute
    /// ratio (attention, normalization and element-wise kernels are in `compute_ns` alone).
    pub gemm_ns: i64,
    /// Time communication kernels run.
    pub comm_ns: i64,
    /// Communication kernel time not overlapped by compute kernels.
    pub comm_exposed_ns: i64,
    /// Time a checkpoint save runs on the CPU while the GPU is idle.
    pub ckpt_stall_ns: i64,
    pub findings: Vec<Finding>,
}

/// GPU time over the whole trace, as HTA's temporal breakdown defines it.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GpuTime {
    /// From the start of the first GPU event to the end of the last ("kernel_time" in HTA).
    pub span_ns: i64,
    pub idle_ns: i64,
    pub compute_ns: i64,
    pub non_compute_ns: i64,
    pub n_events: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StreamIdle {
    pub stream: i32,
    pub host_wait_ns: i64,
    pub kernel_wait_ns: i64,
    pub other_ns: i64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KernelTypeTime {
    /// `communication`, `memory`, `compute` or `other`.
    pub kind: &'static str,
    pub count: u64,
    pub time_ns: i64,
    pub share: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KernelStat {
    pub name: String,
    pub kind: &'static str,
    pub count: u64,
    pub total_ns: i64,
    pub mean_ns: i64,
    pub max_ns: i64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Overlap {
    pub comm_ns: i64,
    pub overlapped_ns: i64,
    pub exposed_ns: i64,
    /// overlapped / comm; `None` without communication kernels.
    pub overlap_ratio: Option<f64>,
}

/// A distribution summary in nanoseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Dist {
    pub count: u64,
    pub mean_ns: f64,
    pub p50_ns: i64,
    pub p99_ns: i64,
    pub max_ns: i64,
}

impl Dist {
    /// The distribution of `values`: the median (to the nearest nanosecond) and the 99th
    /// percentile by nearest rank, as `stoke_stats` defines them.
    pub(super) fn of(values: Vec<i64>) -> Dist {
        let Some(&max_ns) = values.iter().max() else { return Dist::default() };
        let values: Vec<f64> = values.iter().map(|&v| v as f64).collect();
        Dist {
            count: values.len() as u64,
            mean_ns: values.iter().sum::<f64>() / values.len() as f64,
            p50_ns: stoke_stats::median(&values).round() as i64,
            p99_ns: stoke_stats::percentile(&values, 99.0) as i64,
            max_ns,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LaunchStats {
    /// GPU start minus the end of its runtime call, clipped at 0 (HTA's definition).
    pub launch_delay: Dist,
    /// Duration of the runtime calls that launched GPU work.
    pub runtime: Dist,
    pub runtime_outliers: u64,
    pub launch_delay_outliers: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct QueueStat {
    pub stream: i32,
    pub max: i64,
    /// Mean over queue changes (HTA's summary), not over time.
    pub mean: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MemcpyStat {
    /// "Memcpy HtoD", "Memcpy DtoH", "Memcpy DtoD", "Memset", ...
    pub kind: String,
    pub count: u64,
    pub bytes: u64,
    pub time_ns: i64,
    pub gb_per_s: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct MemoryStat {
    pub device: i16,
    pub peak_allocated_bytes: i64,
    pub peak_reserved_bytes: i64,
    pub device_bytes: u64,
    /// peak reserved / device memory; `None` when the device size is unknown.
    pub peak_fraction: Option<f64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct TensorCoreStat {
    /// Kernel time of GEMM/convolution kernels (could use Tensor Cores).
    pub eligible_ns: i64,
    /// Kernel time of kernels whose names show Tensor Core (or MFMA) instructions.
    pub tensor_core_ns: i64,
}

/// Everything about one rank.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankReport {
    pub rank: u32,
    pub rank_source: &'static str,
    pub file: String,
    pub devices: Vec<super::event::DeviceInfo>,
    pub ingest: super::event::IngestStats,
    pub steps: Vec<StepReport>,
    /// Sum over steps.
    pub total: Categories,
    pub total_wall_ns: i64,
    pub mean_step_ns: f64,
    pub median_step_ns: i64,
    /// GPU time as HTA's temporal breakdown reports it (same scope: see `gpu_scope`).
    pub gpu: GpuTime,
    /// Which GPU events the whole-trace analyses use.
    pub gpu_scope: &'static str,
    pub idle_by_stream: Vec<StreamIdle>,
    pub kernel_types: Vec<KernelTypeTime>,
    pub top_kernels: Vec<KernelStat>,
    pub overlap: Overlap,
    pub launches: LaunchStats,
    pub queue: Vec<QueueStat>,
    pub memcpy: Vec<MemcpyStat>,
    pub memory: Vec<MemoryStat>,
    pub tensor_cores: TensorCoreStat,
    /// Model FLOPs utilization over the mean step, when model FLOPs were given.
    pub mfu: Option<f64>,
    pub findings: Vec<Finding>,
    /// All CPU operators by name: (count, total ns); for `diff`.
    #[serde(skip)]
    pub ops: HashMap<String, (u64, i64)>,
    /// All GPU kernels by name: (count, total ns); for `diff`.
    #[serde(skip)]
    pub kernels: HashMap<String, (u64, i64)>,
    /// Communication kernels in trace order: (wall-clock start ns, duration ns, name); for cross-rank.
    #[serde(skip)]
    pub collectives: Vec<(i64, i64, String)>,
}
