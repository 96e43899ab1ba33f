//! Data parallelism: [`DataParallel`], the step hooks that make every rank's step the step of the
//! global batch.
//!
//! Each rank runs forward and backward on its own rows of the global batch. The flat gradient
//! buffer is cut into buckets of consecutive units ([`BucketPlan`], `dist.bucket_mb`, the first
//! bucket smaller). When the gradients of all a bucket's units are final (`grads_final`, on the
//! step's last micro-batch, in reverse unit order) the bucket is all-reduced (average) in place,
//! asynchronously, on the communicator's thread, while backward goes on with the earlier units.
//! With overlap switched off (`dist.overlap = false`, the reference the overlap is measured
//! against) nothing is sent until backward has finished; then every bucket, in the same order.
//! Before the optimizer the step waits for the reductions still in flight; that wait is the
//! `comm_exposed` phase, and the time from the first submission to the last completion is the
//! step's `comm_total_ms`. After the averaging every rank holds the same gradients, so every rank's
//! optimizer makes the same update and the parameters stay identical (they start identical:
//! [`DataParallel::broadcast_parameters`]). The logged loss is averaged too, so every rank logs the
//! global batch's mean loss. [`DataParallel::check_agreement`] refuses, at start, ranks whose model
//! or configuration differ.

mod agree;
mod buckets;
pub(crate) mod compress;
mod layout;
mod pipeline;
mod region;
mod tensor;
mod zero;

pub use agree::{Disagreement, KeyDifference, RankDifference};
pub use buckets::{Bucket, BucketPlan, BucketSizes};
pub use pipeline::{Schedule, StageLink};
pub use zero::ZeroConfig;

use std::ops::Range;
use std::time::Instant;

use stoke_comm::{CommError, Communicator, CommunicatorExt, ReduceOp, Region, Work};
use tch::Tensor;

use crate::clock::StepClock;
use crate::dist::compress::{CompressConfig, Compression, Compressor, Pending};
use crate::dist::zero::{Zero, ZeroError};
use crate::executor::{Gathered, StepHooks};
use crate::optimizers::TensorNorms;
use crate::params::FlatParams;
use crate::trainer::{Phase, Trainer};
use crate::TrainError;
use region::{f32_region, f32_slice};

/// How a data-parallel step communicates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataParallelConfig {
    /// Bucket sizes. Default: the first 1 MiB, then 25 MiB (PyTorch DDP's).
    pub buckets: BucketSizes,
    /// Reduce each bucket as soon as its gradients are final (true), or only after backward has
    /// finished (false: the reference without overlap). Default true.
    pub overlap: bool,
    /// ZeRO sharding (stage 0: none, the default).
    pub zero: ZeroConfig,
    /// Compressed gradient reductions (default: none, the communicator's fp32 collectives).
    pub compress: CompressConfig,
}

impl Default for DataParallelConfig {
    fn default() -> Self {
        DataParallelConfig {
            buckets: BucketSizes { first_bytes: 1 << 20, bytes: 25 << 20 },
            overlap: true,
            zero: ZeroConfig::default(),
            compress: CompressConfig::default(),
        }
    }
}

/// Step hooks that average gradients and the logged loss over the ranks of `comm`.
pub struct DataParallel {
    comm: Box<dyn Communicator>,
    config: DataParallelConfig,
    /// The model's buckets ([`DataParallel::plan`]).
    plan: Option<BucketPlan>,
    /// Buckets whose gradients are final but that are not sent yet (overlap off), in order.
    ready: Vec<Region>,
    /// Reductions submitted this step, in submission order.
    in_flight: Vec<Work>,
    /// When this step's first reduction was submitted.
    first_submit: Option<Instant>,
    /// Milliseconds from the first submission to the end of the wait, in the last step.
    comm_ms: f64,
    /// The ZeRO state, once [`DataParallel::shard`] ran (stage 1 to 3).
    zero: Option<Zero>,
    /// Compressed reductions (`dist.compress` other than "none", more than one rank).
    compressor: Option<Compressor>,
    /// Stage 0 and 1, compressed: buckets whose all-reduce is in flight (their gradient range).
    compressed: Vec<(Range<i64>, Pending)>,
    /// Stage 0 and 1, compressed, overlap off: buckets final but not sent (index, range).
    compress_ready: Vec<(usize, Range<i64>)>,
    /// Whether the model's buffers are host memory (compression needs it).
    host_buffers: bool,
    /// The model's gradient buffer (`plan`), for finishing compressed reductions.
    grad_buffer: Option<Tensor>,
    /// The groups of a job whose model is cut (`dist.tensor` above 1): gradients are averaged
    /// over the data-parallel group alone.
    tensor: Option<tensor::TensorParts>,
    /// The groups of a job whose model is cut into pipeline stages (`dist.pipeline` above 1).
    pipeline: Option<pipeline::PipelineParts>,
}

