//! The training loop and the events it emits.
//!
//! `Trainer::run` reads top to bottom: take a batch, move it to the device, forward, backward,
//! clip, step, tell the observers, maybe checkpoint. Metrics, progress, profiling and reports are
//! observers of `TrainEvent`; none of them is woven into the loop.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use stoke_ckpt::{CheckpointStore, CheckpointWriter, DType, Loaded, Snapshot, TensorRecord};
use stoke_data::BatchSource;
use tch::{Device, Kind, Tensor};

use crate::adaptive::{AdaptiveConfig, NoiseScale};
use crate::clock::StepClock;
use crate::config::{CkptConfig, EvalConfig, GptShape, ModelConfig, Precision, Recompute, TrainConfig};
use crate::executor::{Executor, NoHooks, StepHooks};
use crate::models::{build_model, Model};
use crate::optim::UpdateKernel;
use crate::optimizers::{Hyper, Optimizer};
use crate::params::FlatParams;
use crate::precision::LossScaler;
use crate::snapcopy::PendingCopy;
use crate::TrainError;

pub use stoke_prof::{Phase, PhaseTimes};

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
    pub precision: Precision,
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

/// Where checkpoints go and what the caller wants stored with each (for example the resolved
/// config). The writer decides how (in the background or not, host buffers, retention).
pub struct CheckpointTarget {
    pub writer: CheckpointWriter,
    pub meta: serde_json::Value,
}

pub struct Trainer {
    train: TrainConfig,
    ckpt: CkptConfig,
    model: Box<dyn Model>,
    optimizer: Optimizer,
    executor: Executor,
    /// fp16 only.
    scaler: Option<LossScaler>,
    /// Test hook: poison the gradients of this step (1-based) with an inf.
    inject_overflow_at: Option<u64>,
    device: Device,
    /// Optimizer steps completed.
    step: u64,
    resumed_from: Option<PathBuf>,
    /// Synchronize a GPU at phase boundaries every this many steps (0: never).
    sync_every: u64,
    /// Threads of the fused CPU optimizer: libtorch's intra-op thread count.
    n_threads: usize,
    /// Held-out evaluation, when set.
    eval: Option<EvalState>,
    /// Micro-batches per step now (`train.grad_accum`, grown by the adaptive batch size).
    grad_accum: usize,
    /// Adaptive batch size, when enabled.
    adaptive: Option<AdaptiveState>,
    /// The optimizer runs on a ZeRO shard (`shard_optimizer`): its state is not laid out like
    /// the model, and per-unit monitors are not computed.
    sharded: bool,
}

/// The adaptive batch size's settings and state (the estimates are saved in checkpoints).
struct AdaptiveState {
    config: AdaptiveConfig,
    /// The budget in sequences.
    max_batch: usize,
    noise: NoiseScale,
    /// The flat gradient after the previous micro-batch, to take each micro-batch's own gradient.
    previous_grad: Tensor,
    /// A logged loss since the last decision had a z-score above `stable_z`.
    unstable: bool,
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

/// The held-out data and the early-stopping state (saved in checkpoints).
struct EvalState {
    config: EvalConfig,
    source: Box<dyn BatchSource>,
    /// Best evaluation loss so far (inf before the first).
    best: f64,
    best_step: Option<u64>,
    /// Evaluations in a row without an improvement of more than `min_delta`.
    stale: u64,
}

/// Picks the device: "cpu", "cuda" (the first GPU) or "auto" (a GPU when libtorch sees one).
pub fn parse_device(name: &str) -> Result<Device, TrainError> {
    match name {
        "cpu" => Ok(Device::Cpu),
        "cuda" if tch::Cuda::is_available() => Ok(Device::Cuda(0)),
        "cuda" => Err(TrainError::InvalidConfig {
            key: "run.device",
            message: "is \"cuda\" but libtorch sees no CUDA device".into(),
        }),
        "auto" => Ok(Device::cuda_if_available()),
        other => Err(TrainError::InvalidConfig {
            key: "run.device",
            message: format!("must be one of auto, cpu, cuda; got {other:?}"),
        }),
    }
}

impl Trainer {
    /// A fresh model and optimizer, initialized from `train.seed`.
    pub fn new(
        model: &ModelConfig,
        train: &TrainConfig,
        ckpt: &CkptConfig,
        device: Device,
    ) -> Result<Trainer, TrainError> {
        train.validate()?;
        // A bad shape is refused before libtorch's global state is touched.
        model.shape()?;
        if train.threads > 0 {
            tch::set_num_threads(train.threads as i32);
        }
        crate::host_memory::apply(train.host_memory);
        tch::manual_seed(train.seed as i64);
        // The Rust kernels split their work over libtorch's threads.
        let kernel_threads = tch::get_num_threads().max(1) as usize;
        let model = build_model(model, train, kernel_threads, device)?;
        let optimizer = Optimizer::for_config(train, model.params());
        let executor = Executor::new(train.executor, train.recompute)?;
        let scaler = (train.precision == Precision::Fp16).then(|| LossScaler::new(train.loss_scale()));
        Ok(Trainer {
            train: train.clone(),
            ckpt: ckpt.clone(),
            model,
            optimizer,
            executor,
            scaler,
            inject_overflow_at: None,
            device,
            step: 0,
            resumed_from: None,
            sync_every: 1,
            n_threads: tch::get_num_threads().max(1) as usize,
            eval: None,
            grad_accum: train.grad_accum,
            adaptive: None,
            sharded: false,
        })
    }

    /// Turns on the adaptive batch size (one process only: a data-parallel step reduces the
    /// gradients while the last micro-batch's backward runs, so its own gradient is not readable).
    pub fn set_adaptive(&mut self, config: &AdaptiveConfig) -> Result<(), TrainError> {
        config.validate(self.train.grad_accum)?;
        if !config.enabled {
            self.adaptive = None;
            return Ok(());
        }
        if self.train.world_size > 1 {
            return Err(TrainError::InvalidConfig {
                key: "adaptive.enabled",
                message: "is not available on data-parallel runs yet (one process only)".into(),
            });
        }
        let start = self.train.batch_sequences();
        let max_batch = if config.max_batch == 0 { 8 * start } else { config.max_batch };
        if max_batch < start {
            return Err(TrainError::InvalidConfig {
                key: "adaptive.max_batch",
                message: format!("is {max_batch}, below the starting global batch of {start} sequences"),
            });
        }
        let previous_grad = self.model.params().flat_grad().zeros_like();
        self.adaptive = Some(AdaptiveState {
            config: config.clone(),
            max_batch,
            noise: NoiseScale::default(),
            previous_grad,
            unstable: false,
        });
        Ok(())
    }

