//! Data parallelism beside tensor parallelism (`dist.tensor`): the job's ranks cut into groups
//! that hold one model's parts (consecutive ranks, Megatron-LM's order) and groups that hold the
//! same part of different rows (every `tensor`-th rank), and the whole model's gradient norm from
//! the parts.

use std::sync::Arc;

use stoke_comm::{CommError, Communicator};
use tch::{Kind, Tensor};

use super::zero::sum_over_ranks;

use crate::models::{Model, TensorGroup};
use crate::params::{FlatParams, ParamEntry, ShardMap};
use crate::TrainError;

/// This rank's groups when the model is cut.
pub(super) struct TensorParts {
    pub(super) group: Arc<TensorGroup>,
    /// The ranks holding the same parts (None: one model in the job, nothing to average).
    pub(super) data: Option<Box<dyn Communicator>>,
    /// The gradients of the parameters every rank of the group holds whole (once the model is
    /// cut: `DataParallel::cut_model`), counted once in the norm.
    pub(super) replicated: Vec<Tensor>,
    /// Their names (the pieces of a ZeRO shard are named after their parameters).
    pub(super) replicated_names: std::collections::HashSet<String>,
    /// Under sequence parallelism the replicated gradients that hold each rank's share
    /// (`Model::gradient_is_a_share`), summed over the group before the optimizer.
    pub(super) shares: Vec<Tensor>,
    /// Their names (ZeRO 2 and 3 sum the shares' pieces in the shards).
    share_names: std::collections::HashSet<String>,
    /// ZeRO over `data`: what this rank writes of a checkpoint (`checkpoint_pieces`).
    pub(super) pieces: Option<FlatParams>,
}

/// Cuts `world` into the groups of `tensor` consecutive ranks and, without pipeline stages, the
/// data-parallel groups across them (with stages, `pipeline::split_groups` makes those: one per
/// stage and part). Collective: every rank creates every group, in the same order.
pub(super) fn split_groups(world: &dyn Communicator, tensor: usize, stages: usize) -> Result<TensorParts, TrainError> {
    let size = world.world_size();
    if tensor == 0 || size % tensor != 0 {
        return Err(TrainError::InvalidConfig {
            key: "dist.tensor",
            message: format!("is {tensor}, which does not divide the job's {size} ranks"),
        });
    }
    let comm_error = |source: CommError| TrainError::Comm {
        rank: world.rank(),
        world_size: size,
        op: "creating the tensor- and data-parallel groups",
        source,
    };
    let data = size / tensor;
    let mut group = None;
    for d in 0..data {
        let ranks: Vec<usize> = (d * tensor..(d + 1) * tensor).collect();
        if let Some(made) = world.new_group(&ranks).map_err(comm_error)? {
            group = Some(made);
        }
    }
    let mut data_group = None;
    if data > 1 && stages == 1 {
        for t in 0..tensor {
            let ranks: Vec<usize> = (0..data).map(|d| d * tensor + t).collect();
            if let Some(made) = world.new_group(&ranks).map_err(comm_error)? {
                data_group = Some(made);
            }
        }
    }
    let group = group.expect("every rank is in one tensor-parallel group");
    Ok(TensorParts {
        group: TensorGroup::new(group),
        data: data_group,
        replicated: Vec::new(),
        replicated_names: Default::default(),
        shares: Vec::new(),
        share_names: Default::default(),
        pieces: None,
    })
}

impl TensorParts {
    /// Keeps the gradients and names of `model`'s replicated parameters (after the model is cut).
    pub(super) fn track(&mut self, model: &dyn Model) {
        let replicated: Vec<&ParamEntry> =
            model.params().entries().iter().filter(|e| !model.split_of(&e.name).is_split()).collect();
        self.replicated = replicated.iter().map(|e| e.tensor.grad()).collect();
        self.replicated_names = replicated.iter().map(|e| e.name.clone()).collect();
        let shares: Vec<&&ParamEntry> = replicated.iter().filter(|e| model.gradient_is_a_share(&e.name)).collect();
        self.shares = shares.iter().map(|e| e.tensor.grad()).collect();
        self.share_names = shares.iter().map(|e| e.name.clone()).collect();
    }

