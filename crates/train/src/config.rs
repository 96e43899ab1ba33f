//! The plain-data configuration of the model, the optimizer and the loop.
//!
//! Every field's default is stated in its doc; `validate` names the key of any value out of range.

mod executor;
mod finetune;
mod model;

use serde::{Deserialize, Serialize};

pub use executor::{ExecutorKind, Recompute};
pub use finetune::{glob_match, LoraConfig};
pub use model::{
    GptShape, LlamaShape, ModelConfig, RopeScaling, VlaShape, MODEL_FAMILIES, TENSOR_PARALLEL_FAMILIES, VLA_KEYPOINTS,
};

use crate::TrainError;

/// Arithmetic precision of the matrix multiplies. Master weights, optimizer state, layer norms and
/// the loss stay fp32 either way.
pub use stoke_prof::Precision;

/// `[train]`: the loop and the optimizer (AdamW, warmup + cosine).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Optimizer steps to run. Default 600.
    pub steps: u64,
    /// Step at which the cosine decay reaches `min_lr`; 0 takes `steps`. A resume that extends
    /// `steps` sets it to the original `steps`, so the schedule of the steps already run stays
    /// the same; set it on resume to stretch the decay instead. Default 0.
    pub lr_horizon: u64,
    /// Sequences per micro-batch, per process. Default 16.
    pub micro_batch: usize,
    /// Micro-batches accumulated into one optimizer step. Default 1.
    pub grad_accum: usize,
    /// Sequences per optimizer step over all ranks; 0 = `micro_batch` x ranks x `grad_accum`.
    /// When set, the accumulation is derived from it for the world size the run starts with (it
    /// must divide by `micro_batch` x ranks), so a run resumed or restarted on fewer or more
    /// processes keeps its global batch and its trajectory. Default 0.
    pub global_batch: usize,
    /// Seed of the initialization and the data order. Default 1337.
    pub seed: u64,
    /// Peak learning rate. Default 0.002.
    pub lr: f64,
    /// Learning rate at the end of the cosine decay. Default 0.0002.
    pub min_lr: f64,
    /// Linear warmup steps. Default 50.
    pub warmup_steps: u64,
    /// Decoupled weight decay on matrices and embeddings (not on biases and norms). Default 0.1.
    pub weight_decay: f64,
    /// AdamW beta1. Default 0.9.
    pub beta1: f64,
    /// AdamW beta2. Default 0.99.
    pub beta2: f64,
    /// AdamW epsilon. Default 1e-8.
    pub eps: f64,
    /// Global gradient-norm clip; 0 turns clipping off. Default 1.0.
    pub grad_clip: f64,
    /// "fp32", "bf16" (bf16 matrix multiplies, fp32 master weights) or "fp16" (fp16 matrix
    /// multiplies with dynamic loss scaling, see `loss_scale_*`). Default "bf16". A config file's
    /// "auto" is resolved when the run's config is loaded, by the device (`auto_precision`).
    pub precision: Precision,
    /// fp16 only: the loss scale of the first step. Default 65536.
    pub loss_scale_init: f64,
    /// fp16 only: multiply the loss scale by this after `loss_scale_interval` steps in a row whose
    /// gradients were finite. Default 2.
    pub loss_scale_growth: f64,
    /// fp16 only: multiply the loss scale by this when a step's gradients hold an inf or NaN (that
    /// step's update is skipped). Default 0.5.
    pub loss_scale_backoff: f64,
    /// fp16 only: finite steps in a row before the loss scale grows. Default 2000.
    pub loss_scale_interval: u64,
    /// Activation recomputation: the chosen parts of each block keep only their input in the
    /// forward pass and run their forward again inside the backward pass, trading compute for
    /// memory. "none", "mlp" (each block's LayerNorm + MLP half), "attention" (each block's
    /// LayerNorm + attention half), "block" (whole blocks), or "every:K" (whole blocks 0, K, 2K,
    /// ...). Default "none".
    pub recompute: Recompute,
    /// How the step runs the model: "blocks" (the block executor: unit by unit, with callbacks
    /// between units and recomputation) or "single-graph" (one autograd graph and one backward
    /// call; the reference the executor is measured against; no recomputation). Default "blocks".
    pub executor: ExecutorKind,
    /// Report loss and metrics every this many steps (reading the loss synchronizes a GPU). Default 1.
    pub log_every: u64,
    /// Read the NaN guard's flags every this many steps, where a step keeps its gradient norm on
    /// the device (AdamW or SGD on the tensor-op path: a GPU, or `fused_optimizer = false`; one
    /// process or plain data parallelism, not ZeRO or compressed gradients; no fp16 loss scaler,
    /// no adaptive batch): between reads the clip is computed on the device and nothing is read
    /// back. Logged steps and checkpoints always read them, the ranks agree on what they read, and
    /// a run still stops naming the first non-finite step. 0 takes `log_every`. Elsewhere the
    /// norm is read every step anyway and so is the guard. Default 0.
    pub guard_every: u64,
    /// Intra-op threads for libtorch; 0 leaves libtorch's default (one per core). Default 0.
    pub threads: usize,
    /// Attention under bf16: "fp32" (libtorch's scaled_dot_product_attention on fp32 q, k, v),
    /// "bf16" (the same kernel on bf16), "bf16-math" (scores, softmax and weighted sum as bf16
    /// batched matrix multiplies, the probabilities kept for the backward), or "auto": on a GPU
    /// "bf16"; on a CPU "bf16-math" up to a context of 1024 (the matrix units make it faster than
    /// fp32 SDPA with its casts: 2x at context 128, 1.45x at 256, 0.86-0.91 of its step time at
    /// 1024 with micro-batch 1) and "fp32" beyond.
    /// Default "auto".
    pub attention: AttentionPrecision,
    /// bf16-math attention only: queries per block, each block against only the keys at or before
    /// its last row, so the causal square's upper triangle is never computed (`n` blocks compute
    /// `(n + 1) / 2n` of it). 0, or a value at least the context, computes the whole square and
    /// masks it, as PyTorch's matmul attention does. Default 128.
    pub causal_block_rows: usize,
    /// What the C allocator does with host memory freed between steps: "retain" keeps it for the
    /// next step, "system" leaves the C library's defaults (which return it to the kernel, so
    /// every step faults its pages in again). Process-wide. Default "retain".
    pub host_memory: HostMemory,
    /// The vla family's action loss: "flow" (flow matching: a noised action chunk and its time
    /// in, the velocity toward the actions out, mean squared error) or "l1" (the chunk regressed
    /// straight from the inputs, mean absolute error). Default "flow".
    pub action_loss: ActionLoss,
    /// The vla family's language-model loss on the instruction: its weight beside the action
    /// loss, 0 to leave it out. Above 0 the instruction's tokens attend to the frames and causally
    /// to one another (the frames no longer read the instruction), and each predicts the next
    /// one through the final norm and the token embedding's rows (tied). Default 0.
    pub instruction_lm: f64,
    /// On a CPU, update the parameters in one fused, threaded pass; false runs the update as a
    /// chain of libtorch tensor ops over the flat buffers (PyTorch's default AdamW does one such
    /// chain per parameter). Default true.
    pub fused_optimizer: bool,
    /// Under bf16 on a CPU, the loss and its gradient with respect to the logits in one fused
    /// pass (a Rust kernel) instead of libtorch's fp32 cast, log-softmax and NLL forward and
    /// backward, and the head's matrix multiplies backward-ed by hand from that gradient; the
    /// block executor only. "on", "off", or "auto": on from a vocabulary of
    /// `FUSED_CROSS_ENTROPY_MIN_VOCAB` (8192). The whole head takes 0.75x libtorch's time at
    /// GPT-2's 50304, and 1.01x and 0.90x with the 256 byte tokens of tiny and small (README,
    /// "What each step change bought"). Default "auto".
    pub fused_cross_entropy: FusedCrossEntropy,
    /// Under bf16 on a CPU, every LayerNorm (and the llama family's block RMSNorms, in fp32 runs too:
    /// the same kernel with no mean and no bias) as a Rust kernel from the fp32 residual stream
    /// straight to bf16, and its backward with the residual's gradient added in the same pass,
    /// instead of libtorch's fp32 LayerNorm, casts and add; the block executor only. The kernels
    /// take 0.41-0.66x libtorch's time; a block then runs as its two halves (autograd segments).
    /// With `fused_softmax` and `fused_bias_gelu` on beside it (the halves are then paid once)
    /// the step took 0.993 (tiny), 0.948 (small) and 0.988 (gpt2-124m) of libtorch's ops' step,
    /// with the same activation and peak memory within 1% (README, "The bias + GELU kernel").
    /// Default true.
    pub fused_layer_norm: bool,
    /// Under bf16-math attention on a CPU, each attention's core outside libtorch's graph: the
    /// causal blocks' scores as plain `bmm`s into one buffer, the causal softmax as a Rust kernel
    /// that skips the masked keys (no mask is added), and the core's backward by hand between the
    /// output projection's and the q, k, v projection's; the block executor only. The core takes
    /// 0.72x (tiny) and 0.85x (small) libtorch's time on its own; the block then runs as its two
    /// halves and the attention half as three backward calls. Alone the step measured 0.991
    /// (tiny) and 0.990 (small); with the other two see `fused_layer_norm`. Default true.
    pub fused_softmax: bool,
    /// Under bf16 on a CPU, each MLP's first linear layer without its bias, and the bias and GELU
    /// as one Rust kernel outside libtorch's graph, with the backward by hand (the bias's gradient
    /// summed in the kernel's one pass, the layer's two matrix multiplies); the block executor
    /// only, and a block then runs as its two halves. With the product, 0.88-0.93x libtorch's
    /// time; alone the step measured 0.995 (tiny, small); with the other two see
    /// `fused_layer_norm`. Default true.
    pub fused_bias_gelu: bool,
    /// Under bf16 on a CPU with `fused_layer_norm`, the llama family's attention and MLP branches
    /// whole by hand: q, k and v (and gate and up) as one product each with their LoRA adapters
    /// beside it, the rotary positions and SwiGLU as Rust kernels, libtorch's flash attention,
    /// and the backward's products by hand (none for a frozen weight), with no autograd graph; and
    /// on a CPU in bf16 and fp32 the vla family's blocks whole by hand (`models/vla/by_hand.rs`; a
    /// block with a frozen parameter stays in the graph). Default true.
    pub fused_branches: bool,
    /// Under 16-bit precision, each block's parameters cast to the compute type in one op per
    /// step, its linear layers taking 16-bit leaves cut from that cast whose gradients are added
    /// into the fp32 gradient buffer after the block's backward (the same bits), instead of a cast
    /// per weight and bias in every forward, each with its own backward and accumulation; what the
    /// step gains was within this machine's noise (README, "one cast per block"). Default true.
    pub unit_casts: bool,
    /// "adamw", "lamb" (AdamW's moments with a per-tensor trust ratio ||w|| / ||u||, for large
    /// batches) or "sgd" (momentum, optionally Nesterov; L2 weight decay as PyTorch's SGD).
    /// Default "adamw".
    pub optimizer: OptimizerKind,
    /// SGD only: momentum; 0 is plain SGD. Default 0.9.
    pub momentum: f64,
    /// SGD only: Nesterov momentum. Default false.
    pub nesterov: bool,
    /// LAMB only: the trust ratio on every tensor (NVLAMB); false applies it only to tensors with
    /// weight decay, biases and norms taking Adam's step (apex, TensorFlow Addons). Default false.
    pub lamb_adapt_all: bool,
    /// LAMB only: the trust ratio is clamped to at least this. Default 0 (no lower clamp).
    pub lamb_min_trust: f64,
    /// LAMB only: and at most this; 0 is no upper clamp (DeepSpeed clamps to [0.01, 10]).
    /// Default 0.
    pub lamb_max_trust: f64,
    /// Shape of the learning rate after warmup: "cosine" (to `min_lr` at the horizon), "linear"
    /// (straight down to `min_lr` at the horizon), "constant" (`lr` throughout), or "wsd"
    /// (warmup-stable-decay: `lr` until the last `lr_decay_fraction` of the steps before the
    /// horizon, then linearly down to `min_lr`). Default "cosine".
    pub lr_shape: LrShape,
    /// "wsd" only: the fraction of the post-warmup steps spent decaying. Default 0.2.
    pub lr_decay_fraction: f64,
    /// Batch-size rule for the learning rate: "none" (`lr` as given), "linear" (`lr` and `min_lr`
    /// times k = B / `lr_reference_batch`, B the global batch in sequences: micro_batch x
    /// grad_accum x processes) or "sqrt" (times sqrt(k)); the warmup's tokens grow by the same
    /// factor (see `lr_at_batch`). Default "none".
    pub lr_scaling: LrScaling,
    /// The global batch (sequences per optimizer step) that `lr` was tuned for. Default 16.
    pub lr_reference_batch: usize,
    /// Debugging: make step N (1-based) non-finite on purpose (a NaN written into a parameter
    /// before its forward), to check the NaN guard: the run stops with nan-dump.json and exit 1.
    /// 0 is off. Default 0.
    pub debug_poison_step: u64,
    /// Monitors: measure the per-block gradient norms and update/parameter ratios every this
    /// many steps (on logged steps; 0 turns them off). Default 10.
    pub monitor_every: u64,
    /// Monitors: logged losses the spike z-score is computed over. Default 50.
    pub spike_window: usize,
    /// Parameters that do not train: globs over parameter names (`*` any run of characters, `?`
    /// one), e.g. "model.embed_tokens.*". A frozen parameter gets no gradient, no optimizer state,
    /// no data-parallel reduction and no checkpoint (its values come from the seed's init or
    /// `model.from`). Needs a family that runs in libtorch's graph (every family but gpt).
    /// Default [].
    pub freeze: Vec<String>,
    /// Per-module learning rates: globs over parameter names (as `freeze`'s) to factors on the
    /// learning rate, e.g. {"vision.*" = 0.1} for a slower vision tower. Each factor scales the
    /// parameter's step and its decoupled weight decay, all through the schedule; a parameter
    /// that two patterns match is refused, as is a pattern that matches no trained parameter.
    /// Default {}.
    pub lr_multipliers: std::collections::BTreeMap<String, f64>,
    /// LoRA adapters (see `LoraConfig`); llama only. Default off (rank 0).
    pub lora: LoraConfig,
    /// Processes the global batch is split over (set by the launcher's environment, not a
    /// config key). Default 1.
    #[serde(skip)]
    pub world_size: usize,
    /// Test-only, not config keys: slowdowns and memory that `stoke bench gate`'s self-test
    /// injects (the binary sets them from the STOKE_TEST_* variables). Default none.
    #[serde(skip)]
    pub test_inject: Injections,
}