    /// Sequences per optimizer step now, over all processes.
    fn global_batch(&self) -> usize {
        self.train.micro_batch * self.grad_accum * self.train.world_size.max(1)
    }

    /// Evaluates on `source` (the held-out split) every `config.every` steps and after the last,
    /// with early stopping. Each evaluation reads the same `config.batches` micro-batches from
    /// the source's start.
    pub fn set_eval(&mut self, config: &EvalConfig, source: Box<dyn BatchSource>) -> Result<(), TrainError> {
        config.validate()?;
        let (best, best_step, stale) =
            self.eval.as_ref().map_or((f64::INFINITY, None, 0), |e| (e.best, e.best_step, e.stale));
        self.eval = Some(EvalState { config: config.clone(), source, best, best_step, stale });
        Ok(())
    }

    /// The best evaluation's step, for retention to keep (None before any, or without
    /// `eval.keep_best`).
    pub fn best_eval_step(&self) -> Option<u64> {
        self.eval.as_ref().filter(|e| e.config.keep_best).and_then(|e| e.best_step)
    }

    fn eval_keeps_best(&self) -> bool {
        self.eval.as_ref().is_some_and(|e| e.config.keep_best)
    }

    /// The mean loss over the evaluation batches (averaged over the ranks), no gradients.
    fn evaluate(&mut self, hooks: &mut dyn StepHooks) -> Result<(f64, u64), TrainError> {
        if self.eval.is_none() {
            return Ok((f64::NAN, 0));
        }
        hooks.full_parameters(true)?;
        let Some(eval) = self.eval.as_mut() else { return Ok((f64::NAN, 0)) };
        let shape = self.model.shape();
        let seq_len = shape.seq_len as i64;
        eval.source.seek(0);
        let (mut sum, mut tokens) = (0.0, 0u64);
        for _ in 0..eval.config.batches {
            let batch = eval.source.next_batch()?;
            let rows_n = batch.micro_batch as i64;
            let rows = Tensor::from_slice(&batch.tokens).view([rows_n, seq_len + 1]).to_device(self.device);
            eval.source.recycle(batch);
            let inputs = rows.narrow(1, 0, seq_len).contiguous();
            let targets = rows.narrow(1, 1, seq_len).contiguous();
            let loss = tch::no_grad(|| self.model.loss(&inputs, &targets)).double_value(&[]);
            sum += loss;
            tokens += (rows_n * seq_len) as u64;
        }
        hooks.full_parameters(false)?;
        let loss = hooks.reduce_loss(sum / eval.config.batches as f64)?;
        Ok((loss, tokens))
    }

    /// Whether step `step` (1-based) ends with an evaluation.
    fn eval_due(&self, step: u64) -> bool {
        match &self.eval {
            Some(e) => e.config.every > 0 && (step % e.config.every == 0 || step == self.train.steps),
            None => false,
        }
    }

    /// Evaluates when `step` is due; updates the best loss and early stopping.
    fn maybe_evaluate(&mut self, step: u64, hooks: &mut dyn StepHooks) -> Result<Option<EvalRecord>, TrainError> {
        if !self.eval_due(step) {
            return Ok(None);
        }
        let (loss, tokens) = self.evaluate(hooks)?;
        let eval = self.eval.as_mut().expect("due implies set");
        let improved = loss < eval.best - eval.config.min_delta;
        if improved {
            eval.stale = 0;
        } else {
            eval.stale += 1;
        }
        if loss < eval.best {
            eval.best = loss;
            eval.best_step = Some(step);
        }
        let stop = eval.config.patience > 0 && eval.stale >= eval.config.patience && step < self.train.steps;
        let best = eval.best_step == Some(step);
        Ok(Some(EvalRecord { loss, perplexity: loss.exp(), tokens, best, stop }))
    }

    /// Buffers of optimizer state, each as large as the parameters it covers (AdamW and LAMB 2,
    /// SGD 1).
    pub fn optimizer_buffers(&self) -> usize {
        self.optimizer.buffers().len()
    }

    /// The optimizer runs the fused CPU kernel (`train.fused_optimizer` on a CPU).
    pub fn fused_cpu_optimizer(&self) -> bool {
        self.kernel() == UpdateKernel::Fused && self.device == Device::Cpu
    }

    /// The model's parameters, for moving their buffers (ZeRO).
    pub fn params_mut(&mut self) -> &mut FlatParams {
        self.model.params_mut()
    }

    /// Whether this run's settings allow ZeRO `stage`; the reason when not.
    pub fn check_shardable(&self, stage: u8) -> Result<(), String> {
        if stage >= 3 && self.executor.kind() == crate::ExecutorKind::SingleGraph {
            return Err("3 gathers each unit's parameters around the unit; train.executor = \"single-graph\" runs \
                        the model as one graph: use the block executor"
                .into());
        }
        Ok(())
    }

    /// Replaces the optimizer with one over `shard` (a ZeRO rank's slices of the parameters),
    /// carrying over the state: `starts[name]` is where the shard's piece of parameter `name`
    /// begins inside that parameter.
    pub fn shard_optimizer(
        &mut self,
        shard: &FlatParams,
        starts: &std::collections::HashMap<String, i64>,
    ) -> Result<(), String> {
        let full = self.optimizer.state_tensors(self.model.params());
        let mut sharded = Optimizer::for_config(&self.train, shard);
        sharded.load_state(shard, self.optimizer.n_steps(), |name| {
            let (param, _) = name.rsplit_once('.')?;
            let piece = shard.entries().iter().find(|e| e.name == param)?;
            let whole = full.iter().find(|s| s.name == name)?;
            let values = whole.tensor.reshape([-1]).narrow(0, *starts.get(param)?, piece.numel);
            Some((piece.shape.clone(), values))
        })?;
        self.optimizer = sharded;
        self.sharded = true;
        Ok(())
    }

    pub fn model(&self) -> &dyn Model {
        self.model.as_ref()
    }

    pub fn step(&self) -> u64 {
        self.step
    }

    /// Test hook: put an inf into the gradients of step `step` (1-based), as an fp16 overflow
    /// would, so the loss scaler's skip and back-off can be tested end to end.
    #[doc(hidden)]
    pub fn inject_overflow_at(&mut self, step: u64) {
        self.inject_overflow_at = Some(step);
    }

    /// Restores model, optimizer, loss scaler and step from a checkpoint; returns the data
    /// position to seek to.
    pub fn restore(&mut self, store: &CheckpointStore, step: u64) -> Result<u64, TrainError> {
        self.restore_loaded(&store.load(step)?)
    }

