//! ZeRO: the model states of a data-parallel job sharded over its ranks (Rajbhandari et al. 2020).
//!
//! Every unit u of the flat buffers (embedding, blocks, head) is cut by
//! `stoke_comm::shard_range(len_u, world, rank)`, the cut every reduce-scatter and all-gather of
//! the communicator uses, so rank r owns the same slice of every unit. Its slices, one after the
//! other, are its shard ([`FlatParams::shard`]): parameters (the fp32 values the optimizer
//! updates), gradients and the optimizer state (sized to the shard: that is the saving).
//!
//! - Stage 1: gradients are all-reduced in buckets as in plain data parallelism; each rank copies
//!   its slices into the shard, updates them, copies them back and all-gathers every unit.
//! - Stage 2: the model's gradient buffer is releasable memory; each unit's gradient is
//!   reduce-scattered (average) as soon as it is final, the rank copies its slice into the shard
//!   and gives the unit's pages back, so a full gradient exists only for the units whose
//!   reduction is in flight. Parameters are all-gathered after the update as in stage 1.
//! - Stage 3: the model's parameter buffer is releasable too and holds only what a step needs:
//!   before a unit's forward (and again before its backward) its parameters are all-gathered into
//!   their place, `prefetch` units ahead, and given back after it. The embedding's parameters hold
//!   the tied output weights the head uses, so they stay from the embedding's forward to its
//!   backward. Autograd's saved tensors point into the same memory, which is filled again before
//!   the backward that reads them (what PyTorch FSDP does with a gathered parameter's storage).
//!
//! The global gradient norm (clipping, the fp16 overflow check, the NaN guard) is the sum of the
//! ranks' shard sums of squares, gathered as f64 and added in rank order, so every rank decides
//! alike. LAMB's trust ratios need each whole parameter's ||w|| and ||u||: its first pass sums
//! squares per piece of the shard, the ranks' per-parameter sums are gathered and added the same
//! way, and its second pass moves every piece by its whole parameter's ratio.

use std::collections::VecDeque;
use std::ops::Range;

use stoke_comm::{shard_range, CommError, Communicator, CommunicatorExt, ReduceOp, Work};
use tch::Tensor;

use super::compress::{Compressor, Pending};
use super::{f32_region, f32_slice};
use crate::optimizers::TensorNorms;
use crate::params::{Buffer, FlatParams, ParamEntry, Releaser, ShardMap};

/// Which ZeRO stage, and how far stage 3 gathers ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZeroConfig {
    /// 0 (plain data parallelism), 1 (optimizer state), 2 (and gradients), 3 (and parameters).
    pub stage: u8,
    /// Stage 3: units whose gathers are started ahead of the one running. Default 1.
    pub prefetch_units: usize,
    /// Stages 2 and 3: full gradients alive at once, the one backward is filling included: when a
    /// unit's gradient is final and this many are, the oldest reduce-scatter is waited for. It
    /// bounds the gradient memory (`stoke_plan::ZeroInFlight::gradient_units`). At least 1.
    /// Default 2.
    pub gradient_units: usize,
}

impl Default for ZeroConfig {
    fn default() -> Self {
        ZeroConfig { stage: 0, prefetch_units: 1, gradient_units: 2 }
    }
}

/// Where a stage-3 unit's parameters are.
enum Gathered {
    /// Only the shard holds them (the unit's pages are released).
    Released,
    /// An all-gather into their place is in flight.
    InFlight(Work),
    /// In place and complete.
    Ready,
}

/// A gradient reduction in flight: the communicator's, or a compressed one.
enum InFlight {
    Plain(Work),
    Compressed(Pending),
}

impl InFlight {
    fn is_done(&self) -> bool {
        match self {
            InFlight::Plain(work) => work.is_done(),
            InFlight::Compressed(pending) => pending.is_done(),
        }
    }
}

/// One rank's ZeRO state.
pub(crate) struct Zero {
    stage: u8,
    rank: usize,
    /// What the shard maps from the model instead of holding (`FlatParams::shard`).
    map: ShardMap,
    prefetch: usize,
    /// `ZeroConfig::gradient_units`.
    gradient_units: usize,
    /// Each unit's range of the model's flat buffers.
    units: Vec<Range<i64>>,
    /// This rank's slice of each unit, in the model's buffers.
    own: Vec<Range<i64>>,
    /// The same slices in the shard's buffers.
    local: Vec<Range<i64>>,
    /// This rank's shard: what the optimizer updates.
    pub(crate) shard: FlatParams,
    /// For each of the shard's entries, the model's entry (the logical parameter) it is a piece
    /// of.
    logical: Vec<usize>,
    /// The model's parameter count (entries), the same on every rank.
    n_logical: usize,
    model_flat: Tensor,
    model_grad: Tensor,
    params: Releaser,
    grads: Releaser,
    /// Stage 2 and 3: gradient reduce-scatters in flight, in submission order.
    grad_works: VecDeque<(usize, InFlight)>,
    /// Stage 2 and 3 without overlap: units whose gradients are final, not sent yet.
    grad_ready: Vec<usize>,
    /// Stage 3: each unit's parameters.
    gathered: Vec<Gathered>,
}