/// What `stoke bench gate`'s self-test injects into a run to check that the gate catches it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Injections {
    /// Each forward lap busy-waits this fraction of its own time.
    pub slow_forward: f64,
    /// Each backward lap likewise.
    pub slow_backward: f64,
    /// Each optimizer lap likewise.
    pub slow_optimizer: f64,
    /// Each data-wait lap (one a micro-batch) busy-waits this many milliseconds more.
    pub data_wait_ms: f64,
    /// The run holds this fraction of its peak resident memory more (touched pages, grown after
    /// every step).
    pub more_memory: f64,
}

/// See `TrainConfig::lr_shape`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrShape {
    Cosine,
    Linear,
    Constant,
    Wsd,
}

/// See `TrainConfig::lr_scaling`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrScaling {
    None,
    Linear,
    Sqrt,
}

/// See `TrainConfig::fused_cross_entropy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FusedCrossEntropy {
    Auto,
    On,
    Off,
}

/// The smallest vocabulary `FusedCrossEntropy::Auto` takes the fused kernel at: the head measured
/// at 256 (1.01x libtorch's time on tiny, 0.90x on small: its logits stay in cache, and the step
/// does not resolve the difference) and 50304 (0.75x); between them unmeasured, this is where the
/// logits of a micro-batch outgrow the caches.
pub const FUSED_CROSS_ENTROPY_MIN_VOCAB: usize = 8192;

