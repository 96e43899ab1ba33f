//! Pipeline parallelism (`dist.pipeline`): each copy of the model cut into stages of consecutive
//! units, one rank a stage (Megatron-LM's order: the ranks of one copy's stages are consecutive,
//! data parallelism runs over the copies, stage s of every copy in one data-parallel group).
//!
//! A stage builds the whole model (from the same seed as one process) and then keeps only its
//! units: the other units' parameter and gradient pages go back to the kernel (releasable memory,
//! as ZeRO-3's), and its optimizer runs on a shard of its own units (`FlatParams::shard`, the model's own memory under the fused
//! CPU kernel), so optimizer state is per stage. The head's weights tied to the embedding live
//! in unit 0, which the first stage owns; the last stage keeps a copy for its head, sends the
//! gradient its head gave that copy to the first stage before the optimizer, and receives the
//! updated values after it (Megatron-LM's embedding group, over the two end stages).
//!
//! Every rank of a stage's data-parallel group holds the same units: their gradients are
//! averaged over it before the optimizer (under ZeRO-1 reduce-scattered: each copy gets the
//! average of the slices it updates, Megatron-LM's distributed optimizer). The gradient norm is the sum of the stages' sums,
//! added in stage order (every rank decides clipping and the NaN guard alike); the logged loss
//! is the last stages' mean. A checkpoint holds each stage's units as pieces written by the
//! first copy's ranks (a sharded checkpoint), so it resumes on any layout; evaluation and a
//! checkpoint's consumers see the whole model after `full_parameters`, which broadcasts each
//! stage's units from its owner.

use std::ops::Range;

use stoke_comm::{CommError, Communicator, ReduceOp, Region, Work};
use stoke_plan::stage_units;
use tch::Tensor;

use super::region::f32_region;
use super::zero::sum_over_ranks;
use crate::models::Model;
use crate::params::{Buffer, FlatParams, Releaser, ShardMap};
use crate::TrainError;

/// `dist.pipeline_schedule`: the order of a stage's forwards and backwards within a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// Every micro-batch's forward, then every backward (GPipe): m micro-batches' activations alive.
    GPipe,
    /// One forward, one backward once the pipeline is full (PipeDream-Flush, Megatron-LM's
    /// default): at most (stages - stage) micro-batches' activations alive on a stage.
    OneFOneB,
    /// 1F1B over virtual stages (Megatron-LM's interleaved schedule): the model cut into
    /// stages x `chunks` pieces, stage s holding pieces s, s + stages, ...; the bubble shrinks
    /// by `chunks` for `chunks` times the transfers. Micro-batches a multiple of the stages.
    Interleaved { chunks: usize },
}

impl Schedule {
    /// Model chunks per stage (1 unless interleaved).
    pub fn chunks(&self) -> usize {
        match self {
            Schedule::Interleaved { chunks } => *chunks,
            _ => 1,
        }
    }
}

impl std::str::FromStr for Schedule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "1f1b" => Ok(Schedule::OneFOneB),
            "gpipe" => Ok(Schedule::GPipe),
            "interleaved" => Ok(Schedule::Interleaved { chunks: 2 }),
            other => Err(format!("is {other:?}; allowed: \"1f1b\", \"gpipe\", \"interleaved\"")),
        }
    }
}

/// What the trainer needs to run its stage: its units, its neighbours and the schedule.
pub struct StageLink {
    pub stage: usize,
    pub stages: usize,
    /// This stage's chunks' units (each a contiguous run of the model's; one chunk unless
    /// interleaved), in the model's order.
    pub chunks: Vec<Range<usize>>,
    pub schedule: Schedule,
    /// The copy's stages (its own handle, so activations never wait behind the hooks' sums).
    pub comm: Box<dyn Communicator>,
}

/// Each unit's training FLOPs per token, the balance's cost: six per weight a token meets (the
/// head's tied matrix included), and the attention scores of a block.
pub fn unit_costs(model: &dyn Model) -> Vec<f64> {
    let shape = model.shape();
    let units = model.params().units();
    let (c, t, v) = (shape.d_model as f64, shape.seq_len as f64, shape.vocab_size as f64);
    units
        .iter()
        .enumerate()
        .map(|(u, unit)| {
            let weights = (unit.range.end - unit.range.start) as f64;
            if u == 0 {
                // A lookup, not a matrix multiply.
                0.0
            } else if u + 1 == units.len() {
                6.0 * (weights + if model.head_ties_embedding() { v * c } else { 0.0 })
            } else {
                6.0 * weights + 12.0 * t * c
            }
        })
        .collect()
}

