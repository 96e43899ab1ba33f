//! stoke-prof: where the milliseconds of a training step go.
//!
//! Not built yet: step phases, the step report, diagnosis rules, Chrome-trace and Prometheus output.
//!
//! Built: the trace analyzer behind `stoke trace`. It streams PyTorch profiler (Kineto) traces,
//! plain or gzip, several ranks in parallel, and reports per step where the time went (the
//! TensorBoard plugin's categories, summing to the step's wall time), GPU idle and kernel
//! breakdowns as HTA computes them, launch statistics, cross-rank stragglers, and findings with
//! a cause, a fix and an Amdahl bound; `diff` compares two runs for a CI gate.
//!
//! ```
//! use stoke_prof::{analyze_paths, write_synthetic, AnalyzeOptions, SynthOptions};
//! let dir = std::env::temp_dir().join(format!("stoke-prof-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("rank-0.json");
//! let opts = SynthOptions { max_steps: Some(3), kernels_per_step: 20, ..SynthOptions::default() };
//! write_synthetic(std::fs::File::create(&path).unwrap(), &opts).unwrap();
//!
//! let analysis = analyze_paths(&[path], &AnalyzeOptions::default()).unwrap();
//! let step = &analysis.ranks[0].steps[0];
//! assert_eq!(step.categories.sum(), step.wall_ns); // categories partition the step
//! assert!(step.findings.iter().any(|f| f.id == "dataloader"));
//! # std::fs::remove_dir_all(&dir).unwrap();
//! ```

mod trace;

pub use trace::{
    analyze, analyze_paths, analyze_rank, cross_rank, diff, diff_markdown, diff_table, find_trace_files, kernel_type,
    load_trace, load_traces, markdown, overlay_trace, peak_flops_for, prometheus, rank_from_file_name, table,
    write_synthetic, AlignedStep, Analysis, AnalyzeOptions, Categories, Category, CrossRank, DeviceInfo, DiffOptions,
    Dist, Event, Finding, GpuTime, IngestStats, KernelStat, KernelType, KernelTypeTime, Kind, LaunchStats, MemcpyStat,
    MemorySample, MemoryStat, NameDiff, Overlap, QueueStat, RankCollectives, RankReport, RankTrace, StepReport,
    StepStats, StreamIdle, SynthOptions, TensorCoreStat, TraceDiff, TraceError,
};