impl FusedCrossEntropy {
    /// Whether the kernel runs for a vocabulary of `vocab` tokens.
    pub fn enabled(self, vocab: usize) -> bool {
        match self {
            FusedCrossEntropy::On => true,
            FusedCrossEntropy::Off => false,
            FusedCrossEntropy::Auto => vocab >= FUSED_CROSS_ENTROPY_MIN_VOCAB,
        }
    }
}

/// See `TrainConfig::attention`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionPrecision {
    Auto,
    Fp32,
    Bf16,
    #[serde(rename = "bf16-math")]
    Bf16Math,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            steps: 600,
            lr_horizon: 0,
            micro_batch: 16,
            grad_accum: 1,
            global_batch: 0,
            seed: 1337,
            lr: 2e-3,
            min_lr: 2e-4,
            warmup_steps: 50,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            grad_clip: 1.0,
            precision: Precision::Bf16,
            loss_scale_init: 65536.0,
            loss_scale_growth: 2.0,
            loss_scale_backoff: 0.5,
            loss_scale_interval: 2000,
            recompute: Recompute::None,
            executor: ExecutorKind::Blocks,
            log_every: 1,
            guard_every: 0,
            threads: 0,
            attention: AttentionPrecision::Auto,
            causal_block_rows: 128,
            host_memory: HostMemory::Retain,
            action_loss: ActionLoss::Flow,
            instruction_lm: 0.0,
            fused_optimizer: true,
            fused_cross_entropy: FusedCrossEntropy::Auto,
            fused_layer_norm: true,
            fused_softmax: true,
            fused_bias_gelu: true,
            fused_branches: true,
            unit_casts: true,
            optimizer: OptimizerKind::AdamW,
            momentum: 0.9,
            nesterov: false,
            lamb_adapt_all: false,
            lamb_min_trust: 0.0,
            lamb_max_trust: 0.0,
            lr_shape: LrShape::Cosine,
            lr_decay_fraction: 0.2,
            lr_scaling: LrScaling::None,
            lr_reference_batch: 16,
            debug_poison_step: 0,
            monitor_every: 10,
            spike_window: 50,
            freeze: Vec::new(),
            lr_multipliers: Default::default(),
            lora: LoraConfig::default(),
            world_size: 1,
            test_inject: Injections::default(),
        }
    }
}

