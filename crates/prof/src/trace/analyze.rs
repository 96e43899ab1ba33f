//! Per-rank analyses of one trace: the per-step temporal breakdown, GPU time as HTA reports it,
//! idle time per stream, kernel breakdown, communication overlap, launch statistics, queue
//! length, memcpy bandwidth, memory and MFU.

use std::collections::HashMap;

use super::classify::{
    is_ckpt_save, is_comm_op, is_dataloader, is_gemm, is_tensor_core, is_tensor_core_eligible, kernel_type,
    peak_flops_for, step_number, KernelType,
};
use super::event::{Event, FxBuild, Kind, RankTrace};
use super::figures::{
    Categories, Category, Dist, GpuTime, KernelStat, KernelTypeTime, LaunchStats, MemcpyStat, MemoryStat, Overlap,
    QueueStat, RankReport, StepReport, StreamIdle, TensorCoreStat,
};
use super::intervals::Union;

/// Knobs of the analyses; `Default` gives HTA's defaults where HTA has one.
#[derive(Clone, Debug, PartialEq)]
pub struct AnalyzeOptions {
    /// Kernels listed in the kernel breakdown. Default 10.
    pub top_kernels: usize,
    /// A gap between kernels on a stream shorter than this (and not a host wait) is "kernel
    /// wait". Default 30 us, as HTA's `consecutive_kernel_delay`.
    pub kernel_wait_ns: i64,
    /// Runtime (launch) calls longer than this are outliers. Default 50 us, as HTA.
    pub runtime_outlier_ns: i64,
    /// Launch delays longer than this are outliers. Default 100 us, as HTA.
    pub launch_delay_outlier_ns: i64,
    /// Model FLOPs per step (forward + backward), for MFU. Default none.
    pub model_flops_per_step: Option<f64>,
    /// Peak FLOP/s of one device, for MFU. Default: looked up from the device name when known.
    pub peak_flops: Option<f64>,
}

impl Default for AnalyzeOptions {
    fn default() -> Self {
        AnalyzeOptions {
            top_kernels: 10,
            kernel_wait_ns: 30_000,
            runtime_outlier_ns: 50_000,
            launch_delay_outlier_ns: 100_000,
            model_flops_per_step: None,
            peak_flops: None,
        }
    }
}

