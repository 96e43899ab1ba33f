//! Diagnosis: rules that turn measurements into findings with a cause, a fix and, where a phase
//! could be removed, the Amdahl bound `step / (step - phase)` on the speed-up.
//!
//! Ids shared with `stoke doctor`: `data_wait`, `comm_exposed`, `low_compute_ratio`,
//! `memory_pressure`, `ckpt_stall`, `step_outliers`, `small_batch`. The TensorBoard profiler
//! plugin's rules: `dataloader`, `communication`, `low_gpu_utilization`, `no_tensor_cores`.
//! Across ranks: `straggler`.

use super::event::DeviceInfo;
use super::figures::{RankReport, StepReport};
use crate::findings::{amdahl_bound, pct, Finding, RuleId};

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

fn ms(ns: i64) -> String {
    format!("{:.3} ms", ns as f64 / 1e6)
}

fn amdahl(wall: i64, phase: i64) -> Option<f64> {
    amdahl_bound(wall as f64, phase as f64)
}

/// Ratio rules on one step's (or a rank's summed) numbers.
fn ratio_rules(wall: i64, s: &StepReport, out: &mut Vec<Finding>) {
    if wall <= 0 {
        return;
    }
    let frac = |ns: i64| ns as f64 / wall as f64;
    let dl = s.categories.dataloader;
    if frac(dl) > DATA_WAIT_FRACTION {
        out.push(Finding::new(
            RuleId::TraceDataWait,
            format!("> {} of step", pct(DATA_WAIT_FRACTION)),
            frac(dl),
            format!("the step waits on the DataLoader for {} of {} ({})", ms(dl), ms(wall), pct(frac(dl))),
            amdahl(wall, dl),
        ));
    }
    if frac(dl) > DATALOADER_FRACTION {
        out.push(Finding::new(
            RuleId::TraceDataloader,
            format!("> {} of step", pct(DATALOADER_FRACTION)),
            frac(dl),
            format!("DataLoader time {} is {} of the step", ms(dl), pct(frac(dl))),
            amdahl(wall, dl),
        ));
    }
    let comm = s.categories.communication;
    if frac(comm) > COMMUNICATION_FRACTION {
        out.push(Finding::new(
            RuleId::TraceCommunication,
            format!("> {} of step", pct(COMMUNICATION_FRACTION)),
            frac(comm),
            format!("communication not hidden behind kernels takes {} ({})", ms(comm), pct(frac(comm))),
            amdahl(wall, comm),
        ));
    }
    if frac(s.comm_exposed_ns) > COMM_EXPOSED_FRACTION {
        out.push(Finding::new(
            RuleId::TraceCommExposed,
            format!("> {} of step", pct(COMM_EXPOSED_FRACTION)),
            frac(s.comm_exposed_ns),
            format!(
                "{} of {} communication kernel time runs with no compute kernel beside it",
                ms(s.comm_exposed_ns),
                ms(s.comm_ns)
            ),
            amdahl(wall, s.comm_exposed_ns),
        ));
    }
    if frac(s.gpu_busy_ns) < LOW_GPU_UTILIZATION {
        out.push(Finding::new(
            RuleId::TraceLowGpuUtilization,
            format!("< {} GPU busy", pct(LOW_GPU_UTILIZATION)),
            frac(s.gpu_busy_ns),
            format!("the GPU runs work {} of {} ({})", ms(s.gpu_busy_ns), ms(wall), pct(frac(s.gpu_busy_ns))),
            amdahl(wall, wall - s.gpu_busy_ns),
        ));
    }
    if frac(s.gemm_ns) < LOW_COMPUTE_RATIO {
        out.push(Finding::new(
            RuleId::TraceLowComputeRatio,
            format!("< {} of step in matrix multiply and convolution kernels", pct(LOW_COMPUTE_RATIO)),
            frac(s.gemm_ns),
            format!(
                "matrix multiply and convolution kernels run {} of {} ({}); all compute kernels {} ({})",
                ms(s.gemm_ns),
                ms(wall),
                pct(frac(s.gemm_ns)),
                ms(s.compute_ns),
                pct(frac(s.compute_ns))
            ),
            amdahl(wall, wall - s.gemm_ns),
        ));
    }
    if frac(s.ckpt_stall_ns) > CKPT_STALL_FRACTION {
        out.push(Finding::new(
            RuleId::TraceCkptStall,
            format!("> {} of step", pct(CKPT_STALL_FRACTION)),
            frac(s.ckpt_stall_ns),
            format!("a checkpoint save runs {} while the GPU is idle", ms(s.ckpt_stall_ns)),
            amdahl(wall, s.ckpt_stall_ns),
        ));
    }
}