    /// `restore` from a checkpoint already loaded (and verified) by the caller.
    pub fn restore_loaded(&mut self, loaded: &Loaded) -> Result<u64, TrainError> {
        let mismatch = |message: String| TrainError::CheckpointMismatch { path: loaded.path.clone(), message };
        let model_file = loaded.files.get("model").ok_or_else(|| mismatch("no model.safetensors".into()))?;
        let optim_file = loaded.files.get("optim").ok_or_else(|| mismatch("no optim.safetensors".into()))?;
        let params = self.model.params();
        if model_file.len() != params.entries().len() {
            return Err(mismatch(format!(
                "{} tensors, this model has {} (is model.* the same as the run's?)",
                model_file.len(),
                params.entries().len()
            )));
        }
        let meta = &loaded.manifest.meta;
        let number = |key: &str| {
            meta.get(key)
                .and_then(serde_json::Value::as_u64)
                .ok_or_else(|| mismatch(format!("manifest meta has no {key}")))
        };
        let optimizer_steps = number("optimizer_steps")?;
        let data_position = number("data_position")?;
        let device = self.device;
        let f32_tensor = |record: &TensorRecord| -> Result<(Vec<i64>, Tensor), TrainError> {
            let shape: Vec<i64> = record.shape.iter().map(|&s| s as i64).collect();
            if record.dtype != DType::F32 {
                return Err(mismatch(format!("tensor {:?} is {:?}, want F32", record.name, record.dtype)));
            }
            Ok((shape.clone(), Tensor::from_data_size(&record.data, &shape, Kind::Float).to_device(device)))
        };
        tch::no_grad(|| -> Result<(), TrainError> {
            for entry in params.entries() {
                let record = model_file
                    .iter()
                    .find(|r| r.name == entry.name)
                    .ok_or_else(|| mismatch(format!("no tensor {:?}", entry.name)))?;
                let (shape, values) = f32_tensor(record)?;
                if shape != entry.shape {
                    return Err(mismatch(format!(
                        "tensor {:?} has shape {shape:?}, the model wants {:?}",
                        entry.name, entry.shape
                    )));
                }
                params.flat().narrow(0, entry.offset, entry.numel).copy_(&values.view([-1]));
            }
            Ok(())
        })?;
        let mut bad_record = None;
        self.optimizer
            .load_state(params, optimizer_steps, |name| {
                let record = optim_file.iter().find(|r| r.name == name)?;
                match f32_tensor(record) {
                    Ok(found) => Some(found),
                    Err(err) => {
                        bad_record = Some(err);
                        None
                    }
                }
            })
            .map_err(|message| bad_record.take().unwrap_or_else(|| mismatch(message)))?;
        if let Some(scaler) = &mut self.scaler {
            let scale = meta.get("loss_scale").and_then(serde_json::Value::as_f64);
            match (scale, number("loss_scale_clean_steps"), number("skipped_steps")) {
                (Some(scale), Ok(clean), Ok(skipped)) => scaler.restore(scale, clean, skipped),
                _ => return Err(mismatch("an fp16 run needs the loss scaler's state in the manifest".into())),
            }
        }
        if let Some(accum) = meta.get("grad_accum").and_then(serde_json::Value::as_u64) {
            self.grad_accum = accum as usize;
        }
        if let Some(adaptive) = &mut self.adaptive {
            adaptive.noise.g2 = meta.get("gns_g2").and_then(serde_json::Value::as_f64);
            adaptive.noise.trace = meta.get("gns_trace").and_then(serde_json::Value::as_f64);
        }
        if let Some(eval) = &mut self.eval {
            eval.best = meta.get("eval_best_loss").and_then(serde_json::Value::as_f64).unwrap_or(f64::INFINITY);
            eval.best_step = meta.get("eval_best_step").and_then(serde_json::Value::as_u64);
            eval.stale = meta.get("eval_stale").and_then(serde_json::Value::as_u64).unwrap_or(0);
        }
        self.step = loaded.manifest.step;
        self.resumed_from = Some(loaded.path.clone());
        Ok(data_position)
    }

