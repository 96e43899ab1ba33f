//! The profiler observer: turns each `StepRecord` into a `stoke_prof::StepSample`, streams
//! `trace.json`, updates the Prometheus registry behind `/metrics`, tracks peak memory, and at the
//! end writes `report.json` and `report.html` and prints the step report. The analysis itself lives
//! in `stoke-prof`; this is the glue between the trainer's events and it.
//!
//! In a data-parallel run every rank has one: rank 0's writes the files as above; the others
//! (`Profiler::for_rank`) write nothing, serve their own `/metrics`, and at the end hand their
//! summary and steps (`rank_report`) to rank 0, whose `finish` adds them to the trace (a
//! process per rank) and to report.json (the `ranks` section and the straggler finding).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use stoke_prof::{
    build_report, merge_ranks, render_html, ChromeTraceWriter, ClockOffset, LiveMetrics, MachineFacts, MetricsServer,
    ModelFacts, ProfConfig, RankStepReport, RankSummary, RunFacts, RunReport, StepSample, TimedStep, TrainFacts,
};
use stoke_train::{Observer, ObserverError, Precision, RunInfo, TrainEvent};

/// The machine's measured matmul peaks (FLOP/s) for the run's device and threads.
#[derive(Debug, Clone)]
pub struct Peaks {
    pub fp32: f64,
    pub bf16: f64,
    /// Where each came from (`PeakReading::describe`), for the report.
    pub fp32_source: String,
    pub bf16_source: String,
}

impl Peaks {
    /// Both peaks, measured at start or taken from [`cache_dir`]'s cache when measured there less
    /// than a day ago at the load level of now (per machine, device and thread count).
    pub fn measure(device: tch::Device) -> anyhow::Result<Peaks> {
        let dir = cache_dir();
        let fp32 = stoke_train::matmul_peak_reading(Precision::Fp32, device, &dir)?;
        let bf16 = stoke_train::matmul_peak_reading(Precision::Bf16, device, &dir)?;
        Ok(Peaks { fp32: fp32.flops, bf16: bf16.flops, fp32_source: fp32.describe(), bf16_source: bf16.describe() })
    }

    /// No measurement (0): a data-parallel rank other than 0 reports no MFU, only its times.
    pub fn unmeasured() -> Peaks {
        Peaks { fp32: 0.0, bf16: 0.0, fp32_source: String::new(), bf16_source: String::new() }
    }
}

/// Where stoke keeps what it measured about this machine: `$STOKE_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/stoke`, else `~/.cache/stoke`, else a folder under the system's temporary
/// one. Never inside `run.dir`, where every entry is a run.
pub fn cache_dir() -> std::path::PathBuf {
    let var = |name: &str| std::env::var_os(name).filter(|value| !value.is_empty()).map(std::path::PathBuf::from);
    if let Some(dir) = var("STOKE_CACHE_DIR") {
        return dir;
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return dir.join("stoke");
    }
    match var("HOME") {
        Some(home) => home.join(".cache/stoke"),
        None => std::env::temp_dir().join("stoke-cache"),
    }
}

/// The trainer's record as the profiler's plain sample (the phases are the same type on both sides).
fn sample_of(record: &stoke_train::StepRecord) -> StepSample {
    StepSample {
        step: record.step,
        wall_ms: record.wall_ms,
        phases: record.phases,
        comm_total_ms: record.comm_total_ms,
        tokens: record.tokens,
        loss: record.loss,
        loss_scale: None,
        timed: record.timed,
        frame_stages: record.frame_stages.map(|s| stoke_prof::FrameCounters {
            batches: s.batches,
            decode_ns: s.decode_ns,
            augment_ns: s.augment_ns,
            busy_ns: s.busy_ns,
        }),
        pipeline: record.pipeline.map(|(wait_ms, span_ms)| stoke_prof::StageStep { wait_ms, span_ms }),
    }
}