/// A failed collective of the ZeRO step: what it was, and the communicator's error.
pub(crate) struct ZeroError {
    pub(crate) op: &'static str,
    pub(crate) source: CommError,
}

type Result<T> = std::result::Result<T, ZeroError>;

fn fail(op: &'static str) -> impl FnOnce(CommError) -> ZeroError {
    move |source| ZeroError { op, source }
}

/// `local` (the same length on every rank) summed element-wise over the ranks: every rank's
/// values all-gathered as f64 and added in rank order, so every rank gets the same bits.
/// Collective.
pub(super) fn sum_over_ranks(comm: &dyn Communicator, local: &[f64]) -> std::result::Result<Vec<f64>, CommError> {
    let (rank, world, n) = (comm.rank(), comm.world_size(), local.len());
    let mut bytes = vec![0u8; 8 * n * world];
    for (i, value) in local.iter().enumerate() {
        let at = 8 * (n * rank + i);
        bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
    }
    comm.all_gather(&mut bytes)?;
    let mut sums = vec![0.0f64; n];
    for part in bytes.chunks_exact(8 * n.max(1)) {
        for (sum, c) in sums.iter_mut().zip(part.chunks_exact(8)) {
            *sum += f64::from_le_bytes(c.try_into().expect("8 bytes"));
        }
    }
    Ok(sums)
}

/// Waits for every one of `works` (all of them, even after a failure); the first error.
fn wait_all(works: Vec<Work>, op: &'static str) -> Result<()> {
    let mut first_error = None;
    for work in works {
        if let Err(e) = work.wait() {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), |e| Err(fail(op)(e)))
}

impl Zero {
    /// Shards `params` (whose values every rank already holds alike) for `rank` of `world`; at
    /// stage 2 and 3 the model's gradients, at stage 3 its parameters, move to releasable memory
    /// and are released.
    ///
    /// With `fused` (the optimizer runs the fused CPU kernel) the shard maps what the model
    /// already holds instead of copying it: at stage 1 its parameters and gradients, at stage 2
    /// its parameters; the optimizer then updates the model's own slices in place.
    pub(crate) fn new(
        config: ZeroConfig,
        params: &mut FlatParams,
        rank: usize,
        world: usize,
        fused: bool,
    ) -> std::io::Result<Zero> {
        let units: Vec<Range<i64>> = params.units().iter().map(|u| u.range.clone()).collect();
        let own: Vec<Range<i64>> = units
            .iter()
            .map(|u| {
                let cut = shard_range((u.end - u.start) as usize, world, rank);
                u.start + cut.start as i64..u.start + cut.end as i64
            })
            .collect();
        let mut local = Vec::with_capacity(own.len());
        let mut at = 0i64;
        for slice in &own {
            local.push(at..at + (slice.end - slice.start));
            at += slice.end - slice.start;
        }
        let map = ShardMap { params: fused && config.stage <= 2, grads: fused && config.stage == 1 };
        let shard = params.shard(&own, map);
        let logical = shard
            .entries()
            .iter()
            .map(|piece| {
                params
                    .entries()
                    .iter()
                    .position(|e| e.offset <= piece.source && piece.source < e.offset + e.numel)
                    .expect("a shard's piece lies inside one of the model's parameters")
            })
            .collect();
        let n_logical = params.entries().len();
        if config.stage >= 2 {
            params.make_releasable(Buffer::Grads)?;
        }
        if config.stage >= 3 {
            params.make_releasable(Buffer::Params)?;
        }
        let mut zero = Zero {
            stage: config.stage,
            rank,
            map,
            prefetch: config.prefetch_units,
            gradient_units: config.gradient_units.max(1),
            gathered: units.iter().map(|_| Gathered::Ready).collect(),
            units,
            own,
            local,
            shard,
            logical,
            n_logical,
            model_flat: params.flat().shallow_clone(),
            model_grad: params.flat_grad().shallow_clone(),
            params: params.releaser(Buffer::Params),
            grads: params.releaser(Buffer::Grads),
            grad_works: VecDeque::new(),
            grad_ready: Vec::new(),
        };
        // Gradients start cleared (at stage 2 and 3 that gives their pages back); at stage 3 the
        // shard is the only copy of the parameters.
        zero.grads.release(zero.whole());
        if zero.stage >= 3 {
            for unit in 0..zero.units.len() {
                zero.release_params(unit);
            }
        }
        Ok(zero)
    }