impl TrainConfig {
    /// This config for a run on `world_size` ranks: with `global_batch` set, `grad_accum` is the
    /// accumulation that makes `micro_batch` x `world_size` x `grad_accum` equal it.
    pub fn for_world(&self, world_size: usize) -> Result<TrainConfig, TrainError> {
        if self.global_batch == 0 {
            return Ok(self.clone());
        }
        let per_step = self.micro_batch * world_size.max(1);
        if per_step == 0 || self.global_batch % per_step != 0 {
            return Err(TrainError::InvalidConfig {
                key: "train.global_batch",
                message: format!(
                    "{} sequences do not divide into micro-batches of {} on {} rank(s) ({} per accumulation step)",
                    self.global_batch, self.micro_batch, world_size, per_step
                ),
            });
        }
        // Resolved: the accumulation now says it all (and `validate` accepts the pair).
        Ok(TrainConfig { grad_accum: self.global_batch / per_step, global_batch: 0, ..self.clone() })
    }

    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |key: &'static str, message: String| Err(TrainError::InvalidConfig { key, message });
        self.lora.validate()?;
        if let Some((pattern, factor)) = self.lr_multipliers.iter().find(|(_, f)| !(f.is_finite() && **f >= 0.0)) {
            return Err(TrainError::InvalidConfig {
                key: "train.lr_multipliers",
                message: format!("{pattern:?} = {factor}: a factor must be finite and at least 0"),
            });
        }
        if self.steps == 0 {
            return bad("train.steps", "must be at least 1; got 0".into());
        }
        if !(self.instruction_lm.is_finite() && self.instruction_lm >= 0.0) {
            return bad("train.instruction_lm", format!("must be a finite number >= 0; got {}", self.instruction_lm));
        }
        if self.micro_batch == 0 {
            return bad("train.micro_batch", "must be at least 1; got 0".into());
        }
        if !(self.lamb_min_trust.is_finite() && self.lamb_min_trust >= 0.0) {
            return bad("train.lamb_min_trust", format!("must be a finite number >= 0; got {}", self.lamb_min_trust));
        }
        if !(self.lamb_max_trust.is_finite() && self.lamb_max_trust >= 0.0) {
            return bad("train.lamb_max_trust", format!("must be a finite number >= 0; got {}", self.lamb_max_trust));
        }
        if self.lamb_max_trust > 0.0 && self.lamb_max_trust < self.lamb_min_trust {
            return bad(
                "train.lamb_max_trust",
                format!(
                    "must be 0 (no clamp) or at least train.lamb_min_trust {}; got {}",
                    self.lamb_min_trust, self.lamb_max_trust
                ),
            );
        }
        if self.grad_accum == 0 {
            return bad("train.grad_accum", "must be at least 1; got 0".into());
        }
        if self.global_batch != 0 && self.grad_accum != 1 {
            return bad(
                "train.global_batch",
                format!(
                    "sets the accumulation itself; train.grad_accum must stay 1, got {} (set one of the two)",
                    self.grad_accum
                ),
            );
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("train.lr", format!("must be a finite number > 0; got {}", self.lr));
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return bad("train.min_lr", format!("must be between 0 and train.lr = {}; got {}", self.lr, self.min_lr));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("train.weight_decay", format!("must be a finite number >= 0; got {}", self.weight_decay));
        }
        for (key, beta) in [("train.beta1", self.beta1), ("train.beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return bad(key, format!("must be in [0, 1); got {beta}"));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad("train.eps", format!("must be a finite number > 0; got {}", self.eps));
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return bad("train.grad_clip", format!("must be a finite number >= 0 (0 = off); got {}", self.grad_clip));
        }
        if !(self.loss_scale_init.is_finite() && self.loss_scale_init > 0.0) {
            return bad("train.loss_scale_init", format!("must be a finite number > 0; got {}", self.loss_scale_init));
        }
        if !(self.loss_scale_growth.is_finite() && self.loss_scale_growth >= 1.0) {
            return bad(
                "train.loss_scale_growth",
                format!("must be a finite number >= 1; got {}", self.loss_scale_growth),
            );
        }
        if !(self.loss_scale_backoff > 0.0 && self.loss_scale_backoff < 1.0) {
            return bad("train.loss_scale_backoff", format!("must be in (0, 1); got {}", self.loss_scale_backoff));
        }
        if self.loss_scale_interval == 0 {
            return bad("train.loss_scale_interval", "must be at least 1; got 0".into());
        }
        if self.executor == ExecutorKind::SingleGraph && self.recompute != Recompute::None {
            return bad(
                "train.recompute",
                format!(
                    "is \"{}\", but train.executor = \"single-graph\" cannot recompute; use \"blocks\"",
                    self.recompute
                ),
            );
        }
        if self.log_every == 0 {
            return bad("train.log_every", "must be at least 1; got 0".into());
        }
        if !(self.momentum.is_finite() && (0.0..1.0).contains(&self.momentum)) {
            return bad("train.momentum", format!("must be in [0, 1); got {}", self.momentum));
        }
        if !(self.lr_decay_fraction > 0.0 && self.lr_decay_fraction <= 1.0) {
            return bad("train.lr_decay_fraction", format!("must be in (0, 1]; got {}", self.lr_decay_fraction));
        }
        if self.lr_reference_batch == 0 {
            return bad("train.lr_reference_batch", "must be at least 1; got 0".into());
        }
        if self.spike_window < 2 {
            return bad("train.spike_window", format!("must be at least 2; got {}", self.spike_window));
        }
        Ok(())
    }

