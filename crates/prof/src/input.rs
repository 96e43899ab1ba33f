//! What the profiler is told: each step's measurement (`StepSample`), the facts of the run
//! (`RunFacts`: model, training settings, machine) and the thresholds of its rules (`ProfConfig`).
//! Plain data that the report, the rules and the ranks' merge all read.

use serde::{Deserialize, Serialize};

use crate::error::ProfError;
use crate::vocab::{PhaseTimes, Precision};

/// What one optimizer step measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepSample {
    /// 1-based step number.
    pub step: u64,
    pub wall_ms: f64,
    /// Milliseconds per phase; they sum to `wall_ms`.
    pub phases: PhaseTimes,
    /// All communication time of the step, overlapped or not (0 on one process).
    pub comm_total_ms: f64,
    /// Tokens this process trained on in the step.
    pub tokens: u64,
    /// Mean loss; NaN when the step was not logged.
    pub loss: f64,
    /// The loss scale after the step, when the run scales its loss (fp16); None otherwise.
    pub loss_scale: Option<f64>,
    /// True when phase boundaries were synchronized with the device, so the phase split is exact.
    /// Always true on the CPU; on a GPU only on sampled steps.
    pub timed: bool,
    /// A loader that decodes and augments frames: its counters so far (cumulative).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frame_stages: Option<FrameCounters>,
    /// A pipeline stage's waits on its neighbours and its schedule's span.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<crate::pipeline::StageStep>,
}

/// A frame loader's cumulative counters: batches made, and nanoseconds its threads spent decoding,
/// augmenting, and busy in all (reading records and assembling batches are the rest).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct FrameCounters {
    pub batches: u64,
    pub decode_ns: u64,
    pub augment_ns: u64,
    pub busy_ns: u64,
}

/// `report.json`'s `model`: the shape and its arithmetic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelFacts {
    pub n_layer: usize,
    pub n_head: usize,
    pub d_model: usize,
    pub seq_len: usize,
    pub vocab_size: usize,
    pub n_params: usize,
    /// Parameters that train (all of them unless `train.freeze` or LoRA froze some; with LoRA
    /// the adapters). Reports written before it existed read as 0.
    #[serde(default)]
    pub n_trainable_params: usize,
    /// Training FLOPs per token: 6N + 12·L·H·Q·T (PaLM, appendix B).
    pub flops_per_token: f64,
    /// Camera frames a sample reads (a vision-language-action model); 0 for text models.
    #[serde(default)]
    pub frames_per_sample: usize,
}

/// `report.json`'s `train`.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainFacts {
    pub micro_batch: usize,
    pub grad_accum: usize,
    pub precision: Precision,
    pub world_size: usize,
    /// Ranks one model is cut over (`dist.tensor`, tensor parallelism): the job's data-parallel
    /// copies are `world_size / tensor`. 0 (absent from an older report) means 1.
    #[serde(default)]
    pub tensor: usize,
    /// Pipeline stages one model copy is cut into (`dist.pipeline`); 0 (absent) means 1.
    #[serde(default)]
    pub pipeline: usize,
    /// The pipeline's schedule (`dist.pipeline_schedule`); empty without stages.
    #[serde(default)]
    pub pipeline_schedule: String,
    /// Model chunks per stage (the interleaved schedule's); 0 (absent) means 1.
    #[serde(default)]
    pub pipeline_chunks: usize,
    /// The activation recomputation policy (`train.recompute`).
    #[serde(default)]
    pub recompute: String,
    /// Host bytes each block's kept activations held, measured on the first step (CPU only;
    /// empty when not measured).
    #[serde(default)]
    pub activation_bytes_per_block: Vec<u64>,
    /// Host bytes of all activations of one micro-batch at the step's peak, and the process's
    /// bytes in use then (parameters, gradients, optimizer state and activations).
    #[serde(default)]
    pub activation_bytes: Option<u64>,
    #[serde(default)]
    pub step_peak_bytes_in_use: Option<u64>,
    /// fp16: the loss scale at the end, and the updates skipped for overflowing gradients.
    #[serde(default)]
    pub loss_scale: Option<f64>,
    #[serde(default)]
    pub skipped_steps: u64,
    /// The step's matrix multiplies timed alone, at its shapes, precision, device and threads, ms
    /// (the fastest timing; all micro-batches, recomputation included): the effective compute
    /// ratio's numerator. None when not measured.
    #[serde(default)]
    pub gemm_ms_per_step: Option<f64>,
    /// Those multiplies' FLOP/s when timed alone.
    #[serde(default)]
    pub gemm_flops_per_s: Option<f64>,
}

/// `report.json`'s `machine`: what the run ran on, measured on it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MachineFacts {
    /// Peak FLOP/s of one device in the run's precision (a large matmul, measured).
    pub peak_flops: f64,
    /// Measured fp32 and bf16 peaks, when both are known (the fp32 rule compares them).
    pub peak_flops_fp32: Option<f64>,
    pub peak_flops_bf16: Option<f64>,
    /// "cpu" or "cuda".
    pub device: String,
    /// Memory the run can use: RAM on the CPU, device memory on a GPU; None when unknown.
    pub memory_capacity_bytes: Option<u64>,
    /// Where `peak_flops` came from: measured in this run, or cached (when, at what load).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_source: Option<String>,
}

/// Everything about a run the report needs besides its steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunFacts {
    pub name: String,
    pub model: ModelFacts,
    pub train: TrainFacts,
    pub machine: MachineFacts,
}

