//! What the loop tells its observers: the closed `TrainEvent` enum and the records it carries.

use std::path::{Path, PathBuf};
use stoke_prof::PhaseTimes;

use tch::Device;

use crate::config::{GptShape, Precision, Recompute};
use crate::TrainError;

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRecord {
    /// 1-based: the number of optimizer steps completed, counting this one.
    pub step: u64,
    /// Mean loss over the step's micro-batches; NaN on steps that were not logged.
    pub loss: f64,
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub tokens: u64,
    pub wall_ms: f64,
    /// When the step ended (its clock stopped): observers that place the step on a time line take
    /// this, not the moment the record reaches them, which on a loaded machine can be later.
    pub ended: std::time::Instant,
    pub phases: PhaseTimes,
    pub logged: bool,
    /// True when the phase boundaries were synchronized with the device, so the phase split is
    /// exact: always on the CPU, every `sync_every` steps on a GPU.
    pub timed: bool,
    /// All communication time of the step, hidden or exposed (0 on one process).
    pub comm_total_ms: f64,
    /// fp16: the loss scale this step's backward used; None under fp32 and bf16.
    pub loss_scale: Option<f64>,
    /// fp16: true when this step's gradients overflowed and its update was skipped.
    pub skipped: bool,
    /// Per-block gradient norms and update/parameter ratios, on monitored steps
    /// (`train.monitor_every`).
    pub monitors: Option<BlockMonitors>,
    /// How many standard deviations this logged loss lies above the mean of the previous
    /// `train.spike_window` logged losses; None until the window holds enough losses.
    pub loss_z: Option<f64>,
    /// The held-out evaluation made after this step, on evaluation steps (`eval.every`).
    pub eval: Option<EvalRecord>,
    /// Adaptive batch size: the gradient noise scale estimate (sequences).
    pub noise_scale: Option<f64>,
    /// Adaptive batch size: the batch grew after this step.
    pub batch_change: Option<BatchChange>,
    /// The episode loader's counters so far (decode, augmentation, its threads' busy time); None
    /// for sources that decode no frames.
    pub frame_stages: Option<stoke_data::EpisodeLoaderStats>,
    /// A pipeline stage: milliseconds blocked on its neighbours, and the schedule's span.
    pub pipeline: Option<(f64, f64)>,
}

/// Per-unit (embedding, each block, head) figures of one step, in unit order (`RunInfo::units`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct BlockMonitors {
    /// Gradient norm of each unit (loss scale divided out, before clipping).
    pub grad_norm: Vec<f64>,
    /// ||w_after - w_before|| / ||w_before|| of each unit.
    pub update_ratio: Vec<f64>,
}

/// One evaluation on held-out data.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EvalRecord {
    pub loss: f64,
    pub perplexity: f64,
    /// Tokens the evaluation read.
    pub tokens: u64,
    /// True when this is the lowest evaluation loss so far (its checkpoint is kept with
    /// `eval.keep_best`); early stopping counts only improvements of more than `eval.min_delta`.
    pub best: bool,
    /// True when early stopping ends the run after this step.
    pub stop: bool,
}

/// The end of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub first_step: u64,
    pub last_step: u64,
    pub steps_run: u64,
    pub tokens: u64,
    pub wall_s: f64,
    pub tokens_per_s: f64,
    pub first_loss: f64,
    pub final_loss: f64,
    pub best_loss: f64,
    pub interrupted: bool,
    /// fp16: updates skipped for overflowing gradients over the whole run (resumes included).
    pub skipped_steps: u64,
    /// fp16: the loss scale at the end.
    pub loss_scale: Option<f64>,
    /// Activation memory, measured on the run's first step (CPU only).
    pub memory: Option<MemoryReport>,
    /// True when early stopping (`eval.patience`) ended the run.
    pub early_stopped: bool,
    /// The best evaluation so far: (step, loss).
    pub best_eval: Option<(u64, f64)>,
}

/// Activation memory of one micro-batch, measured through the C allocator on a CPU.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryReport {
    /// The recomputation policy it was measured under.
    pub recompute: Recompute,
    /// Bytes each block's kept activations hold at the end of the forward pass.
    pub activation_bytes_per_block: Vec<u64>,
    /// Host bytes in use at the end of the forward pass of the step's first micro-batch minus
    /// before it: all activations the backward will need.
    pub activation_bytes: u64,
    /// Host bytes in use at that moment: parameters, gradients, optimizer state and activations.
    pub peak_bytes_in_use: u64,
}

/// Facts about the run that observers need up front.
#[derive(Debug, Clone)]
pub struct RunInfo {
    pub shape: GptShape,
    pub n_params: usize,
    /// Parameters that train: the flat buffers' elements (frozen ones are outside them).
    pub n_trainable_params: usize,
    /// Training FLOPs per token, the model's own count (`Model::flops_per_token`): MFU's numerator.
    pub flops_per_token: f64,
    /// Camera frames a sample reads (a vla model); 0 for text models.
    pub frames_per_sample: usize,
    pub precision: Precision,
    /// The model's bf16 products run widened to fp32 (`Model::widened_products`).
    pub widened_products: bool,
    pub device: Device,
    pub micro_batch: usize,
    pub grad_accum: usize,
    pub tokens_per_step: u64,
    pub start_step: u64,
    pub total_steps: u64,
    pub resumed_from: Option<PathBuf>,
    pub recompute: Recompute,
    /// The units' names (embedding, blocks, head), the order of `BlockMonitors`.
    pub units: Vec<String>,
    /// Sequences per optimizer step over all processes.
    pub global_batch: usize,
    /// The model's matrix multiplies, as the planner describes the model (widths, key/value heads,
    /// MLP, head, adapters): what the profiler times alone for the effective compute ratio.
    pub matmuls: stoke_plan::ModelConfig,
}

/// Everything the loop tells its observers.
#[derive(Debug)]
pub enum TrainEvent<'a> {
    Started(&'a RunInfo),
    Step(&'a StepRecord),
    /// A checkpoint is committed on disk (with background writes, some steps after its snapshot).
    CheckpointSaved {
        step: u64,
        path: &'a Path,
    },
    Finished(&'a Summary),
}

pub type ObserverError = Box<dyn std::error::Error + Send + Sync>;

/// Listens to a run. An error stops the run after the current step.
pub trait Observer {
    fn on_event(&mut self, event: &TrainEvent<'_>) -> Result<(), ObserverError>;
}

pub(super) fn notify(observers: &mut [&mut dyn Observer], event: &TrainEvent<'_>) -> Result<(), TrainError> {
    for observer in observers.iter_mut() {
        observer.on_event(event).map_err(|e| TrainError::Observer(e.to_string()))?;
    }
    Ok(())
}

/// The adaptive batch size grew the batch after this step.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct BatchChange {
    /// Global batch in sequences, before and after.
    pub from: usize,
    pub to: usize,
    /// The gradient noise scale (sequences) that justified it.
    pub noise_scale: f64,
}