/// Adds the findings of each step and of the rank to an analyzed rank.
pub(crate) fn diagnose(report: &mut RankReport, device: Option<&DeviceInfo>) {
    for step in &mut report.steps {
        step.findings = diagnose_step(step);
    }
    report.findings = diagnose_rank(report, device);
}

fn diagnose_step(step: &StepReport) -> Vec<Finding> {
    let mut out = Vec::new();
    ratio_rules(step.wall_ns, step, &mut out);
    out
}

fn diagnose_rank(r: &RankReport, device: Option<&DeviceInfo>) -> Vec<Finding> {
    let mut out = Vec::new();
    // The ratio rules on the sum over steps.
    let summed = StepReport {
        step: None,
        start_ns: 0,
        wall_ns: r.total_wall_ns,
        categories: r.total,
        gpu_busy_ns: r.steps.iter().map(|s| s.gpu_busy_ns).sum(),
        compute_ns: r.steps.iter().map(|s| s.compute_ns).sum(),
        gemm_ns: r.steps.iter().map(|s| s.gemm_ns).sum(),
        comm_ns: r.steps.iter().map(|s| s.comm_ns).sum(),
        comm_exposed_ns: r.steps.iter().map(|s| s.comm_exposed_ns).sum(),
        ckpt_stall_ns: r.steps.iter().map(|s| s.ckpt_stall_ns).sum(),
        findings: Vec::new(),
    };
    ratio_rules(r.total_wall_ns, &summed, &mut out);

    for m in &r.memory {
        if let Some(f) = m.peak_fraction.filter(|&f| f > MEMORY_PRESSURE_FRACTION) {
            out.push(Finding::new(
                RuleId::TraceMemoryPressure,
                format!("> {} of device memory reserved", pct(MEMORY_PRESSURE_FRACTION)),
                f,
                format!(
                    "device {} peak reserved {:.2} GiB of {:.2} GiB",
                    m.device,
                    m.peak_reserved_bytes as f64 / (1u64 << 30) as f64,
                    m.device_bytes as f64 / (1u64 << 30) as f64
                ),
                None,
            ));
        }
    }

    // Tensor Cores exist from Volta (compute capability 7) on NVIDIA and on AMD's CDNA (MFMA).
    let has_tensor_cores = device.is_none_or(|d| d.compute_major >= 7 || d.name.contains("AMD"));
    let tc = &r.tensor_cores;
    if has_tensor_cores && tc.eligible_ns > 0 && tc.tensor_core_ns == 0 {
        out.push(Finding::new(
            RuleId::TraceNoTensorCores,
            "no Tensor Core kernel among GEMM/convolution kernels".into(),
            0.0,
            format!("{} of GEMM/convolution kernels, none on Tensor Cores", ms(tc.eligible_ns)),
            None,
        ));
    }

    let with_number: Vec<&StepReport> = r.steps.iter().filter(|s| s.step.is_some()).collect();
    if with_number.len() >= 3 && r.median_step_ns > 0 {
        let slow: Vec<String> = with_number
            .iter()
            .filter(|s| s.wall_ns as f64 > STEP_OUTLIER_FACTOR * r.median_step_ns as f64)
            .map(|s| format!("#{} {}", s.step.unwrap_or(0), ms(s.wall_ns)))
            .collect();
        if !slow.is_empty() {
            out.push(Finding::new(
                RuleId::TraceStepOutliers,
                format!("step > {STEP_OUTLIER_FACTOR}x the median"),
                slow.len() as f64,
                format!("median {}; slow steps: {}", ms(r.median_step_ns), slow.join(", ")),
                None,
            ));
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
            out.push(Finding::new(
                RuleId::TraceSmallBatch,
                format!("mean kernel < {} us and GPU busy < {}", SMALL_KERNEL_NS / 1000, pct(LOW_GPU_UTILIZATION)),
                mean_kernel as f64,
                format!(
                    "mean kernel {:.1} us, GPU busy {}, host wait {} of {} idle",
                    mean_kernel as f64 / 1e3,
                    pct(busy),
                    ms(host_wait),
                    ms(idle_total)
                ),
                None,
            ));
        }
    }
    out
}