    /// The fp16 loss scaler's settings.
    pub fn loss_scale(&self) -> LossScaleConfig {
        LossScaleConfig {
            init: self.loss_scale_init,
            growth: self.loss_scale_growth,
            backoff: self.loss_scale_backoff,
            interval: self.loss_scale_interval,
        }
    }

    /// The step at which the decay ends: `lr_horizon`, or `steps` when it is 0.
    pub fn horizon(&self) -> u64 {
        if self.lr_horizon == 0 {
            self.steps
        } else {
            self.lr_horizon
        }
    }

    /// Sequences per optimizer step over all processes.
    pub fn batch_sequences(&self) -> usize {
        self.micro_batch * self.grad_accum * self.world_size.max(1)
    }

    /// The batch-size rule's factor for a global batch of `batch` sequences: 1 without scaling,
    /// B / B_ref (linear) or sqrt(B / B_ref).
    pub fn lr_factor(&self, batch: usize) -> f64 {
        let ratio = batch as f64 / self.lr_reference_batch.max(1) as f64;
        match self.lr_scaling {
            LrScaling::None => 1.0,
            LrScaling::Linear => ratio,
            LrScaling::Sqrt => ratio.sqrt(),
        }
    }

    /// Learning rate at `step` (0-based) for the configured global batch.
    pub fn lr_at(&self, step: u64) -> f64 {
        self.lr_at_batch(step, self.batch_sequences())
    }