    /// Sequence parallelism: the shares summed over the group in one all-reduce, in place (every
    /// rank gets the same bits, so the replicated parameters stay equal).
    pub(super) fn sum_shares(&self) -> Result<(), CommError> {
        self.sum_in_place(&self.shares.iter().map(|g| g.view([-1])).collect::<Vec<_>>())
    }

    /// `sum_shares` under ZeRO 2 and 3, where the reduced gradients live in `shard`: the pieces of
    /// the shares this rank's shard holds. The parts of a cut model have the same layout (every
    /// split even), so the ranks of the group hold the same pieces at the same offsets.
    pub(super) fn sum_shard_shares(&self, shard: &FlatParams) -> Result<(), CommError> {
        let grads = shard.flat_grad();
        let pieces: Vec<Tensor> = shard
            .entries()
            .iter()
            .filter(|e| self.share_names.contains(&e.name))
            .map(|e| grads.narrow(0, e.offset, e.numel))
            .collect();
        self.sum_in_place(&pieces)
    }

    /// `flat` (1-D views) summed over the group in one all-reduce, written back in place.
    fn sum_in_place(&self, flat: &[Tensor]) -> Result<(), CommError> {
        if flat.is_empty() {
            // Every rank of the group holds the same pieces, so none of them all-reduces.
            return Ok(());
        }
        let summed = self.group.all_reduce(&Tensor::cat(flat, 0));
        if let Some(failure) = self.group.take_failure() {
            return Err(failure);
        }
        let mut at = 0;
        tch::no_grad(|| {
            for piece in flat {
                let n = piece.numel() as i64;
                piece.shallow_clone().copy_(&summed.narrow(0, at, n));
                at += n;
            }
        });
        Ok(())
    }

    /// The sum of squared gradients of this rank's pieces of the replicated parameters in a ZeRO
    /// `shard` whose gradients it holds itself (stage 2: the model's are given back).
    pub(super) fn replicated_sq_sum(&self, shard: &FlatParams) -> f64 {
        let grads = shard.flat_grad();
        let pieces = shard.entries().iter().filter(|e| self.replicated_names.contains(&e.name));
        sq_sum(pieces.map(|e| grads.narrow(0, e.offset, e.numel)))
    }

    /// ZeRO over the copies: a checkpoint's tensors are gathered whole over the copies and the
    /// parts, and the first copy's first part writes every one (as a sharded checkpoint's
    /// pieces: `params` mapped, nothing copied); the other ranks write nothing.
    pub(super) fn checkpoint_pieces(&mut self, params: &FlatParams, data_rank: usize) {
        let writes = data_rank == 0 && self.group.rank() == 0;
        let units = params.units().iter().map(|u| u.range.clone());
        let segments: Vec<std::ops::Range<i64>> = if writes { units.collect() } else { Vec::new() };
        self.pieces = Some(params.shard(&segments, ShardMap { params: writes, grads: writes }));
    }

    /// The whole model's sum of squared gradients from this rank's `local` sum over its parts:
    /// the group adds every rank's sum with the replicated parameters' share taken out of all but
    /// one copy (each rank removes (size - 1) / size of it), in rank order, so every rank gets
    /// the same bits. The replicated sum is `replicated` when given (ZeRO-2: from the shards,
    /// `replicated_sq_sum`), else read from the tracked gradients on the device once.
    pub(super) fn global_sq_sum(&self, local: f64, replicated: Option<f64>) -> Result<f64, CommError> {
        let size = self.group.size();
        let replicated = replicated.unwrap_or_else(|| sq_sum(self.replicated.iter().map(Tensor::shallow_clone)));
        let mine = local - replicated * (size - 1) as f64 / size as f64;
        Ok(sum_over_ranks(self.group.communicator(), &[mine])?[0])
    }
}

/// The sum of squares of every element of `tensors`, in f64, read from the device once.
fn sq_sum(tensors: impl Iterator<Item = Tensor>) -> f64 {
    let sums: Vec<Tensor> = tensors.map(|t| t.to_kind(Kind::Double).square().sum(Kind::Double)).collect();
    if sums.is_empty() {
        0.0
    } else {
        Tensor::stack(&sums, 0).sum(Kind::Double).double_value(&[])
    }
}