/// This rank's pipeline state inside `DataParallel`.
pub(super) struct PipelineParts {
    pub(super) stage: usize,
    pub(super) stages: usize,
    /// This rank's part of its stage's cut model (`dist.tensor`; 0 of 1 when not cut).
    pub(super) part: usize,
    pub(super) tensor: usize,
    /// The copy's stages: the norm's sums, the tied weights, `full_parameters`.
    group: Box<dyn Communicator>,
    /// A second handle on the same ranks for the trainer's activations (taken once).
    link: Option<Box<dyn Communicator>>,
    /// The ranks holding this stage's units in the other copies (None: one copy).
    pub(super) data: Option<Box<dyn Communicator>>,
    /// The copy this rank's stage belongs to.
    pub(super) copy: usize,
    /// Every chunk's units (stages x chunks of them; chunk c on stage c mod stages), and what
    /// the units are in the model's buffers.
    stage_units: Vec<Range<usize>>,
    unit_ranges: Vec<Range<i64>>,
    /// The head uses the embedding's weights (both end stages hold them).
    tied: bool,
    /// ZeRO-1 over each stage's copies: this rank's optimizer holds its slice
    /// (`shard_range` over the copies) of each of the stage's units.
    pub(super) zero: bool,
    /// The optimizer's buffers: this stage's units, or their slices under ZeRO-1 (mapped: the
    /// model's own memory).
    pub(super) shard: Option<FlatParams>,
    /// The shard's segments, in the model's buffers.
    segments: Vec<Range<i64>>,
    mapped: bool,
    /// An empty shard: what a copy other than the first writes into a checkpoint.
    pub(super) nothing: Option<FlatParams>,
    model_flat: Option<Tensor>,
    model_grad: Option<Tensor>,
    /// Give the other stages' units' pages back (`release_others`).
    releasers: Option<(Releaser, Releaser)>,
}

/// `range` of a contiguous fp32 buffer as a communicator's region.
fn region(t: &Tensor, range: Range<i64>) -> Result<Region, TrainError> {
    f32_region(t, range).map_err(|message| TrainError::InvalidConfig { key: "dist", message })
}

fn comm_error(rank: usize, size: usize, op: &'static str) -> impl FnOnce(CommError) -> TrainError {
    move |source| TrainError::Comm { rank, world_size: size, op, source }
}

/// Cuts `world` into model copies of `stages` x `tensor` consecutive ranks (rank = (copy x
/// stages + stage) x tensor + part, Megatron-LM's order with the tensor-parallel parts
/// innermost): the pipeline groups (one copy's stages holding the same part) and the
/// data-parallel groups (one stage's part across the copies). Collective: every rank creates
/// every group, in the same order.
pub(super) fn split_groups(
    world: &dyn Communicator,
    stages: usize,
    tensor: usize,
) -> Result<PipelineParts, TrainError> {
    let (rank, size) = (world.rank(), world.world_size());
    if stages == 0 || tensor == 0 || size % (stages * tensor) != 0 {
        return Err(TrainError::InvalidConfig {
            key: "dist.pipeline",
            message: format!("is {stages}, which with dist.tensor = {tensor} does not divide the job's {size} ranks"),
        });
    }
    let fail = || comm_error(rank, size, "creating the pipeline groups");
    let copies = size / (stages * tensor);
    let rank_of = |copy: usize, stage: usize, part: usize| (copy * stages + stage) * tensor + part;
    let mut groups = (None, None);
    for copy in 0..copies {
        for part in 0..tensor {
            let ranks: Vec<usize> = (0..stages).map(|stage| rank_of(copy, stage, part)).collect();
            let sums = world.new_group(&ranks).map_err(fail())?;
            let link = world.new_group(&ranks).map_err(fail())?;
            if let (Some(sums), Some(link)) = (sums, link) {
                groups = (Some(sums), Some(link));
            }
        }
    }
    let mut data = None;
    if copies > 1 {
        for stage in 0..stages {
            for part in 0..tensor {
                let ranks: Vec<usize> = (0..copies).map(|copy| rank_of(copy, stage, part)).collect();
                if let Some(made) = world.new_group(&ranks).map_err(fail())? {
                    data = Some(made);
                }
            }
        }
    }
    let (Some(group), link) = groups else { unreachable!("every rank is in one copy's pipeline group") };
    Ok(PipelineParts {
        stage: rank / tensor % stages,
        stages,
        part: rank % tensor,
        tensor,
        group,
        link,
        data,
        copy: rank / (stages * tensor),
        stage_units: Vec::new(),
        unit_ranges: Vec::new(),
        tied: false,
        zero: false,
        shard: None,
        segments: Vec::new(),
        mapped: false,
        nothing: None,
        model_flat: None,
        model_grad: None,
        releasers: None,
    })
}