pub struct Profiler {
    config: ProfConfig,
    /// Where the files go; None on a data-parallel rank other than 0, which writes nothing.
    run_dir: Option<PathBuf>,
    rank: usize,
    world_size: usize,
    /// The ranks one model is cut over (`dist.tensor`): they train the same rows.
    tensor: usize,
    /// Pipeline stages of one model copy (`dist.pipeline`), their schedule and chunks a stage.
    pipeline: (usize, String, usize),
    name: String,
    peaks: Peaks,
    facts: Option<RunFacts>,
    device: Option<tch::Device>,
    /// The precision whose matmul peak the run's products reach (`peak_precision`).
    peak_precision: Precision,
    steps: Vec<StepSample>,
    /// When each of `steps` started, microseconds after `run_start`.
    starts_us: Vec<f64>,
    trace: Option<ChromeTraceWriter>,
    metrics: Arc<LiveMetrics>,
    server: Option<MetricsServer>,
    /// Time zero of the trace: the run's start, or the common start of a data-parallel run's ranks.
    run_start: Option<Instant>,
    /// CLOCK_MONOTONIC at `run_start` when set by `set_clock_zero`, ns.
    clock_zero_host_ns: Option<u64>,
    /// This rank's memory (`set_memory`).
    memory: Option<stoke_prof::RankMemory>,
    /// Rank 0 of a data-parallel run: the other ranks' clocks against this one's.
    clock_offsets: Vec<ClockOffset>,
    peak_memory_bytes: u64,
    /// Time spent inside this observer per step event, the profiler's own cost.
    spent_ms: Vec<f64>,
    /// Evaluation, spikes and per-block monitors, for the report's dynamics section.
    dynamics: stoke_prof::Dynamics,
    /// Tokens seen before the run's first step (a resumed run's steps so far).
    tokens_before: u64,
    /// What the run ran on, for report.json (`set_environment`).
    environment: Option<serde_json::Value>,
    /// The model's matrix multiplies alone (`crate::gemm`), timed at the start and every
    /// `prof.ecr_every` steps where the peaks are measured: the effective compute ratio's numerator.
    gemm: Option<GemmProbe>,
    /// Why the MFU is withheld (`check_peak`), if it is.
    mfu_withheld: Option<String>,
    /// NVML on a run on a GPU (or why not), its readings so far and when it was last read.
    gpu: Option<Result<stoke_prof::GpuHealth, String>>,
    gpu_summaries: Vec<stoke_prof::GpuSummary>,
    gpu_read_at: Option<Instant>,
}

impl Profiler {
    /// Opens the outputs in `run_dir` and starts `/metrics` when enabled. A port that is taken is a
    /// warning, not a failure: the run matters more than its live metrics. `rank` and `world_size`
    /// label the metrics (0 and 1 on one process); the writer of a data-parallel run is rank 0.
    pub fn new(
        config: &ProfConfig,
        run_dir: &Path,
        name: &str,
        peaks: Peaks,
        rank: usize,
        world_size: usize,
    ) -> anyhow::Result<Profiler> {
        Profiler::open(config, Some(run_dir), name, peaks, rank, world_size)
    }

    /// The profiler of data-parallel rank `rank` (not 0): it writes no file, serves `/metrics` on
    /// `config.prometheus_port` (the caller adds the local rank) and keeps what `rank_report` sends.
    pub fn for_rank(config: &ProfConfig, name: &str, rank: usize, world_size: usize) -> anyhow::Result<Profiler> {
        Profiler::open(config, None, name, Peaks::unmeasured(), rank, world_size)
    }

