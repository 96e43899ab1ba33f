//! stoke-plan: a memory and time model of parallel training layouts, and a search over them.
//!
//! Given a model, a global batch and a cluster, [`search`] tries every split of data x tensor x
//! pipeline parallelism (with sequence parallelism and interleaved stages), every ZeRO stage,
//! recomputation policy and micro-batch size, drops those that do not fit in a device's memory, and
//! ranks the rest by predicted step time. The memory model follows the ZeRO paper and Korthikanti
//! et al. (2022); the time model counts FLOPs and bytes at calibrated efficiencies, ring
//! collectives, the pipeline bubble and the data-parallel communication the backward cannot hide.
//! [`calibrate`] fits the efficiencies of a machine from measured `stoke train` runs.
//!
//! ```
//! use stoke_plan::{search, ClusterConfig, ModelConfig, PlanConfig, Precision};
//!
//! let config = PlanConfig {
//!     model: ModelConfig::preset("llama-7b")?,
//!     cluster: ClusterConfig::preset("h100", 16)?,
//!     precision: Precision::Bf16,
//!     global_batch: 64,
//!     ..PlanConfig::default()
//! };
//! let outcome = search(&config)?;
//! let best = &outcome.plans[0];
//! assert!(best.fits && best.memory.total <= config.cluster.memory_bytes);
//! assert_eq!(best.layout.n_devices(), 16);
//! println!("{}", stoke_plan::render_table(&outcome.plans, 5));
//! # Ok::<(), stoke_plan::PlanError>(())
//! ```

mod calibrate;
mod cluster;
mod error;
mod layout;
mod memory;
mod model;
mod render;
mod search;
mod stages;
mod time;
mod zero;

pub use calibrate::{
    calibrate, compare, merge_repeats, Calibration, MeasuredRun, ReportMachine, ReportModel, ReportTrain, RunFit,
    RunReport,
};
pub use cluster::{ClusterConfig, Efficiency, Precision, CLUSTER_PRESETS};
pub use error::PlanError;
pub use layout::{Layout, Recompute, ZeroStage};
pub use memory::{
    fine_tune_states, layer_activation_bytes, layers_in_flight, memory_per_device, model_states, stage_params,
    stage_trainable_params, MemoryBreakdown, ModelStates, Stage,
};
pub use model::{ExplicitUnits, LayerActivations, ModelConfig, LORA_TARGETS, MODEL_PRESETS};
pub use render::{format_seconds, render_table};
pub use search::{candidate_layouts, evaluate, search, Estimate, PlanConfig, SearchConfig, SearchOutcome};
pub use stages::stage_units;
pub use time::{hardware_flops_per_step, stage_flops_per_micro_batch, step_time, Link, StepTime};
pub use zero::{
    largest_window, model_units, optimizer_state_buffers, shard_elements, zero_rank_bytes, PublishedStates, RankBytes,
    Slices, ZeroInFlight, ZERO_FIGURE_1, ZERO_FIGURE_1_DEVICES, ZERO_FIGURE_1_PARAMS,
};
