//! The training loop and the events it emits.
//!
//! `Trainer::run` reads top to bottom: take a batch, move it to the device, forward, backward,
//! clip, step, tell the observers, maybe checkpoint. Metrics, progress, profiling and reports are
//! observers of `TrainEvent`; none of them is woven into the loop.

mod checkpoint;
mod device_guard;
mod eval;
mod events;
mod guards;
mod inputs;
mod nan_dump;
mod pipeline;
mod rounds;
mod state;
mod step;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use stoke_ckpt::DType;
use stoke_data::BatchSource;
use tch::Device;

use crate::adaptive::{AdaptiveConfig, NoiseScale};
use crate::clock::StepClock;
use crate::config::{CkptConfig, ModelConfig, Precision, TrainConfig};
use crate::executor::{Executor, NoHooks, StepHooks};
use crate::models::{build_model, Model};
use crate::optim::UpdateKernel;
use crate::optimizers::Optimizer;
use crate::params::FlatParams;
use crate::precision::LossScaler;
use crate::snapcopy::PendingCopy;
use crate::TrainError;

pub use checkpoint::CheckpointTarget;
pub use events::{
    BatchChange, BlockMonitors, EvalRecord, MemoryReport, Observer, ObserverError, RunInfo, StepRecord, Summary,
    TrainEvent,
};
pub use nan_dump::NanDump;
pub use state::Trainer;
pub use stoke_prof::{Phase, PhaseTimes};

use checkpoint::{submit, submit_pending};
use device_guard::Caught;
use events::notify;
use guards::spike_z;
use state::AdaptiveState;

/// Picks the device of a single process: "cpu", "cuda" (the first visible GPU), "cuda:K" or "auto"
/// (a GPU when libtorch sees one); the ranks of a job use [`device_for_rank`].
pub fn parse_device(name: &str) -> Result<Device, TrainError> {
    device_for_rank(name, 0, 1)
}

/// The device of local rank `local_rank` of the `local_world` ranks on this machine: `cuda` (and
/// `auto` where there is a CUDA device) is `cuda:LOCAL_RANK`, one device per rank as torchrun users
/// expect, among the devices `CUDA_VISIBLE_DEVICES` leaves visible; `cuda:K` pins device K.
pub fn device_for_rank(name: &str, local_rank: usize, local_world: usize) -> Result<Device, TrainError> {
    let n_cuda = if tch::Cuda::is_available() { tch::Cuda::device_count().max(0) as usize } else { 0 };
    select_device(name, n_cuda, local_rank, local_world, std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref())
}