    fn open(
        config: &ProfConfig,
        run_dir: Option<&Path>,
        name: &str,
        peaks: Peaks,
        rank: usize,
        world_size: usize,
    ) -> anyhow::Result<Profiler> {
        let metrics = Arc::new(LiveMetrics::for_rank(rank, world_size));
        let mut server = None;
        if config.enabled && config.prometheus {
            match MetricsServer::start(&config.prometheus_host, config.prometheus_port, Arc::clone(&metrics)) {
                Ok(started) => {
                    let addr = started.addr();
                    if let Some(run_dir) = run_dir {
                        // Written whole and renamed into place: a reader polling for the file never
                        // sees it empty or half-written.
                        let (path, tmp) = (run_dir.join("metrics.addr"), run_dir.join("metrics.addr.tmp"));
                        std::fs::write(&tmp, format!("{addr}\n"))
                            .and_then(|()| std::fs::rename(&tmp, &path))
                            .with_context(|| format!("cannot write {}", path.display()))?;
                    }
                    eprintln!("metrics: http://{addr}/metrics");
                    server = Some(started);
                }
                Err(err) => eprintln!(
                    "warning: no /metrics endpoint: cannot listen on {}:{} ({err}); set prof.prometheus_port",
                    config.prometheus_host, config.prometheus_port
                ),
            }
        }
        let trace = match run_dir {
            Some(run_dir) if config.enabled && config.trace => {
                let path = run_dir.join("trace.json");
                Some(
                    ChromeTraceWriter::create(&path, rank as u32)
                        .with_context(|| format!("cannot write {}", path.display()))?,
                )
            }
            _ => None,
        };
        Ok(Profiler {
            config: config.clone(),
            run_dir: run_dir.map(Path::to_path_buf),
            rank,
            world_size,
            tensor: 1,
            pipeline: (1, String::new(), 1),
            name: name.to_string(),
            peaks,
            facts: None,
            device: None,
            peak_precision: Precision::Fp32,
            steps: Vec::new(),
            starts_us: Vec::new(),
            trace,
            metrics,
            server,
            run_start: None,
            clock_zero_host_ns: None,
            memory: None,
            clock_offsets: Vec::new(),
            peak_memory_bytes: 0,
            spent_ms: Vec::new(),
            dynamics: stoke_prof::Dynamics {
                spike_z: config.loss_spike_z,
                update_ratio_max: config.update_ratio_max,
                ..stoke_prof::Dynamics::default()
            },
            tokens_before: 0,
            environment: None,
            gemm: None,
            mfu_withheld: None,
            gpu: None,
            gpu_summaries: Vec::new(),
            gpu_read_at: None,
        })
    }

    /// Measures the trace from `zero` instead of the run's start: every rank of a data-parallel run
    /// passes the moment it left the barrier before the first step.
    /// `host_ns` is the host's CLOCK_MONOTONIC at that moment, when known.
    pub fn set_clock_zero(&mut self, zero: Instant, host_ns: Option<u64>) {
        self.run_start = Some(zero);
        self.clock_zero_host_ns = host_ns;
    }

    /// Rank 0: how the other ranks' clocks differ from this one's (`finish` moves their steps by it).
    pub fn set_clock_offsets(&mut self, offsets: Vec<ClockOffset>) {
        self.clock_offsets = offsets;
    }

    fn started(&mut self, info: &RunInfo) {
        let shape = info.shape;
        let device = if info.device.is_cuda() { "cuda" } else { "cpu" };
        self.peak_precision = peak_precision(info);
        // A model whose bf16 products run widened multiplies at fp32's peak.
        let bf16_peak = if info.widened_products { self.peaks.fp32 } else { self.peaks.bf16 };
        let (peak, peak_source) = match self.peak_precision {
            Precision::Fp32 if info.precision == Precision::Bf16 => {
                (self.peaks.fp32, format!("{} (bf16 products widened to fp32)", self.peaks.fp32_source))
            }
            Precision::Fp32 => (self.peaks.fp32, self.peaks.fp32_source.clone()),
            Precision::Bf16 | Precision::Fp16 => (self.peaks.bf16, self.peaks.bf16_source.clone()),
        };
        self.facts = Some(RunFacts {
            name: self.name.clone(),
            model: ModelFacts {
                n_layer: shape.n_layer,
                n_head: shape.n_head,
                d_model: shape.d_model,
                seq_len: shape.seq_len,
                vocab_size: shape.vocab_size,
                n_params: info.n_params,
                n_trainable_params: info.n_trainable_params,
                flops_per_token: info.flops_per_token,
                frames_per_sample: info.frames_per_sample,
            },
            train: TrainFacts {
                micro_batch: info.micro_batch,
                grad_accum: info.grad_accum,
                precision: info.precision,
                world_size: self.world_size,
                tensor: self.tensor,
                pipeline: self.pipeline.0,
                pipeline_schedule: self.pipeline.1.clone(),
                pipeline_chunks: self.pipeline.2,
                recompute: info.recompute.to_string(),
                activation_bytes_per_block: Vec::new(),
                activation_bytes: None,
                step_peak_bytes_in_use: None,
                loss_scale: None,
                skipped_steps: 0,
                gemm_ms_per_step: None,
                gemm_flops_per_s: None,
            },
            machine: MachineFacts {
                peak_flops: peak,
                peak_flops_fp32: Some(self.peaks.fp32).filter(|&p| p > 0.0),
                peak_flops_bf16: Some(bf16_peak).filter(|&p| p > 0.0),
                device: device.into(),
                memory_capacity_bytes: stoke_train::memory_capacity_bytes(info.device),
                peak_source: Some(peak_source).filter(|s| !s.is_empty()),
            },
        });
        self.device = Some(info.device);
        if peak > 0.0 {
            let probe = GemmProbe::new(info);
            if let Some(facts) = self.facts.as_mut() {
                facts.train.gemm_ms_per_step = Some(probe.ms_per_step());
                facts.train.gemm_flops_per_s = Some(probe.flops_per_s());
            }
            self.gemm = Some(probe);
        }
        if let tch::Device::Cuda(index) = info.device {
            self.gpu = Some(open_gpu_health(index));
        }
        self.run_start.get_or_insert_with(Instant::now);
        self.dynamics.units = info.units.clone();
        self.tokens_before = info.start_step * info.tokens_per_step;
    }

