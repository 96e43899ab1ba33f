//! The trainer's state, shared by the loop and its parts (each part an `impl Trainer` in its own file).

use std::path::PathBuf;

use stoke_data::BatchSource;
use tch::{Device, Tensor};

use crate::adaptive::{AdaptiveConfig, NoiseScale};
use crate::config::{CkptConfig, EvalConfig, TrainConfig};
use crate::executor::Executor;
use crate::models::Model;
use crate::optimizers::Optimizer;
use crate::precision::LossScaler;

pub struct Trainer {
    pub(super) train: TrainConfig,
    pub(super) ckpt: CkptConfig,
    pub(super) model: Box<dyn Model>,
    pub(super) optimizer: Optimizer,
    pub(super) executor: Executor,
    /// fp16 only.
    pub(super) scaler: Option<LossScaler>,
    /// Test hook: poison the gradients of this step (1-based) with an inf.
    pub(super) inject_overflow_at: Option<u64>,
    pub(super) device: Device,
    /// Optimizer steps completed.
    pub(super) step: u64,
    pub(super) resumed_from: Option<PathBuf>,
    /// Synchronize a GPU at phase boundaries every this many steps (0: never).
    pub(super) sync_every: u64,
    /// Threads of the fused CPU optimizer: libtorch's intra-op thread count.
    pub(super) n_threads: usize,
    /// Held-out evaluation, when set.
    pub(super) eval: Option<EvalState>,
    /// Micro-batches per step now (`train.grad_accum`, grown by the adaptive batch size).
    pub(super) grad_accum: usize,
    /// Adaptive batch size, when enabled.
    pub(super) adaptive: Option<AdaptiveState>,
    /// The optimizer runs on a ZeRO shard (`shard_optimizer`): its state is not laid out like
    /// the model, and per-unit monitors are not computed.
    pub(super) sharded: bool,
    /// The model's matrix multiplies as the planner counts them (`RunInfo::matmuls`).
    pub(super) matmuls: stoke_plan::ModelConfig,
    /// A vla model's shape, which its episode batches are checked against; None for token models.
    pub(super) episode_shape: Option<crate::config::VlaShape>,
    /// The pipeline stage this trainer runs (`set_stage`); None: every unit.
    pub(super) stage: Option<crate::dist::StageLink>,
    /// An interleaved stage's rounds (`super::rounds`), planned once in `set_stage`.
    pub(super) stage_rounds: Vec<super::rounds::Round>,
    /// The last step's pipeline waits and span, ms (a stage's `StepRecord::pipeline`).
    pub(super) stage_times: Option<(f64, f64)>,
}

/// The adaptive batch size's settings and state (the estimates are saved in checkpoints).
pub(super) struct AdaptiveState {
    pub(super) config: AdaptiveConfig,
    /// The budget in sequences.
    pub(super) max_batch: usize,
    pub(super) noise: NoiseScale,
    /// The flat gradient after the previous micro-batch, to take each micro-batch's own gradient.
    pub(super) previous_grad: Tensor,
    /// A logged loss since the last decision had a z-score above `stable_z`.
    pub(super) unstable: bool,
}

/// The held-out data and the early-stopping state (saved in checkpoints).
pub(super) struct EvalState {
    pub(super) config: EvalConfig,
    pub(super) source: Box<dyn BatchSource>,
    /// Best evaluation loss so far (inf before the first).
    pub(super) best: f64,
    pub(super) best_step: Option<u64>,
    /// Evaluations in a row without an improvement of more than `min_delta`.
    pub(super) stale: u64,
}
