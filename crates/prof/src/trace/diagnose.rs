//! Diagnosis: rules that turn measurements into findings with a cause, a fix and, where a phase
//! could be removed, the Amdahl bound `step / (step - phase)` on the speed-up.
//!
//! Ids shared with `stoke doctor`: `data_wait`, `comm_exposed`, `low_compute_ratio`,
//! `memory_pressure`, `ckpt_stall`, `step_outliers`, `small_batch`. The TensorBoard profiler
//! plugin's rules: `dataloader`, `communication`, `low_gpu_utilization`, `no_tensor_cores`.
//! Across ranks: `straggler`.

use serde::Serialize;

use super::analyze::{RankReport, StepReport};
use super::event::DeviceInfo;

/// One diagnosis.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finding {
    pub id: &'static str,
    /// The rule's threshold, in words ("> 5% of step").
    pub threshold: String,
    /// The measured value the threshold applies to (a fraction or a count).
    pub value: f64,
    /// The numbers behind the finding.
    pub evidence: String,
    pub cause: &'static str,
    pub fix: &'static str,
    /// Amdahl bound on the speed-up from removing the phase: step / (step - phase).
    pub bound: Option<f64>,
}

/// Thresholds, in one place so that documentation and code agree.
pub const DATA_WAIT_FRACTION: f64 = 0.02;
pub const DATALOADER_FRACTION: f64 = 0.05;
pub const COMMUNICATION_FRACTION: f64 = 0.10;
pub const COMM_EXPOSED_FRACTION: f64 = 0.05;
pub const LOW_GPU_UTILIZATION: f64 = 0.50;
pub const LOW_COMPUTE_RATIO: f64 = 0.60;
pub const MEMORY_PRESSURE_FRACTION: f64 = 0.90;
pub const CKPT_STALL_FRACTION: f64 = 0.01;
pub const STEP_OUTLIER_FACTOR: f64 = 1.5;
pub const SMALL_KERNEL_NS: i64 = 10_000;
pub const STRAGGLER_FACTOR: f64 = 1.05;

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn ms(ns: i64) -> String {
    format!("{:.3} ms", ns as f64 / 1e6)
}

fn amdahl(wall: i64, phase: i64) -> Option<f64> {
    (wall > phase && phase > 0).then(|| wall as f64 / (wall - phase) as f64)
}