    /// Reads NVML at most once a second: each reading is a few driver calls per device.
    fn read_gpus(&mut self) {
        let Some(Ok(health)) = &self.gpu else { return };
        if self.gpu_read_at.is_some_and(|at| at.elapsed() < std::time::Duration::from_secs(1)) {
            return;
        }
        self.gpu_read_at = Some(Instant::now());
        let samples = health.sample();
        self.metrics.set_gpus(&samples);
        stoke_prof::accumulate_gpus(&mut self.gpu_summaries, &samples);
    }

    fn step(&mut self, record: &stoke_train::StepRecord) -> std::io::Result<()> {
        self.read_gpus();
        if let Some(probe) =
            self.gemm.as_mut().filter(|_| self.config.ecr_every > 0 && record.step % self.config.ecr_every == 0)
        {
            probe.time_again();
            if let Some(facts) = self.facts.as_mut() {
                facts.train.gemm_ms_per_step = Some(probe.ms_per_step());
                facts.train.gemm_flops_per_s = Some(probe.flops_per_s());
            }
        }
        let sample = sample_of(record);
        if let Some(device) = self.device {
            let in_use = stoke_train::memory_in_use_bytes(device).unwrap_or(0);
            self.peak_memory_bytes = self.peak_memory_bytes.max(in_use);
            self.metrics.set_memory_peak(self.peak_memory_bytes);
        }
        if let Some(facts) = &self.facts {
            let gemm_ms = facts.train.gemm_ms_per_step;
            self.metrics.observe(&sample, record.lr, facts.model.flops_per_token, facts.machine.peak_flops, gemm_ms);
        }
        // The step began wall_ms before it ended (not before the record reached this observer: on
        // a loaded machine the observers before it, or the scheduler, can delay that by
        // milliseconds, which once put a rank's step after the other rank's same step on the
        // merged time line, though their all-reduce held both inside it at once).
        let start_us = self.run_start.map_or(0.0, |start| {
            record.ended.saturating_duration_since(start).as_secs_f64() * 1e6 - record.wall_ms * 1e3
        });
        if let Some(trace) = &mut self.trace {
            trace.step(start_us.max(0.0), &sample)?;
        }
        self.starts_us.push(start_us.max(0.0));
        self.steps.push(sample);
        self.record_dynamics(record);
        Ok(())
    }

