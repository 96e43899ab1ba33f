//! Tensor parallelism in Megatron-LM's form, for the families whose blocks declare their split.
//!
//! A block's first matrix of each branch is cut by output rows (column-parallel: attention's q, k
//! and v by heads, the MLP's inner dimension), its second by input columns (row-parallel), so a
//! branch runs on this rank's heads or inner slice alone and ends in a partial sum. Two operators
//! join the ranks of a [`TensorGroup`]:
//! - `f` at the branch's input: identity forward, the sum of the ranks' input gradients backward.
//!   tch has no custom autograd functions, so `f` is a cut in the graph: the normed input becomes a
//!   leaf ([`copy_to_ranks`]) and its backward, a [`CoreBackward`] the block executor calls, sums
//!   the leaf's gradient over the group and hands it to the graph before.
//! - `g` at the branch's output: the sum over the group forward, identity backward
//!   ([`TensorGroup::reduce_from_ranks`]), exact in value: `sum + (t - t.detach())` adds an exact
//!   zero that carries `t`'s gradient through.
//!
//! The token embedding is cut by vocabulary rows (each rank looks up the tokens its rows hold,
//! zero elsewhere, then `g`), and the head's cross-entropy runs on the vocabulary shard's logits
//! ([`vocab_parallel_cross_entropy`]): the row maxima, the sums of exponentials and the target's
//! logit are summed over the group, never the logits themselves. Norms, position embeddings and
//! biases after a row-parallel matrix are replicated: every rank computes them from the same
//! values, so their gradients and updates stay identical without a reduction.
//!
//! Sequence parallelism (`dist.sequence_parallel`, Korthikanti et al., 2022) keeps the residual
//! stream between the branches as each rank's piece of the sequence, `[batch, seq / n, d]`: the
//! norms, the residual additions and the replicated biases run on the piece; `f` becomes an
//! all-gather of the normed pieces (its backward a reduce-scatter of the leaf's gradient) and `g`
//! a reduce-scatter of the partial sums into a new leaf (its backward an all-gather of that
//! leaf's gradient, run by the core's backward before `f`'s). The embedding's output (summed over
//! the group as without it) is cut to the rank's piece, and the head gathers the final norm's
//! pieces back. The replicated parameters used on pieces (the norms, the biases after a
//! row-parallel matrix) get each rank's share of their gradient, summed over the group before the
//! optimizer (`DataParallel`); the position embedding, used before the cut, gets the whole.
//!
//! A failed collective inside a forward (a peer that died) cannot return an error through the
//! model's functions: the group keeps the first failure and returns the tensor unreduced; the
//! step hooks turn it into the run's error before the optimizer (`TensorGroup::take_failure`).

use std::sync::{Arc, Mutex};

use stoke_comm::shard_range;
use tch::{Kind, Tensor};

use crate::models::tensor_group::{Split, TensorGroup};
use crate::models::{CoreBackward, HeadBackward, HeadLoss};
use crate::params::{FlatParams, Init, ParamSpec, UnitSpec};
use crate::TrainError;

/// Rank `rank` of `size`'s parts of `whole`'s parameters (each cut by `split(name)`), in new flat
/// buffers laid out unit by unit as before, each with its learning-rate factor. `whole` must hold
/// every parameter it was built with (nothing frozen or sharded).
pub fn split_params(
    whole: &FlatParams,
    split: &dyn Fn(&str) -> Split,
    rank: usize,
    size: usize,
) -> Result<FlatParams, TrainError> {
    if !whole.frozen_entries().is_empty() {
        return Err(TrainError::InvalidConfig {
            key: "dist.tensor",
            message: "cannot cut a model with frozen parameters yet (train.freeze, train.lora): keep dist.tensor = 1"
                .into(),
        });
    }
    let units = whole
        .units()
        .iter()
        .map(|unit| UnitSpec {
            name: unit.name.clone(),
            params: whole.entries()[unit.entries.clone()]
                .iter()
                .map(|e| ParamSpec {
                    name: e.name.clone(),
                    shape: split(&e.name).local_shape(&e.shape, rank, size),
                    init: Init::Zeros,
                    decay: e.decay,
                })
                .collect(),
        })
        .collect();
    let mut parts = FlatParams::new(units, whole.device());
    for (from, to) in whole.entries().iter().zip(parts.entries()) {
        let piece = split(&from.name).cut(&from.tensor.detach(), rank, size);
        tch::no_grad(|| to.tensor.detach().copy_(&piece));
    }
    let scales: std::collections::HashMap<String, f64> =
        whole.entries().iter().map(|e| (e.name.clone(), e.lr_scale)).collect();
    parts.set_lr_scales(&|name| scales.get(name).copied().unwrap_or(1.0));
    Ok(parts)
}