/// [`device_for_rank`] given the number of visible CUDA devices (and `CUDA_VISIBLE_DEVICES`, for
/// the messages).
pub fn select_device(
    name: &str,
    n_cuda: usize,
    local_rank: usize,
    local_world: usize,
    visible: Option<&str>,
) -> Result<Device, TrainError> {
    let invalid = |message: String| TrainError::InvalidConfig { key: "run.device", message };
    let seen = || match visible {
        Some(v) => format!("{n_cuda} (CUDA_VISIBLE_DEVICES={v:?})"),
        None => n_cuda.to_string(),
    };
    let one_per_rank = || {
        if n_cuda == 0 {
            return Err(invalid(format!("is {name:?} but libtorch sees no CUDA device (CUDA devices: {})", seen())));
        }
        if local_world > n_cuda {
            return Err(invalid(format!(
                "is {name:?}: one device per rank, but {local_world} ranks run on this machine and it has {}                  CUDA devices; start at most {n_cuda} ranks per machine, or pin a device with run.device=\"cuda:K\"",
                seen()
            )));
        }
        Ok(Device::Cuda(local_rank))
    };
    match name {
        "cpu" => Ok(Device::Cpu),
        "auto" if n_cuda == 0 => Ok(Device::Cpu),
        "auto" | "cuda" => one_per_rank(),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(index)) if index < n_cuda => Ok(Device::Cuda(index)),
            Some(Ok(_)) => {
                Err(invalid(format!("is {other:?} but CUDA devices visible: {}; indices start at 0", seen())))
            }
            _ => Err(invalid(format!("must be one of auto, cpu, cuda, cuda:K; got {other:?}"))),
        },
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
        let matmuls = crate::models::plan_model_for(model, train)?;
        let episode_shape = if model.family == "vla" { Some(model.vla_shape()?) } else { None };
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
            matmuls,
            episode_shape,
            stage: None,
            stage_rounds: Vec::new(),
            stage_times: None,
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

    /// Cuts the model over the ranks of `group` (tensor parallelism: `dist.tensor`), before any
    /// restore, sharding or step: each rank keeps its part of the freshly built (or imported)
    /// model, and the optimizer is made anew over those parts. The block executor only: a single
    /// graph has no place for the group's input-gradient sums.
    pub fn split_tensor(&mut self, group: std::sync::Arc<crate::models::TensorGroup>) -> Result<(), TrainError> {
        if self.executor.kind() == crate::ExecutorKind::SingleGraph {
            return Err(TrainError::InvalidConfig {
                key: "train.executor",
                message: "is \"single-graph\", which cannot run a model cut by dist.tensor; use \"blocks\"".into(),
            });
        }
        if self.step > 0 || self.sharded {
            return Err(TrainError::InvalidConfig {
                key: "dist.tensor",
                message: "cuts a model before its first step and before ZeRO shards it".into(),
            });
        }
        self.model.split_tensor(group)?;
        self.optimizer = Optimizer::for_config(&self.train, self.model.params());
        Ok(())
    }

    /// After `split_tensor`: the cut model's blocks pass pieces of the sequence
    /// (`dist.sequence_parallel`, `models::tensor_parallel`).
    pub fn enable_sequence_parallel(&mut self) -> Result<(), TrainError> {
        self.model.enable_sequence_parallel()
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
            n_trainable_params: self.model.params().n_elements() as usize,
            flops_per_token: self.model.flops_per_token(),
            frames_per_sample: self.episode_shape.map_or(0, |s| s.frames),
            precision: self.train.precision,
            widened_products: self.model.widened_products(),
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
            matmuls: self.matmuls.clone(),
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
        // Test-only: memory held to make the run's peak larger (`Injections::more_memory`).
        let mut injected_memory: Vec<u8> = Vec::new();
        // The NaN guard on the device, where the step keeps its norm there (`train.guard_every`).
        let mut guard = self.device_guard(hooks);
        while self.step < self.train.steps {
            let step_number = self.step + 1;
            let logged = step_number % self.train.log_every == 0
                || step_number == self.train.steps
                || self.eval_due(step_number);
            let timed = !self.device.is_cuda() || (self.sync_every > 0 && step_number % self.sync_every == 0);
            let mut clock = StepClock::start(self.device, timed).inject(self.train.test_inject);
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
            // The NaN guard: a non-finite loss or gradient norm stops the run. Read every step
            // where the norm is read for the clip anyway; kept on the device between reads
            // otherwise (`train.guard_every`).
            let read_now = guard.as_ref().is_none_or(|g| logged || g.due(step_number));
            let local_loss = if read_now { loss_sum.double_value(&[]) } else { f64::NAN };
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
            let outcome = match guard.as_mut() {
                Some(guard) => {
                    let sq_sum = self.optimizer_step_on_device(lr);
                    guard.record(step_number, &loss_sum, &sq_sum, position_before, source.position());
                    let caught = if read_now { guard.read(|local| hooks.agree_first_bad(local))? } else { None };
                    let outcome = match caught {
                        Some(caught) => Err(caught),
                        None => {
                            hooks.after_optimizer(&mut clock)?;
                            let grad_norm = if read_now { sq_sum.double_value(&[]).sqrt() } else { f64::NAN };
                            Ok(crate::optim::StepOutcome { grad_norm, skipped: false })
                        }
                    };
                    Ok(outcome)
                }
                None => self.optimizer_step(lr, local_loss.is_finite(), hooks, &mut clock).map(|outcome| {
                    outcome.map_err(|grad_norm| Caught {
                        step: step_number,
                        loss: local_loss,
                        grad_norm,
                        last_finite_loss,
                        position_before,
                        position_after: source.position(),
                    })
                }),
            };
            if pending.is_some() {
                // An update that ran saved the snapshot; one that did not (skipped, not finite, an
                // error) left the state as it was, and `finish` copies it now.
                self.optimizer.save_in_next_update(None);
                clock.lap(Phase::Optimizer);
                submit_pending(&mut pending, checkpoints.as_deref_mut(), self.n_threads)?;
                clock.lap(Phase::CkptStall);
            }
            let outcome = match outcome? {
                Ok(outcome) => outcome,
                Err(caught) => return Err(self.stop_non_finite(caught, step_number, checkpoints, observers)?),
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
            if self.train.test_inject.more_memory > 0.0 {
                grow_injected_memory(&mut injected_memory, self.train.test_inject.more_memory, self.device);
            }
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
            // No checkpoint holds a step after a non-finite one.
            if let Some(guard) = guard.as_mut().filter(|g| checkpoint_now && g.unread()) {
                if let Some(caught) = guard.read(|local| hooks.agree_first_bad(local))? {
                    return Err(self.stop_non_finite(caught, step_number, checkpoints, observers)?);
                }
            }
            // A cut model's parts gathered whole, on every rank of its group.
            let whole = match checkpoint_now {
                true => {
                    // ZeRO beside the cut: the copies' slices first, then the parts.
                    let gathered = hooks.gather_sharded_state(&self.optimizer.buffers())?;
                    self.whole_state(hooks.optimizer_params(), gathered)?
                }
                false => None,
            };
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
                let shard = if self.sharded { hooks.checkpoint_params() } else { None };
                // The copy goes beside the next step when there is one and the writer is a
                // background one (a synchronous save is the step's stall anyway).
                let last = step_number == self.train.steps || interrupted || early_stopped;
                let defer = self.ckpt.overlap && target.writer.config().background && !last;
                let deferred = self.snapshot_into(&mut snapshot, &target.meta, source.position(), shard, defer, whole);
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
                // A pipeline stage's sends and receives (its waits on its neighbours) too.
                comm_total_ms: hooks.take_comm_ms() + self.stage_times.map_or(0.0, |(wait, _)| wait),
                loss_scale,
                skipped: outcome.skipped,
                monitors,
                loss_z,
                eval,
                noise_scale: self.adaptive.as_ref().and_then(|a| a.noise.estimate()),
                batch_change,
                frame_stages: source.frame_stages(),
                pipeline: self.stage_times.take(),
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
        if let Some(guard) = guard.as_mut().filter(|g| g.unread()) {
            if let Some(caught) = guard.read(|local| hooks.agree_first_bad(local))? {
                return Err(self.stop_non_finite(caught, self.step, checkpoints, observers)?);
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_local_rank_gets_its_own_device_and_too_many_ranks_are_refused() {
        for rank in 0..4 {
            assert_eq!(select_device("cuda", 4, rank, 4, None).unwrap(), Device::Cuda(rank));
            assert_eq!(select_device("auto", 4, rank, 4, None).unwrap(), Device::Cuda(rank));
        }
        assert_eq!(select_device("auto", 0, 1, 2, None).unwrap(), Device::Cpu);
        assert_eq!(select_device("cpu", 8, 3, 8, None).unwrap(), Device::Cpu);
        assert_eq!(select_device("cuda:1", 2, 0, 2, None).unwrap(), Device::Cuda(1));
        let err = select_device("cuda", 2, 2, 3, Some("0,3")).unwrap_err().to_string();
        assert!(err.contains("3 ranks") && err.contains("2 (CUDA_VISIBLE_DEVICES=\"0,3\")"), "{err}");
        let err = select_device("cuda", 0, 0, 1, Some("")).unwrap_err().to_string();
        assert!(err.contains("no CUDA device"), "{err}");
        let err = select_device("cuda:2", 2, 0, 1, None).unwrap_err().to_string();
        assert!(err.contains("\"cuda:2\"") && err.contains("visible: 2"), "{err}");
        let err = select_device("gpu", 2, 0, 1, None).unwrap_err().to_string();
        assert!(err.contains("cuda:K"), "{err}");
    }
}

/// Test-only: grows `held` to `fraction` of the process's peak resident memory without it, every
/// page touched so that it counts.
fn grow_injected_memory(held: &mut Vec<u8>, fraction: f64, device: Device) {
    let Some(peak) = crate::memory_in_use_bytes(device) else { return };
    let want = (fraction * peak.saturating_sub(held.len() as u64) as f64) as usize;
    if want > held.len() {
        held.resize(want, 1);
    }
}