    /// Learning rate at `step` (0-based) for a global batch of `batch` sequences: linear warmup,
    /// then the shape (`lr_shape`) down to `min_lr` at the horizon (`lr_horizon`, else the last
    /// step), `min_lr` after it. Under a batch-size rule with factor f for batch B, `lr` and
    /// `min_lr` are multiplied by f and the warmup lasts `warmup_steps` x f x B_ref / B steps: its
    /// tokens grow with the rule's factor (the same steps under "linear", more tokens per step).
    /// A pure function of the step and the batch, so a resumed run follows the same schedule.
    pub fn lr_at_batch(&self, step: u64, batch: usize) -> f64 {
        let (lr, min_lr, warmup) = match self.lr_scaling {
            LrScaling::None => (self.lr, self.min_lr, self.warmup_steps),
            _ => {
                let factor = self.lr_factor(batch);
                let steps = self.warmup_steps as f64 * factor * self.lr_reference_batch as f64 / batch.max(1) as f64;
                (self.lr * factor, self.min_lr * factor, steps.round() as u64)
            }
        };
        if step < warmup {
            return lr * (step + 1) as f64 / warmup as f64;
        }
        let decay_steps = self.horizon().saturating_sub(warmup).max(1);
        let progress = ((step - warmup) as f64 / decay_steps as f64).min(1.0);
        match self.lr_shape {
            LrShape::Cosine => {
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                min_lr + cosine * (lr - min_lr)
            }
            LrShape::Linear => min_lr + (1.0 - progress) * (lr - min_lr),
            LrShape::Constant => lr,
            LrShape::Wsd => {
                let stable = 1.0 - self.lr_decay_fraction;
                if progress <= stable {
                    lr
                } else {
                    let decay = ((progress - stable) / self.lr_decay_fraction).min(1.0);
                    min_lr + (1.0 - decay) * (lr - min_lr)
                }
            }
        }
    }
}

