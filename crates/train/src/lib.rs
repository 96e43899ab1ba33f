//! stoke-train: the models, their parameters and optimizer, and the training loop. The only library
//! crate that links libtorch.
//!
//! ```no_run
//! use std::sync::atomic::AtomicBool;
//! use stoke_train::{CkptConfig, ModelConfig, TrainConfig, Trainer};
//! let train = TrainConfig { steps: 10, ..TrainConfig::default() };
//! let mut trainer = Trainer::new(&ModelConfig::default(), &train, &CkptConfig::default(), tch::Device::Cpu).unwrap();
//! let text = stoke_data::builtin_corpus(0, 1 << 16);
//! let mut source = stoke_data::RandomWindows::from_bytes(&text, 128, train.micro_batch, train.seed).unwrap();
//! let summary = trainer.run(&mut source, &mut [], None, &AtomicBool::new(false)).unwrap();
//! println!("final loss {}", summary.final_loss);
//! ```

mod adaptive;
mod clock;
mod config;
mod dist;
mod error;
mod executor;
mod find_batch;
mod host_memory;
mod kernels;
mod memory_fit;
mod models;
mod omp;
mod optim;
mod optimizers;
mod params;
mod peak;
mod precision;
mod snapcopy;
mod trainer;

pub use adaptive::{grown_accum, AdaptiveConfig, NoiseScale};
pub use clock::StepClock;
pub use config::{
    glob_match, ActionLoss, AttentionPrecision, CkptConfig, EvalConfig, ExecutorKind, FusedCrossEntropy, GptShape,
    HostMemory, Injections, LlamaShape, LoraConfig, LossScaleConfig, LrScaling, LrShape, ModelConfig, OptimizerKind,
    Precision, Recompute, RopeScaling, TrainConfig, VlaShape, FUSED_CROSS_ENTROPY_MIN_VOCAB, MODEL_FAMILIES,
};
pub use dist::compress::{CompressConfig, Compression, Compressor, Pending};
pub use dist::{
    Bucket, BucketPlan, BucketSizes, DataParallel, DataParallelConfig, Disagreement, KeyDifference, RankDifference,
    Schedule, StageLink, ZeroConfig,
};
pub use error::TrainError;
pub use executor::{Executor, Gathered, MicroBatch, NoHooks, StepHooks};
pub use find_batch::{find_micro_batch, measure_step_memory, BatchFit};
pub use host_memory::retain_env;
pub use kernels::{
    bias_gelu, bias_gelu_backward, causal_softmax_backward_bf16, causal_softmax_bf16, cross_entropy_bf16,
    layer_norm_bf16, layer_norm_bf16_backward, CausalBlock, CrossEntropy, LayerNormStats,
};
pub use memory_fit::{check_fits, estimate_step_memory, memory_limit, MemoryEstimate, MemoryLimit};
pub use models::{
    build_model, export_hf, export_peft, merged_parameters, plan_model, plan_model_for, resolve_from, Branch,
    BranchBackward, ByHand, CoreBackward, EpisodeInputs, Gpt, GptRms, HeadBackward, HeadLoss, Inputs, Llama, Model,
    Norm, Split, TensorGroup, Vla, TENSOR_PARALLEL_FAMILIES,
};
pub use optim::{AdamW, AdamWStep, StateTensor, StepOutcome, UpdateKernel};
pub use optimizers::{Hyper, Lamb, LambOptions, Optimizer, Sgd, TensorNorms};
pub use params::{FlatParams, Init, ParamEntry, ParamSpec, UnitRange, UnitSpec};
pub use peak::{
    auto_precision, host_bytes_in_use, load_per_cpu, matmul_peak_flops_cached, matmul_peak_reading,
    measure_matmul_peak_flops, memory_available_bytes, memory_capacity_bytes, memory_in_use_bytes, peak_key,
    peak_rss_bytes, remeasure_matmul_peak, reset_peak_rss, PeakReading, PEAK_CACHE_FILE, PEAK_MAX_AGE_S,
};
pub use precision::{compute_kind, cpu_has_bf16, LossScaler, Products, ScaleOutcome, FP32_OPS};
pub use trainer::{
    device_for_rank, parse_device, select_device, BatchChange, BlockMonitors, CheckpointTarget, EvalRecord,
    MemoryReport, NanDump, Observer, ObserverError, Phase, PhaseTimes, RunInfo, StepRecord, Summary, TrainEvent,
    Trainer,
};

/// Held by unit tests that seed libtorch's global generator and then draw from it, so tests
/// running in parallel do not draw from each other's seeds.
#[cfg(test)]
pub(crate) static GLOBAL_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