/// Ratio rules on one step's (or a rank's summed) numbers.
fn ratio_rules(wall: i64, s: &StepReport, out: &mut Vec<Finding>) {
    if wall <= 0 {
        return;
    }
    let frac = |ns: i64| ns as f64 / wall as f64;
    let dl = s.categories.dataloader;
    if frac(dl) > DATA_WAIT_FRACTION {
        out.push(Finding {
            id: "data_wait",
            threshold: format!("> {} of step", pct(DATA_WAIT_FRACTION)),
            value: frac(dl),
            evidence: format!("the step waits on the DataLoader for {} of {} ({})", ms(dl), ms(wall), pct(frac(dl))),
            cause: "the input pipeline does not keep up: the training loop blocks on the next batch with no GPU work queued",
            fix: "more DataLoader workers, pin_memory and prefetch_factor, or pre-tokenised shards (stoke's loader prefetches on its own threads)",
            bound: amdahl(wall, dl),
        });
    }
    if frac(dl) > DATALOADER_FRACTION {
        out.push(Finding {
            id: "dataloader",
            threshold: format!("> {} of step", pct(DATALOADER_FRACTION)),
            value: frac(dl),
            evidence: format!("DataLoader time {} is {} of the step", ms(dl), pct(frac(dl))),
            cause: "data loading runs on the critical path (TensorBoard profiler rule)",
            fix: "set num_workers > 0 on the DataLoader and enable pin_memory; move preprocessing offline",
            bound: amdahl(wall, dl),
        });
    }
    let comm = s.categories.communication;
    if frac(comm) > COMMUNICATION_FRACTION {
        out.push(Finding {
            id: "communication",
            threshold: format!("> {} of step", pct(COMMUNICATION_FRACTION)),
            value: frac(comm),
            evidence: format!("communication not hidden behind kernels takes {} ({})", ms(comm), pct(frac(comm))),
            cause: "collectives dominate the step (TensorBoard profiler rule)",
            fix: "larger gradient buckets, gradient accumulation (fewer all-reduces), compression, or a faster interconnect",
            bound: amdahl(wall, comm),
        });
    }
    if frac(s.comm_exposed_ns) > COMM_EXPOSED_FRACTION {
        out.push(Finding {
            id: "comm_exposed",
            threshold: format!("> {} of step", pct(COMM_EXPOSED_FRACTION)),
            value: frac(s.comm_exposed_ns),
            evidence: format!(
                "{} of {} communication kernel time runs with no compute kernel beside it",
                ms(s.comm_exposed_ns),
                ms(s.comm_ns)
            ),
            cause: "communication is not overlapped with computation",
            fix: "overlap gradient all-reduce with backward (DDP buckets, FSDP prefetch), put collectives on their own stream",
            bound: amdahl(wall, s.comm_exposed_ns),
        });
    }
    if frac(s.gpu_busy_ns) < LOW_GPU_UTILIZATION {
        out.push(Finding {
            id: "low_gpu_utilization",
            threshold: format!("< {} GPU busy", pct(LOW_GPU_UTILIZATION)),
            value: frac(s.gpu_busy_ns),
            evidence: format!("the GPU runs work {} of {} ({})", ms(s.gpu_busy_ns), ms(wall), pct(frac(s.gpu_busy_ns))),
            cause:
                "the GPU waits for the host (launches, data, Python) more than it computes (TensorBoard profiler rule)",
            fix: "bigger batches, CUDA graphs or torch.compile to cut launches, move host work off the step",
            bound: amdahl(wall, wall - s.gpu_busy_ns),
        });
    }
    if frac(s.compute_ns) < LOW_COMPUTE_RATIO {
        out.push(Finding {
            id: "low_compute_ratio",
            threshold: format!("< {} of step in compute kernels", pct(LOW_COMPUTE_RATIO)),
            value: frac(s.compute_ns),
            evidence: format!("compute kernels run {} of {} ({})", ms(s.compute_ns), ms(wall), pct(frac(s.compute_ns))),
            cause: "most of the step is spent outside compute: waiting, copying or communicating",
            fix: "remove the largest non-compute category first (see the breakdown); its Amdahl bound is the most to gain",
            bound: amdahl(wall, wall - s.compute_ns),
        });
    }
    if frac(s.ckpt_stall_ns) > CKPT_STALL_FRACTION {
        out.push(Finding {
            id: "ckpt_stall",
            threshold: format!("> {} of step", pct(CKPT_STALL_FRACTION)),
            value: frac(s.ckpt_stall_ns),
            evidence: format!("a checkpoint save runs {} while the GPU is idle", ms(s.ckpt_stall_ns)),
            cause: "checkpointing blocks training",
            fix: "save asynchronously (copy to host, persist on a background thread), or checkpoint less often",
            bound: amdahl(wall, s.ckpt_stall_ns),
        });
    }
}

pub(crate) fn diagnose_step(step: &StepReport) -> Vec<Finding> {
    let mut out = Vec::new();
    ratio_rules(step.wall_ns, step, &mut out);
    out
}