/// A model cut over a group: what a family keeps once `Model::split_tensor` ran, and the parts
/// of its forward that the cut changes.
pub struct Cut {
    pub group: Arc<TensorGroup>,
    /// The vocabulary rows this rank's embedding (and head) holds.
    pub vocab: std::ops::Range<i64>,
    /// Inside a branch under sequence parallelism: where its row-parallel output's partial sum
    /// and the leaf its reduce-scatter became are left for the branch's core.
    pending: Mutex<Option<Option<(Tensor, Tensor)>>>,
}

/// Megatron-LM's cut of a model with nanoGPT's parameter names (the `gpt` and `gpt-rms`
/// families): the token embedding (and so the tied head) and the MLP's first matrix by rows, q,
/// k and v by rows in three blocks (their biases with them), both output projections' weights by
/// columns; everything else, the output projections' biases included, replicated.
pub fn nanogpt_split(name: &str) -> Split {
    if name == "transformer.wte.weight" || name.contains(".mlp.c_fc.") {
        Split::Rows { blocks: 1 }
    } else if name.contains(".attn.c_attn.") {
        Split::Rows { blocks: 3 }
    } else if name.ends_with(".c_proj.weight") {
        Split::Cols { blocks: 1 }
    } else {
        Split::Replicated
    }
}

impl Cut {
    /// Cuts `params` (the whole model's, replaced by this rank's parts) over `group` by `split`;
    /// `vocab` is the vocabulary's size and `heads` the head counts that must divide evenly
    /// (each rank takes whole heads), each with its key for the error.
    pub fn params(
        params: &mut FlatParams,
        group: Arc<TensorGroup>,
        split: &dyn Fn(&str) -> Split,
        vocab: usize,
        heads: &[(&str, usize)],
    ) -> Result<Cut, TrainError> {
        let (rank, size) = (group.rank(), group.size());
        if let Some((key, n)) = heads.iter().find(|(_, n)| n % size != 0) {
            return Err(TrainError::InvalidConfig {
                key: "dist.tensor",
                message: format!("is {size}, which does not divide {key} = {n}: each rank takes whole heads"),
            });
        }
        *params = split_params(params, split, rank, size)?;
        Ok(Cut { vocab: vocab_rows(vocab, rank, size), group, pending: Mutex::new(None) })
    }

    /// Heads on this rank of `n` in all.
    pub fn local(&self, n: usize) -> i64 {
        (n / self.group.size()) as i64
    }

    /// `g`: a row-parallel matrix's partial output summed over the group; inside a branch under
    /// sequence parallelism reduce-scattered into this rank's piece, a leaf the branch's core
    /// takes the gradient of.
    pub fn reduced(&self, partial: &Tensor) -> Tensor {
        if self.group.sequence() {
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(slot) = pending.as_mut() {
                let out = self.group.reduce_scatter_seq(partial).set_requires_grad(true);
                *slot = Some((partial.shallow_clone(), out.shallow_clone()));
                return out;
            }
        }
        self.group.reduce_from_ranks(partial)
    }

    /// The token embedding's lookup from this rank's vocabulary rows (see
    /// [`vocab_parallel_embedding`]).
    pub fn embedding(&self, table: &Tensor, tokens: &Tensor) -> Tensor {
        vocab_parallel_embedding(&self.group, table, &self.vocab, tokens)
    }