    fn invalid(&self, op: &'static str, reason: String) -> ZeroError {
        ZeroError { op, source: CommError::InvalidArgument { rank: self.rank, op, reason } }
    }

    pub(crate) fn stage(&self) -> u8 {
        self.stage
    }

    /// The whole range of the model's buffers.
    fn whole(&self) -> Range<i64> {
        self.units.first().map_or(0, |u| u.start)..self.units.last().map_or(0, |u| u.end)
    }

    /// `unit`'s slice that this rank owns, in a buffer laid out like the model's.
    fn model_slice(&self, unit: usize, model: &Tensor) -> Tensor {
        let own = &self.own[unit];
        model.narrow(0, own.start, own.end - own.start)
    }

    /// The same slice in a buffer laid out like the shard.
    fn shard_slice(&self, unit: usize, shard: &Tensor) -> Tensor {
        let local = &self.local[unit];
        shard.narrow(0, local.start, local.end - local.start)
    }

    /// Copies this rank's slice of `unit`'s averaged gradient into the shard.
    fn take_grad_slice(&self, unit: usize) {
        tch::no_grad(|| {
            self.shard_slice(unit, self.shard.flat_grad()).copy_(&self.model_slice(unit, &self.model_grad))
        });
    }

    /// Where each piece of the shard starts inside its parameter (by parameter name), for moving
    /// optimizer state between the whole model and the shard.
    pub(crate) fn piece_start(&self, entry: &ParamEntry) -> Option<i64> {
        let slice = &self.own[entry.unit];
        let lo = entry.offset.max(slice.start);
        (lo < (entry.offset + entry.numel).min(slice.end)).then_some(lo - entry.offset)
    }

    /// The global sum of squared gradients from this rank's part: every rank's value, gathered as
    /// f64, summed in rank order (NaN anywhere gives NaN everywhere). Collective.
    pub(crate) fn global_sq_sum(&self, comm: &dyn Communicator, local: f64) -> Result<f64> {
        Ok(sum_over_ranks(comm, &[local]).map_err(fail("all_gather gradient norm"))?[0])
    }

    /// LAMB's per-tensor sums of squares (||w||², ||u||²) over this rank's shard, indexed by the
    /// shard's entries, made the whole parameters': each piece's sums go to its parameter, every
    /// rank's per-parameter sums are gathered as f64 and added in rank order, and each piece gets
    /// its parameter's totals. Every rank gets the same bits, whatever the timing. Collective.
    pub(crate) fn whole_tensor_norms(&self, comm: &dyn Communicator, norms: &mut TensorNorms) -> Result<()> {
        let n = self.n_logical;
        let mut mine = vec![0.0f64; 2 * n];
        for (piece, &param) in self.logical.iter().enumerate() {
            mine[param] += norms.param_sq[piece];
            mine[n + param] += norms.update_sq[piece];
        }
        let whole = sum_over_ranks(comm, &mine).map_err(fail("all_gather LAMB tensor norms"))?;
        for (piece, &param) in self.logical.iter().enumerate() {
            norms.param_sq[piece] = whole[param];
            norms.update_sq[piece] = whole[n + param];
        }
        Ok(())
    }

    // ---- gradients ----

    /// Stage 1: the gradients are averaged in the model's buffer; take this rank's slices and
    /// clear the buffer for the next step (a shard that maps them reads them in place; the
    /// buffer is cleared after the update, `all_gather_params`).
    pub(crate) fn take_reduced_grads(&self) {
        if self.map.grads {
            return;
        }
        for unit in 0..self.units.len() {
            self.take_grad_slice(unit);
        }
        self.grads.release(self.whole());
    }