    /// Copies the state into a host buffer: the part of a checkpoint the step must wait for.
    /// `shard`: the ZeRO shard this rank's optimizer runs on; then the snapshot holds this rank's
    /// pieces of every parameter and optimizer tensor (`Snapshot::piece`, a sharded writer), which
    /// rank 0's checkpoint lists beside the other ranks' (no gathering).
    ///
    /// `defer` (an unsharded snapshot only): when every tensor can be (`snapcopy::can_defer`), their rooms are taken but not
    /// filled, and the tensors are returned for a `PendingCopy`; otherwise they are copied now and
    /// nothing is returned.
    fn snapshot_into(
        &self,
        snapshot: &mut Snapshot,
        extra: &serde_json::Value,
        data_position: u64,
        shard: Option<&FlatParams>,
        defer: bool,
    ) -> Vec<(String, String, Tensor)> {
        let mut deferred = Vec::new();
        let params = self.model.params();
        let shape_of = |shape: &[i64]| -> Vec<usize> { shape.iter().map(|&s| s as usize).collect() };
        match shard {
            Some(shard) => {
                // Each shard entry is this rank's piece of the parameter of that name: elements
                // from `source - offset` of it (a unit's slice is contiguous, so one per parameter).
                let whole: std::collections::HashMap<&str, (i64, Vec<usize>)> =
                    params.entries().iter().map(|e| (e.name.as_str(), (e.offset, shape_of(&e.shape)))).collect();
                let mut pieces = std::collections::HashMap::new();
                for entry in shard.entries() {
                    let (offset, shape) = &whole[entry.name.as_str()];
                    let start = (entry.source - offset) as usize;
                    let range = start..start + entry.numel as usize;
                    let room = snapshot.piece("model", &entry.name, DType::F32, shape, range.clone());
                    let checksum = copy_into(&entry.tensor.detach(), room);
                    snapshot.add_checksums(checksum);
                    pieces.insert(entry.name.as_str(), (range, shape));
                }
                for state in self.optimizer.state_tensors(shard) {
                    let param = state.name.rsplit_once('.').map_or(state.name.as_str(), |(param, _)| param);
                    let (range, shape) = &pieces[param];
                    let room = snapshot.piece("optim", &state.name, DType::F32, shape, range.clone());
                    let checksum = copy_into(&state.tensor, room);
                    snapshot.add_checksums(checksum);
                }
            }
            None => {
                let sources: Vec<(&str, String, Vec<i64>, Tensor)> = params
                    .entries()
                    .iter()
                    .map(|e| ("model", e.name.clone(), e.shape.clone(), e.tensor.detach()))
                    .chain(
                        self.optimizer.state_tensors(params).into_iter().map(|s| ("optim", s.name, s.shape, s.tensor)),
                    )
                    .collect();
                let defer = defer && sources.iter().all(|(_, _, _, t)| crate::snapcopy::can_defer(t));
                if defer {
                    // The first snapshots into a buffer fault its pages in: the copy beside the step does.
                    snapshot.fault_in_when_filled();
                }
                for (stem, name, shape, tensor) in sources {
                    let room = snapshot.tensor(stem, &name, DType::F32, &shape_of(&shape));
                    if defer {
                        deferred.push((stem.to_string(), name, tensor));
                    } else {
                        let checksum = copy_into(&tensor, room);
                        snapshot.add_checksums(checksum);
                    }
                }
            }
        }
        let mut meta = serde_json::json!({
            "step": self.step,
            "optimizer_steps": self.optimizer.n_steps(),
            "data_position": data_position,
            "seed": self.train.seed,
        });
        if let (Some(scaler), Some(object)) = (&self.scaler, meta.as_object_mut()) {
            let (scale, clean, skipped) = scaler.state();
            object.insert("loss_scale".into(), serde_json::json!(scale));
            object.insert("loss_scale_clean_steps".into(), serde_json::json!(clean));
            object.insert("skipped_steps".into(), serde_json::json!(skipped));
        }
        if let (Some(eval), Some(object)) = (&self.eval, meta.as_object_mut()) {
            if let Some(best_step) = eval.best_step {
                object.insert("eval_best_loss".into(), serde_json::json!(eval.best));
                object.insert("eval_best_step".into(), serde_json::json!(best_step));
            }
            object.insert("eval_stale".into(), serde_json::json!(eval.stale));
        }
        object_optimizer(&mut meta, self.train.optimizer.name());
        if let (Some(adaptive), Some(object)) = (&self.adaptive, meta.as_object_mut()) {
            object.insert("grad_accum".into(), serde_json::json!(self.grad_accum));
            object.insert("gns_g2".into(), serde_json::json!(adaptive.noise.g2));
            object.insert("gns_trace".into(), serde_json::json!(adaptive.noise.trace));
        }
        if let (Some(meta), Some(extra)) = (meta.as_object_mut(), extra.as_object()) {
            meta.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        snapshot.set_meta(meta);
        deferred
    }

    /// On a GPU, synchronize at phase boundaries only every `every` steps (1, the default: every
    /// step; 0: never): the other steps' phases are host-side launch times, their wall time is
    /// still right on average. The CPU is always exact.
    pub fn set_sync_every(&mut self, every: u64) {
        self.sync_every = every;
    }

    /// Trains until `train.steps` optimizer steps are done or `stop` is raised (then it finishes
    /// the current step, checkpoints, and returns with `interrupted`).
    pub fn run(
        &mut self,
        source: &mut dyn BatchSource,
        observers: &mut [&mut dyn Observer],
        checkpoints: Option<&mut CheckpointTarget>,
        stop: &AtomicBool,
    ) -> Result<Summary, TrainError> {
        self.run_with_hooks(source, observers, checkpoints, stop, &mut NoHooks)
    }

    /// `run`, with `hooks` called between the units of every step (see `executor`).
    pub fn run_with_hooks(
        &mut self,
        source: &mut dyn BatchSource,
        observers: &mut [&mut dyn Observer],
        mut checkpoints: Option<&mut CheckpointTarget>,
        stop: &AtomicBool,
        hooks: &mut dyn StepHooks,
    ) -> Result<Summary, TrainError> {
        let shape = self.model.shape();
        let tokens_per_step = (self.train.micro_batch * shape.seq_len * self.grad_accum) as u64;
        let info = RunInfo {
            shape,
            n_params: self.model.n_params(),
            precision: self.train.precision,
            device: self.device,
            micro_batch: self.train.micro_batch,
            grad_accum: self.grad_accum,
            tokens_per_step,
            start_step: self.step,
            total_steps: self.train.steps,
            resumed_from: self.resumed_from.clone(),
            recompute: self.executor.recompute(),
            units: self.model.params().units().iter().map(|u| u.name.clone()).collect(),
            global_batch: self.global_batch(),
        };
        let mut tokens = 0u64;
        notify(observers, &TrainEvent::Started(&info))?;
        if let (Some(target), Some(best)) = (checkpoints.as_deref_mut(), self.best_eval_step()) {
            target.writer.protect(Some(best));
        }
        let first_step = self.step + 1;
        let run_start = Instant::now();
        let (mut first_loss, mut final_loss, mut best_loss) = (f64::NAN, f64::NAN, f64::INFINITY);
        let mut interrupted = false;
        let mut memory = None;
        let mut losses = std::collections::VecDeque::with_capacity(self.train.spike_window);
        let mut last_finite_loss = f64::NAN;
        let mut early_stopped = false;
        // A checkpoint's copy running beside this step, finished before its optimizer step.
        let mut pending: Option<PendingCopy> = None;
        while self.step < self.train.steps {
            let step_number = self.step + 1;
            let logged = step_number % self.train.log_every == 0
                || step_number == self.train.steps
                || self.eval_due(step_number);
            let timed = !self.device.is_cuda() || (self.sync_every > 0 && step_number % self.sync_every == 0);
            let mut clock = StepClock::start(self.device, timed).slow_forward(self.train.test_slow_forward);
            let measure_memory = step_number == first_step;
            let position_before = source.position();
            if self.train.debug_poison_step == step_number {
                submit_pending(&mut pending, checkpoints.as_deref_mut(), self.n_threads)?;
                self.poison();
            }
            let (loss_sum, step_memory, micro_sq) =
                self.forward_backward(source, step_number, measure_memory, &mut clock, hooks)?;
            if memory.is_none() {
                memory = step_memory;
            }
            hooks.before_optimizer(&mut clock)?;
            if let Some(copy) = &pending {
                match copy.save_map() {
                    // The update saves the state it overwrites.
                    Some(save) => self.optimizer.save_in_next_update(Some(save)),
                    None => {
                        // The optimizer writes what the copy reads: the rest of the copy is this
                        // step's stall.
                        clock.lap(Phase::Other);
                        submit_pending(&mut pending, checkpoints.as_deref_mut(), self.n_threads)?;
                        clock.lap(Phase::CkptStall);
                    }
                }
            }
            // The global batch of this step (the adaptive batch size may have grown it).
            let lr = self.train.lr_at_batch(self.step, self.global_batch());
            let step_tokens = (self.train.micro_batch * shape.seq_len * self.grad_accum) as u64;
            let loss_scale = self.scaler.as_ref().map(LossScaler::scale);
            // The NaN guard: a non-finite loss (read every step: the gradient norm below
            // synchronizes anyway) or gradient norm stops the run before the update.
            let local_loss = loss_sum.double_value(&[]);
            let monitored = logged && self.train.monitor_every > 0 && step_number % self.train.monitor_every == 0;
            // The fused AdamW measures the update ratios as it updates; other paths copy the
            // weights first.
            let measured_in_update =
                monitored && !self.sharded && self.optimizer.is_fused_adamw(self.model.params(), self.kernel());
            let before_update = (monitored && !self.sharded)
                .then(|| self.block_grad_norms(loss_scale.unwrap_or(1.0), !measured_in_update));
            if measured_in_update {
                self.optimizer.measure_next_update();
            }
            let outcome = self.optimizer_step(lr, local_loss.is_finite(), hooks, &mut clock);
            if pending.is_some() {
                // An update that ran saved the snapshot; one that did not (skipped, not finite, an
                // error) left the state as it was, and `finish` copies it now.
                self.optimizer.save_in_next_update(None);
                clock.lap(Phase::Optimizer);
                submit_pending(&mut pending, checkpoints.as_deref_mut(), self.n_threads)?;
                clock.lap(Phase::CkptStall);
            }
            let outcome = outcome?;
            let outcome = match outcome {
                Ok(outcome) => outcome,
                Err(grad_norm) => {
                    let what = if local_loss.is_finite() { "gradients" } else { "loss" };
                    let dump = self.nan_dump(
                        step_number,
                        what,
                        local_loss,
                        grad_norm,
                        last_finite_loss,
                        position_before,
                        source.position(),
                    );
                    // Checkpoints of earlier steps are committed before the run stops; this step
                    // writes none.
                    let mut latest = None;
                    if let Some(target) = checkpoints.as_deref_mut() {
                        for saved in target.writer.finish()? {
                            notify(observers, &TrainEvent::CheckpointSaved { step: saved.step, path: &saved.path })?;
                        }
                        latest = target.writer.store().latest()?;
                    }
                    return Err(TrainError::NonFinite(Box::new(NanDump { latest_checkpoint: latest, ..dump })));
                }
            };
            let update_norms = self.optimizer.take_update_norms();
            let monitors = before_update.map(|(grad_norm, params_before)| BlockMonitors {
                grad_norm,
                update_ratio: match params_before {
                    Some(before) => self.update_ratios(&before),
                    None => self.unit_update_ratios(update_norms.as_deref()),
                },
            });
            clock.lap(Phase::Optimizer);
            self.step = step_number;
            let loss = if logged { hooks.reduce_loss(local_loss)? } else { f64::NAN };
            if logged && !loss.is_finite() {
                return Err(TrainError::NonFiniteLoss { step: step_number, value: loss });
            }
            last_finite_loss = local_loss;
            let mut loss_z = None;
            if logged {
                if first_loss.is_nan() {
                    first_loss = loss;
                }
                final_loss = loss;
                best_loss = best_loss.min(loss);
                loss_z = spike_z(&losses, loss);
                if losses.len() == self.train.spike_window {
                    losses.pop_front();
                }
                losses.push_back(loss);
            }
            let batch_change = self.adapt_batch(step_number, &outcome, micro_sq, loss_z);
            tokens += step_tokens;
            let eval = self.maybe_evaluate(step_number, hooks)?;
            if let Some(eval) = &eval {
                clock.lap(Phase::Other);
                early_stopped = eval.stop;
            }
            interrupted = hooks.agree_stop(stop.load(Ordering::Relaxed))?;
            let due = self.ckpt.every > 0 && step_number % self.ckpt.every == 0;
            let at_end = (step_number == self.train.steps || early_stopped) && self.ckpt.at_end;
            let best_eval = eval.as_ref().is_some_and(|e| e.best) && self.eval_keeps_best();
            let checkpoint_now = due || at_end || interrupted || best_eval;
            // A sharded run: every rank writes its own pieces and residuals (a sharded writer).
            let extras = if checkpoint_now { hooks.checkpoint_extras(self.sharded)? } else { Vec::new() };
            if let Some(target) = checkpoints.as_deref_mut().filter(|_| checkpoint_now) {
                clock.lap(Phase::Other);
                if self.sharded && target.writer.store().shard_role().is_none() {
                    return Err(TrainError::InvalidConfig {
                        key: "dist.zero",
                        message:
                            "a sharded optimizer's checkpoint needs a sharded writer (CheckpointStore::with_shard)"
                                .into(),
                    });
                }
                // Blocks only while every host buffer is still being written (back-pressure).
                let mut snapshot = target.writer.begin(self.step)?;
                let shard = if self.sharded { hooks.optimizer_params() } else { None };
                // The copy goes beside the next step when there is one and the writer is a
                // background one (a synchronous save is the step's stall anyway).
                let last = step_number == self.train.steps || interrupted || early_stopped;
                let defer = self.ckpt.overlap && target.writer.config().background && !last;
                let deferred = self.snapshot_into(&mut snapshot, &target.meta, source.position(), shard, defer);
                for (name, values) in &extras {
                    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
                    snapshot.tensor("dist", name, DType::F32, &[values.len()]).copy_from_slice(&bytes);
                }
                if deferred.is_empty() {
                    submit(&mut target.writer, snapshot, best_eval)?;
                } else if self.optimizer.is_fused_adamw(self.model.params(), self.kernel())
                    && std::env::var_os("STOKE_CKPT_SAVE_IN_UPDATE").is_none_or(|v| v != "0")
                {
                    pending = Some(PendingCopy::for_optimizer(snapshot, deferred, best_eval));
                } else {
                    pending = Some(PendingCopy::start(snapshot, deferred, best_eval));
                }
                clock.lap(Phase::CkptStall);
            }
            let (phases, wall_ms) = clock.finish();
            let ended = std::time::Instant::now();
            let record = StepRecord {
                step: step_number,
                loss,
                lr,
                grad_norm: outcome.grad_norm,
                tokens: step_tokens,
                wall_ms,
                ended,
                phases,
                logged,
                timed,
                comm_total_ms: hooks.take_comm_ms(),
                loss_scale,
                skipped: outcome.skipped,
                monitors,
                loss_z,
                eval,
                noise_scale: self.adaptive.as_ref().and_then(|a| a.noise.estimate()),
                batch_change,
            };
            notify(observers, &TrainEvent::Step(&record))?;
            if let Some(target) = checkpoints.as_deref_mut() {
                // The step is recorded: its checkpoint may now be published.
                target.writer.release(step_number)?;
                for saved in target.writer.committed()? {
                    notify(observers, &TrainEvent::CheckpointSaved { step: saved.step, path: &saved.path })?;
                }
            }
            if interrupted || early_stopped {
                break;
            }
        }
        submit_pending(&mut pending, checkpoints.as_deref_mut(), self.n_threads)?;
        if let Some(target) = checkpoints {
            for saved in target.writer.finish()? {
                notify(observers, &TrainEvent::CheckpointSaved { step: saved.step, path: &saved.path })?;
            }
        }
        let wall_s = run_start.elapsed().as_secs_f64();
        let steps_run = self.step + 1 - first_step;
        let _ = tokens_per_step;
        let summary = Summary {
            first_step,
            last_step: self.step,
            steps_run,
            tokens,
            wall_s,
            tokens_per_s: tokens as f64 / wall_s.max(1e-9),
            first_loss,
            final_loss,
            best_loss,
            interrupted,
            skipped_steps: self.scaler.as_ref().map_or(0, LossScaler::skipped_steps),
            loss_scale: self.scaler.as_ref().map(LossScaler::scale),
            memory,
            early_stopped,
            best_eval: self.eval.as_ref().and_then(|e| e.best_step.map(|step| (step, e.best))),
        };
        notify(observers, &TrainEvent::Finished(&summary))?;
        Ok(summary)
    }

    /// The forward and backward of every micro-batch of one step, through the executor. Returns
    /// the step's mean loss (a device scalar) and, when measured, the activation memory.
    fn forward_backward(
        &mut self,
        source: &mut dyn BatchSource,
        step_number: u64,
        measure_memory: bool,
        clock: &mut StepClock,
        hooks: &mut dyn StepHooks,
    ) -> Result<(Tensor, Option<MemoryReport>, Option<f64>), TrainError> {
        let shape = self.model.shape();
        let (micro_batch, seq_len) = (self.train.micro_batch, shape.seq_len);
        let n_micro = self.grad_accum;
        // Adaptive batch size: the mean squared norm of the micro-batches' own gradients.
        let mut micro_sq_sum = 0.0;
        let loss_multiplier = self.scaler.as_ref().map_or(1.0, LossScaler::scale) / n_micro as f64;
        let mut loss_sum = Tensor::zeros([], (Kind::Float, self.device));
        let mut memory = None;
        // Each weight cast to the compute type once per step (not per micro-batch); a ZeRO step
        // does not keep them (stage 3 releases the parameters between uses).
        self.model.begin_step_casts(n_micro > 1 && !self.sharded);
        for micro_idx in 0..n_micro {
            let batch = source.next_batch()?;
            clock.lap(Phase::DataWait);
            if batch.micro_batch != micro_batch || batch.seq_len != seq_len {
                return Err(TrainError::InvalidConfig {
                    key: "data",
                    message: format!(
                        "the data source gave a [{}, {}] batch, the run wants [{micro_batch}, {seq_len}]",
                        batch.micro_batch, batch.seq_len
                    ),
                });
            }
            if let Some(&token) = batch.tokens.iter().find(|&&t| t < 0 || t as usize >= shape.vocab_size) {
                return Err(TrainError::TokenOutOfVocab { step: step_number, token, vocab_size: shape.vocab_size });
            }
            let rows = Tensor::from_slice(&batch.tokens).view([micro_batch as i64, seq_len as i64 + 1]);
            // from_slice copied the tokens: the buffer goes back to the source for a later batch.
            source.recycle(batch);
            let rows = rows.to_device(self.device);
            let inputs = rows.narrow(1, 0, seq_len as i64).contiguous();
            let targets = rows.narrow(1, 1, seq_len as i64).contiguous();
            clock.lap(Phase::H2d);
            let measure = measure_memory && micro_idx == 0;
            let before = measure.then(crate::peak::host_bytes_in_use).flatten();
            let last = micro_idx + 1 == n_micro;
            let result = self.executor.run_micro_batch(
                self.model.as_ref(),
                &inputs,
                &targets,
                loss_multiplier,
                last,
                measure,
                clock,
                hooks,
            )?;
            if let (Some(before), Some(per_block)) = (before, result.activation_bytes) {
                let peak = result.peak_bytes_in_use.unwrap_or(before);
                memory = Some(MemoryReport {
                    recompute: self.executor.recompute(),
                    activation_bytes_per_block: per_block,
                    activation_bytes: peak.saturating_sub(before),
                    peak_bytes_in_use: peak,
                });
            }
            loss_sum += result.loss / n_micro as f64;
            if let Some(adaptive) = &self.adaptive {
                // flat_grad holds the sum of g_i / n_micro (times the fp16 scale) so far.
                let scale = self.scaler.as_ref().map_or(1.0, LossScaler::scale);
                let flat_grad = self.model.params().flat_grad();
                let own = tch::no_grad(|| (flat_grad - &adaptive.previous_grad) * (n_micro as f64 / scale));
                micro_sq_sum += crate::optim::tensor_sq_sum(&own, 0);
                tch::no_grad(|| adaptive.previous_grad.shallow_clone().copy_(flat_grad));
            }
        }
        self.model.end_step_casts();
        if let Some(adaptive) = &self.adaptive {
            // The next step starts from cleared gradients.
            tch::no_grad(|| {
                let _ = adaptive.previous_grad.shallow_clone().zero_();
            });
        }
        let micro_sq = self.adaptive.is_some().then(|| micro_sq_sum / n_micro as f64);
        if self.inject_overflow_at == Some(step_number) {
            tch::no_grad(|| {
                let _ = self.model.params().flat_grad().narrow(0, 0, 1).fill_(f64::INFINITY);
            });
        }
        Ok((loss_sum, memory, micro_sq))
    }

    /// Adaptive batch size after a step: feeds the noise-scale estimate and, every
    /// `adaptive.every` steps, grows the accumulation when the phase is stable and the noise
    /// scale exceeds the batch.
    fn adapt_batch(
        &mut self,
        step: u64,
        outcome: &crate::optim::StepOutcome,
        micro_sq: Option<f64>,
        loss_z: Option<f64>,
    ) -> Option<BatchChange> {
        let rows = self.train.micro_batch * self.train.world_size.max(1);
        let accum = self.grad_accum;
        let adaptive = self.adaptive.as_mut()?;
        if let (Some(small_sq), false) = (micro_sq, outcome.skipped) {
            let (b_small, b_big) = (self.train.micro_batch as f64, (self.train.micro_batch * accum) as f64);
            let big_sq = outcome.grad_norm * outcome.grad_norm;
            adaptive.noise.observe(adaptive.config.ema, b_small, small_sq, b_big, big_sq);
        }
        if loss_z.is_some_and(|z| z > adaptive.config.stable_z) {
            adaptive.unstable = true;
        }
        if step % adaptive.config.every != 0 {
            return None;
        }
        let stable = !std::mem::replace(&mut adaptive.unstable, false);
        let noise_scale = adaptive.noise.estimate();
        let next = crate::adaptive::grown_accum(accum, rows, adaptive.max_batch, noise_scale, stable)?;
        self.grad_accum = next;
        Some(BatchChange { from: rows * accum, to: rows * next, noise_scale: noise_scale.unwrap_or(f64::NAN) })
    }

    /// The optimizer's step at learning rate `lr` (clipping, fp16 unscaling and skipping inside);
    /// Ok(Err(gradient norm)) when the loss or the gradients are not finite (nothing updated).
    /// Under ZeRO the norm is the whole model's (the hooks add the shards') and the update runs
    /// on this rank's shard; the hooks then gather the updated parameters.
    fn optimizer_step(
        &mut self,
        lr: f64,
        loss_finite: bool,
        hooks: &mut dyn StepHooks,
        clock: &mut StepClock,
    ) -> Result<Result<crate::optim::StepOutcome, f64>, TrainError> {
        let hp = Hyper {
            lr,
            beta1: self.train.beta1,
            beta2: self.train.beta2,
            eps: self.train.eps,
            weight_decay: self.train.weight_decay,
            momentum: self.train.momentum,
            nesterov: self.train.nesterov,
        };
        let kernel = self.kernel();
        let local = {
            let params = hooks.optimizer_params().unwrap_or(self.model.params());
            self.optimizer.grad_sq_sum(params, 0..params.n_elements(), kernel, self.n_threads)
        };
        // A rank whose loss is not finite makes every rank's norm NaN, so all stop together.
        let sq_sum = hooks.global_sq_sum(if loss_finite { local } else { f64::NAN })?;
        if !loss_finite {
            return Ok(Err(f64::NAN));
        }
        let params = hooks.optimizer_params().unwrap_or(self.model.params());
        let outcome = self.optimizer.step_with_sq_sum(
            params,
            sq_sum,
            &hp,
            self.train.grad_clip,
            self.scaler.as_mut(),
            kernel,
            self.n_threads,
            |norms| hooks.whole_tensor_norms(norms),
        )?;
        if outcome.is_ok() {
            hooks.after_optimizer(clock)?;
        }
        Ok(outcome)
    }

    fn kernel(&self) -> UpdateKernel {
        if self.train.fused_optimizer {
            UpdateKernel::Fused
        } else {
            UpdateKernel::TensorOps
        }
    }

    /// `train.debug_poison_step`: a NaN written into the first block's first parameter, so this
    /// step's loss and gradients are not finite, as a diverged run's would be.
    fn poison(&self) {
        let params = self.model.params();
        let units = params.units();
        let unit = units.get(1).unwrap_or(&units[0]);
        tch::no_grad(|| {
            let _ = params.flat().narrow(0, unit.range.start, 1).fill_(f64::NAN);
        });
    }

    /// Each unit's gradient norm (divided by the loss scale), and (`copy`) a copy of the parameters
    /// before the update, for `update_ratios`.
    fn block_grad_norms(&self, scale: f64, copy: bool) -> (Vec<f64>, Option<Tensor>) {
        let params = self.model.params();
        let kernel = self.kernel();
        let norms = params
            .units()
            .iter()
            .map(|u| self.optimizer.grad_sq_sum(params, u.range.clone(), kernel, self.n_threads).sqrt() / scale)
            .collect();
        (norms, copy.then(|| params.flat().detach().copy()))
    }

    /// Each unit's ||Δw|| / ||w|| from the per-parameter squared norms a measured update found
    /// (`Optimizer::take_update_norms`); no update (a skipped step): 0 for every unit, as the copy's
    /// way gives.
    fn unit_update_ratios(&self, norms: Option<&[(f64, f64)]>) -> Vec<f64> {
        self.model
            .params()
            .units()
            .iter()
            .map(|u| {
                let (change, weight) = norms.map_or((0.0, 0.0), |n| {
                    n[u.entries.clone()].iter().fold((0.0, 0.0), |(c, w), &(dc, dw)| (c + dc, w + dw))
                });
                if weight > 0.0 {
                    (change / weight).sqrt()
                } else {
                    0.0
                }
            })
            .collect()
    }

    /// ||w_after - w_before|| / ||w_before|| per unit.
    fn update_ratios(&self, before: &Tensor) -> Vec<f64> {
        let params = self.model.params();
        tch::no_grad(|| {
            let delta = params.flat() - before;
            params
                .units()
                .iter()
                .map(|u| {
                    let len = u.range.end - u.range.start;
                    let d = crate::optim::tensor_sq_sum(&delta.narrow(0, u.range.start, len), u.range.start);
                    let w = crate::optim::tensor_sq_sum(&before.narrow(0, u.range.start, len), u.range.start);
                    if w > 0.0 {
                        (d / w).sqrt()
                    } else {
                        0.0
                    }
                })
                .collect()
        })
    }

    /// What `nan-dump.json` holds: the step, its samples, every parameter or gradient tensor that
    /// holds a NaN or an inf with its statistics, and the last finite loss.
    #[allow(clippy::too_many_arguments)]
    fn nan_dump(
        &self,
        step: u64,
        what: &str,
        loss: f64,
        grad_norm: f64,
        last_finite_loss: f64,
        position_before: u64,
        position_after: u64,
    ) -> NanDump {
        let params = self.model.params();
        let mut offending = Vec::new();
        for entry in params.entries() {
            let grad = params.flat_grad().narrow(0, entry.offset, entry.numel);
            let value = params.flat().narrow(0, entry.offset, entry.numel);
            for (kind, t) in [("parameter", &value), ("gradient", &grad)] {
                let stats = TensorStats::of(t);
                if stats.nan > 0 || stats.inf > 0 {
                    offending.push(OffendingTensor { name: entry.name.clone(), kind: kind.into(), stats });
                }
            }
        }
        NanDump {
            step,
            detected_at: what.into(),
            loss: finite_or_null(loss),
            grad_norm: finite_or_null(grad_norm),
            last_finite_loss: finite_or_null(last_finite_loss),
            data_position_before: position_before,
            data_position_after: position_after,
            micro_batch: self.train.micro_batch,
            grad_accum: self.train.grad_accum,
            seq_len: self.model.shape().seq_len,
            offending,
            latest_checkpoint: None,
            poisoned_on_purpose: self.train.debug_poison_step == step,
        }
    }
}

/// Names the optimizer in a checkpoint's meta.
fn object_optimizer(meta: &mut serde_json::Value, name: &str) {
    if let Some(object) = meta.as_object_mut() {
        object.insert("optimizer".into(), serde_json::json!(name));
    }
}

/// JSON has no NaN: a non-finite number is written as null.
fn finite_or_null(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// `nan-dump.json`: why and where a run stopped on a non-finite value.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NanDump {
    /// The step (1-based) whose loss or gradients were not finite; it was not applied.
    pub step: u64,
    /// "loss" or "gradients": which check fired.
    pub detected_at: String,
    /// The step's loss (null when not finite).
    pub loss: Option<f64>,
    pub grad_norm: Option<f64>,
    /// The loss of the last step whose loss was finite (null when there was none).
    pub last_finite_loss: Option<f64>,
    /// The data source's position before and after the step's batches: the step read the
    /// samples in between (the loader's global sample positions; for the in-memory windows, the
    /// batch numbers).
    pub data_position_before: u64,
    pub data_position_after: u64,
    pub micro_batch: usize,
    pub grad_accum: usize,
    pub seq_len: usize,
    /// Every parameter or gradient tensor holding a NaN or an inf.
    pub offending: Vec<OffendingTensor>,
    /// The newest committed checkpoint (left as it was), if any.
    pub latest_checkpoint: Option<u64>,
    /// True when `train.debug_poison_step` caused it.
    pub poisoned_on_purpose: bool,
}

/// A tensor of `NanDump::offending`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct OffendingTensor {
    pub name: String,
    /// "parameter" or "gradient".
    pub kind: String,
    pub stats: TensorStats,
}

/// Statistics of a tensor's values.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TensorStats {
    pub numel: i64,
    pub nan: i64,
    pub inf: i64,
    /// Over the finite values (null when there are none).
    pub finite_min: Option<f64>,
    pub finite_max: Option<f64>,
    pub finite_abs_mean: Option<f64>,
}