    /// The mean cross-entropy of `[.., vocab_local]` logits against their targets (see
    /// [`vocab_parallel_cross_entropy`]).
    pub fn cross_entropy(&self, logits: &Tensor, targets: &Tensor) -> Tensor {
        let rows = *logits.size().last().expect("logits have a vocabulary dimension");
        vocab_parallel_cross_entropy(&self.group, &logits.view([-1, rows]), &self.vocab, &targets.view([-1]))
    }

    /// A column-parallel branch on `normed` (part of a graph): `run` from `f`'s leaf, and the
    /// backward that sums the leaf's gradient over the group (`ByHand::branch_core`).
    pub fn branch<'m>(
        &'m self,
        normed: &Tensor,
        run: impl FnOnce(&Tensor) -> Tensor,
    ) -> (Tensor, Box<dyn CoreBackward + 'm>) {
        if !self.group.sequence() {
            let (leaf, input_grads) = copy_to_ranks(&self.group, normed);
            return (run(&leaf), input_grads);
        }
        let leaf = self.group.all_gather_seq(normed).set_requires_grad(true);
        *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(None);
        let output = run(&leaf);
        let taken = self.pending.lock().unwrap_or_else(|e| e.into_inner()).take().flatten();
        let (partial, out) = taken.expect("a branch under sequence parallelism ends in a row-parallel matrix");
        // The core needs these three's places in the graph (and `out`'s gradient), not their
        // values, which nothing after the branch reads (unless `out` is the branch's output, as
        // with no bias to add): the activations kept are the graph's.
        let before = normed.shallow_clone();
        keep_place_only(&partial);
        keep_place_only(&before);
        if out.data_ptr() != output.data_ptr() {
            keep_place_only(&out);
        }
        (output, Box::new(SequenceCore { group: &self.group, before, leaf, partial, out }))
    }

    /// The head on the final norm's output `normed` (part of the graph from the head's input):
    /// `loss` from `f`'s leaf; its backward runs the loss's, then sums the leaf's gradient.
    pub fn head<'m>(
        &'m self,
        normed: &Tensor,
        loss_multiplier: f64,
        loss: impl FnOnce(&Tensor) -> Tensor,
    ) -> HeadLoss<'m> {
        let (leaf, input_grads) = copy_to_ranks(&self.group, normed);
        let loss = loss(&leaf);
        let by_hand = CutHead { loss: loss.shallow_clone(), loss_multiplier, input_grads };
        HeadLoss { loss, by_hand: Some(Box::new(by_hand)) }
    }
}

/// The head cut over a group: its loss's backward, then `f`'s sum of its input's gradient.
struct CutHead<'m> {
    loss: Tensor,
    loss_multiplier: f64,
    input_grads: Box<dyn CoreBackward + 'm>,
}

impl HeadBackward for CutHead<'_> {
    fn backward(self: Box<Self>) -> (Tensor, Tensor) {
        (&self.loss * self.loss_multiplier).backward();
        self.input_grads.backward()
    }
}

/// `f` at a column-parallel region's input `x` (part of a graph): the leaf the region runs from,
/// and the backward that sums the leaf's gradient over the group and hands it to `x`'s graph.
/// Under sequence parallelism `x` is this rank's piece: the leaf is the pieces gathered, and its
/// gradient is reduce-scattered back.
pub fn copy_to_ranks<'m>(group: &'m TensorGroup, x: &Tensor) -> (Tensor, Box<dyn CoreBackward + 'm>) {
    let scatter = group.sequence();
    let leaf = if scatter { group.all_gather_seq(x) } else { x.detach() }.set_requires_grad(true);
    let backward = InputGrads { group, before: x.shallow_clone(), leaf: leaf.shallow_clone(), scatter };
    (leaf, Box::new(backward))
}

/// `f`'s backward: the leaf's gradient summed over the group, or under sequence parallelism
/// (`scatter`, the leaf gathered from the pieces) reduce-scattered back to the rank's piece.
struct InputGrads<'m> {
    group: &'m TensorGroup,
    before: Tensor,
    leaf: Tensor,
    scatter: bool,
}

