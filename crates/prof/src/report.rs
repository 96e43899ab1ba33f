//! The step report ("CT scan"): where a run's milliseconds went, from plain per-step data.
//!
//! The trainer measures each step as laps of its phases; this module turns a run's steps into mean
//! milliseconds and shares per phase, the effective compute ratio, MFU against the machine's
//! measured peak, tokens/s, step-time outliers and the Amdahl bound of every removable phase, then
//! asks `rules` for findings. Nothing here knows about libtorch or devices: it is arithmetic over
//! `StepSample`s and `RunFacts`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use stoke_stats::median;

use crate::findings::{amdahl, Finding};
use crate::input::{MachineFacts, ModelFacts, ProfConfig, RunFacts, StepSample, TrainFacts};
use crate::rank_report::RanksReport;
use crate::stats::{tokens_per_s as tokens_per_s_fn, Spread};
use crate::vocab::{Phase, PhaseTimes};

/// The step report of a run: what `report.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    pub name: String,
    /// Steps the figures describe (after `skip_steps`), and of those the exactly timed ones that
    /// the phase split comes from.
    pub steps_measured: u64,
    pub steps_timed: u64,
    /// The headline: the median wall time of the measured steps, ms. The phases sum to it.
    pub step_ms: f64,
    /// Mean, 90th percentile and standard deviation of the measured steps' wall time, ms.
    pub step_ms_mean: f64,
    pub step_ms_p90: f64,
    pub step_ms_std: f64,
    /// The headline rate: `stats::tokens_per_s(tokens per step, step_ms)`, the median step's.
    pub tokens_per_s: f64,
    /// All tokens of the measured steps over their summed wall time (the mean step's rate).
    pub tokens_per_s_mean: f64,
    /// Sequences per second at the headline rate (`tokens_per_s / seq_len`).
    #[serde(default)]
    pub samples_per_s: f64,
    /// Camera frames per second at the headline rate (`samples_per_s` x the model's frames per
    /// sample); 0 for text models.
    #[serde(default)]
    pub frames_per_s: f64,
    /// The rate of the 90th-percentile step: nine steps in ten were at least this fast.
    pub tokens_per_s_p90_step: f64,
    /// Milliseconds per phase: `step_ms` split in `phase_shares`, so they sum to `step_ms`.
    pub phases: BTreeMap<Phase, f64>,
    /// Each phase's share of the timed steps' summed wall time (0..1): a cost that comes every
    /// few steps, such as a checkpoint, counts at its average rate.
    pub phase_shares: BTreeMap<Phase, f64>,
    /// All communication per step, hidden or exposed, ms, at the scale of `phases` (not part of
    /// their sum).
    pub comm_total_ms: f64,
    /// The effective compute ratio: the step's matrix multiplies timed alone (in the same process,
    /// at the step's shapes and precision: `train.gemm_ms_per_step`) over the step's wall time.
    /// Where they were not timed, `compute_share`.
    pub effective_compute_ratio: f64,
    /// (forward + backward + recompute + optimizer) / step: the compute phases' share.
    #[serde(default)]
    pub compute_share: f64,
    /// Model FLOPs per second over the machine's peak; null (NaN) when withheld.
    pub mfu: f64,
    /// A frame loader's stages per batch (the episode loader); absent for other sources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frame_stages: Option<FrameStages>,
    /// A pipeline stage's medians over the measured steps (this rank's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline_stage: Option<crate::pipeline::StageStep>,
    /// A pipeline-parallel run's bubble, stage by stage (rank 0's merged report).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<crate::pipeline::PipelineReport>,
    /// Why `mfu` is withheld: above 1 even against a peak measured again at the end of the run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mfu_withheld: Option<String>,
    /// Model FLOPs per second over the peak, counting only the compute phases' time.
    pub compute_mfu: f64,
    /// Peak memory: RSS on the CPU, device memory on a GPU.
    pub peak_memory_bytes: u64,
    /// Steps slower than mean + outlier_sigma · std.
    pub outlier_steps: Vec<u64>,
    /// For each removable phase, step / (step - phase): the speed-up if it vanished.
    pub amdahl: BTreeMap<Phase, f64>,
    /// Milliseconds per step the profiler's own observer spent (the median step, measured in every run).
    pub profiler_overhead_ms: f64,
    /// Findings, largest bound first.
    pub findings: Vec<Finding>,
    /// A data-parallel run's ranks (rank 0's merged report only; absent on one process). In such a
    /// run the headline rates (`tokens_per_s`, `samples_per_s`, `mfu` against every rank's peak)
    /// are the job's, all ranks together, and `rank0` keeps rank 0's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<RanksReport>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank0: Option<RankRates>,
    /// Training dynamics (evaluation, spikes, per-block monitors), when the run recorded any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamics: Option<crate::dynamics::Dynamics>,
    pub model: ModelFacts,
    pub train: TrainFacts,
    pub machine: MachineFacts,
    /// What the run ran on (versions, performance-relevant variables), as the binary that ran it
    /// captured it; the profiler carries it through unread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<serde_json::Value>,
    /// NVML's readings of the run's GPUs over the run (a run on a GPU); or why there are none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<crate::GpuSummary>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_health_error: Option<String>,
}