pub(crate) fn diagnose_rank(r: &RankReport, device: Option<&DeviceInfo>) -> Vec<Finding> {
    let mut out = Vec::new();
    // The ratio rules on the sum over steps.
    let summed = StepReport {
        step: None,
        start_ns: 0,
        wall_ns: r.total_wall_ns,
        categories: r.total,
        gpu_busy_ns: r.steps.iter().map(|s| s.gpu_busy_ns).sum(),
        compute_ns: r.steps.iter().map(|s| s.compute_ns).sum(),
        comm_ns: r.steps.iter().map(|s| s.comm_ns).sum(),
        comm_exposed_ns: r.steps.iter().map(|s| s.comm_exposed_ns).sum(),
        ckpt_stall_ns: r.steps.iter().map(|s| s.ckpt_stall_ns).sum(),
        findings: Vec::new(),
    };
    ratio_rules(r.total_wall_ns, &summed, &mut out);

    for m in &r.memory {
        if let Some(f) = m.peak_fraction.filter(|&f| f > MEMORY_PRESSURE_FRACTION) {
            out.push(Finding {
                id: "memory_pressure",
                threshold: format!("> {} of device memory reserved", pct(MEMORY_PRESSURE_FRACTION)),
                value: f,
                evidence: format!(
                    "device {} peak reserved {:.2} GiB of {:.2} GiB",
                    m.device,
                    m.peak_reserved_bytes as f64 / (1u64 << 30) as f64,
                    m.device_bytes as f64 / (1u64 << 30) as f64
                ),
                cause: "the caching allocator is near the device limit: fragmentation, retries and OOM risk",
                fix: "activation checkpointing, a smaller micro-batch with accumulation, sharded optimizer state, or expandable_segments",
                bound: None,
            });
        }
    }

    // Tensor Cores exist from Volta (compute capability 7) on NVIDIA and on AMD's CDNA (MFMA).
    let has_tensor_cores = device.is_none_or(|d| d.compute_major >= 7 || d.name.contains("AMD"));
    let tc = &r.tensor_cores;
    if has_tensor_cores && tc.eligible_ns > 0 && tc.tensor_core_ns == 0 {
        out.push(Finding {
            id: "no_tensor_cores",
            threshold: "no Tensor Core kernel among GEMM/convolution kernels".into(),
            value: 0.0,
            evidence: format!("{} of GEMM/convolution kernels, none on Tensor Cores", ms(tc.eligible_ns)),
            cause: "matrix math runs in fp32 on CUDA cores (TensorBoard profiler rule)",
            fix: "autocast to bf16/fp16, or allow TF32 (torch.backends.cuda.matmul.allow_tf32 = True)",
            bound: None,
        });
    }

    let with_number: Vec<&StepReport> = r.steps.iter().filter(|s| s.step.is_some()).collect();
    if with_number.len() >= 3 && r.median_step_ns > 0 {
        let slow: Vec<String> = with_number
            .iter()
            .filter(|s| s.wall_ns as f64 > STEP_OUTLIER_FACTOR * r.median_step_ns as f64)
            .map(|s| format!("#{} {}", s.step.unwrap_or(0), ms(s.wall_ns)))
            .collect();
        if !slow.is_empty() {
            out.push(Finding {
                id: "step_outliers",
                threshold: format!("step > {STEP_OUTLIER_FACTOR}x the median"),
                value: slow.len() as f64,
                evidence: format!("median {}; slow steps: {}", ms(r.median_step_ns), slow.join(", ")),
                cause: "some steps are much slower than the rest: warm-up, allocator growth, checkpoints, or host interference",
                fix: "look at the slow steps' breakdown; exclude warm-up from measurements",
                bound: None,
            });
        }
    }

    let kernel_count: u64 = r.kernel_types.iter().map(|k| k.count).sum();
    let kernel_time: i64 = r.kernel_types.iter().map(|k| k.time_ns).sum();
    let host_wait: i64 = r.idle_by_stream.iter().map(|s| s.host_wait_ns).sum();
    let idle_total: i64 = r.idle_by_stream.iter().map(|s| s.host_wait_ns + s.kernel_wait_ns + s.other_ns).sum();
    if kernel_count > 0 && r.gpu.span_ns > 0 {
        let mean_kernel = kernel_time / kernel_count as i64;
        let busy = (r.gpu.span_ns - r.gpu.idle_ns) as f64 / r.gpu.span_ns as f64;
        if mean_kernel < SMALL_KERNEL_NS && busy < LOW_GPU_UTILIZATION && host_wait * 2 > idle_total {
            out.push(Finding {
                id: "small_batch",
                threshold: format!("mean kernel < {} us and GPU busy < {}", SMALL_KERNEL_NS / 1000, pct(LOW_GPU_UTILIZATION)),
                value: mean_kernel as f64,
                evidence: format!(
                    "mean kernel {:.1} us, GPU busy {}, host wait {} of {} idle",
                    mean_kernel as f64 / 1e3,
                    pct(busy),
                    ms(host_wait),
                    ms(idle_total)
                ),
                cause: "kernels are too small to hide their launch cost: the step is launch-bound",
                fix: "raise the batch size (with gradient accumulation if memory allows), fuse ops (torch.compile), CUDA graphs",
                bound: None,
            });
        }
    }
    out
}