/// `[prof]`: the profiler's outputs and the thresholds of its rules.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProfConfig {
    /// Write trace.json, report.json and report.html and serve /metrics. Default true.
    pub enabled: bool,
    /// Steps at the start left out of the report (allocator warm-up, lazy initialization). Default 1.
    pub skip_steps: u64,
    /// On a GPU, synchronize at phase boundaries every this many steps, so those steps' phases are
    /// exact (the report uses them); 1 = every step, 0 = never. The CPU is always exact. Default 10.
    pub sync_every: u64,
    /// Time the step's matrix multiplies alone (the effective compute ratio's numerator) at the
    /// start and again every this many steps, keeping the fastest; 0 = at the start only.
    /// Default 100.
    pub ecr_every: u64,
    /// Write a Chrome trace (trace.json, one span per phase per step). Default true.
    pub trace: bool,
    /// Write report.html with plots. Default true.
    pub html: bool,
    /// Serve Prometheus metrics at http://<prometheus_host>:<prometheus_port>/metrics while training.
    /// Default true.
    pub prometheus: bool,
    /// Address the metrics endpoint listens on. Default "127.0.0.1".
    pub prometheus_host: String,
    /// Port of the metrics endpoint; 0 picks a free one (written to metrics.addr). Default 9477.
    pub prometheus_port: u16,
    /// Rule data_wait: fires when waiting for data exceeds this share of the step. Default 0.05.
    pub data_wait_max: f64,
    /// Rule comm_exposed: fires when communication the step waits for exceeds this share. Default 0.1.
    pub comm_exposed_max: f64,
    /// Rule low_compute_ratio: fires when the effective compute ratio (the step's matrix multiplies
    /// timed alone, over the step) is below this. Default 0.7.
    pub compute_ratio_min: f64,
    /// Rule memory_pressure: fires when peak memory exceeds this share of capacity. Default 0.9.
    pub memory_max: f64,
    /// Rule ckpt_stall: fires when checkpoint stalls exceed this share of the step. Default 0.02.
    pub ckpt_stall_max: f64,
    /// Rule fp32_on_bf16_hardware: fires on an fp32 run when the measured bf16 peak is at least this
    /// many times the fp32 peak; rule bf16_slower_than_fp32, on a bf16 or fp16 run when the fp32
    /// peak is at least this many times the bf16 one. Default 1.5.
    pub bf16_speedup_min: f64,
    /// Rule loss_scale_thrashing: fires when the loss scale changes on more than this share of steps.
    /// Default 0.05.
    pub loss_scale_changes_max: f64,
    /// A step is an outlier when its time exceeds the mean by this many standard deviations. Default 3.0.
    pub outlier_sigma: f64,
    /// Rule step_outliers: fires when outliers are more than this share of steps. Default 0.01.
    pub outlier_fraction_max: f64,
    /// Rule small_batch: fires when the compute phases reach less than this share of peak FLOP/s...
    /// Default 0.3.
    pub batch_mfu_min: f64,
    /// ...and a micro-batch holds fewer tokens than this (micro_batch x seq_len). Default 8192.
    pub batch_tokens_small: u64,
    /// Rule straggler (data-parallel runs): fires when the slowest rank's busy time per step (step
    /// minus comm_exposed) exceeds the median rank's by more than this share. Default 0.2.
    pub straggler_min: f64,
    /// Rule loss_spike: fires when a logged loss lies more than this many standard deviations above
    /// the mean of the previous train.spike_window logged losses. Default 4.0.
    pub loss_spike_z: f64,
    /// Rule update_ratio: fires when a block's ||update|| / ||weights|| in one step exceeds this.
    /// Default 0.01.
    pub update_ratio_max: f64,
}

impl Default for ProfConfig {
    fn default() -> Self {
        ProfConfig {
            enabled: true,
            skip_steps: 1,
            sync_every: 10,
            ecr_every: 100,
            trace: true,
            html: true,
            prometheus: true,
            prometheus_host: "127.0.0.1".into(),
            prometheus_port: 9477,
            data_wait_max: 0.05,
            comm_exposed_max: 0.10,
            compute_ratio_min: 0.70,
            memory_max: 0.90,
            ckpt_stall_max: 0.02,
            bf16_speedup_min: 1.5,
            loss_scale_changes_max: 0.05,
            outlier_sigma: 3.0,
            outlier_fraction_max: 0.01,
            batch_mfu_min: 0.3,
            batch_tokens_small: 8192,
            straggler_min: 0.20,
            loss_spike_z: 4.0,
            update_ratio_max: 0.01,
        }
    }
}

impl ProfConfig {
    /// Names the first key whose value is out of range.
    pub fn validate(&self) -> Result<(), ProfError> {
        let invalid = |key, message| Err(ProfError::InvalidConfig { key, message });
        for (key, value) in [
            ("data_wait_max", self.data_wait_max),
            ("comm_exposed_max", self.comm_exposed_max),
            ("compute_ratio_min", self.compute_ratio_min),
            ("memory_max", self.memory_max),
            ("ckpt_stall_max", self.ckpt_stall_max),
            ("loss_scale_changes_max", self.loss_scale_changes_max),
            ("outlier_fraction_max", self.outlier_fraction_max),
            ("batch_mfu_min", self.batch_mfu_min),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return invalid(key, format!("must be a share between 0 and 1; got {value}"));
            }
        }
        for (key, value) in [
            ("bf16_speedup_min", self.bf16_speedup_min),
            ("outlier_sigma", self.outlier_sigma),
            ("straggler_min", self.straggler_min),
            ("loss_spike_z", self.loss_spike_z),
            ("update_ratio_max", self.update_ratio_max),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return invalid(key, format!("must be a finite number > 0; got {value}"));
            }
        }
        Ok(())
    }
}