/// One rank's own headline rates, beside the job's in a multi-rank report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankRates {
    pub tokens_per_s: f64,
    pub tokens_per_s_mean: f64,
    pub samples_per_s: f64,
    pub mfu: f64,
}

/// The steps after the first `skip` (all of them when the run was shorter), and of those the
/// exactly timed ones (all measured ones when none was).
pub(crate) fn measured_steps(steps: &[StepSample], skip: u64) -> (Vec<&StepSample>, Vec<&StepSample>) {
    let first = steps.first().map_or(0, |s| s.step);
    let mut measured: Vec<&StepSample> = steps.iter().filter(|s| s.step >= first + skip).collect();
    if measured.is_empty() {
        measured = steps.iter().collect();
    }
    let mut timed: Vec<&StepSample> = measured.iter().copied().filter(|s| s.timed).collect();
    if timed.is_empty() {
        timed = measured.clone();
    }
    (measured, timed)
}

/// Each phase's share of the timed steps' summed wall time, and communication's. Time-weighted
/// over every timed step, so a cost that comes every few steps (a checkpoint, a slow batch) counts
/// at its average rate, as it does in the run's wall time.
fn mean_shares(timed: &[&StepSample]) -> (PhaseTimes, f64) {
    let wall: f64 = timed.iter().map(|s| s.wall_ms).sum();
    let mut shares = PhaseTimes::default();
    let mut comm = 0.0;
    if wall > 0.0 {
        for sample in timed {
            for (phase, ms) in sample.phases.iter() {
                shares.add(phase, ms / wall);
            }
            comm += sample.comm_total_ms / wall;
        }
    }
    (shares, comm)
}

