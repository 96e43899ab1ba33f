//! stoke-prof: where the milliseconds of a training step go.
//!
//! The vocabulary the trainer and the report share: `Phase`, `PhaseTimes`, `Precision` (this crate
//! has no libtorch, so the trainer depends on it, not the other way round).
//!
//! The step report ("CT scan"): given plain per-step data from the trainer (milliseconds per phase,
//! tokens, the model's FLOPs per token, the machine's measured peak, memory), `build_report`
//! computes each phase's share, the effective compute ratio, MFU, tokens/s, step-time outliers and
//! the Amdahl bound of every removable phase, and runs the diagnosis rules (`rules`; one `Finding` type
//! and one table of rules, `RULES`, serve this and the trace analyzer), each with a
//! configurable threshold, evidence, cause, fix and bound. `ChromeTraceWriter` streams `trace.json`,
//! `LiveMetrics` + `MetricsServer` serve Prometheus `/metrics`, `render_html` draws `report.html`.
//!
//! ```
//! use stoke_prof::{build_report, MachineFacts, ModelFacts, PhaseTimes, Precision, ProfConfig, RunFacts, StepSample,
//!     TrainFacts};
//! let model = ModelFacts { n_layer: 2, n_head: 2, d_model: 64, seq_len: 32, vocab_size: 256,
//!     n_params: 120_000, n_trainable_params: 120_000, flops_per_token: 7e5, frames_per_sample: 0 };
//! let train = TrainFacts { micro_batch: 512, grad_accum: 1, precision: Precision::Bf16, world_size: 1, ..TrainFacts::default() };
//! let machine = MachineFacts { peak_flops: 8e11, peak_flops_fp32: None, peak_flops_bf16: None,
//!     device: "cpu".into(), memory_capacity_bytes: None, peak_source: None };
//! let facts = RunFacts { name: "demo".into(), model, train, machine };
//! // data_wait, h2d, forward, backward, recompute, comm_exposed, optimizer, ckpt_stall, other
//! let phases = PhaseTimes { ms: [4.0, 0.1, 3.0, 6.0, 0.0, 0.0, 1.0, 0.0, 0.4] };
//! let steps: Vec<StepSample> = (1..=50).map(|step| StepSample { step, wall_ms: phases.total(),
//!     phases, comm_total_ms: 0.0, tokens: 16_384, loss: 2.0, loss_scale: None, timed: true,
//!     frame_stages: None, pipeline: None }).collect();
//! let report = build_report(&facts, &steps, 1 << 30, 0.0, &ProfConfig::default());
//! assert!((report.phases.values().sum::<f64>() - report.step_ms).abs() < 1e-9);
//! assert_eq!(report.findings[0].id, "data_wait"); // 4 of 14.5 ms: removing it bounds the gain at 1.38x
//! assert!((report.findings[0].bound.unwrap() - 14.5 / 10.5).abs() < 1e-9);
//! ```
//!
//! Also built: the trace analyzer behind `stoke trace`. It streams PyTorch profiler (Kineto) traces,
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

mod chrome;
mod compare;
mod dynamics;
mod error;
mod findings;
mod gpu;
mod html;
mod input;
mod pipeline;
mod prom;
mod rank_report;
mod ranks;
mod report;
mod rules;
mod stats;
mod step;
mod trace;
mod vocab;

pub use chrome::{validate_chrome_trace, ChromeTraceWriter};
pub use compare::{compare, render_compare_html, Comparison, Gap, RunCurves, SMOOTH};
pub use dynamics::{BatchEvent, Dynamics, EvalPoint, MonitorPoint, Spike};
pub use error::ProfError;
pub use findings::{amdahl, amdahl_bound, Finding, Rule, RuleId, Scope, RULES};
pub use gpu::{
    accumulate as accumulate_gpus, nvml_index, summarize as summarize_gpus, GpuHealth, GpuSample, GpuSummary,
    NVML_LIBRARY,
};
pub use html::render_html;
pub use input::{FrameCounters, MachineFacts, ModelFacts, ProfConfig, RunFacts, StepSample, TrainFacts};
pub use pipeline::{bubble_formula, PipelineReport, StageBubble, StageStep};
pub use prom::{scrape, validate_exposition, LiveMetrics, MetricsServer};
pub use rank_report::{ClockOffset, RankMemory, RankStepReport, RankSummary, RanksReport, TimedStep};
pub use ranks::merge_ranks;
pub use report::{format_bound, FrameStages, RankRates, RunReport};
pub use rules::diagnose;
pub use stats::{tokens_per_s, Spread};
pub use step::build_report;
pub use stoke_stats::{mad, median, percentile};
pub use trace::{
    analyze, analyze_paths, analyze_rank, cross_rank, diff, diff_markdown, diff_table, find_trace_files, kernel_type,
    load_trace, load_traces, markdown, overlay_trace, peak_flops_for, prometheus, rank_from_file_name, table,
    write_synthetic, AlignedStep, Analysis, AnalyzeOptions, Categories, Category, CrossRank, DeviceInfo, DiffOptions,
    Dist, Event, GpuTime, IngestStats, KernelStat, KernelType, KernelTypeTime, Kind, LaunchStats, MemcpyStat,
    MemorySample, MemoryStat, NameDiff, Overlap, QueueStat, RankCollectives, RankReport, RankTrace, StepReport,
    StepStats, StreamIdle, SynthOptions, TensorCoreStat, TraceDiff, TraceError,
};
pub use vocab::{Phase, PhaseTimes, Precision, N_PHASES};