/// Runs every per-rank analysis.
pub(crate) fn measure_rank(trace: &RankTrace, opts: &AnalyzeOptions) -> RankReport {
    let events = &trace.events;
    let names = &trace.names;
    let name_of = |e: &Event| names[e.name as usize].as_str();

    // Classify names once per distinct name, not per event.
    let kernel_types: Vec<KernelType> = names.iter().map(|n| kernel_type(n)).collect();
    let step_numbers: Vec<Option<u64>> = names.iter().map(|n| step_number(n)).collect();
    let cpu_category: Vec<Category> = names
        .iter()
        .map(|n| {
            if is_dataloader(n) {
                Category::DataLoader
            } else if is_comm_op(n) {
                Category::Communication
            } else {
                Category::CpuOp
            }
        })
        .collect();
    let ckpt_names: Vec<bool> = names.iter().map(|n| is_ckpt_save(n)).collect();
    let gemm_names: Vec<bool> = names.iter().map(|n| is_gemm(&n.to_ascii_lowercase())).collect();
    // (uses Tensor Cores, could use them) per name.
    let tensor_core_names: Vec<(bool, bool)> = names
        .iter()
        .map(|n| {
            let lower = n.to_ascii_lowercase();
            (is_tensor_core(&lower), is_tensor_core_eligible(&lower))
        })
        .collect();
    // Per name id: (count, total ns) of CPU operators and of GPU work.
    let mut op_totals: Vec<(u64, i64)> = vec![(0, 0); names.len()];
    let mut kernel_totals: Vec<(u64, i64)> = vec![(0, 0); names.len()];

    let mut runtime_by_corr: HashMap<u64, usize, FxBuild> = HashMap::default();
    for (i, e) in events.iter().enumerate() {
        if e.kind == Kind::Runtime && e.correlation != 0 {
            runtime_by_corr.insert(e.correlation, i);
        }
    }

    // Interval lists per category (over the whole trace), and the GPU unions.
    let mut spans: [Vec<(i64, i64)>; 8] = Default::default();
    let (mut gpu_all, mut compute_all, mut comm_all, mut ckpt_all) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut gemm_all = Vec::new();
    let mut cpu_steps: Vec<(u64, i64, i64)> = Vec::new();
    for e in events {
        let span = (e.ts, e.end());
        let cat = match e.kind {
            Kind::Kernel | Kind::Memcpy | Kind::Memset => {
                let kt = kernel_types[e.name as usize];
                gpu_all.push(span);
                if e.kind == Kind::Kernel && gemm_names[e.name as usize] {
                    gemm_all.push(span);
                }
                match kt {
                    KernelType::Compute => compute_all.push(span),
                    KernelType::Communication => comm_all.push(span),
                    _ => {}
                }
                let entry = &mut kernel_totals[e.name as usize];
                entry.0 += 1;
                entry.1 += e.dur;
                match (e.kind, kt) {
                    (_, KernelType::Communication) => Some(Category::Communication),
                    (Kind::Memcpy, _) => Some(Category::Memcpy),
                    (Kind::Memset, _) => Some(Category::Memset),
                    _ => Some(Category::Kernel),
                }
            }
            Kind::Runtime => Some(Category::Runtime),
            Kind::CpuOp | Kind::UserAnnotation | Kind::PythonFunction => {
                if let Some(n) = step_numbers[e.name as usize] {
                    cpu_steps.push((n, e.ts, e.end()));
                    None
                } else {
                    if e.kind == Kind::CpuOp {
                        let entry = &mut op_totals[e.name as usize];
                        entry.0 += 1;
                        entry.1 += e.dur;
                    }
                    if ckpt_names[e.name as usize] {
                        ckpt_all.push(span);
                    }
                    Some(cpu_category[e.name as usize])
                }
            }
            Kind::Sync | Kind::GpuAnnotation | Kind::Other => None,
        };
        if let Some(c) = cat {
            spans[c as usize].push(span);
        }
    }

    // Exclusive time per category: each category minus everything of higher priority.
    let mut exclusive: Vec<Union> = Vec::with_capacity(7);
    let mut covered = Union::default();
    for c in &Category::PRIORITY[..7] {
        let u = Union::from_intervals(std::mem::take(&mut spans[*c as usize]));
        exclusive.push(u.minus(&covered));
        covered = covered.union(&u);
    }
    let gpu_union = Union::from_intervals(gpu_all);
    let compute_union = Union::from_intervals(compute_all);
    let gemm_union = Union::from_intervals(gemm_all);
    let comm_union = Union::from_intervals(comm_all);
    let comm_exposed_union = comm_union.minus(&compute_union);
    let ckpt_stall_union = Union::from_intervals(ckpt_all).minus(&gpu_union);

    // Step windows: from a step's CPU start to the later of its CPU end and the end of the GPU
    // work it launched, but never past the next step's start.
    cpu_steps.sort_by_key(|s| (s.1, s.0));
    cpu_steps.dedup_by_key(|s| s.0);
    let mut windows: Vec<(Option<u64>, i64, i64)> = Vec::new();
    if cpu_steps.is_empty() {
        let lo = events.iter().map(|e| e.ts).min().unwrap_or(0);
        let hi = events.iter().map(|e| e.end()).max().unwrap_or(0);
        windows.push((None, lo, hi));
    } else {
        let mut gpu_end_by_step = vec![i64::MIN; cpu_steps.len()];
        for e in events.iter().filter(|e| e.kind.is_gpu_work()) {
            if let Some(&ri) = runtime_by_corr.get(&e.correlation) {
                let launch = events[ri].ts;
                let idx = cpu_steps.partition_point(|s| s.1 <= launch);
                if idx > 0 && launch < cpu_steps[idx - 1].2 {
                    gpu_end_by_step[idx - 1] = gpu_end_by_step[idx - 1].max(e.end());
                }
            }
        }
        for (i, &(n, start, cpu_end)) in cpu_steps.iter().enumerate() {
            let mut end = cpu_end.max(gpu_end_by_step[i]);
            if let Some(next) = cpu_steps.get(i + 1) {
                end = end.min(next.1);
            }
            windows.push((Some(n), start, end.max(start)));
        }
    }

    let mut steps = Vec::with_capacity(windows.len());
    let mut total = Categories::default();
    for &(n, lo, hi) in &windows {
        let mut cats = Categories::default();
        for (i, c) in Category::PRIORITY[..7].iter().enumerate() {
            *cats.slot(*c) = exclusive[i].clipped_len(lo, hi);
        }
        let wall = hi - lo;
        cats.other = wall - cats.sum();
        debug_assert!(cats.other >= 0, "exclusive categories cannot exceed the window");
        total.add(&cats);
        let step = StepReport {
            step: n,
            start_ns: lo,
            wall_ns: wall,
            categories: cats,
            gpu_busy_ns: gpu_union.clipped_len(lo, hi),
            compute_ns: compute_union.clipped_len(lo, hi),
            gemm_ns: gemm_union.clipped_len(lo, hi),
            comm_ns: comm_union.clipped_len(lo, hi),
            comm_exposed_ns: comm_exposed_union.clipped_len(lo, hi),
            ckpt_stall_ns: ckpt_stall_union.clipped_len(lo, hi),
            findings: Vec::new(),
        };
        steps.push(step);
    }
    let walls: Vec<i64> = steps.iter().map(|s| s.wall_ns).collect();
    let total_wall_ns: i64 = walls.iter().sum();
    let mean_step_ns = if walls.is_empty() { 0.0 } else { total_wall_ns as f64 / walls.len() as f64 };
    let median_step_ns = {
        let mut w = walls.clone();
        w.sort_unstable();
        w.get(w.len() / 2).copied().unwrap_or(0)
    };

    // HTA's scope for whole-trace GPU analyses: GPU work on a stream with a correlation id whose
    // launch happened before the last ProfilerStep began (when there are two or more steps).
    let last_step_start = if cpu_steps.len() >= 2 { cpu_steps.iter().map(|s| s.1).max() } else { None };
    let in_scope = |e: &Event| -> bool {
        if !e.kind.is_gpu_work() || e.stream < 0 {
            return false;
        }
        match last_step_start {
            None => true,
            Some(limit) => runtime_by_corr.get(&e.correlation).is_some_and(|&ri| events[ri].ts < limit),
        }
    };
    let scoped: Vec<&Event> = events.iter().filter(|e| in_scope(e)).collect();
    let gpu_scope = if last_step_start.is_some() {
        "GPU work launched before the last ProfilerStep (as HTA)"
    } else {
        "all GPU work"
    };

    // Temporal breakdown (HTA).
    let mut gpu = GpuTime { n_events: scoped.len() as u64, ..GpuTime::default() };
    if !scoped.is_empty() {
        let all = Union::from_intervals(scoped.iter().map(|e| (e.ts, e.end())).collect());
        let compute = Union::from_intervals(
            scoped
                .iter()
                .filter(|e| kernel_types[e.name as usize] == KernelType::Compute)
                .map(|e| (e.ts, e.end()))
                .collect(),
        );
        let first = all.0.first().map_or(0, |s| s.0);
        let last = all.0.last().map_or(0, |s| s.1);
        gpu.span_ns = last - first;
        gpu.idle_ns = gpu.span_ns - all.len_ns();
        gpu.compute_ns = compute.len_ns();
        gpu.non_compute_ns = gpu.span_ns - gpu.compute_ns - gpu.idle_ns;
    }

    // Idle time per stream.
    let mut by_stream: HashMap<i32, Vec<&Event>> = HashMap::new();
    for e in &scoped {
        by_stream.entry(e.stream).or_default().push(e);
    }
    let mut stream_ids: Vec<i32> = by_stream.keys().copied().collect();
    stream_ids.sort_unstable();
    let mut idle_by_stream = Vec::new();
    let mut queue = Vec::new();
    for &s in &stream_ids {
        let list = &by_stream[&s];
        let mut idle = StreamIdle { stream: s, ..StreamIdle::default() };
        for pair in list.windows(2) {
            let (prev, cur) = (pair[0], pair[1]);
            let gap = cur.ts - prev.end();
            if gap <= 0 {
                continue;
            }
            let launched_at = runtime_by_corr.get(&cur.correlation).map(|&ri| events[ri].ts);
            if launched_at.is_some_and(|t| t > prev.end()) {
                idle.host_wait_ns += gap;
            } else if gap < opts.kernel_wait_ns {
                idle.kernel_wait_ns += gap;
            } else {
                idle.other_ns += gap;
            }
        }
        idle_by_stream.push(idle);

        // Queue length (HTA's definition): operations launched on the stream and not yet
        // started; +1 at the runtime call, -1 when the GPU starts the work.
        let mut changes: Vec<(i64, i64)> = Vec::with_capacity(list.len() * 2);
        for e in list {
            if let Some(&ri) = runtime_by_corr.get(&e.correlation) {
                changes.push((events[ri].ts, 1));
                changes.push((e.ts, -1));
            }
        }
        changes.sort_unstable();
        let (mut q, mut max, mut sum) = (0i64, 0i64, 0f64);
        for &(_, d) in &changes {
            q += d;
            max = max.max(q);
            sum += q as f64;
        }
        let mean = if changes.is_empty() { 0.0 } else { sum / changes.len() as f64 };
        queue.push(QueueStat { stream: s, max, mean });
    }

    // Kernel breakdown.
    let mut by_type: HashMap<KernelType, (u64, i64)> = HashMap::new();
    let mut by_name: HashMap<u32, (u64, i64, i64)> = HashMap::new();
    let mut tensor_cores = TensorCoreStat::default();
    let mut memcpy_by_kind: HashMap<String, MemcpyStat> = HashMap::new();
    for e in &scoped {
        let kt = kernel_types[e.name as usize];
        let t = by_type.entry(kt).or_default();
        t.0 += 1;
        t.1 += e.dur;
        let n = by_name.entry(e.name).or_default();
        n.0 += 1;
        n.1 += e.dur;
        n.2 = n.2.max(e.dur);
        if kt == KernelType::Compute && e.kind == Kind::Kernel {
            let (uses, eligible) = tensor_core_names[e.name as usize];
            if uses {
                tensor_cores.tensor_core_ns += e.dur;
                tensor_cores.eligible_ns += e.dur;
            } else if eligible {
                tensor_cores.eligible_ns += e.dur;
            }
        }
        if matches!(e.kind, Kind::Memcpy | Kind::Memset) {
            let name = name_of(e);
            let kind = if name.starts_with("Memcpy") {
                name.chars().take(11).collect()
            } else if name.starts_with("Memset") {
                "Memset".to_string()
            } else {
                name.to_string()
            };
            let m = memcpy_by_kind.entry(kind.clone()).or_insert_with(|| MemcpyStat { kind, ..MemcpyStat::default() });
            m.count += 1;
            m.bytes += e.bytes;
            m.time_ns += e.dur;
        }
    }
    let kernel_total: i64 = by_type.values().map(|v| v.1).sum();
    let mut kernel_types_out: Vec<KernelTypeTime> = by_type
        .iter()
        .map(|(k, &(count, time_ns))| KernelTypeTime {
            kind: k.key(),
            count,
            time_ns,
            share: if kernel_total > 0 { time_ns as f64 / kernel_total as f64 } else { 0.0 },
        })
        .collect();
    kernel_types_out.sort_by(|a, b| b.time_ns.cmp(&a.time_ns).then(a.kind.cmp(b.kind)));
    let mut top: Vec<(u32, (u64, i64, i64))> = by_name.into_iter().collect();
    top.sort_by(|a, b| b.1 .1.cmp(&a.1 .1).then(a.0.cmp(&b.0)));
    let top_kernels = top
        .iter()
        .take(opts.top_kernels)
        .map(|&(id, (count, total, max))| KernelStat {
            name: names[id as usize].clone(),
            kind: kernel_types[id as usize].key(),
            count,
            total_ns: total,
            mean_ns: total / count.max(1) as i64,
            max_ns: max,
        })
        .collect();
    let mut memcpy: Vec<MemcpyStat> = memcpy_by_kind.into_values().collect();
    for m in &mut memcpy {
        m.gb_per_s = if m.time_ns > 0 { m.bytes as f64 / m.time_ns as f64 } else { 0.0 };
    }
    memcpy.sort_by(|a, b| a.kind.cmp(&b.kind));

    // Communication / computation overlap (HTA's), over the scoped kernels.
    let scoped_union = |kt: KernelType| {
        Union::from_intervals(
            scoped.iter().filter(|e| kernel_types[e.name as usize] == kt).map(|e| (e.ts, e.end())).collect(),
        )
    };
    let (comm_scoped, compute_scoped) = (scoped_union(KernelType::Communication), scoped_union(KernelType::Compute));
    let comm_ns = comm_scoped.len_ns();
    let overlapped_ns = comm_scoped.overlap_len(&compute_scoped);
    let overlap = Overlap {
        comm_ns,
        overlapped_ns,
        exposed_ns: comm_ns - overlapped_ns,
        overlap_ratio: if comm_ns > 0 { Some(overlapped_ns as f64 / comm_ns as f64) } else { None },
    };

    // Launch statistics through correlation ids.
    let (mut delays, mut runtimes) = (Vec::new(), Vec::new());
    for e in &scoped {
        if let Some(&ri) = runtime_by_corr.get(&e.correlation) {
            let rt = &events[ri];
            delays.push((e.ts - rt.end()).max(0));
            runtimes.push(rt.dur);
        }
    }
    let launches = LaunchStats {
        runtime_outliers: runtimes.iter().filter(|&&d| d > opts.runtime_outlier_ns).count() as u64,
        launch_delay_outliers: delays.iter().filter(|&&d| d > opts.launch_delay_outlier_ns).count() as u64,
        launch_delay: Dist::of(delays),
        runtime: Dist::of(runtimes),
    };

    // Memory: peaks per device from the allocator's samples.
    let mut memory: Vec<MemoryStat> = Vec::new();
    for m in trace.memory.iter().filter(|m| m.device >= 0) {
        let pos = memory.iter().position(|s| s.device == m.device);
        let stat = match pos {
            Some(i) => &mut memory[i],
            None => {
                let device_bytes =
                    trace.devices.iter().find(|d| d.id == i64::from(m.device)).map_or(0, |d| d.total_memory_bytes);
                memory.push(MemoryStat { device: m.device, device_bytes, ..MemoryStat::default() });
                memory.last_mut().expect("just pushed")
            }
        };
        stat.peak_allocated_bytes = stat.peak_allocated_bytes.max(m.total_allocated);
        stat.peak_reserved_bytes = stat.peak_reserved_bytes.max(m.total_reserved);
    }
    for m in &mut memory {
        m.peak_fraction = (m.device_bytes > 0).then(|| m.peak_reserved_bytes as f64 / m.device_bytes as f64);
    }

    let peak = opts.peak_flops.or_else(|| trace.devices.first().and_then(|d| peak_flops_for(&d.name)));
    let mfu = match (opts.model_flops_per_step, peak) {
        (Some(flops), Some(peak)) if mean_step_ns > 0.0 => Some(flops / (mean_step_ns * 1e-9) / peak),
        _ => None,
    };

    let by_name = |totals: &[(u64, i64)]| -> HashMap<String, (u64, i64)> {
        totals.iter().enumerate().filter(|(_, t)| t.0 > 0).map(|(i, &t)| (names[i].clone(), t)).collect()
    };
    let (ops, kernels) = (by_name(&op_totals), by_name(&kernel_totals));
    let collectives: Vec<(i64, i64, String)> = events
        .iter()
        .filter(|e| e.kind == Kind::Kernel && kernel_types[e.name as usize] == KernelType::Communication)
        .map(|e| (e.ts + trace.base_time_ns, e.dur, name_of(e).to_string()))
        .collect();

    let report = RankReport {
        rank: trace.rank,
        rank_source: trace.rank_source,
        file: trace.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        devices: trace.devices.clone(),
        ingest: trace.stats.clone(),
        steps,
        total,
        total_wall_ns,
        mean_step_ns,
        median_step_ns,
        gpu,
        gpu_scope,
        idle_by_stream,
        kernel_types: kernel_types_out,
        top_kernels,
        overlap,
        launches,
        queue,
        memcpy,
        memory,
        tensor_cores,
        mfu,
        findings: Vec::new(),
        ops,
        kernels,
        collectives,
    };
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_kernel_type(name: &str, expected: KernelType) {
        assert_eq!(kernel_type(name), expected, "{name}");
    }

    #[test]
    fn kernel_types_follow_hta() {
        check_kernel_type("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", KernelType::Communication);
        check_kernel_type(
            "ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
            KernelType::Communication,
        );
        check_kernel_type("Memcpy HtoD (Pageable -> Device)", KernelType::Memory);
        check_kernel_type("Memset (Device)", KernelType::Memory);
        check_kernel_type("void at::native::vectorized_elementwise_kernel<4>", KernelType::Compute);
        check_kernel_type("cudaStreamSync", KernelType::Other);
        check_kernel_type("ampere_sgemm_128x64_nn", KernelType::Compute);
    }

    fn check_step(name: &str, expected: Option<u64>) {
        assert_eq!(step_number(name), expected, "{name}");
    }

    #[test]
    fn step_names() {
        check_step("ProfilerStep#12", Some(12));
        check_step("ProfilerStep # 3", Some(3));
        check_step("ProfilerStep#", None);
        check_step("ProfilerStepX", None);
        check_step("aten::mm", None);
    }
}