    fn record_dynamics(&mut self, record: &stoke_train::StepRecord) {
        let d = &mut self.dynamics;
        if let Some(z) = record.loss_z.filter(|&z| z > d.spike_z) {
            d.spikes.push(stoke_prof::Spike { step: record.step, loss: record.loss, z });
        }
        if let Some(m) = &record.monitors {
            d.monitors.push(stoke_prof::MonitorPoint {
                step: record.step,
                grad_norm: record.grad_norm,
                block_grad_norm: m.grad_norm.clone(),
                update_ratio: m.update_ratio.clone(),
            });
        }
        if let Some(change) = &record.batch_change {
            d.batch_changes.push(stoke_prof::BatchEvent {
                step: record.step,
                from: change.from,
                to: change.to,
                noise_scale: change.noise_scale,
            });
        }
        if let Some(eval) = &record.eval {
            let tokens_seen = self.tokens_before + self.steps.iter().map(|s| s.tokens).sum::<u64>();
            d.eval.push(stoke_prof::EvalPoint {
                step: record.step,
                tokens_seen,
                loss: eval.loss,
                perplexity: eval.perplexity,
            });
            if eval.stop {
                d.early_stopped_at = Some(record.step);
            }
        }
    }

    /// The report of the run so far (None before the first step).
    pub fn report(&self) -> Option<RunReport> {
        let facts = self.facts.as_ref()?;
        if self.steps.is_empty() {
            return None;
        }
        // The median step's cost, not the mean: on a busy machine the mean mostly measures the
        // times the scheduler took the core away while this code happened to run.
        let mut spent = self.spent_ms.clone();
        spent.sort_by(f64::total_cmp);
        let median_ms = spent.get(spent.len() / 2).copied().unwrap_or(0.0);
        let total_ms = median_ms * self.steps.len() as f64;
        let mut report = build_report(facts, &self.steps, self.peak_memory_bytes, total_ms, &self.config);
        let d = &self.dynamics;
        if !(d.eval.is_empty() && d.spikes.is_empty() && d.monitors.is_empty() && d.batch_changes.is_empty()) {
            report.findings.extend(d.findings());
            report.dynamics = Some(d.clone());
        }
        report.environment = self.environment.clone();
        if let Some(reason) = &self.mfu_withheld {
            report.mfu = f64::NAN;
            report.compute_mfu = f64::NAN;
            report.mfu_withheld = Some(reason.clone());
        }
        report.gpus = self.gpu_summaries.clone();
        report.gpu_health_error = match &self.gpu {
            Some(Err(reason)) => Some(reason.clone()),
            _ => None,
        };
        Some(report)
    }

    /// An MFU above 1 means the peak was measured while something else ran: the peak is measured
    /// again now (and the cache updated); if the MFU still exceeds 1, it is withheld with the
    /// reason instead of printed.
    fn check_peak(&mut self) {
        let Some(report) = self.report() else { return };
        if report.mfu <= 1.0 {
            return;
        }
        let (Some(device), Some(facts)) = (self.device, self.facts.as_mut()) else { return };
        let precision = self.peak_precision;
        let old = facts.machine.peak_flops;
        match stoke_train::remeasure_matmul_peak(precision, device, &cache_dir()) {
            Ok(reading) => {
                facts.machine.peak_flops = reading.flops.max(old);
                facts.machine.peak_source = Some(format!(
                    "measured again at the end of this run, as MFU against the peak taken at start ({:.1} GFLOP/s) \
                     was {:.3}",
                    old / 1e9,
                    report.mfu
                ));
            }
            Err(err) => eprintln!("warning: the matmul peak could not be measured again: {err}"),
        }
        if let Some(report) = self.report() {
            if report.mfu > 1.0 {
                self.mfu_withheld = Some(format!(
                    "MFU would be {:.3} against a peak of {:.1} GFLOP/s measured again now: the machine's peak \
                     cannot be measured reliably at its present load",
                    report.mfu,
                    self.facts.as_ref().map_or(0.0, |f| f.machine.peak_flops) / 1e9
                ));
            }
        }
    }

    /// The run's environment (`crate::environment`), written into report.json.
    pub fn set_environment(&mut self, environment: serde_json::Value) {
        self.environment = Some(environment);
    }

    /// The ranks one model is cut over (`dist.tensor`), whose tokens the job's rate counts once.
    pub fn set_tensor(&mut self, tensor: usize) {
        self.tensor = tensor.max(1);
        if let Some(facts) = &mut self.facts {
            facts.train.tensor = self.tensor;
        }
    }