/// The figures of a run's report from its steps, without findings (`step::build_report` adds them).
/// `profiler_ms` is the total time the profiler's observers spent; `peak_memory_bytes` the run's peak.
pub(crate) fn measure_report(
    facts: &RunFacts,
    steps: &[StepSample],
    peak_memory_bytes: u64,
    profiler_ms: f64,
    config: &ProfConfig,
) -> RunReport {
    let (measured, timed) = measured_steps(steps, config.skip_steps);
    let walls: Vec<f64> = measured.iter().map(|s| s.wall_ms).collect();
    let spread = Spread::of(&walls);
    let step_ms = if spread.median.is_finite() { spread.median } else { 0.0 };
    let outlier_steps: Vec<u64> = measured
        .iter()
        .filter(|s| spread.std > 0.0 && s.wall_ms > spread.mean + config.outlier_sigma * spread.std)
        .map(|s| s.step)
        .collect();
    let tokens: Vec<f64> = measured.iter().map(|s| s.tokens as f64).collect();
    let tokens_per_step = median(&tokens);
    let tokens_per_s = tokens_per_s_fn(tokens_per_step, step_ms);
    let tokens_per_s_mean = tokens_per_s_fn(tokens.iter().sum(), walls.iter().sum());
    let tokens_per_s_p90_step = tokens_per_s_fn(tokens_per_step, spread.p90);
    let samples_per_s = tokens_per_s / facts.model.seq_len.max(1) as f64;
    let (shares, comm_share) = mean_shares(&timed);
    let phase_shares: BTreeMap<Phase, f64> = shares.iter().collect();
    let phases: BTreeMap<Phase, f64> = shares.iter().map(|(phase, share)| (phase, share * step_ms)).collect();
    let compute_share = shares.compute();
    let effective_compute_ratio = match facts.train.gemm_ms_per_step {
        Some(gemm) if step_ms > 0.0 && gemm > 0.0 => gemm / step_ms,
        _ => compute_share,
    };
    let peak = facts.machine.peak_flops;
    let model_flops_per_s = facts.model.flops_per_token * tokens_per_s;
    let mfu = if peak > 0.0 { model_flops_per_s / peak } else { 0.0 };
    let compute_mfu = if compute_share > 0.0 { mfu / compute_share } else { 0.0 };
    let amdahl = Phase::REMOVABLE.iter().map(|&p| (p, amdahl(step_ms, phases[&p]))).collect();
    let frame_stages = measured.last().and_then(|last| FrameStages::of(last));
    let stage_steps: Vec<crate::pipeline::StageStep> = measured.iter().filter_map(|s| s.pipeline).collect();
    let pipeline_stage = (!stage_steps.is_empty()).then(|| crate::pipeline::StageStep {
        wait_ms: stoke_stats::median(&stage_steps.iter().map(|s| s.wait_ms).collect::<Vec<_>>()),
        span_ms: stoke_stats::median(&stage_steps.iter().map(|s| s.span_ms).collect::<Vec<_>>()),
    });
    RunReport {
        name: facts.name.clone(),
        steps_measured: measured.len() as u64,
        steps_timed: timed.len() as u64,
        step_ms,
        step_ms_mean: spread.mean,
        step_ms_p90: spread.p90,
        step_ms_std: spread.std,
        tokens_per_s,
        tokens_per_s_mean,
        samples_per_s,
        frames_per_s: samples_per_s * facts.model.frames_per_sample as f64,
        tokens_per_s_p90_step,
        phases,
        phase_shares,
        comm_total_ms: comm_share * step_ms,
        effective_compute_ratio,
        compute_share,
        mfu,
        compute_mfu,
        peak_memory_bytes,
        outlier_steps,
        amdahl,
        profiler_overhead_ms: profiler_ms / steps.len().max(1) as f64,
        findings: Vec::new(),
        ranks: None,
        rank0: None,
        mfu_withheld: None,
        dynamics: None,
        model: facts.model.clone(),
        train: facts.train.clone(),
        machine: facts.machine.clone(),
        environment: None,
        gpus: Vec::new(),
        gpu_health_error: None,
        frame_stages,
        pipeline_stage,
        pipeline: None,
    }
}

/// Where a frame loader's threads spent a batch's time, ms (summed over the threads): decoding
/// encoded frames, augmenting them, and the rest (reading records, assembling the batch).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FrameStages {
    pub batches: u64,
    pub decode_ms: f64,
    pub augment_ms: f64,
    pub read_ms: f64,
}

impl FrameStages {
    /// Per batch, from the counters at the run's last measured step: every batch of the run so far
    /// (prefetching makes the next ones while a step runs, so no step's own batches can be told).
    fn of(last: &StepSample) -> Option<FrameStages> {
        let last = last.frame_stages?;
        if last.batches == 0 {
            return None;
        }
        let per_batch = |ns: u64| ns as f64 / 1e6 / last.batches as f64;
        let (decode_ms, augment_ms) = (per_batch(last.decode_ns), per_batch(last.augment_ns));
        let read_ms = (per_batch(last.busy_ns) - decode_ms - augment_ms).max(0.0);
        Some(FrameStages { batches: last.batches, decode_ms, augment_ms, read_ms })
    }

    /// The stage most of a batch's time goes to: its name and what makes it faster.
    pub fn dominant(&self) -> (&'static str, &'static str) {
        if self.decode_ms >= self.augment_ms && self.decode_ms >= self.read_ms {
            (
                "decoding frames",
                "prepare the frames decoded once (stoke prep episodes without --keep-encoded), or raise data.workers",
            )
        } else if self.augment_ms >= self.read_ms {
            ("augmenting frames", "raise data.workers (each sample's crop and jitter run on the loader's threads)")
        } else {
            (
                "reading records and assembling batches",
                "keep the prepared folder on faster storage or in the page cache, and raise data.prefetch",
            )
        }
    }
}