/// `[eval]`: held-out evaluation and early stopping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Evaluate on the held-out split every this many steps (and after the last); 0 turns
    /// evaluation off and trains on all the data. Default 0.
    pub every: u64,
    /// Micro-batches per evaluation (the same ones every time). Default 8.
    pub batches: usize,
    /// The share of the data held out: the built-in corpus's tail, or whole documents of prepared
    /// shards. Used only when `every` > 0. Default 0.05.
    pub holdout: f64,
    /// Early stopping: end the run after this many evaluations in a row without an improvement
    /// of more than `min_delta` (a checkpoint is written); 0 never stops early. Default 0.
    pub patience: u64,
    /// The improvement of the evaluation loss that counts as one. Default 0.001.
    pub min_delta: f64,
    /// Retention also keeps the checkpoint of the best evaluation loss (one is written at each
    /// new best). Default true.
    pub keep_best: bool,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig { every: 0, batches: 8, holdout: 0.05, patience: 0, min_delta: 0.001, keep_best: true }
    }
}

impl EvalConfig {
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |key: &'static str, message: String| Err(TrainError::InvalidConfig { key, message });
        if self.batches == 0 {
            return bad("eval.batches", "must be at least 1; got 0".into());
        }
        if !(self.holdout > 0.0 && self.holdout < 1.0) {
            return bad("eval.holdout", format!("must be in (0, 1); got {}", self.holdout));
        }
        if !(self.min_delta.is_finite() && self.min_delta >= 0.0) {
            return bad("eval.min_delta", format!("must be a finite number >= 0; got {}", self.min_delta));
        }
        Ok(())
    }
}