impl PipelineParts {
    fn error(&self, op: &'static str) -> impl FnOnce(CommError) -> TrainError {
        comm_error(self.group.rank(), self.group.world_size(), op)
    }

    /// Waits for `work` just submitted, naming `op` on failure.
    fn wait(&self, work: Result<Work, CommError>, op: &'static str) -> Result<(), TrainError> {
        work.and_then(|w| w.wait()).map_err(self.error(op))
    }

    /// Whether this rank is an end stage sharing the embedding's weights with the other end.
    fn shares_embedding(&self) -> bool {
        self.tied && self.stages > 1 && (self.stage == 0 || self.stage + 1 == self.stages)
    }

    /// Cuts `model`'s units into the stages and gives the trainer its link.
    pub(super) fn plan(
        &mut self,
        model: &dyn Model,
        schedule: Schedule,
        split: &[usize],
    ) -> Result<StageLink, TrainError> {
        let invalid = |message: String| TrainError::InvalidConfig { key: "dist.pipeline", message };
        let chunks = schedule.chunks();
        self.stage_units = stage_units(&unit_costs(model), self.stages * chunks, split).map_err(|message| {
            invalid(if chunks > 1 {
                format!("{message} ({} stages of {chunks} chunks each)", self.stages)
            } else {
                message
            })
        })?;
        self.unit_ranges = model.params().units().iter().map(|u| u.range.clone()).collect();
        self.tied = model.head_ties_embedding();
        let comm = self.link.take().ok_or_else(|| invalid("the stage's link was already taken".into()))?;
        Ok(StageLink {
            stage: self.stage,
            stages: self.stages,
            chunks: self.owned_chunks().map(|c| self.stage_units[c].clone()).collect(),
            schedule,
            comm,
        })
    }

    /// The units of every chunk (every stage's, in the model's order; after `plan`).
    pub(super) fn stage_units(&self) -> &[Range<usize>] {
        &self.stage_units
    }

    /// The chunks this rank's stage holds.
    fn owned_chunks(&self) -> impl Iterator<Item = usize> {
        (self.stage..self.stage_units.len()).step_by(self.stages)
    }

    /// Chunk `chunk`'s part of the model's buffers.
    fn chunk_range(&self, chunk: usize) -> Range<i64> {
        let units = &self.stage_units[chunk];
        self.unit_ranges[units.start].start..self.unit_ranges[units.end - 1].end
    }

    /// This stage's parts of the model's buffers, in order.
    fn own(&self) -> Vec<Range<i64>> {
        self.owned_chunks().map(|c| self.chunk_range(c)).collect()
    }

    /// The units this stage holds, in order.
    fn own_units(&self) -> Vec<usize> {
        self.owned_chunks().flat_map(|c| self.stage_units[c].clone()).collect()
    }

    /// The shard this stage's optimizer runs on: its units, or under ZeRO-1 this copy's slice of
    /// each; `fused`: the model's own memory (the fused CPU kernel updates it in place). Returns
    /// where each piece starts in its parameter.
    pub(super) fn shard(
        &mut self,
        params: &mut FlatParams,
        fused: bool,
    ) -> std::io::Result<std::collections::HashMap<String, i64>> {
        // Releasable first: a mapped shard points into the buffers it moves them to.
        params.make_releasable(Buffer::Params)?;
        params.make_releasable(Buffer::Grads)?;
        self.releasers = Some((params.releaser(Buffer::Params), params.releaser(Buffer::Grads)));
        let copies = self.data.as_ref().map_or(1, |d| d.world_size());
        let segments: Vec<Range<i64>> = self
            .own_units()
            .into_iter()
            .map(|u| {
                let unit = self.unit_ranges[u].clone();
                if !self.zero {
                    return unit;
                }
                let cut = stoke_comm::shard_range((unit.end - unit.start) as usize, copies, self.copy);
                unit.start + cut.start as i64..unit.start + cut.end as i64
            })
            .collect();
        let map = ShardMap { params: fused, grads: fused };
        let shard = params.shard(&segments, map);
        let offsets: std::collections::HashMap<&str, i64> =
            params.entries().iter().map(|e| (e.name.as_str(), e.offset)).collect();
        let starts = shard.entries().iter().map(|e| (e.name.clone(), e.source - offsets[e.name.as_str()])).collect();
        self.nothing = Some(params.shard(&[], ShardMap { params: false, grads: false }));
        self.shard = Some(shard);
        self.segments = segments;
        self.mapped = fused;
        self.model_flat = Some(params.flat().shallow_clone());
        self.model_grad = Some(params.flat_grad().shallow_clone());
        self.release_others(true);
        Ok(starts)
    }