impl TensorStats {
    fn of(t: &Tensor) -> TensorStats {
        let t = t.detach().to_kind(Kind::Double);
        let nan = t.isnan().sum(Kind::Int64).int64_value(&[]);
        let inf = t.isinf().sum(Kind::Int64).int64_value(&[]);
        let finite = t.masked_select(&t.isfinite());
        let n_finite = finite.numel();
        let stat = |x: Tensor| (n_finite > 0).then(|| x.double_value(&[]));
        TensorStats {
            numel: t.numel() as i64,
            nan,
            inf,
            finite_min: stat(if n_finite > 0 { finite.min() } else { Tensor::from(0.0) }),
            finite_max: stat(if n_finite > 0 { finite.max() } else { Tensor::from(0.0) }),
            finite_abs_mean: stat(finite.abs().mean(Kind::Double)),
        }
    }
}

/// How many standard deviations `loss` lies above the mean of `window` (None until it holds 10
/// losses, or when they do not vary).
fn spike_z(window: &std::collections::VecDeque<f64>, loss: f64) -> Option<f64> {
    if window.len() < 10 {
        return None;
    }
    let n = window.len() as f64;
    let mean = window.iter().sum::<f64>() / n;
    let var = window.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (var > 0.0).then(|| (loss - mean) / var.sqrt())
}