    /// The pipeline stages one model copy is cut into and their schedule (the report's bubble).
    pub fn set_pipeline(&mut self, stages: usize, schedule: &str, chunks: usize) {
        let schedule = if stages > 1 { schedule.to_string() } else { String::new() };
        self.pipeline = (stages.max(1), schedule, chunks.max(1));
        if let Some(facts) = &mut self.facts {
            facts.train.pipeline = self.pipeline.0;
            facts.train.pipeline_schedule = self.pipeline.1.clone();
            facts.train.pipeline_chunks = self.pipeline.2;
        }
    }

    /// What this rank sends rank 0 at the end of a data-parallel run: its own report's summary, and
    /// its steps when the trace is on.
    pub fn rank_report(&self) -> RankStepReport {
        let steps = if self.config.trace {
            self.starts_us
                .iter()
                .zip(&self.steps)
                .map(|(&start_us, sample)| TimedStep { start_us, sample: sample.clone() })
                .collect()
        } else {
            Vec::new()
        };
        RankStepReport {
            rank: self.rank,
            summary: self.report().map(|r| RankSummary::of(self.rank, &r)),
            steps,
            clock_zero_host_ns: self.clock_zero_host_ns,
            memory: self.memory.clone(),
        }
    }

    /// This rank's memory, for report.json's `ranks.memory` (rank 0) or rank 0 (the others).
    pub fn set_memory(&mut self, memory: stoke_prof::RankMemory) {
        self.memory = Some(memory);
    }

    /// Closes the trace, stops `/metrics`, writes report.json and report.html; returns the report.
    /// On rank 0 of a data-parallel run `others` are the other ranks' reports (empty otherwise):
    /// their steps go to the trace, a process per rank, and their summaries with this rank's to
    /// report.json's `ranks` section and the straggler finding.
    pub fn finish(&mut self, others: Vec<RankStepReport>) -> anyhow::Result<Option<RunReport>> {
        self.server = None;
        let Some(run_dir) = self.run_dir.clone() else { return Ok(self.report()) };
        for offset in &mut self.clock_offsets {
            let theirs = others.iter().find(|o| o.rank == offset.rank).and_then(|o| o.clock_zero_host_ns);
            if let (Some(ours), Some(theirs)) = (self.clock_zero_host_ns, theirs) {
                offset.host_clock_offset_us = Some((ours as f64 - theirs as f64) / 1e3);
            }
        }
        let trace_path = run_dir.join("trace.json");
        if let Some(mut trace) = self.trace.take() {
            for other in &others {
                trace.add_rank(other.rank as u32).with_context(|| format!("cannot write {}", trace_path.display()))?;
                let offset_us = self.clock_offsets.iter().find(|c| c.rank == other.rank).map_or(0.0, |c| c.offset_us);
                for step in &other.steps {
                    trace
                        .rank_step(other.rank as u32, (step.start_us - offset_us).max(0.0), &step.sample)
                        .with_context(|| format!("cannot write {}", trace_path.display()))?;
                }
            }
            trace.finish().with_context(|| format!("cannot write {}", trace_path.display()))?;
        }
        self.check_peak();
        let Some(mut report) = self.report() else { return Ok(None) };
        if self.world_size > 1 {
            let memory: Vec<stoke_prof::RankMemory> =
                self.memory.iter().cloned().chain(others.iter().filter_map(|o| o.memory.clone())).collect();
            let summaries = std::iter::once(RankSummary::of(self.rank, &report))
                .chain(others.into_iter().filter_map(|other| other.summary))
                .collect();
            merge_ranks(&mut report, self.world_size, self.tensor, summaries, self.clock_offsets.clone(), &self.config);
            if let Some(ranks) = report.ranks.as_mut() {
                ranks.memory = memory;
            }
        }
        if self.config.enabled {
            let path = run_dir.join("report.json");
            let text = serde_json::to_string_pretty(&report).expect("the report serializes");
            std::fs::write(&path, text + "\n").with_context(|| format!("cannot write {}", path.display()))?;
            if self.config.html {
                let path = run_dir.join("report.html");
                let html = render_html(&report, &self.steps)?;
                std::fs::write(&path, html).with_context(|| format!("cannot write {}", path.display()))?;
            }
        }
        Ok(Some(report))
    }
}