    /// Stage 2 and 3: unit `unit`'s gradient is final. Starts its reduce-scatter (or, without
    /// overlap, notes it) and completes the reductions that have finished since.
    pub(crate) fn grads_final(
        &mut self,
        comm: &dyn Communicator,
        unit: usize,
        overlap: bool,
        mut compressor: Option<&mut Compressor>,
    ) -> Result<()> {
        if !overlap {
            self.grad_ready.push(unit);
            return Ok(());
        }
        self.submit_grad(comm, unit, compressor.as_deref_mut())?;
        // The finished ones, and the oldest while the next unit's gradient would make more than
        // `gradient_units` full gradients at once.
        while self
            .grad_works
            .front()
            .is_some_and(|(_, work)| work.is_done() || self.grad_works.len() >= self.gradient_units)
        {
            let (unit, work) = self.grad_works.pop_front().expect("front exists");
            self.finish_grad(comm, unit, work, compressor.as_deref_mut())?;
        }
        Ok(())
    }

    fn submit_grad(&mut self, comm: &dyn Communicator, unit: usize, compressor: Option<&mut Compressor>) -> Result<()> {
        let range = self.units[unit].clone();
        if range.is_empty() {
            return Ok(());
        }
        if let Some(compressor) = compressor {
            // SAFETY: the unit's range of the model's CPU gradient buffer, final for this step;
            // the compressor reads it only during this call.
            let values = unsafe { f32_slice(&self.model_grad, range.clone()) };
            let pending = compressor
                .start_reduce_scatter(comm, unit, values)
                .map_err(|e| self.compress_error("compressed reduce_scatter gradients", e))?;
            self.grad_works.push_back((unit, InFlight::Compressed(pending)));
            return Ok(());
        }
        let region =
            f32_region(&self.model_grad, range).map_err(|reason| self.invalid("reduce_scatter gradients", reason))?;
        // SAFETY: the unit's gradient is final for this step (grads_final fires after its last
        // backward), nothing writes or reads it until `finish_grad` has waited on this Work, and
        // the model's gradient buffer outlives `self` (its memory is never unmapped).
        let work =
            unsafe { comm.reduce_scatter_async(region, ReduceOp::Avg) }.map_err(fail("reduce_scatter gradients"))?;
        self.grad_works.push_back((unit, InFlight::Plain(work)));
        Ok(())
    }

    fn compress_error(&self, op: &'static str, e: crate::TrainError) -> ZeroError {
        match e {
            crate::TrainError::Comm { source, .. } => ZeroError { op, source },
            other => self.invalid(op, other.to_string()),
        }
    }

    /// Waits for one unit's reduce-scatter, keeps this rank's slice, releases the rest.
    fn finish_grad(
        &mut self,
        comm: &dyn Communicator,
        unit: usize,
        work: InFlight,
        compressor: Option<&mut Compressor>,
    ) -> Result<()> {
        match (work, compressor) {
            (InFlight::Plain(work), _) => work.wait().map_err(fail("reduce_scatter gradients"))?,
            (InFlight::Compressed(pending), Some(compressor)) => {
                let range = &self.units[unit];
                // SAFETY: as in `submit_grad`; nothing else touches the range until it is
                // released below.
                let values = unsafe { f32_slice(&self.model_grad, range.clone()) };
                compressor
                    .finish(comm, pending, values)
                    .map_err(|e| self.compress_error("compressed reduce_scatter gradients", e))?;
            }
            (InFlight::Compressed(_), None) => unreachable!("a compressed reduction is finished with its compressor"),
        }
        self.take_grad_slice(unit);
        self.grads.release(self.units[unit].clone());
        Ok(())
    }