fn notify(observers: &mut [&mut dyn Observer], event: &TrainEvent<'_>) -> Result<(), TrainError> {
    for observer in observers.iter_mut() {
        observer.on_event(event).map_err(|e| TrainError::Observer(e.to_string()))?;
    }
    Ok(())
}

/// Finishes the checkpoint copy started beside this step, if any, and hands its snapshot to the
/// writer.
fn submit_pending(
    pending: &mut Option<PendingCopy>,
    target: Option<&mut CheckpointTarget>,
    threads: usize,
) -> Result<(), TrainError> {
    let Some(copy) = pending.take() else { return Ok(()) };
    let target = target.expect("a pending checkpoint copy has its writer");
    let best_eval = copy.best_eval;
    submit(&mut target.writer, copy.finish(threads), best_eval)
}

/// Hands a filled snapshot to the writer; the best evaluation's checkpoint is kept from retention.
fn submit(writer: &mut CheckpointWriter, snapshot: Snapshot, best_eval: bool) -> Result<(), TrainError> {
    let step = snapshot.step();
    writer.submit(snapshot)?;
    if best_eval {
        writer.protect(Some(step));
    }
    Ok(())
}

/// Copies `t` into `dst`. A contiguous CPU tensor is copied by
/// `stoke_ckpt::stream_copy_checksummed` (the intra-op thread count, streaming stores: about twice
/// libtorch's copy into a large host buffer), which also hashes it from the cache: the returned
/// (address, bytes, CRC-32) is for `Snapshot::add_checksums`. Anything else (another device, a
/// strided view) is copied by libtorch, and the writer hashes it. `STOKE_CKPT_COPY=torch` uses
/// libtorch's copy for every tensor (a diagnostic switch).
fn copy_into(t: &Tensor, dst: &mut [u8]) -> Option<(usize, usize, u32)> {
    let numel = t.numel();
    assert_eq!(dst.len(), numel * t.kind().elt_size_in_bytes(), "the host slot fits the tensor");
    if !dst.is_empty()
        && t.device() == Device::Cpu
        && t.is_contiguous()
        && std::env::var_os("STOKE_CKPT_COPY").is_none_or(|v| v != "torch")
    {
        let threads = tch::get_num_threads().max(1) as usize;
        // SAFETY: a contiguous CPU tensor's `dst.len()` bytes (numel x element size, checked
        // above) start at `data_ptr`; `t` is borrowed for this whole function, so the storage
        // stays alive, and nothing writes it meanwhile (the step is not running).
        let src = unsafe { std::slice::from_raw_parts(t.data_ptr() as *const u8, dst.len()) };
        return Some((dst.as_ptr() as usize, dst.len(), stoke_ckpt::stream_copy_checksummed(dst, src, threads)));
    }
    // SAFETY: `host` views exactly `dst`'s bytes (length checked above) as a CPU tensor; `dst` is
    // borrowed mutably for this whole function and `host` is dropped before it returns, so
    // nothing else reads or writes that memory meanwhile and the view never outlives it.
    let mut host = unsafe { Tensor::from_blob(dst.as_mut_ptr(), &[numel as i64], &[1], t.kind(), Device::Cpu) };
    tch::no_grad(|| host.copy_(&t.reshape([-1])));
    None
}