impl CoreBackward for InputGrads<'_> {
    fn backward(&self) -> (Tensor, Tensor) {
        let grad = self.leaf.grad();
        let summed = if self.scatter { self.group.reduce_scatter_seq(&grad) } else { self.group.all_reduce(&grad) };
        (self.before.shallow_clone(), summed)
    }
}

/// Replaces `t`'s values with one zero seen at every position (the same shape, no memory), so
/// a handle kept for its place in the graph does not keep its activations alive.
fn keep_place_only(t: &Tensor) {
    let zero = Tensor::zeros([1], (t.kind(), t.device())).expand(t.size(), false);
    t.shallow_clone().set_data(&zero);
}

/// A branch under sequence parallelism: `g`'s leaf's gradient all-gathered and run back through
/// the branch from its partial sum, then `f`'s reduce-scatter.
struct SequenceCore<'m> {
    group: &'m TensorGroup,
    before: Tensor,
    leaf: Tensor,
    partial: Tensor,
    out: Tensor,
}

impl CoreBackward for SequenceCore<'_> {
    fn backward(&self) -> (Tensor, Tensor) {
        let whole = self.group.all_gather_seq(&self.out.grad());
        (&self.partial * whole).sum(self.partial.kind()).backward();
        (self.before.shallow_clone(), self.group.reduce_scatter_seq(&self.leaf.grad()))
    }
}

/// The rows of the vocabulary rank `rank` of `size` holds.
pub fn vocab_rows(vocab: usize, rank: usize, size: usize) -> std::ops::Range<i64> {
    let rows = shard_range(vocab, size, rank);
    rows.start as i64..rows.end as i64
}

/// The token embedding cut by vocabulary rows (`wte_local` holds `rows`): every rank looks up the
/// tokens its rows hold (zero for the others) and the group sums them (`g`).
pub fn vocab_parallel_embedding(
    group: &TensorGroup,
    wte_local: &Tensor,
    rows: &std::ops::Range<i64>,
    tokens: &Tensor,
) -> Tensor {
    let held = tokens.ge(rows.start).logical_and(&tokens.lt(rows.end));
    let local_ids = (tokens - rows.start) * held.to_kind(Kind::Int64);
    let looked_up =
        Tensor::embedding(wte_local, &local_ids, -1, false, false) * held.unsqueeze(-1).to_kind(wte_local.kind());
    group.reduce_from_ranks(&looked_up)
}

/// The mean cross-entropy of `[rows, vocab_local]` logits (this rank's vocabulary `rows`) against
/// `[rows]` global targets (-100 skipped), with the same value on every rank and the gradient of
/// this rank's logits, without gathering the logits: the row maximum, the sum of exponentials
/// and the target's logit are reduced over the group.
pub fn vocab_parallel_cross_entropy(
    group: &TensorGroup,
    logits: &Tensor,
    rows: &std::ops::Range<i64>,
    targets: &Tensor,
) -> Tensor {
    let logits = logits.to_kind(Kind::Float);
    let max = group.all_max(&logits.detach().amax([-1i64].as_slice(), false));
    let shifted = logits - max.unsqueeze(-1);
    let sum_exp = group.reduce_from_ranks(&shifted.exp().sum_dim_intlist([-1i64].as_slice(), false, Kind::Float));
    let held = targets.ge(rows.start).logical_and(&targets.lt(rows.end));
    let local_targets = ((targets - rows.start) * held.to_kind(Kind::Int64)).unsqueeze(-1);
    let picked = shifted.gather(-1, &local_targets, false).squeeze_dim(-1) * held.to_kind(Kind::Float);
    let target_logit = group.reduce_from_ranks(&picked);
    let valid = targets.ne(-100).to_kind(Kind::Float);
    let per_row = (sum_exp.log() - target_logit) * &valid;
    per_row.sum(Kind::Float) / valid.sum(Kind::Float)
}