    /// Stage 2 and 3, before the optimizer: sends what waited (overlap off), then completes every
    /// reduction.
    pub(crate) fn finish_grads(
        &mut self,
        comm: &dyn Communicator,
        mut compressor: Option<&mut Compressor>,
    ) -> Result<()> {
        let mut first_error = None;
        for unit in std::mem::take(&mut self.grad_ready) {
            if let Err(e) = self.submit_grad(comm, unit, compressor.as_deref_mut()) {
                first_error.get_or_insert(e);
                break;
            }
        }
        while let Some((unit, work)) = self.grad_works.pop_front() {
            if let Err(e) = self.finish_grad(comm, unit, work, compressor.as_deref_mut()) {
                first_error.get_or_insert(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub(crate) fn grads_in_flight(&self) -> bool {
        !self.grad_works.is_empty() || !self.grad_ready.is_empty()
    }

    // ---- parameters ----

    /// Stage 1 and 2, after the update: every rank's updated slices into the model's buffer.
    pub(crate) fn all_gather_params(&mut self, comm: &dyn Communicator) -> Result<()> {
        if self.map.grads {
            // The update cleared this rank's slices of the mapped gradients; the others too.
            self.grads.release(self.whole());
        }
        let mut works = Vec::with_capacity(self.units.len());
        for unit in 0..self.units.len() {
            if !self.map.params {
                self.place_shard(unit);
            }
            works.extend(self.submit_gather(comm, &self.model_flat, unit, "all_gather parameters")?);
        }
        wait_all(works, "all_gather parameters")
    }

    /// A buffer laid out like this rank's shard (an optimizer state) made whole in the model's
    /// layout: this rank's slices put in place and every rank's gathered. Collective over `comm`.
    pub(crate) fn gather_shard_buffer(&self, comm: &dyn Communicator, buffer: &Tensor) -> Result<Tensor> {
        let whole = Tensor::zeros([self.model_flat.numel() as i64], (tch::Kind::Float, buffer.device()));
        tch::no_grad(|| {
            for unit in 0..self.units.len() {
                self.model_slice(unit, &whole).copy_(&self.shard_slice(unit, buffer));
            }
        });
        let op = "all_gather optimizer state";
        let mut works = Vec::with_capacity(self.units.len());
        for unit in 0..self.units.len() {
            works.extend(self.submit_gather(comm, &whole, unit, op)?);
        }
        wait_all(works, op)?;
        Ok(whole)
    }

    /// Copies this rank's slice of `unit` from the shard into the model's buffer.
    fn place_shard(&self, unit: usize) {
        tch::no_grad(|| self.model_slice(unit, &self.model_flat).copy_(&self.shard_slice(unit, self.shard.flat())));
    }

    /// Starts the in-place all-gather of `unit`'s range of `buffer` (laid out like the model's),
    /// whose slice this rank already holds; None for an empty unit.
    fn submit_gather(
        &self,
        comm: &dyn Communicator,
        buffer: &Tensor,
        unit: usize,
        op: &'static str,
    ) -> Result<Option<Work>> {
        let range = self.units[unit].clone();
        if range.is_empty() {
            return Ok(None);
        }
        let region = f32_region(buffer, range).map_err(|reason| self.invalid(op, reason))?;
        // SAFETY: nothing reads or writes the range until the Work is waited on: the model's
        // parameters at stage 1 and 2 and the optimizer state are waited on before the caller
        // returns; at stage 3 a unit is used only once `ensure` has waited (its state is InFlight
        // until then). The buffers outlive the wait (the model's is never unmapped).
        let work = unsafe { comm.all_gather_async(region) }.map_err(fail(op))?;
        Ok(Some(work))
    }

    /// Stage 3: starts gathering `unit` unless it is in place or on its way.
    pub(crate) fn prefetch(&mut self, comm: &dyn Communicator, unit: usize) -> Result<()> {
        if unit >= self.units.len() || !matches!(self.gathered[unit], Gathered::Released) {
            return Ok(());
        }
        self.params.populate(self.units[unit].clone());
        self.place_shard(unit);
        self.gathered[unit] = match self.submit_gather(comm, &self.model_flat, unit, "all_gather parameters")? {
            Some(work) => Gathered::InFlight(work),
            None => Gathered::Ready,
        };
        Ok(())
    }

    /// Stage 3: `unit`'s parameters in place (gathered now if nobody started it).
    pub(crate) fn ensure(&mut self, comm: &dyn Communicator, unit: usize) -> Result<()> {
        self.prefetch(comm, unit)?;
        match std::mem::replace(&mut self.gathered[unit], Gathered::Ready) {
            Gathered::InFlight(work) => work.wait().map_err(fail("all_gather parameters")),
            Gathered::Ready => Ok(()),
            Gathered::Released => unreachable!("prefetch started it"),
        }
    }

    /// Stage 3: gives `unit`'s gathered parameters back (the shard keeps this rank's slice).
    pub(crate) fn release_params(&mut self, unit: usize) {
        if unit >= self.units.len() {
            return;
        }
        if let Gathered::InFlight(work) = std::mem::replace(&mut self.gathered[unit], Gathered::Released) {
            // A gather nobody used: finish it before its memory goes (an error shows on the next
            // collective, which the poisoned communicator refuses).
            let _ = work.wait();
        }
        self.params.release(self.units[unit].clone());
    }

    /// Stage 2 and 3: `unit`'s released gradient pages faulted back in before its backward fills
    /// them.
    pub(crate) fn populate_grads(&self, unit: usize) {
        if let Some(range) = self.units.get(unit) {
            self.grads.populate(range.clone());
        }
    }

    pub(crate) fn n_units(&self) -> usize {
        self.units.len()
    }

    pub(crate) fn prefetch_units(&self) -> usize {
        self.prefetch
    }

    pub(crate) fn is_ready(&self, unit: usize) -> bool {
        matches!(self.gathered.get(unit), Some(Gathered::Ready))
    }
}
