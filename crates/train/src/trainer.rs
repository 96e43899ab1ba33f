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

use crate::clock::StepClock;
use crate::config::{CkptConfig, GptShape, ModelConfig, Precision, TrainConfig};
use crate::executor::{Executor, NoHooks, Recompute, StepHooks};
use crate::model::Gpt;
use crate::optim::{AdamW, AdamWStep, UpdateKernel};
use crate::precision::LossScaler;
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
    model: Gpt,
    optimizer: AdamW,
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
        let shape = model.shape()?;
        if train.threads > 0 {
            tch::set_num_threads(train.threads as i32);
        }
        crate::host_memory::apply(train.host_memory);
        tch::manual_seed(train.seed as i64);
        let model = Gpt::new(shape, train.precision, train.attention, device);
        let optimizer = AdamW::new(model.params());
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
        })
    }

    pub fn model(&self) -> &Gpt {
        &self.model
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
        self.step = loaded.manifest.step;
        self.resumed_from = Some(loaded.path.clone());
        Ok(data_position)
    }

    /// Copies the state into a host buffer: the part of a checkpoint the step must wait for.
    fn snapshot_into(&self, snapshot: &mut Snapshot, extra: &serde_json::Value, data_position: u64) {
        let params = self.model.params();
        for entry in params.entries() {
            let shape: Vec<usize> = entry.shape.iter().map(|&s| s as usize).collect();
            copy_into(&entry.tensor.detach(), snapshot.tensor("model", &entry.name, DType::F32, &shape));
        }
        for state in self.optimizer.state_tensors(params) {
            let shape: Vec<usize> = state.shape.iter().map(|&s| s as usize).collect();
            copy_into(&state.tensor, snapshot.tensor("optim", &state.name, DType::F32, &shape));
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
        if let (Some(meta), Some(extra)) = (meta.as_object_mut(), extra.as_object()) {
            meta.extend(extra.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        snapshot.set_meta(meta);
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
        let tokens_per_step = (self.train.micro_batch * shape.seq_len * self.train.grad_accum) as u64;
        let info = RunInfo {
            shape,
            n_params: shape.n_params(),
            precision: self.train.precision,
            device: self.device,
            micro_batch: self.train.micro_batch,
            grad_accum: self.train.grad_accum,
            tokens_per_step,
            start_step: self.step,
            total_steps: self.train.steps,
            resumed_from: self.resumed_from.clone(),
            recompute: self.executor.recompute(),
        };
        notify(observers, &TrainEvent::Started(&info))?;
        let first_step = self.step + 1;
        let run_start = Instant::now();
        let (mut first_loss, mut final_loss, mut best_loss) = (f64::NAN, f64::NAN, f64::INFINITY);
        let mut interrupted = false;
        let mut memory = None;
        while self.step < self.train.steps {
            let step_number = self.step + 1;
            let logged = step_number % self.train.log_every == 0 || step_number == self.train.steps;
            let timed = !self.device.is_cuda() || (self.sync_every > 0 && step_number % self.sync_every == 0);
            let mut clock = StepClock::start(self.device, timed).slow_forward(self.train.test_slow_forward);
            let measure_memory = step_number == first_step;
            let (loss_sum, step_memory) =
                self.forward_backward(source, step_number, measure_memory, &mut clock, hooks)?;
            if memory.is_none() {
                memory = step_memory;
            }
            hooks.before_optimizer(&mut clock)?;
            let lr = self.train.lr_at(self.step);
            let loss_scale = self.scaler.as_ref().map(LossScaler::scale);
            let outcome = self.optimizer_step(lr);
            clock.lap(Phase::Optimizer);
            self.step = step_number;
            let loss = if logged { hooks.reduce_loss(loss_sum.double_value(&[]))? } else { f64::NAN };
            if logged && !loss.is_finite() {
                return Err(TrainError::NonFiniteLoss { step: step_number, value: loss });
            }
            if logged {
                if first_loss.is_nan() {
                    first_loss = loss;
                }
                final_loss = loss;
                best_loss = best_loss.min(loss);
            }
            interrupted = hooks.agree_stop(stop.load(Ordering::Relaxed))?;
            let due = self.ckpt.every > 0 && step_number % self.ckpt.every == 0;
            let at_end = step_number == self.train.steps && self.ckpt.at_end;
            if let Some(target) = checkpoints.as_deref_mut().filter(|_| due || at_end || interrupted) {
                clock.lap(Phase::Other);
                // Blocks only while every host buffer is still being written (back-pressure).
                let mut snapshot = target.writer.begin(self.step)?;
                self.snapshot_into(&mut snapshot, &target.meta, source.position());
                target.writer.submit(snapshot)?;
                clock.lap(Phase::CkptStall);
            }
            let (phases, wall_ms) = clock.finish();
            let record = StepRecord {
                step: step_number,
                loss,
                lr,
                grad_norm: outcome.grad_norm,
                tokens: tokens_per_step,
                wall_ms,
                phases,
                logged,
                timed,
                comm_total_ms: hooks.take_comm_ms(),
                loss_scale,
                skipped: outcome.skipped,
            };
            notify(observers, &TrainEvent::Step(&record))?;
            if let Some(target) = checkpoints.as_deref_mut() {
                // The step is recorded: its checkpoint may now be published.
                target.writer.release(step_number)?;
                for saved in target.writer.committed()? {
                    notify(observers, &TrainEvent::CheckpointSaved { step: saved.step, path: &saved.path })?;
                }
            }
            if interrupted {
                break;
            }
        }
        if let Some(target) = checkpoints {
            for saved in target.writer.finish()? {
                notify(observers, &TrainEvent::CheckpointSaved { step: saved.step, path: &saved.path })?;
            }
        }
        let wall_s = run_start.elapsed().as_secs_f64();
        let steps_run = self.step + 1 - first_step;
        let tokens = steps_run * tokens_per_step;
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
    ) -> Result<(Tensor, Option<MemoryReport>), TrainError> {
        let shape = self.model.shape();
        let (micro_batch, seq_len) = (self.train.micro_batch, shape.seq_len);
        let n_micro = self.train.grad_accum;
        let loss_multiplier = self.scaler.as_ref().map_or(1.0, LossScaler::scale) / n_micro as f64;
        let mut loss_sum = Tensor::zeros([], (Kind::Float, self.device));
        let mut memory = None;
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
                &self.model,
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
        }
        if self.inject_overflow_at == Some(step_number) {
            tch::no_grad(|| {
                let _ = self.model.params().flat_grad().narrow(0, 0, 1).fill_(f64::INFINITY);
            });
        }
        Ok((loss_sum, memory))
    }

    /// The optimizer's step at learning rate `lr` (clipping, fp16 unscaling and skipping inside).
    fn optimizer_step(&mut self, lr: f64) -> crate::optim::StepOutcome {
        let hp = AdamWStep {
            lr,
            beta1: self.train.beta1,
            beta2: self.train.beta2,
            eps: self.train.eps,
            weight_decay: self.train.weight_decay,
        };
        let kernel = if self.train.fused_optimizer { UpdateKernel::Fused } else { UpdateKernel::TensorOps };
        self.optimizer.step(self.model.params(), hp, self.train.grad_clip, self.scaler.as_mut(), kernel, self.n_threads)
    }
}

fn notify(observers: &mut [&mut dyn Observer], event: &TrainEvent<'_>) -> Result<(), TrainError> {
    for observer in observers.iter_mut() {
        observer.on_event(event).map_err(|e| TrainError::Observer(e.to_string()))?;
    }
    Ok(())
}

/// Copies `t` (any device) into `dst` with libtorch's copy, which splits a large tensor across the
/// intra-op threads.
fn copy_into(t: &Tensor, dst: &mut [u8]) {
    let numel = t.numel();
    assert_eq!(dst.len(), numel * t.kind().elt_size_in_bytes(), "the host slot fits the tensor");
    // SAFETY: `host` views exactly `dst`'s bytes (length checked above) as a CPU tensor; `dst` is
    // borrowed mutably for this whole function and `host` is dropped before it returns, so
    // nothing else reads or writes that memory meanwhile and the view never outlives it.
    let mut host = unsafe { Tensor::from_blob(dst.as_mut_ptr(), &[numel as i64], &[1], t.kind(), Device::Cpu) };
    tch::no_grad(|| host.copy_(&t.reshape([-1])));
}