impl Observer for Profiler {
    fn on_event(&mut self, event: &TrainEvent<'_>) -> Result<(), ObserverError> {
        if !self.config.enabled {
            return Ok(());
        }
        match event {
            TrainEvent::Started(info) => self.started(info),
            TrainEvent::Step(record) => {
                let start = Instant::now();
                self.step(record)?;
                self.spent_ms.push(start.elapsed().as_secs_f64() * 1e3);
            }
            TrainEvent::Finished(summary) => {
                if let Some(facts) = &mut self.facts {
                    facts.train.loss_scale = summary.loss_scale;
                    facts.train.skipped_steps = summary.skipped_steps;
                    if let Some(memory) = &summary.memory {
                        facts.train.activation_bytes_per_block = memory.activation_bytes_per_block.clone();
                        facts.train.activation_bytes = Some(memory.activation_bytes);
                        facts.train.step_peak_bytes_in_use = Some(memory.peak_bytes_in_use);
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// Measures the profiler's cost in one run: passes events to the profiler in alternate blocks of
/// `block` steps and times the interval between consecutive step ends (the step and everything
/// the observers did after it) in the blocks with and without it. Alternating blocks within one
/// process cancel the drift of a shared machine that separate runs would see.
pub struct OverheadProbe<'a> {
    profiler: &'a mut Profiler,
    block: u64,
    last: Option<Instant>,
    /// Mean interval per block, ms, tagged on (true) or off.
    blocks: Vec<(bool, f64)>,
    current: (u64, f64),
}

/// The result of an `OverheadProbe`.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Overhead {
    pub on_ms_per_step: f64,
    pub off_ms_per_step: f64,
    /// Median over adjacent (on, off) block pairs of on / off - 1.
    pub overhead_fraction: f64,
    pub n_block_pairs: usize,
}

impl<'a> OverheadProbe<'a> {
    pub fn new(profiler: &'a mut Profiler, block: u64) -> OverheadProbe<'a> {
        OverheadProbe { profiler, block: block.max(1), last: None, blocks: Vec::new(), current: (0, 0.0) }
    }

    fn on_for(&self, step: u64) -> bool {
        (step / self.block) % 2 == 1
    }

    /// None until at least one pair of blocks was measured.
    pub fn result(&self) -> Option<Overhead> {
        // Skip the first two blocks: warm-up.
        let blocks = &self.blocks[self.blocks.len().min(2)..];
        let mean = |on: bool| {
            let v: Vec<f64> = blocks.iter().filter(|b| b.0 == on).map(|b| b.1).collect();
            v.iter().sum::<f64>() / v.len().max(1) as f64
        };
        let ratios: Vec<f64> = blocks
            .windows(2)
            .filter(|w| w[0].0 != w[1].0)
            .map(|w| if w[0].0 { w[0].1 / w[1].1 } else { w[1].1 / w[0].1 } - 1.0)
            .collect();
        if ratios.is_empty() {
            return None;
        }
        Some(Overhead {
            on_ms_per_step: mean(true),
            off_ms_per_step: mean(false),
            overhead_fraction: stoke_prof::median(&ratios),
            n_block_pairs: ratios.len(),
        })
    }
}

impl Observer for OverheadProbe<'_> {
    fn on_event(&mut self, event: &TrainEvent<'_>) -> Result<(), ObserverError> {
        let TrainEvent::Step(record) = event else { return self.profiler.on_event(event) };
        let on = self.on_for(record.step);
        if on {
            self.profiler.on_event(event)?;
        }
        // Timed after the profiler ran, so an on-step's interval includes its cost.
        let now = Instant::now();
        if let Some(last) = self.last {
            self.current.0 += 1;
            self.current.1 += (now - last).as_secs_f64() * 1e3;
        }
        self.last = Some(now);
        if (record.step + 1) % self.block == 0 && self.current.0 > 0 {
            self.blocks.push((on, self.current.1 / self.current.0 as f64));
            self.current = (0, 0.0);
        }
        Ok(())
    }
}

/// NVML for CUDA device `index` (mapped through CUDA_VISIBLE_DEVICES); on failure the reason,
/// printed once: a run on a GPU trains without its health metrics rather than not at all.
fn open_gpu_health(index: usize) -> Result<stoke_prof::GpuHealth, String> {
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let opened = match stoke_prof::nvml_index(index as u32, visible.as_deref()) {
        Some(nvml) => stoke_prof::GpuHealth::open(&[nvml]).map_err(|err| err.to_string()),
        None => Err(format!(
            "GPU health metrics: CUDA device {index} has no NVML index in CUDA_VISIBLE_DEVICES={:?}",
            visible.unwrap_or_default()
        )),
    };
    if let Err(reason) = &opened {
        eprintln!("warning: {reason}; the run trains without GPU health metrics");
    }
    opened
}

/// The precision whose matmul peak a run's products reach: fp32's where its bf16 products run
/// widened; bf16's for fp16 too (GPUs multiply fp16 and bf16 at the same peak; a CPU without fp16
/// matrix units is slower in fp16, so there MFU against the bf16 peak is a lower bound).
fn peak_precision(info: &RunInfo) -> Precision {
    match info.precision {
        Precision::Bf16 if info.widened_products => Precision::Fp32,
        Precision::Fp32 => Precision::Fp32,
        Precision::Bf16 | Precision::Fp16 => Precision::Bf16,
    }
}

/// The model's matrix multiplies for one micro-batch, and the fastest time of them so far. The
/// reference's tensors (for a large vocabulary, the head's activations are the size of the step's
/// logits) are held only while it is timed, so the run's memory between timings is its own.
struct GemmProbe {
    matmuls: stoke_plan::ModelConfig,
    micro_batch: usize,
    precision: stoke_train::Precision,
    widened_products: bool,
    device: tch::Device,
    best: crate::gemm::ReferenceTimes,
    flops: f64,
    micro_batches: f64,
    /// Forward products run again in the backward per micro-batch, as a share of the forward:
    /// a whole block under `block`, one in K blocks under `every:K`, about two thirds of a block's
    /// products for `mlp` and one third for `attention`.
    recomputed: f64,
}

impl GemmProbe {
    fn new(info: &stoke_train::RunInfo) -> GemmProbe {
        let reference = crate::gemm::GemmReference::new(
            &info.matmuls,
            info.micro_batch,
            info.precision,
            info.widened_products,
            info.device,
        );
        let recomputed = match info.recompute {
            stoke_train::Recompute::None => 0.0,
            stoke_train::Recompute::Mlp => 2.0 / 3.0,
            stoke_train::Recompute::Attention => 1.0 / 3.0,
            stoke_train::Recompute::Block => 1.0,
            stoke_train::Recompute::Every(k) => 1.0 / k.max(1) as f64,
        };
        GemmProbe {
            matmuls: info.matmuls.clone(),
            micro_batch: info.micro_batch,
            precision: info.precision,
            widened_products: info.widened_products,
            device: info.device,
            best: reference.fastest(2),
            flops: reference.flops(),
            micro_batches: info.grad_accum.max(1) as f64,
            recomputed,
        }
    }

    fn time_again(&mut self) {
        let reference = crate::gemm::GemmReference::new(
            &self.matmuls,
            self.micro_batch,
            self.precision,
            self.widened_products,
            self.device,
        );
        let t = reference.time();
        self.best.forward_ms = self.best.forward_ms.min(t.forward_ms);
        self.best.backward_ms = self.best.backward_ms.min(t.backward_ms);
    }

    /// The step's products: every micro-batch's forward (with what recomputation repeats) and
    /// backward.
    fn ms_per_step(&self) -> f64 {
        self.micro_batches * (self.best.forward_ms * (1.0 + self.recomputed) + self.best.backward_ms)
    }

    fn flops_per_s(&self) -> f64 {
        self.flops / (self.best.total_ms() / 1e3)
    }
}
