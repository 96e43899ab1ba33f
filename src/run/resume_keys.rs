//! Which configuration keys `stoke train --resume` may change, and which it refuses to.
//!
//! Every key of the configuration is classified here, by its section or by name: the keys that
//! leave the sequence of losses as it was (a resume may change them) and the keys that fix the
//! trajectory (a resume refuses a change). A key classified nowhere is refused like a fixed one;
//! the integration test `resume_keys` keeps this table and `src/defaults.toml` in step (every
//! key classified, no name here that the defaults lack). This file uses nothing outside itself.

/// How `--resume` treats a change to one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeKey {
    /// The key leaves the sequence of losses as it was.
    MayChange,
    /// The key is part of the trajectory: a resume refuses a change to it.
    Fixed,
}

/// Sections a resume may change entirely: run placement over processes (`dist`), profiling and
/// logging (`prof`) and checkpointing (`ckpt`) are not part of the trajectory.
pub const MAY_CHANGE_SECTIONS: &[&str] = &["prof", "ckpt", "dist"];

/// Keys of the other sections a resume may change. `train.steps` extends or shortens the run (the
/// schedule's horizon is kept unless `train.lr_horizon` is set too), as early stopping's settings
/// may; `train.debug_poison_step` may be cleared to continue past it; the run's name and folder,
/// logging, monitoring, loader threads and the cache are not part of the trajectory (the batches
/// are a function of the data position alone).
pub const MAY_CHANGE_KEYS: &[&str] = &[
    "run.name",
    "run.dir",
    "train.steps",
    "train.lr_horizon",
    "train.log_every",
    "train.guard_every",
    "train.host_memory",
    "train.debug_poison_step",
    "train.monitor_every",
    "train.spike_window",
    "eval.batches",
    "eval.patience",
    "eval.min_delta",
    "eval.keep_best",
    "data.workers",
    "data.prefetch",
    "data.cache_dir",
    "data.cache_budget_bytes",
];

/// Sections whose every key fixes the trajectory: the model and the adaptive batch size.
pub const FIXED_SECTIONS: &[&str] = &["model", "adaptive"];

/// Keys of the other sections that fix the trajectory: the device, the optimization (batch,
/// schedule, optimizer, precision, the kernels, whose rounding differs), the data and its order,
/// and what is held out for evaluation.
pub const FIXED_KEYS: &[&str] = &[
    "run.device",
    "train.micro_batch",
    "train.grad_accum",
    "train.global_batch",
    "train.seed",
    "train.lr",
    "train.min_lr",
    "train.warmup_steps",
    "train.weight_decay",
    "train.beta1",
    "train.beta2",
    "train.eps",
    "train.grad_clip",
    "train.precision",
    "train.loss_scale_init",
    "train.loss_scale_growth",
    "train.loss_scale_backoff",
    "train.loss_scale_interval",
    "train.recompute",
    "train.executor",
    "train.freeze",
    "data.tokenizer",
    "data.eos",
    "data.builtin_episodes",
    "data.history",
    "data.augment",
    "data.blank",
    "train.action_loss",
    "train.instruction_lm",
    "train.lora.rank",
    "train.lora.alpha",
    "train.lora.dropout",
    "train.lora.targets",
    "train.threads",
    "train.attention",
    "train.causal_block_rows",
    "train.fused_optimizer",
    "train.fused_cross_entropy",
    "train.fused_layer_norm",
    "train.fused_softmax",
    "train.fused_bias_gelu",
    "train.fused_branches",
    "train.unit_casts",
    "train.optimizer",
    "train.momentum",
    "train.nesterov",
    "train.lamb_adapt_all",
    "train.lamb_min_trust",
    "train.lamb_max_trust",
    "train.lr_shape",
    "train.lr_decay_fraction",
    "train.lr_scaling",
    "train.lr_reference_batch",
    "data.path",
    "data.builtin_bytes",
    "data.drop_last",
    "data.blend",
    "data.weights",
    "eval.every",
    "eval.holdout",
];

/// How `--resume` treats `key` (`section.key`); `None` for a key classified nowhere.
pub fn classify(key: &str) -> Option<ResumeKey> {
    let section = key.split('.').next().unwrap_or("");
    if MAY_CHANGE_SECTIONS.contains(&section) || MAY_CHANGE_KEYS.contains(&key) {
        Some(ResumeKey::MayChange)
    } else if FIXED_SECTIONS.contains(&section) || FIXED_KEYS.contains(&key) {
        Some(ResumeKey::Fixed)
    } else {
        None
    }
}

/// Whether a resume may change `key`: only the keys classified `MayChange`.
pub fn resume_may_change(key: &str) -> bool {
    classify(key) == Some(ResumeKey::MayChange)
}