    /// The ranges of the model's buffers this rank keeps: its stage's units, and on the last stage
    /// the embedding its head shares.
    fn kept(&self) -> Vec<Range<i64>> {
        let mut kept = self.own();
        if self.shares_embedding() && self.stage > 0 {
            kept.insert(0, self.unit_ranges[0].clone());
        }
        kept
    }

    /// Gives back the pages of every unit this rank does not keep (parameters; with `grads` their
    /// gradients too): they read as zero until written again.
    pub(super) fn release_others(&self, grads: bool) {
        let Some((params, gradients)) = &self.releasers else { return };
        let whole = self.unit_ranges.first().map_or(0, |u| u.start)..self.unit_ranges.last().map_or(0, |u| u.end);
        let mut at = whole.start;
        for keep in self.kept().into_iter().chain(std::iter::once(whole.end..whole.end)) {
            if at < keep.start {
                params.release(at..keep.start);
                if grads {
                    gradients.release(at..keep.start);
                }
            }
            at = at.max(keep.end);
        }
    }

    /// Copies between the model's buffer and a copied shard's (`to_shard`: into the shard).
    fn copy_shard(&self, model: &Tensor, shard: &Tensor, to_shard: bool) {
        let mut at = 0;
        tch::no_grad(|| {
            for segment in &self.segments {
                let len = segment.end - segment.start;
                let (ours, theirs) = (shard.narrow(0, at, len), model.narrow(0, segment.start, len));
                if to_shard {
                    ours.shallow_clone().copy_(&theirs);
                } else {
                    theirs.shallow_clone().copy_(&ours);
                }
                at += len;
            }
        });
    }

    fn buffers(&self) -> (&Tensor, &Tensor) {
        (
            self.model_flat.as_ref().expect("the pipeline shard is made before training"),
            self.model_grad.as_ref().expect("the pipeline shard is made before training"),
        )
    }

    /// Before the optimizer: the tied weights' gradient from the last stage into the first's;
    /// the stage's gradients averaged over its copies; a copied shard filled.
    pub(super) fn before_optimizer(&self) -> Result<(), TrainError> {
        let (_, grad) = self.buffers();
        let last = self.stages - 1;
        if self.shares_embedding() {
            let unit0 = self.unit_ranges[0].clone();
            let len = unit0.end - unit0.start;
            let mine = grad.narrow(0, unit0.start, len);
            if self.stage == last {
                let region = region(grad, unit0.clone())?;
                // SAFETY: the unit's gradient range, alive and untouched until `wait` returns.
                let work = unsafe { self.group.send_async(region, 0) };
                self.wait(work, "send the tied weights' gradient to the first stage")?;
                tch::no_grad(|| {
                    let _ = mine.shallow_clone().zero_();
                });
            } else {
                let received = Tensor::zeros([len], (tch::Kind::Float, grad.device()));
                let region = region(&received, 0..len)?;
                // SAFETY: `received` is alive and untouched until `wait` returns.
                let work = unsafe { self.group.recv_async(region, last) };
                self.wait(work, "receive the tied weights' gradient from the last stage")?;
                tch::no_grad(|| {
                    let mut mine = mine.shallow_clone();
                    mine += &received;
                });
            }
        }
        match self.data.as_deref() {
            // ZeRO-1 (Megatron-LM's distributed optimizer): each copy updates its slice of every
            // unit, so it needs that slice's average alone; the rest of the buffer is scratch
            // until the next step clears it.
            Some(data) if self.zero => {
                for unit in self.own_units() {
                    let range = self.unit_ranges[unit].clone();
                    if range.is_empty() {
                        continue;
                    }
                    let region = region(grad, range)?;
                    // SAFETY: the unit's gradient range; backward is over and nothing touches it until `wait`.
                    let work = unsafe { data.reduce_scatter_async(region, ReduceOp::Avg) };
                    self.wait(work, "reduce_scatter a stage's gradients over its copies")?;
                }
            }
            Some(data) => {
                for own in self.own() {
                    let region = region(grad, own)?;
                    // SAFETY: a chunk's gradient range; backward is over and nothing touches it until `wait`.
                    let work = unsafe { data.all_reduce_async(region, ReduceOp::Avg) };
                    self.wait(work, "all_reduce a stage's gradients over its copies")?;
                }
            }
            None => {}
        }
        if !self.mapped {
            // The model's gradients are cleared after the optimizer: a cut model's norm still
            // reads its replicated parameters' gradients there.
            let shard = self.shard.as_ref().expect("shard made");
            self.copy_shard(grad, shard.flat_grad(), true);
        }
        Ok(())
    }

