//! What a step does between the executor's units (`StepHooks`): the seam data parallelism, ZeRO,
//! a cut model and pipeline stages act through, and the hooks of a single process (`NoHooks`).

use std::ops::Range;

use tch::Tensor;

use crate::clock::StepClock;
use crate::optimizers::TensorNorms;
use crate::params::FlatParams;
use crate::TrainError;

/// A sharded state gathered whole: (the parameters when the model's are given back, the optimizer's buffers by suffix).
pub type Gathered = (Option<Tensor>, Vec<(&'static str, Tensor)>);

/// Code that acts between units. Every method has a do-nothing default.
pub trait StepHooks {
    /// Unit `unit` is about to run its forward (a sharded step gathers its parameters here).
    fn before_forward(&mut self, _unit: usize, _clock: &mut StepClock) -> Result<(), TrainError> {
        Ok(())
    }

    /// Unit `unit` is about to run its backward (and its recomputation, if any).
    fn before_backward(&mut self, _unit: usize, _clock: &mut StepClock) -> Result<(), TrainError> {
        Ok(())
    }

    /// Unit `unit`'s gradients, `flat_grad[range]`, are final for this step (called on the last
    /// micro-batch only): a data-parallel step starts reducing that bucket here.
    fn grads_final(
        &mut self,
        _unit: usize,
        _range: Range<i64>,
        _flat_grad: &Tensor,
        _clock: &mut StepClock,
    ) -> Result<(), TrainError> {
        Ok(())
    }

    /// Every micro-batch's backward is done and the optimizer step is next: a data-parallel step
    /// waits here for the reductions still in flight (charged to `comm_exposed`).
    fn before_optimizer(&mut self, _clock: &mut StepClock) -> Result<(), TrainError> {
        Ok(())
    }

    /// This process's mean loss of the step, turned into the value the step logs (data-parallel:
    /// the mean over all ranks). Called on logged steps only, on every rank alike.
    fn reduce_loss(&mut self, loss: f64) -> Result<f64, TrainError> {
        Ok(loss)
    }

    /// Milliseconds of communication, hidden or exposed, in the step just finished (0 without
    /// communication); reading it resets it.
    fn take_comm_ms(&mut self) -> f64 {
        0.0
    }

    /// The buffers the optimizer updates: this rank's shard under ZeRO (None: the model's own).
    fn optimizer_params(&self) -> Option<&FlatParams> {
        None
    }

    /// ZeRO beside a cut model: the optimizer's `buffers` (laid out like `optimizer_params`), and
    /// at stage 3 the parameters, gathered over the copies in the model's layout. Collective.
    fn gather_sharded_state(&self, _buffers: &[(&'static str, Tensor)]) -> Result<Option<Gathered>, TrainError> {
        Ok(None)
    }

    /// The buffers whose values a sharded checkpoint takes from this rank (its pieces):
    /// `optimizer_params` unless another rank writes the same ones (a pipeline's later copies).
    fn checkpoint_params(&self) -> Option<&FlatParams> {
        self.optimizer_params()
    }

    /// The sum of squared gradients of the whole model, from this process's part of it (`local`:
    /// of the buffers `optimizer_params` names). ZeRO adds the ranks' shard sums; NaN anywhere
    /// gives NaN everywhere, so every rank takes the same decision.
    fn global_sq_sum(&mut self, local: f64) -> Result<f64, TrainError> {
        Ok(local)
    }

    /// Whether `global_sq_sum` needs the local sum on the host (a reduction over processes: ZeRO's
    /// shards, or compressed gradients that may not carry a NaN); then the NaN guard reads it every
    /// step, whatever `train.guard_every` says.
    fn reduces_norm_on_host(&self) -> bool {
        false
    }

    /// The first non-finite step any process's guard holds (0: none), from this process's
    /// `local`, so every rank stops on the same step. Collective; called where the guard kept on
    /// the device is read, on every rank alike.
    fn agree_first_bad(&mut self, local: u64) -> Result<u64, TrainError> {
        Ok(local)
    }

    /// LAMB's per-tensor sums of squares over the buffers `optimizer_params` names (indexed like
    /// their entries) made the whole tensors': ZeRO adds every rank's pieces of each parameter
    /// (in rank order, so every rank gets the same sums). Collective; called once per LAMB step,
    /// between its two passes, on every rank alike.
    fn whole_tensor_norms(&self, _norms: &mut TensorNorms) -> Result<(), TrainError> {
        Ok(())
    }

    /// The optimizer has updated its buffers (ZeRO 1 and 2 all-gather the updated parameters).
    fn after_optimizer(&mut self, _clock: &mut StepClock) -> Result<(), TrainError> {
        Ok(())
    }

    /// Outside a step, the whole model's parameters are needed (`true`: an evaluation, a
    /// checkpoint) or no longer (`false`). ZeRO 3 gathers and releases them. Collective.
    fn full_parameters(&mut self, _needed: bool) -> Result<(), TrainError> {
        Ok(())
    }

    /// Per-rank state a checkpoint must hold besides the model's and the optimizer's (the
    /// compression residuals), named `<name>@rank<r>`. `own`: this rank's only (every rank writes
    /// its part of a sharded checkpoint); otherwise every rank's on the rank that writes, none on
    /// the others (collective). Called on every rank at every checkpoint.
    fn checkpoint_extras(&mut self, _own: bool) -> Result<Vec<(String, Vec<f32>)>, TrainError> {
        Ok(Vec::new())
    }

    /// Whether the run stops after this step, from this process's view (`local`: a stop signal
    /// arrived). Called after every step on every rank alike; data-parallel ranks must agree, or
    /// the rank that stopped would leave the others waiting in their next reduction.
    fn agree_stop(&mut self, local: bool) -> Result<bool, TrainError> {
        Ok(local)
    }

    /// Whether these hooks act between blocks (`before_forward`, `before_backward` or
    /// `grads_final` of a block's unit). Without, the block executor runs consecutive whole
    /// blocks that keep their activations as one autograd graph (`Segment::last_layer`): cutting
    /// the graph between them only costs each a backward seed and an input gradient of its own.
    /// The callbacks still fire, in the same order, but a chained run's together.
    fn between_blocks(&self) -> bool {
        true
    }
}

/// Hooks that do nothing: a single-process step.
pub struct NoHooks;

impl StepHooks for NoHooks {
    fn between_blocks(&self) -> bool {
        false
    }
}