impl DataParallel {
    pub fn new(comm: Box<dyn Communicator>, config: DataParallelConfig) -> DataParallel {
        DataParallel {
            comm,
            config,
            plan: None,
            ready: Vec::new(),
            in_flight: Vec::new(),
            first_submit: None,
            comm_ms: 0.0,
            zero: None,
            compressor: None,
            compressed: Vec::new(),
            compress_ready: Vec::new(),
            host_buffers: true,
            grad_buffer: None,
            tensor: None,
            pipeline: None,
        }
    }

    /// The group gradients are averaged over: the job, or with a cut model the ranks holding
    /// the same parts (None: only one copy of the model).
    fn gradient_comm(&self) -> Option<&dyn Communicator> {
        if self.pipeline.is_some() {
            // A stage averages its own units over its copies (`PipelineParts::before_optimizer`).
            return None;
        }
        match &self.tensor {
            Some(parts) => parts.data.as_deref(),
            None => Some(self.comm.as_ref()),
        }
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    pub fn config(&self) -> &DataParallelConfig {
        &self.config
    }

    pub fn communicator(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    fn error(&self, op: &'static str, source: CommError) -> TrainError {
        TrainError::Comm { rank: self.comm.rank(), world_size: self.comm.world_size(), op, source }
    }

    /// Refuses to train unless every rank passed the same `entries` (sorted `key = value` pairs
    /// describing what must be equal on all ranks: model, configuration without per-rank keys,
    /// backend). On a mismatch every rank returns [`TrainError::RanksDisagree`], naming each rank
    /// that differs from rank 0 and its differing keys. Collective.
    pub fn check_agreement(&self, entries: &[(String, String)]) -> Result<(), TrainError> {
        agree::check(self.comm.as_ref(), entries).map_err(|e| match e {
            agree::AgreeError::Comm(source) => self.error("start-up check", source),
            agree::AgreeError::Disagree(differences) => {
                TrainError::RanksDisagree { rank: self.comm.rank(), world_size: self.comm.world_size(), differences }
            }
        })
    }

    /// Groups `params`' units into this job's buckets; call once before training (the layout is
    /// worth a log line).
    pub fn plan(&mut self, params: &FlatParams) -> Result<&BucketPlan, TrainError> {
        self.host_buffers = params.device() == tch::Device::Cpu;
        self.grad_buffer = Some(params.flat_grad().shallow_clone());
        if self.config.compress.compression != Compression::None && self.comm.world_size() > 1 {
            if !self.host_buffers {
                return Err(TrainError::InvalidConfig {
                    key: "dist.compress",
                    message: "compresses gradients in host memory; on a GPU keep \"none\"".into(),
                });
            }
            self.compressor = Some(Compressor::new(self.config.compress)?);
        }
        Ok(self.plan.insert(BucketPlan::new(params.units(), self.config.buckets)))
    }

    /// Bytes this rank sent in compressed reductions so far (None without compression).
    pub fn compressed_wire_bytes(&self) -> Option<u64> {
        self.compressor.as_ref().map(Compressor::wire_bytes)
    }

    /// The compression residuals (error feedback) of this rank, by name.
    pub fn residual_state(&self) -> Vec<(String, Vec<f32>)> {
        self.compressor.as_ref().map_or_else(Vec::new, |c| {
            c.residual_state().into_iter().map(|(name, values)| (name.to_string(), values.to_vec())).collect()
        })
    }

    /// Restores residuals saved by `residual_state` (a resumed run continues the same sums).
    pub fn load_residual_state(&mut self, state: Vec<(String, Vec<f32>)>) -> Result<(), TrainError> {
        match self.compressor.as_mut() {
            Some(c) => c.load_residual_state(state),
            None => Ok(()),
        }
    }

    /// Copies rank 0's parameters to every rank (call after initialization or restore, before
    /// training), so all ranks start from the same model. Collective.
    pub fn broadcast_parameters(&mut self, trainer: &Trainer) -> Result<(), TrainError> {
        let flat = trainer.model().params().flat();
        let region = f32_region(flat, 0..flat.numel() as i64)
            .map_err(|reason| TrainError::InvalidConfig { key: "dist", message: reason })?;
        // A cut model: the copies of each part (every rank of the data-parallel group holds the
        // same part). Pipeline stages: each stage's part across the copies.
        let comm = match &self.pipeline {
            Some(parts) => parts.data.as_deref(),
            None => self.gradient_comm(),
        };
        let Some(comm) = comm else { return Ok(()) };
        // SAFETY: the region is the whole flat parameter buffer, alive as long as `trainer`, which
        // is borrowed for this whole call; nothing else runs on it until `wait` returns.
        let work = unsafe { comm.broadcast_async(region, 0) }.map_err(|e| self.error("broadcast parameters", e))?;
        work.wait().map_err(|e| self.error("broadcast parameters", e))
    }

    /// Shards the model states for the configured ZeRO stage (nothing at stage 0). Call after
    /// `broadcast_parameters` (every rank holds the same values) and after any restore: the
    /// trainer's optimizer is replaced by one over this rank's shard, its state carried over.
    pub fn shard(&mut self, trainer: &mut Trainer) -> Result<(), TrainError> {
        let config = self.config.zero;
        // Pipeline stages shard their own optimizer (`pipeline_stage`).
        if config.stage == 0 || self.comm.world_size() == 1 || self.pipeline.is_some() {
            return Ok(());
        }
        let invalid = |message: String| TrainError::InvalidConfig { key: "dist.zero", message };
        if config.stage > 3 {
            return Err(invalid(format!("must be 0, 1, 2 or 3; got {}", config.stage)));
        }
        trainer.check_shardable(config.stage).map_err(invalid)?;
        // A cut model's shards are cut over the ranks holding the same part (none: one copy).
        let group = match &self.tensor {
            Some(parts) => match parts.data.as_deref() {
                Some(data) => data,
                None => return Ok(()),
            },
            None => self.comm.as_ref(),
        };
        let (rank, world) = (group.rank(), group.world_size());
        let fused = trainer.fused_cpu_optimizer();
        let zero = Zero::new(config, trainer.params_mut(), rank, world, fused)
            .map_err(|e| invalid(format!("cannot map memory for the sharded buffers: {e}")))?;
        // After the shard: from stage 2 on it moves the model's buffers, which the pieces map.
        if let Some(parts) = self.tensor.as_mut() {
            parts.checkpoint_pieces(trainer.model().params(), rank);
        }
        let starts: std::collections::HashMap<String, i64> = trainer
            .model()
            .params()
            .entries()
            .iter()
            .filter_map(|e| zero.piece_start(e).map(|start| (e.name.clone(), start)))
            .collect();
        trainer.shard_optimizer(&zero.shard, &starts).map_err(invalid)?;
        // The model's gradient buffer may have moved (stage 2 and 3).
        self.grad_buffer = Some(trainer.model().params().flat_grad().shallow_clone());
        self.zero = Some(zero);
        Ok(())
    }

    /// Every other rank's `bytes` at rank 0, in rank order (1, 2, ...): each sends a length, then
    /// the bytes; rank 0 passes nothing and gets them, the others get an empty list. Collective.
    pub fn gather_bytes_at_rank0(&self, bytes: &[u8], op: &'static str) -> Result<Vec<Vec<u8>>, TrainError> {
        if self.comm.rank() != 0 {
            self.comm
                .send(&(bytes.len() as u64).to_le_bytes(), 0)
                .and_then(|()| self.comm.send(bytes, 0))
                .map_err(|e| self.error(op, e))?;
            return Ok(Vec::new());
        }
        let mut out = Vec::with_capacity(self.comm.world_size().saturating_sub(1));
        for from in 1..self.comm.world_size() {
            let mut len = [0u8; 8];
            self.comm.recv(&mut len, from).map_err(|e| self.error(op, e))?;
            let len = u64::from_le_bytes(len);
            // Reports and residuals are far below this; more is a corrupt length.
            if len > 1 << 34 {
                return Err(TrainError::InvalidConfig {
                    key: "dist",
                    message: format!("rank 0: rank {from} announced {len} bytes in `{op}`"),
                });
            }
            let mut received = vec![0u8; len as usize];
            self.comm.recv(&mut received, from).map_err(|e| self.error(op, e))?;
            out.push(received);
        }
        Ok(out)
    }

    /// The ZeRO stage in effect (0 before `shard`, or on one process).
    pub fn zero_stage(&self) -> u8 {
        self.zero.as_ref().map_or(0, Zero::stage)
    }

    /// Elements of this rank's shard (None without ZeRO).
    pub fn shard_elements(&self) -> Option<u64> {
        self.zero.as_ref().map(|z| z.shard.n_elements() as u64)
    }

    /// Starts the in-place average of one bucket.
    ///
    /// # Safety
    /// `region` is a final range of the flat gradient buffer: nothing writes or reads it until
    /// `before_optimizer` has waited for the returned work (or `self` is dropped, which waits).
    unsafe fn submit(&mut self, region: Region) -> Result<(), TrainError> {
        let comm = self.gradient_comm().expect("gradients are submitted only when there are copies to average");
        // SAFETY: the caller's contract, passed on.
        let work = unsafe { comm.all_reduce_async(region, ReduceOp::Avg) }
            .map_err(|e| self.error("all_reduce gradients", e))?;
        self.first_submit.get_or_insert_with(Instant::now);
        self.in_flight.push(work);
        Ok(())
    }

    /// Waits for every reduction in flight (the `comm_exposed` phase; the clock is at its start).
    fn wait_in_flight(&mut self, clock: &mut StepClock) -> Result<(), TrainError> {
        let mut first_error = None;
        for work in self.in_flight.drain(..) {
            if let Err(e) = work.wait() {
                first_error.get_or_insert(e);
            }
        }
        clock.lap(Phase::CommExposed);
        if let Some(start) = self.first_submit.take() {
            self.comm_ms = start.elapsed().as_secs_f64() * 1e3;
        }
        match first_error {
            Some(e) => Err(self.error("all_reduce gradients", e)),
            None => Ok(()),
        }
    }
}

impl DataParallel {
    /// Starts the compressed all-reduce of a final bucket (stage 0 and 1; host memory).
    fn start_compressed(&mut self, flat_grad: &Tensor, id: usize, range: Range<i64>) -> Result<(), TrainError> {
        let compressor = self.compressor.as_mut().expect("compression is on");
        // SAFETY: the bucket's range of the model's contiguous CPU fp32 gradient buffer (checked
        // in `plan`), final for this step; the compressor reads it only during this call.
        let values = unsafe { f32_slice(flat_grad, range.clone()) };
        let pending = compressor.start_all_reduce(self.comm.as_ref(), id, values)?;
        self.compressed.push((range, pending));
        Ok(())
    }

    /// Sends what waited (overlap off) and finishes every compressed all-reduce into its bucket.
    fn finish_compressed(&mut self) -> Result<(), TrainError> {
        let Some(flat_grad) = self.grad_buffer.as_ref().map(Tensor::shallow_clone) else {
            return Err(TrainError::InvalidConfig { key: "dist", message: "plan was not called".into() });
        };
        for (id, range) in std::mem::take(&mut self.compress_ready) {
            self.first_submit.get_or_insert_with(Instant::now);
            self.start_compressed(&flat_grad, id, range)?;
        }
        let compressor = self.compressor.as_mut().expect("compression is on");
        for (range, pending) in self.compressed.drain(..) {
            // SAFETY: as in `start_compressed`; backward is over and the optimizer waits for this.
            let values = unsafe { f32_slice(&flat_grad, range) };
            compressor.finish(self.comm.as_ref(), pending, values)?;
        }
        Ok(())
    }

    fn zero_error(&self, e: ZeroError) -> TrainError {
        self.error(e.op, e.source)
    }

    /// Sequence parallelism: the norms' gradient shares summed over the cut, in the model's
    /// gradients or, under ZeRO 2 and 3, in `shard`, where the copies' reduce-scatters left them;
    /// the wait is `comm_exposed`. Nothing to do without shares.
    fn sum_sequence_shares(&self, clock: &mut StepClock, shard: Option<&FlatParams>) -> Result<(), TrainError> {
        let Some(cut) = self.tensor.as_ref().filter(|t| !t.shares.is_empty()) else { return Ok(()) };
        clock.lap(Phase::Backward);
        let result = match shard {
            Some(shard) => cut.sum_shard_shares(shard),
            None => cut.sum_shares(),
        };
        clock.lap(Phase::CommExposed);
        result.map_err(|e| self.error("all_reduce sequence-parallel gradient shares", e))
    }

    /// Stage 3: `unit`'s parameters in place before it runs; the wait, if any, is `comm_exposed`
    /// (the time before it is charged to `before`).
    fn ensure_gathered(&mut self, unit: usize, before: Phase, clock: &mut StepClock) -> Result<(), TrainError> {
        let Some(zero) = self.zero.as_mut() else { return Ok(()) };
        if zero.is_ready(unit) {
            return Ok(());
        }
        clock.lap(before);
        let result = zero.ensure(zero_group(self.comm.as_ref(), self.tensor.as_ref()), unit);
        clock.lap(Phase::CommExposed);
        result.map_err(|e| self.zero_error(e))
    }

    fn prefetch(&mut self, units: impl Iterator<Item = usize>) -> Result<(), TrainError> {
        let Some(zero) = self.zero.as_mut() else { return Ok(()) };
        for unit in units {
            if let Err(e) = zero.prefetch(zero_group(self.comm.as_ref(), self.tensor.as_ref()), unit) {
                return Err(self.zero_error(e));
            }
        }
        Ok(())
    }
}

/// The group ZeRO shards over: a cut model's copies of this rank's part, or the job.
fn zero_group<'a>(comm: &'a dyn Communicator, tensor: Option<&'a tensor::TensorParts>) -> &'a dyn Communicator {
    tensor.and_then(|t| t.data.as_deref()).unwrap_or(comm)
}

impl StepHooks for DataParallel {
    fn before_forward(&mut self, unit: usize, clock: &mut StepClock) -> Result<(), TrainError> {
        if self.zero_stage() < 3 {
            return Ok(());
        }
        self.ensure_gathered(unit, Phase::Forward, clock)?;
        let zero = self.zero.as_mut().expect("stage 3");
        // The previous unit's forward is over; the embedding's parameters (the head's tied
        // weights) stay until the embedding's backward.
        if unit >= 2 {
            zero.release_params(unit - 1);
        }
        let ahead = zero.prefetch_units();
        self.prefetch(unit + 1..=unit + ahead)
    }

    fn before_backward(&mut self, unit: usize, clock: &mut StepClock) -> Result<(), TrainError> {
        if self.zero_stage() >= 2 {
            self.zero.as_ref().expect("stage 2 or 3").populate_grads(unit);
        }
        if self.zero_stage() < 3 {
            return Ok(());
        }
        self.ensure_gathered(unit, Phase::Backward, clock)?;
        let zero = self.zero.as_mut().expect("stage 3");
        // The next unit's backward is over.
        if unit + 1 < zero.n_units() {
            zero.release_params(unit + 1);
        }
        let ahead = zero.prefetch_units();
        self.prefetch((unit.saturating_sub(ahead)..unit).rev())
    }

    fn grads_final(
        &mut self,
        unit: usize,
        range: Range<i64>,
        flat_grad: &Tensor,
        _clock: &mut StepClock,
    ) -> Result<(), TrainError> {
        if self.gradient_comm().is_none_or(|comm| comm.world_size() == 1) {
            return Ok(());
        }
        if self.zero_stage() >= 2 {
            self.first_submit.get_or_insert_with(Instant::now);
            let overlap = self.config.overlap;
            let zero = self.zero.as_mut().expect("stage 2 or 3");
            return zero
                .grads_final(
                    zero_group(self.comm.as_ref(), self.tensor.as_ref()),
                    unit,
                    overlap,
                    self.compressor.as_mut(),
                )
                .map_err(|e| self.zero_error(e));
        }
        let plan = self.plan.as_ref().ok_or_else(|| TrainError::InvalidConfig {
            key: "dist",
            message: "DataParallel::plan must be called before training".into(),
        })?;
        debug_assert!(unit < plan.n_units());
        if !plan.completes_bucket(unit) {
            return Ok(());
        }
        let bucket_idx = plan.bucket_of(unit);
        let bucket = &plan.buckets()[bucket_idx];
        debug_assert_eq!(bucket.range.start, range.start);
        if self.compressor.is_some() {
            let bucket_range = bucket.range.clone();
            if !self.config.overlap {
                self.compress_ready.push((bucket_idx, bucket_range));
                return Ok(());
            }
            self.first_submit.get_or_insert_with(Instant::now);
            return self.start_compressed(flat_grad, bucket_idx, bucket_range);
        }
        let region = f32_region(flat_grad, bucket.range.clone())
            .map_err(|reason| TrainError::InvalidConfig { key: "dist", message: reason })?;
        if region.count() == 0 {
            return Ok(());
        }
        if !self.config.overlap {
            self.ready.push(region);
            return Ok(());
        }
        // SAFETY: all the bucket's units are final for this step (grads_final fires in reverse
        // unit order and this is the bucket's first unit): backward does not write the range
        // again, and nothing reads it until `before_optimizer` has waited on this Work (the
        // trainer calls it before the optimizer, and `Drop` of `self.in_flight` waits too). The
        // buffer is the model's flat gradient, which outlives the step.
        unsafe { self.submit(region) }
    }

    fn before_optimizer(&mut self, clock: &mut StepClock) -> Result<(), TrainError> {
        if let Some(parts) = &self.pipeline {
            // A cut stage's parts sum their shares first, so that the copies average whole gradients.
            self.sum_sequence_shares(clock, None)?;
            clock.lap(Phase::Backward);
            let result = parts.before_optimizer();
            clock.lap(Phase::CommExposed);
            return result;
        }
        // A collective inside the cut model's forward or backward failed: the step is void.
        if let Some(failure) = self.tensor.as_ref().and_then(|t| t.group.take_failure()) {
            return Err(self.error("tensor-parallel all_reduce in the model", failure));
        }
        match self.zero_stage() {
            0 | 1 => {
                if !self.compressed.is_empty() || !self.compress_ready.is_empty() {
                    clock.lap(Phase::Backward);
                    let result = self.finish_compressed();
                    clock.lap(Phase::CommExposed);
                    if let Some(start) = self.first_submit.take() {
                        self.comm_ms = start.elapsed().as_secs_f64() * 1e3;
                    }
                    result?;
                }
                if !self.in_flight.is_empty() || !self.ready.is_empty() {
                    clock.lap(Phase::Backward);
                    for region in std::mem::take(&mut self.ready) {
                        // SAFETY: as in `grads_final`: the bucket is final, backward is over, and
                        // the optimizer runs only after the wait below.
                        unsafe { self.submit(region) }?;
                    }
                    self.wait_in_flight(clock)?;
                }
                // Once the copies' reductions of the shares are waited for.
                self.sum_sequence_shares(clock, None)?;
                if let Some(zero) = &self.zero {
                    zero.take_reduced_grads();
                }
                Ok(())
            }
            _ => {
                let zero = self.zero.as_mut().expect("stage 2 or 3");
                if zero.stage() >= 3 {
                    // Every unit's backward is over: only the shard keeps the parameters.
                    for unit in 0..zero.n_units() {
                        zero.release_params(unit);
                    }
                }
                let result = if zero.grads_in_flight() {
                    clock.lap(Phase::Backward);
                    let result = zero
                        .finish_grads(zero_group(self.comm.as_ref(), self.tensor.as_ref()), self.compressor.as_mut());
                    clock.lap(Phase::CommExposed);
                    result
                } else {
                    // Every reduction completed while backward ran: nothing is exposed.
                    Ok(())
                };
                if let Some(start) = self.first_submit.take() {
                    self.comm_ms = start.elapsed().as_secs_f64() * 1e3;
                }
                result.map_err(|e| self.zero_error(e))?;
                self.sum_sequence_shares(clock, self.zero.as_ref().map(|zero| &zero.shard))
            }
        }
    }

    fn optimizer_params(&self) -> Option<&FlatParams> {
        if let Some(parts) = &self.pipeline {
            return parts.shard.as_ref();
        }
        self.zero.as_ref().map(|z| &z.shard)
    }

    fn gather_sharded_state(&self, buffers: &[(&'static str, Tensor)]) -> Result<Option<Gathered>, TrainError> {
        let (Some(zero), Some(data)) = (&self.zero, self.tensor.as_ref().and_then(|t| t.data.as_deref())) else {
            return Ok(None);
        };
        let gather = |buffer: &Tensor| zero.gather_shard_buffer(data, buffer).map_err(|e| self.zero_error(e));
        let params = if zero.stage() >= 3 { Some(gather(zero.shard.flat())?) } else { None };
        let state = buffers.iter().map(|(suffix, buffer)| gather(buffer).map(|t| (*suffix, t)));
        let state = state.collect::<Result<Vec<_>, _>>()?;
        Ok(Some((params, state)))
    }

    fn checkpoint_params(&self) -> Option<&FlatParams> {
        if let Some(pieces) = self.tensor.as_ref().and_then(|t| t.pieces.as_ref()) {
            return Some(pieces);
        }
        match &self.pipeline {
            // The first copy's stages write the pieces (a cut stage's first part, its tensors
            // gathered whole); the others' are the same values.
            Some(parts) if !parts.zero && (parts.copy > 0 || parts.part > 0) => parts.nothing.as_ref(),
            _ => self.optimizer_params(),
        }
    }

    fn reduces_norm_on_host(&self) -> bool {
        // ZeRO adds the shards' sums on the host; a compressed reduction's codec may not carry a
        // NaN to every rank. Plain data parallelism all-reduces the gradients themselves, so each
        // rank's norm is the same and may stay on the device (`agree_first_bad` at the reads).
        // A cut model adds its parts' sums on the host.
        self.zero.is_some() || self.compressor.is_some() || self.tensor.is_some() || self.pipeline.is_some()
    }

    fn agree_first_bad(&mut self, local: u64) -> Result<u64, TrainError> {
        let (rank, world) = (self.comm.rank(), self.comm.world_size());
        if world == 1 {
            return Ok(local);
        }
        let mut bytes = vec![0u8; 8 * world];
        bytes[8 * rank..8 * rank + 8].copy_from_slice(&local.to_le_bytes());
        self.comm.all_gather(&mut bytes).map_err(|e| self.error("all_gather NaN guard", e))?;
        let steps = bytes.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")));
        Ok(steps.filter(|&s| s > 0).min().unwrap_or(0))
    }

    fn global_sq_sum(&mut self, local: f64) -> Result<f64, TrainError> {
        if let Some(parts) = &self.pipeline {
            // A cut stage's parts first (its replicated tensors counted once), then the stages.
            let stage = match &self.tensor {
                Some(cut) => {
                    cut.global_sq_sum(local, None).map_err(|e| self.error("all_gather tensor-parallel norm", e))?
                }
                None => local,
            };
            return parts.global_sq_sum(stage);
        }
        if let Some(parts) = &self.tensor {
            // The copies' shards of this part first (ZeRO), then the parts. From stage 2 on the
            // replicated tensors' gradients are in the shards only, so their sum comes from there.
            let (part, replicated) = match (&self.zero, parts.data.as_deref()) {
                (Some(zero), Some(data)) => {
                    let replicated = if zero.stage() >= 2 { parts.replicated_sq_sum(&zero.shard) } else { 0.0 };
                    let sums = zero::sum_over_ranks(data, &[local, replicated])
                        .map_err(|e| self.error("all_gather gradient norm", e))?;
                    (sums[0], (zero.stage() >= 2).then_some(sums[1]))
                }
                _ => (local, None),
            };
            return parts.global_sq_sum(part, replicated).map_err(|e| self.error("all_gather tensor-parallel norm", e));
        }
        match &self.zero {
            Some(zero) => zero.global_sq_sum(self.comm.as_ref(), local).map_err(|e| self.zero_error(e)),
            None => Ok(local),
        }
    }

    fn whole_tensor_norms(&self, norms: &mut TensorNorms) -> Result<(), TrainError> {
        match &self.zero {
            Some(zero) => zero.whole_tensor_norms(self.comm.as_ref(), norms).map_err(|e| self.zero_error(e)),
            None => Ok(()),
        }
    }

    fn after_optimizer(&mut self, clock: &mut StepClock) -> Result<(), TrainError> {
        if let Some(parts) = &self.pipeline {
            clock.lap(Phase::Optimizer);
            let result = parts.after_optimizer();
            clock.lap(Phase::CommExposed);
            return result;
        }
        let Some(zero) = self.zero.as_mut().filter(|z| z.stage() <= 2) else { return Ok(()) };
        clock.lap(Phase::Optimizer);
        let result = zero.all_gather_params(zero_group(self.comm.as_ref(), self.tensor.as_ref()));
        clock.lap(Phase::CommExposed);
        result.map_err(|e| self.zero_error(e))
    }

    fn checkpoint_extras(&mut self, own: bool) -> Result<Vec<(String, Vec<f32>)>, TrainError> {
        if self.compressor.is_none() {
            return Ok(Vec::new());
        }
        let mine = self.residual_state();
        let rank = self.comm.rank();
        if own {
            return Ok(mine.into_iter().map(|(name, values)| (format!("{name}@rank{rank}"), values)).collect());
        }
        let gathered = self.gather_bytes_at_rank0(
            &serde_json::to_vec(&mine).expect("residuals serialize"),
            "gather compression residuals",
        )?;
        if rank != 0 {
            return Ok(Vec::new());
        }
        let mut all: Vec<(String, Vec<f32>)> =
            mine.into_iter().map(|(name, values)| (format!("{name}@rank0"), values)).collect();
        for (from, bytes) in (1..).zip(gathered) {
            let state: Vec<(String, Vec<f32>)> =
                serde_json::from_slice(&bytes).map_err(|e| TrainError::InvalidConfig {
                    key: "dist.compress",
                    message: format!("rank {from} sent residuals that do not parse: {e}"),
                })?;
            all.extend(state.into_iter().map(|(name, values)| (format!("{name}@rank{from}"), values)));
        }
        Ok(all)
    }

    fn full_parameters(&mut self, needed: bool) -> Result<(), TrainError> {
        if let Some(parts) = self.pipeline.as_ref() {
            // The other stages' units for an evaluation, given back after it.
            if needed {
                return parts.broadcast_all();
            }
            parts.release_others(false);
            return Ok(());
        }
        let Some(zero) = self.zero.as_mut().filter(|z| z.stage() >= 3) else { return Ok(()) };
        for unit in 0..zero.n_units() {
            if needed {
                if let Err(e) = zero.ensure(zero_group(self.comm.as_ref(), self.tensor.as_ref()), unit) {
                    return Err(self.zero_error(e));
                }
            } else {
                zero.release_params(unit);
            }
        }
        Ok(())
    }

    fn reduce_loss(&mut self, loss: f64) -> Result<f64, TrainError> {
        if self.comm.world_size() == 1 {
            return Ok(loss);
        }
        if let Some(parts) = &self.pipeline {
            return parts.reduce_loss(self.comm.as_ref(), loss);
        }
        let mut value = [loss as f32];
        self.comm.all_reduce(&mut value, ReduceOp::Avg).map_err(|e| self.error("all_reduce loss", e))?;
        Ok(value[0] as f64)
    }

    /// With a cut model, the model's own collectives (inside forward and backward) too.
    fn take_comm_ms(&mut self) -> f64 {
        std::mem::take(&mut self.comm_ms) + self.tensor.as_ref().map_or(0.0, |t| t.group.take_comm_ms())
    }

    /// A stop signal on any rank stops every rank after the same step (one 4-byte all-reduce per
    /// step), so a preempted job checkpoints once, at one step, and every rank exits as preempted.
    fn agree_stop(&mut self, local: bool) -> Result<bool, TrainError> {
        if self.comm.world_size() == 1 {
            return Ok(local);
        }
        let mut flag = [if local { 1.0f32 } else { 0.0 }];
        self.comm.all_reduce(&mut flag, ReduceOp::Sum).map_err(|e| self.error("all_reduce stop flag", e))?;
        Ok(flag[0] > 0.0)
    }
}