    /// The whole model's sum of squared gradients from this rank's shard's sum: under ZeRO-1 the
    /// copies' slices added first, then the stages' sums, each in rank order.
    pub(super) fn global_sq_sum(&self, local: f64) -> Result<f64, TrainError> {
        let stage = match self.data.as_deref().filter(|_| self.zero) {
            Some(data) => sum_over_ranks(data, &[local]).map_err(self.error("all_gather the copies' norms"))?[0],
            None => local,
        };
        Ok(sum_over_ranks(self.group.as_ref(), &[stage]).map_err(self.error("all_gather the stages' norms"))?[0])
    }

    /// After the optimizer: a copied shard's values back into the model, the tied weights from
    /// the first stage to the last.
    pub(super) fn after_optimizer(&self) -> Result<(), TrainError> {
        let (flat, grad) = self.buffers();
        // A mapped shard is the model's own memory, updated in place (its gradients cleared).
        if !self.mapped {
            let shard = self.shard.as_ref().expect("shard made");
            self.copy_shard(flat, shard.flat(), false);
            // Only what this rank keeps: the other units' pages stay given back.
            tch::no_grad(|| {
                for keep in self.kept() {
                    let _ = grad.narrow(0, keep.start, keep.end - keep.start).zero_();
                }
            });
        } else if self.zero {
            // The update cleared this rank's slices of the mapped gradients; the copies' too.
            tch::no_grad(|| {
                for own in self.own() {
                    let _ = grad.narrow(0, own.start, own.end - own.start).zero_();
                }
            });
        }
        if let Some(data) = self.data.as_deref().filter(|_| self.zero) {
            // Every copy's updated slices, unit by unit (the cut every slice was made by).
            for u in self.own_units() {
                let range = self.unit_ranges[u].clone();
                if range.is_empty() {
                    continue;
                }
                let region = region(flat, range)?;
                // SAFETY: the unit's parameter range; the optimizer is done and nothing reads it
                // until `wait` returns.
                let work = unsafe { data.all_gather_async(region) };
                self.wait(work, "all_gather a stage's parameters over its copies")?;
            }
        }
        self.tied_weights_to_last()
    }

    fn tied_weights_to_last(&self) -> Result<(), TrainError> {
        if !self.shares_embedding() {
            return Ok(());
        }
        let (flat, _) = self.buffers();
        let region = region(flat, self.unit_ranges[0].clone())?;
        // SAFETY: the embedding's parameter range: the first stage only reads it, the last only
        // writes it, and neither touches it until `wait` returns.
        let work = unsafe {
            if self.stage == 0 {
                self.group.send_async(region, self.stages - 1)
            } else {
                self.group.recv_async(region, 0)
            }
        };
        self.wait(work, "send the tied weights to the last stage")
    }

    /// Every stage's units from their owner, so each rank holds the whole current model
    /// (evaluation, or a consumer of the whole model). Collective over the copy.
    pub(super) fn broadcast_all(&self) -> Result<(), TrainError> {
        let (flat, _) = self.buffers();
        for chunk in 0..self.stage_units.len() {
            let region = region(flat, self.chunk_range(chunk))?;
            // SAFETY: the model's parameter buffer, alive; no step runs during the broadcast.
            let work = unsafe { self.group.broadcast_async(region, chunk % self.stages) };
            self.wait(work, "broadcast a stage's parameters")?;
        }
        Ok(())
    }

    /// The logged loss from this rank's `loss` (the last stage's; 0 elsewhere): the last stages'
    /// mean over the copies (a cut model's parts all hold it: the first part's counts).
    pub(super) fn reduce_loss(&self, world: &dyn Communicator, loss: f64) -> Result<f64, TrainError> {
        let mine = if self.stage + 1 == self.stages && self.part == 0 { loss } else { 0.0 };
        let copies = world.world_size() / (self.stages * self.tensor);
        let sum = sum_over_ranks(world, &[mine]).map_err(self.error("all_gather the last stages' loss"))?[0];
        Ok(sum / copies as f64)
    }
}