fn human_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else {
        format!("{:.1} MB", b / 1e6)
    }
}

/// Formats a bound: "1.25x", or "-" when unknown.
pub fn format_bound(bound: Option<f64>) -> String {
    match bound {
        Some(b) if b.is_finite() => format!("{b:.2}x"),
        Some(_) => "inf".into(),
        None => "-".into(),
    }
}

impl RunReport {
    /// The report as the terminal shows it at the end of every run.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "step report: {} steps measured ({} timed) | {:.2} ms/step median (mean {:.2}, p90 {:.2}, std {:.2}) | \
             {:.0} tokens/s median (mean {:.0}, p90 step {:.0})",
            self.steps_measured,
            self.steps_timed,
            self.step_ms,
            self.step_ms_mean,
            self.step_ms_p90,
            self.step_ms_std,
            self.tokens_per_s,
            self.tokens_per_s_mean,
            self.tokens_per_s_p90_step
        );
        if self.model.frames_per_sample > 0 {
            let _ = writeln!(
                out,
                "  robot samples: {:.1} samples/s, {:.0} camera frames/s ({} a sample)",
                self.samples_per_s, self.frames_per_s, self.model.frames_per_sample
            );
        }
        if let (Some(rank0), Some(ranks)) = (&self.rank0, &self.ranks) {
            let _ = writeln!(
                out,
                "  the job's {:.0} tokens/s, {:.1} samples/s and MFU over all {} ranks; rank 0 alone: {:.0} tokens/s, \
                 {:.1} samples/s, MFU {:.2}%",
                self.tokens_per_s,
                self.samples_per_s,
                ranks.world_size,
                rank0.tokens_per_s,
                rank0.samples_per_s,
                100.0 * rank0.mfu
            );
        }
        let _ = writeln!(out, "  {:<13} {:>10} {:>7} {:>9}", "phase", "ms/step", "share", "bound");
        for phase in Phase::ALL {
            let ms = self.phases[&phase];
            let bound = self.amdahl.get(&phase).map(|b| format_bound(Some(*b))).unwrap_or_default();
            if ms == 0.0 && phase != Phase::DataWait {
                continue;
            }
            let _ = writeln!(
                out,
                "  {:<13} {:>10.2} {:>6.1}% {:>9}",
                phase.name(),
                ms,
                100.0 * self.phase_shares[&phase],
                bound
            );
        }
        if self.comm_total_ms > 0.0 {
            let _ = writeln!(
                out,
                "  {:<13} {:>10.2} (overlapped or not; not in the sum)",
                "comm_total", self.comm_total_ms
            );
        }
        let mfu = match &self.mfu_withheld {
            Some(reason) => format!("MFU withheld ({reason})"),
            None => format!(
                "MFU {:.2}% of {:.1} GFLOP/s ({} {}; peak {})",
                100.0 * self.mfu,
                self.machine.peak_flops / 1e9,
                self.machine.device,
                self.train.precision,
                self.machine.peak_source.as_deref().unwrap_or("as given")
            ),
        };
        let ecr = match self.train.gemm_ms_per_step {
            Some(gemm) => format!(
                "effective compute ratio {:.3} (matrix multiplies alone {gemm:.2} ms of the step) | compute phases {:.3}",
                self.effective_compute_ratio, self.compute_share
            ),
            None => format!("compute phases' share {:.3}", self.compute_share),
        };
        let _ = writeln!(out, "  {ecr} | {mfu} | peak memory {}", human_bytes(self.peak_memory_bytes));
        let _ = writeln!(
            out,
            "  outlier steps (> mean + 3 sigma): {} | profiler overhead {:.3} ms/step ({:.2}%)",
            self.outlier_steps.len(),
            self.profiler_overhead_ms,
            if self.step_ms > 0.0 { 100.0 * self.profiler_overhead_ms / self.step_ms } else { 0.0 }
        );
        if let Some(ranks) = &self.ranks {
            out.push_str(&ranks.render_text());
        }
        if let Some(pipeline) = &self.pipeline {
            out.push_str(&pipeline.render_text());
        }
        if self.findings.is_empty() {
            let _ = writeln!(out, "findings: none");
        } else {
            let _ = writeln!(out, "findings (largest bound first):");
            for f in &self.findings {
                let _ = writeln!(out, "  [{}] bound {} | {}", f.id, format_bound(f.bound), f.evidence);
                let _ = writeln!(out, "      cause: {}", f.cause);
                let _ = writeln!(out, "      fix:   {}", f.fix);
            }
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::step::build_report;
    use crate::vocab::Precision;

    pub(crate) fn facts() -> RunFacts {
        RunFacts {
            name: "t".into(),
            model: ModelFacts {
                n_layer: 2,
                n_head: 2,
                d_model: 64,
                seq_len: 32,
                vocab_size: 256,
                n_params: 100_000,
                n_trainable_params: 100_000,
                flops_per_token: 6e5,
                frames_per_sample: 0,
            },
            train: TrainFacts {
                micro_batch: 8,
                grad_accum: 1,
                precision: Precision::Bf16,
                world_size: 1,
                ..TrainFacts::default()
            },
            machine: MachineFacts {
                peak_flops: 1e12,
                peak_flops_fp32: Some(2.5e11),
                peak_flops_bf16: Some(1e12),
                device: "cpu".into(),
                memory_capacity_bytes: Some(1 << 34),
                peak_source: None,
            },
        }
    }

    /// A step from (phase, ms) pairs; the wall time is their sum.
    pub(crate) fn step(step: u64, parts: &[(Phase, f64)]) -> StepSample {
        let mut phases = PhaseTimes::default();
        for &(phase, ms) in parts {
            phases.add(phase, ms);
        }
        StepSample {
            step,
            wall_ms: phases.total(),
            phases,
            comm_total_ms: 0.0,
            tokens: 256,
            loss: 1.0,
            loss_scale: None,
            timed: true,
            frame_stages: None,
            pipeline: None,
        }
    }

    #[test]
    fn phases_sum_to_the_step_and_bounds_follow_amdahl() {
        let steps: Vec<StepSample> = (1..=20)
            .map(|i| {
                step(
                    i,
                    &[(Phase::DataWait, 2.0), (Phase::Forward, 3.0), (Phase::Backward, 4.0), (Phase::Optimizer, 1.0)],
                )
            })
            .collect();
        let report = build_report(&facts(), &steps, 1 << 20, 0.0, &ProfConfig::default());
        let sum: f64 = report.phases.values().sum();
        assert!((sum - report.step_ms).abs() < 1e-9);
        assert_eq!(report.step_ms, 10.0);
        assert_eq!(report.steps_measured, 19);
        assert!((report.effective_compute_ratio - 0.8).abs() < 1e-12);
        assert!((report.amdahl[&Phase::DataWait] - 10.0 / 8.0).abs() < 1e-12);
        // 256 tokens per 10 ms = 25600 tokens/s; 6e5 FLOPs each over 1e12.
        assert!((report.tokens_per_s - 25_600.0).abs() < 1e-6);
        assert!((report.mfu - 25_600.0 * 6e5 / 1e12).abs() < 1e-12);
        assert!(report.render_text().contains("data_wait"));
    }

    #[test]
    fn a_withheld_mfu_is_printed_as_its_reason_and_written_as_null() {
        let steps: Vec<StepSample> = (1..=5).map(|i| step(i, &[(Phase::Forward, 3.0)])).collect();
        let mut report = build_report(&facts(), &steps, 0, 0.0, &ProfConfig::default());
        report.mfu = f64::NAN;
        report.mfu_withheld = Some("MFU would be 1.184 against a peak measured again now".into());
        let text = report.render_text();
        assert!(text.contains("MFU withheld (MFU would be 1.184") && !text.contains("MFU NaN"), "{text}");
        let json: serde_json::Value = serde_json::from_str(&serde_json::to_string(&report).unwrap()).unwrap();
        assert!(json["mfu"].is_null() && json["mfu_withheld"].is_string(), "{json}");
    }

    #[test]
    fn untimed_steps_count_for_throughput_not_for_the_split() {
        let mut steps: Vec<StepSample> =
            (1..=10).map(|i| step(i, &[(Phase::Forward, 5.0), (Phase::Other, 5.0)])).collect();
        for s in steps.iter_mut().filter(|s| s.step % 2 == 0) {
            s.timed = false;
            s.phases = PhaseTimes::default();
            s.phases.add(Phase::Forward, 10.0);
        }
        let report = build_report(&facts(), &steps, 0, 0.0, &ProfConfig::default());
        assert_eq!(report.steps_timed, 4);
        assert_eq!(report.phases[&Phase::Other], 5.0);
    }

    #[test]
    fn the_headline_is_the_median_when_the_machine_was_busy_for_a_third_of_the_run() {
        // Steps 1-100 shared the cores with another process (everything 4x slower, the data wait
        // 20x); steps 101-300 are the steady state: 10 ms, of which 1 ms data_wait.
        let steps: Vec<StepSample> = (1..=300)
            .map(|i| {
                let busy = i <= 100;
                let parts = [
                    (Phase::DataWait, if busy { 20.0 } else { 1.0 }),
                    (Phase::Forward, if busy { 12.0 } else { 3.0 }),
                    (Phase::Backward, if busy { 20.0 } else { 5.0 }),
                    (Phase::Optimizer, if busy { 4.0 } else { 1.0 }),
                ];
                step(i, &parts)
            })
            .collect();
        let report = build_report(&facts(), &steps, 0, 0.0, &ProfConfig::default());
        assert_eq!(report.step_ms, 10.0);
        assert_eq!(report.tokens_per_s, 25_600.0);
        assert!(report.step_ms_mean > 25.0 && report.step_ms_p90 == 56.0, "{}", report.render_text());
        // 299 steps of 256 tokens in 99 x 56 + 200 x 10 ms; the p90 step took 56 ms.
        assert!((report.tokens_per_s_mean - 299.0 * 256.0 / 7.544).abs() < 1e-6);
        assert!((report.tokens_per_s_p90_step - 256.0 / 0.056).abs() < 1e-6);
        // The split weighs every step by its time and sums to the headline.
        let data_wait_share = (99.0 * 20.0 + 200.0 * 1.0) / 7544.0;
        assert!((report.phase_shares[&Phase::DataWait] - data_wait_share).abs() < 1e-12);
        assert!((report.phases.values().sum::<f64>() - report.step_ms).abs() < 1e-9);
        assert!((report.amdahl[&Phase::DataWait] - 1.0 / (1.0 - data_wait_share)).abs() < 1e-9);
        let text = report.render_text();
        assert!(text.contains("10.00 ms/step median") && text.contains("25600 tokens/s median"), "{text}");
    }

    #[test]
    fn a_checkpoint_every_ten_steps_counts_at_its_average_rate() {
        let steps: Vec<StepSample> = (1..=101)
            .map(|i| {
                let stall = if i % 10 == 0 { 10.0 } else { 0.0 };
                step(
                    i,
                    &[
                        (Phase::Forward, 4.0),
                        (Phase::Backward, 5.0),
                        (Phase::Optimizer, 1.0),
                        (Phase::CkptStall, stall),
                    ],
                )
            })
            .collect();
        let report = build_report(&facts(), &steps, 0, 0.0, &ProfConfig::default());
        // The median step does not checkpoint; one step in ten adds 10 ms: 100 of 1100 ms.
        assert_eq!(report.step_ms, 10.0);
        assert!((report.phase_shares[&Phase::CkptStall] - 100.0 / 1100.0).abs() < 1e-12);
        assert!(report.findings.iter().any(|f| f.id == "ckpt_stall"), "{}", report.render_text());
    }

    #[test]
    fn a_slow_step_is_an_outlier() {
        let mut steps: Vec<StepSample> =
            (1..=200).map(|i| step(i, &[(Phase::Forward, 10.0 + (i % 3) as f64)])).collect();
        steps[150] = step(151, &[(Phase::Forward, 40.0)]);
        let report = build_report(&facts(), &steps, 0, 0.0, &ProfConfig::default());
        assert_eq!(report.outlier_steps, vec![151]);
    }
}