/// `[ckpt]`: when to write checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CkptConfig {
    /// Write a checkpoint every this many steps; 0 writes none except `at_end`. Default 200.
    pub every: u64,
    /// Also write one after the last step. Default true.
    pub at_end: bool,
    /// Keep this many newest checkpoints and delete older ones; 0 keeps all. Default 3.
    pub keep: usize,
    /// Also keep every checkpoint whose step is a multiple of this, outside `keep` (long-term
    /// milestones); 0 keeps none beyond `keep`. Default 0.
    pub keep_every: u64,
    /// Persist on a background thread: the step waits only for the copy to host memory. Default true.
    pub background: bool,
    /// Host buffers for snapshots (at least 1): host memory for checkpoints is at most this many
    /// copies of the state. With 2, a snapshot can be taken while the previous one is written;
    /// when all are being written the step waits (counted in `ckpt_stall`). Default 2.
    pub host_buffers: usize,
    /// A background checkpoint's state is not copied within its own step: the next step's fused
    /// AdamW update saves each block into host memory just before it overwrites it, or (another
    /// optimizer, the tensor-op update) a thread of the lowest priority copies it beside the next
    /// step's batch, forward and backward, and the next optimizer step first copies what is left
    /// (counted in `ckpt_stall`). Only for state in CPU memory, unsharded; the run's last
    /// checkpoint is copied at once. Default true.
    pub overlap: bool,
    /// Second tier: every committed checkpoint is also copied, in the background, to
    /// "s3://BUCKET/PREFIX" (endpoint and credentials from the `AWS_*` variables) or
    /// "file:///PATH"; a resume takes the latest complete checkpoint from the faster tier that
    /// holds it. "" = none. Default "".
    pub mirror: String,
    /// Keep this many newest checkpoints on the mirror; 0 keeps all. Default 0.
    pub mirror_keep: usize,
    /// Also keep every mirrored checkpoint whose step is a multiple of this, outside
    /// `mirror_keep`; 0 keeps none beyond it. Default 0.
    pub mirror_keep_every: u64,
}

impl Default for CkptConfig {
    fn default() -> Self {
        CkptConfig {
            every: 200,
            at_end: true,
            keep: 3,
            keep_every: 0,
            background: true,
            host_buffers: 2,
            overlap: true,
            mirror: String::new(),
            mirror_keep: 0,
            mirror_keep_every: 0,
        }
    }
}

/// `train.optimizer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    AdamW,
    Lamb,
    Sgd,
}

impl OptimizerKind {
    pub fn name(self) -> &'static str {
        match self {
            OptimizerKind::AdamW => "adamw",
            OptimizerKind::Lamb => "lamb",
            OptimizerKind::Sgd => "sgd",
        }
    }
}

/// The fp16 loss scaler's settings (`train.loss_scale_*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScaleConfig {
    /// The scale the first step multiplies the loss by. Default 65536.
    pub init: f64,
    /// Multiply the scale by this after `interval` steps in a row without overflow. Default 2.
    pub growth: f64,
    /// Multiply the scale by this when a step's gradients overflow (the step is skipped). Default 0.5.
    pub backoff: f64,
    /// Steps without overflow before the scale grows. Default 2000.
    pub interval: u64,
}

/// See `TrainConfig::action_loss`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ActionLoss {
    /// Flow matching, integrated by Euler steps at evaluation.
    Flow,
    /// Direct regression with an L1 loss.
    L1,
}

/// See `TrainConfig::host_memory`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HostMemory {
    /// Take every block from the heap (no mmap, whatever its size), keep freed blocks there and
    /// never trim it.
    Retain,
    /// The C library's defaults.
    System,
}

#[cfg(test)]
mod tests;
