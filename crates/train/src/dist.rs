//! Data parallelism: [`DataParallel`], the step hooks that make every rank's step the step of the
//! global batch.
//!
//! Each rank runs forward and backward on its own rows of the global batch. When a unit's
//! gradients are final (`grads_final`, on the step's last micro-batch, in reverse unit order) its
//! range of the flat gradient buffer is all-reduced (average) in place, asynchronously, on the
//! communicator's thread, while backward goes on with the earlier units. Before the optimizer the
//! step waits for the reductions still in flight; that wait is the `comm_exposed` phase, and the
//! time from the first submission to the last completion is the step's `comm_total_ms`. After the
//! averaging every rank holds the same gradients, so every rank's optimizer makes the same update
//! and the parameters stay identical (they start identical: [`DataParallel::broadcast_parameters`]).
//! The logged loss is averaged too, so every rank logs the global batch's mean loss.

use std::ops::Range;
use std::time::Instant;

use stoke_comm::{CommError, Communicator, CommunicatorExt, ReduceOp, Region, Work};
use tch::{Kind, Tensor};

use crate::clock::StepClock;
use crate::executor::StepHooks;
use crate::trainer::{Phase, Trainer};
use crate::TrainError;

/// Step hooks that average gradients and the logged loss over the ranks of `comm`.
pub struct DataParallel {
    comm: Box<dyn Communicator>,
    /// Reductions submitted this step, in submission order.
    in_flight: Vec<Work>,
    /// When this step's first reduction was submitted.
    first_submit: Option<Instant>,
    /// When the last reduction was seen complete (at a hook call, or at the wait).
    comm_ms: f64,
}

impl DataParallel {
    pub fn new(comm: Box<dyn Communicator>) -> DataParallel {
        DataParallel { comm, in_flight: Vec::new(), first_submit: None, comm_ms: 0.0 }
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    pub fn communicator(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    fn error(&self, op: &'static str, source: CommError) -> TrainError {
        TrainError::Comm { rank: self.comm.rank(), world_size: self.comm.world_size(), op, source }
    }

    /// Copies rank 0's parameters to every rank (call after initialization or restore, before
    /// training), so all ranks start from the same model. Collective.
    pub fn broadcast_parameters(&mut self, trainer: &Trainer) -> Result<(), TrainError> {
        let flat = trainer.model().params().flat();
        let region = f32_region(flat, 0..flat.numel() as i64)
            .map_err(|reason| TrainError::InvalidConfig { key: "dist", message: reason })?;
        // SAFETY: the region is the whole flat parameter buffer, alive as long as `trainer`, which
        // is borrowed for this whole call; nothing else runs on it until `wait` returns.
        let work =
            unsafe { self.comm.broadcast_async(region, 0) }.map_err(|e| self.error("broadcast parameters", e))?;
        work.wait().map_err(|e| self.error("broadcast parameters", e))
    }

    /// Waits for every reduction still in flight (the `comm_exposed` phase).
    fn wait_all(&mut self, clock: &mut StepClock) -> Result<(), TrainError> {
        if self.in_flight.is_empty() {
            return Ok(());
        }
        clock.lap(Phase::Backward);
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

impl StepHooks for DataParallel {
    fn grads_final(
        &mut self,
        _unit: usize,
        range: Range<i64>,
        flat_grad: &Tensor,
        _clock: &mut StepClock,
    ) -> Result<(), TrainError> {
        if self.comm.world_size() == 1 || range.is_empty() {
            return Ok(());
        }
        let region = f32_region(flat_grad, range)
            .map_err(|reason| TrainError::InvalidConfig { key: "dist", message: reason })?;
        // SAFETY: `flat_grad[range]` is final for this step: backward does not write it again, and
        // nothing reads it until `before_optimizer` has waited on this Work (the trainer calls it
        // before the optimizer, and `Drop` of `self.in_flight` waits too). The buffer is the
        // model's flat gradient, which outlives the step.
        let work = unsafe { self.comm.all_reduce_async(region, ReduceOp::Avg) }
            .map_err(|e| self.error("all_reduce gradients", e))?;
        self.first_submit.get_or_insert_with(Instant::now);
        self.in_flight.push(work);
        Ok(())
    }

    fn before_optimizer(&mut self, clock: &mut StepClock) -> Result<(), TrainError> {
        self.wait_all(clock)
    }

    fn reduce_loss(&mut self, loss: f64) -> Result<f64, TrainError> {
        if self.comm.world_size() == 1 {
            return Ok(loss);
        }
        let mut value = [loss as f32];
        self.comm.all_reduce(&mut value, ReduceOp::Avg).map_err(|e| self.error("all_reduce loss", e))?;
        Ok(value[0] as f64)
    }

    fn take_comm_ms(&mut self) -> f64 {
        std::mem::take(&mut self.comm_ms)
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

/// The region of elements `range` of a contiguous fp32 tensor (host memory, or device memory for
/// a device backend).
fn f32_region(t: &Tensor, range: Range<i64>) -> Result<Region, String> {
    if t.kind() != Kind::Float || !t.is_contiguous() {
        return Err(format!("data parallelism needs a contiguous fp32 buffer, got {:?}", t.kind()));
    }
    if range.start < 0 || range.end > t.numel() as i64 || range.start > range.end {
        return Err(format!("range {range:?} is outside the buffer of {} elements", t.numel()));
    }
    let whole = Region::new(t.data_ptr() as *mut u8, t.numel(), stoke_comm::DType::F32);
    Ok(whole.slice(range.start as usize, range.end as usize))
}
