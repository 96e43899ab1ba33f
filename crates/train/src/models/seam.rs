//! The seam's types: [`Model`], what a family offers by hand ([`ByHand`] and the backward traits),
//! and the words they share ([`Branch`], [`Norm`], [`HeadLoss`]). See the module doc of `models`.

use std::sync::Arc;

use tch::Tensor;

use crate::config::GptShape;
use crate::kernels::LayerNormStats;
use crate::models::tensor_group::{Split, TensorGroup};
use crate::params::FlatParams;
use crate::TrainError;

/// One micro-batch as a model takes it, on the model's device.
pub struct Inputs {
    /// `[batch, seq]` int64: the token rows a text model reads; a VLA model's instruction tokens
    /// (0 where padded).
    pub tokens: Tensor,
    /// `[batch, seq]` int64 next-token targets, `-100` where the loss skips one; a VLA model's are
    /// its instruction's next tokens, `[batch, instruction_tokens - 1]`, `-100` where padded.
    pub targets: Tensor,
    /// The rest of a robot sample, for a model of episodes (`model.family = "vla"`).
    pub episode: Option<EpisodeInputs>,
}

impl Inputs {
    /// A text model's micro-batch: token rows and their targets.
    pub fn tokens(tokens: Tensor, targets: Tensor) -> Inputs {
        Inputs { tokens, targets, episode: None }
    }
}

/// A robot sample's tensors beside its instruction tokens (see `stoke_data::EpisodeBatch`).
pub struct EpisodeInputs {
    /// `[batch, frames, side, side, 3]` uint8 camera frames.
    pub frames: Tensor,
    /// `[batch, state_dim]` fp32, normalized.
    pub state: Tensor,
    /// `[batch, chunk, action_dim]` fp32 the action chunk, normalized.
    pub actions: Tensor,
    /// `[batch, chunk]` fp32: 1 where the action exists.
    pub action_mask: Tensor,
    /// `[batch, chunk, action_dim]` fp32 standard normal noise, the flow's start.
    pub noise: Tensor,
    /// `[batch]` fp32 in [0, 1): where on the flow from noise (0) to the actions (1) a sample trains.
    pub time: Tensor,
    /// `[batch, instruction_tokens]` fp32: 1 where the instruction has a token, 0 where it is padding.
    pub token_mask: Tensor,
}

/// One of a block's two residual branches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Branch {
    /// Causal self-attention, the block's first branch.
    Attention,
    /// The feed-forward network, its second.
    Mlp,
}

/// One of the model's norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    /// Block `layer_idx`'s norm before its attention.
    Attention(usize),
    /// Block `layer_idx`'s norm before its MLP.
    Mlp(usize),
    /// The final norm, before the head.
    Final,
}

impl Norm {
    /// The norm at the start of block `layer_idx`'s `branch`.
    pub fn before(layer_idx: usize, branch: Branch) -> Norm {
        match branch {
            Branch::Attention => Norm::Attention(layer_idx),
            Branch::Mlp => Norm::Mlp(layer_idx),
        }
    }
}

/// The head's loss, ready for its backward ([`Model::head_loss_for_backward`]).
pub struct HeadLoss<'m> {
    /// The mean loss, fp32; part of the autograd graph when `by_hand` is `None`.
    pub loss: Tensor,
    /// A head whose matrix multiplies are backward-ed by hand (the gradient of the logits came
    /// with the loss).
    pub by_hand: Option<Box<dyn HeadBackward + 'm>>,
}

/// The backward by hand of a head ([`HeadLoss::by_hand`]).
pub trait HeadBackward {
    /// Adds the head's parameter gradients into the flat gradient buffer and returns the head's
    /// input in the compute type with its gradient, for the caller to backward from.
    fn backward(self: Box<Self>) -> (Tensor, Tensor);
}

/// A whole branch run outside libtorch's graph, from its norm's output ([`ByHand::branch_whole`]).
pub trait BranchBackward {
    /// From the gradient of the residual's output (fp32), adds every parameter's gradient into
    /// the flat gradient buffer and returns the gradient of the branch's normed input.
    fn backward(&self, grad_output: &Tensor) -> Tensor;
}

/// A whole block run outside libtorch's graph ([`Model::block_by_hand`]).
pub trait BlockBackward {
    /// From the gradient of the block's output (fp32, taken over: it may be written in place),
    /// adds every parameter's gradient into the flat gradient buffer and returns the gradient of
    /// the block's input.
    fn backward(&self, grad_output: Tensor) -> Tensor;
}

/// The core of a branch run outside libtorch's graph between two of its graphs
/// ([`ByHand::branch_core`]).
pub trait CoreBackward {
    /// Once the graph after the core has run its backward: the tensor where the graph before the
    /// core ends, and its gradient, for the caller to backward from.
    fn backward(&self) -> (Tensor, Tensor);
}

/// The parts of a model it runs by hand, outside libtorch's graph, with their backward.
pub trait ByHand {
    /// Whether the norms inside blocks run by hand ([`ByHand::norm`] gives `Some`).
    fn norms(&self) -> bool;

    /// Whether `branch` runs by hand: with the norm by hand the whole branch
    /// ([`ByHand::branch_whole`]), otherwise its core ([`ByHand::branch_core`]).
    fn branch(&self, branch: Branch) -> bool;

    /// Norm `which` of `x` (fp32) by hand, in the compute type, with what its backward needs;
    /// `None` when this norm is not run by hand (the caller runs [`Model::norm`]).
    fn norm(&self, which: Norm, x: &Tensor) -> Option<(Tensor, LayerNormStats)>;

    /// The backward of a [`ByHand::norm`]: the gradient with respect to `x` given the normed
    /// output's `grad`, added in place to `residual` when given; the norm's parameter gradients
    /// go into the flat gradient buffer.
    fn norm_backward(
        &self,
        which: Norm,
        grad: &Tensor,
        x: &Tensor,
        stats: &LayerNormStats,
        residual: Option<Tensor>,
    ) -> Tensor;

    /// Block `layer_idx`'s `branch` on `normed` (its norm's output, part of libtorch's graph)
    /// with its core by hand: the branch's output and the core's backward.
    fn branch_core<'m>(
        &'m self,
        layer_idx: usize,
        branch: Branch,
        normed: &Tensor,
    ) -> (Tensor, Box<dyn CoreBackward + 'm>);

    /// Block `layer_idx`'s whole `branch` by hand from [`ByHand::norm`]'s output: the branch's
    /// output (no graph) and its backward.
    fn branch_whole<'m>(
        &'m self,
        layer_idx: usize,
        branch: Branch,
        normed: &Tensor,
    ) -> (Tensor, Box<dyn BranchBackward + 'm>);
}

/// A model as the executor, ZeRO and checkpoints see it; see the module doc.
///
/// Units: 0 is the embedding, `1..=n_layer` the blocks, `n_layer + 1` the head; the parameter
/// buffers are laid out in the same units, in the same order.
pub trait Model {
    /// The decoder's dimensions (layers, heads, width, context, vocabulary).
    fn shape(&self) -> GptShape;

    /// The parameters and their gradients.
    fn params(&self) -> &FlatParams;

    /// For moving the buffers (ZeRO's releasable memory).
    fn params_mut(&mut self) -> &mut FlatParams;

    /// Parameters, counting tied ones once.
    fn n_params(&self) -> usize;

    /// Training FLOPs per token (forward and backward), the MFU's numerator.
    fn flops_per_token(&self) -> f64;

    /// Whether the model's bf16 matrix products run widened to fp32 (`precision::Products`), so
    /// at the fp32 peak.
    fn widened_products(&self) -> bool {
        false
    }

    /// The number of units the executor runs: the embedding, each block, the head.
    fn n_units(&self) -> usize {
        self.shape().n_layer + 2
    }

    /// Starts a step's casts of the weights to the compute type; with `reuse` a cast made with
    /// autograd may be kept for the step's later micro-batches.
    fn begin_step_casts(&mut self, _reuse: bool) {}

    /// Drops the step's kept casts (before the optimizer changes the weights).
    fn end_step_casts(&mut self) {}

    /// After a backward that reached block `layer_idx` (or with `None` the head): adds any
    /// gradients the model keeps outside the flat gradient buffer into it.
    fn add_cast_grads(&self, _layer_idx: Option<usize>) {}

    /// `add_cast_grads` for every block and the head.
    fn add_all_cast_grads(&self) {}

    /// The embedding unit: `[batch, seq, d]` fp32 from the micro-batch.
    fn embed(&self, inputs: &Inputs) -> Tensor;

    /// Norm `which` of `x`, fp32.
    fn norm(&self, which: Norm, x: &Tensor) -> Tensor;

    /// Block `layer_idx`'s `branch` on its normed input, in the compute type.
    fn branch(&self, layer_idx: usize, branch: Branch, normed: &Tensor) -> Tensor;

    /// `x + branch(norm(x))` for block `layer_idx`'s `branch`.
    fn residual(&self, layer_idx: usize, branch: Branch, x: &Tensor) -> Tensor {
        x + self.branch(layer_idx, branch, &self.norm(Norm::before(layer_idx, branch), x))
    }

    /// Whether [`Model::block_by_hand`] may run whole blocks outside libtorch's graph (the block
    /// executor then keeps each block its own segment, not chained to the next).
    fn blocks_by_hand(&self) -> bool {
        false
    }

    /// Block `layer_idx` whole from its input `x` (fp32, detached) by hand, forward now and
    /// backward later with no graph over the block's body: its output and its backward; `None`
    /// runs the block through [`Model::residual`] in libtorch's graph.
    fn block_by_hand<'m>(&'m self, _layer_idx: usize, _x: &Tensor) -> Option<(Tensor, Box<dyn BlockBackward + 'm>)> {
        None
    }

    /// The head's loss for the block executor's backward, which starts from `loss x
    /// loss_multiplier`. `normed`: `x` is already the final norm's output (by hand).
    fn head_loss_for_backward(&self, x: &Tensor, normed: bool, inputs: &Inputs, loss_multiplier: f64) -> HeadLoss<'_>;

    /// The training loss of the micro-batch (a text model's mean cross-entropy) as one autograd
    /// graph (the executor runs the same functions unit by unit).
    fn loss(&self, inputs: &Inputs) -> Tensor;

    /// The figure evaluation reports on held-out data: the training loss unless the family says
    /// otherwise (a VLA model's action error after integrating its flow).
    fn eval_loss(&self, inputs: &Inputs) -> Tensor {
        self.loss(inputs)
    }

    /// Logits `[batch, seq, vocab]` (16-bit under 16-bit precision) of token rows, as one graph;
    /// None for a family whose head gives no token logits (vla).
    fn forward(&self, inputs: &Tensor) -> Option<Tensor>;

    /// The parts this model runs by hand; `None` runs everything in libtorch's graph.
    fn by_hand(&self) -> Option<&dyn ByHand> {
        None
    }

    /// Cuts the model over the ranks of `group` (tensor parallelism, see `tensor_parallel`): each
    /// rank keeps its part of every parameter by the family's [`Model::split_of`], and its
    /// branches and head run on their parts through [`ByHand`]. A family that declares no split
    /// refuses.
    fn split_tensor(&mut self, _group: Arc<TensorGroup>) -> Result<(), TrainError> {
        Err(TrainError::InvalidConfig {
            key: "dist.tensor",
            message: format!(
                "needs a model family whose blocks declare their split ({}); keep dist.tensor = 1",
                crate::config::TENSOR_PARALLEL_FAMILIES.join(", ")
            ),
        })
    }

    /// How parameter `name` is cut over a tensor-parallel group.
    fn split_of(&self, _name: &str) -> Split {
        Split::Replicated
    }

    /// From now on a step's micro-batches interleave: a pipeline stage runs a later micro-batch's
    /// forward before an earlier one's backward. A family that keeps per-block state from a
    /// forward to its backward (the GPT's 16-bit leaves, one per weight) stops keeping it.
    fn interleave_micro_batches(&mut self) {}

    /// Whether the head's matrix is the embedding's (unit 0's) weights: a pipeline's end stages
    /// then share them. GPT-2's convention; an untied family says no.
    fn head_ties_embedding(&self) -> bool {
        true
    }

    /// The tensor-parallel group the model is cut over, once [`Model::split_tensor`] ran.
    fn tensor_group(&self) -> Option<&Arc<TensorGroup>> {
        None
    }

    /// After `split_tensor`: the blocks pass pieces of the sequence (`dist.sequence_parallel`;
    /// every family that declares its split runs it, through `models::tensor_parallel`).
    fn enable_sequence_parallel(&mut self) -> Result<(), TrainError> {
        let invalid = |message: String| TrainError::InvalidConfig { key: "dist.sequence_parallel", message };
        match self.tensor_group() {
            Some(group) => {
                group.enable_sequence(self.shape().seq_len).map_err(|m| invalid(format!("is true, but {m}")))
            }
            None => {
                Err(invalid("is true, but the model is not cut by dist.tensor (gpt, gpt-rms and llama cut it)".into()))
            }
        }
    }

    /// The group the sequence is cut over once sequence parallelism is on (None: off).
    fn sequence_group(&self) -> Option<&Arc<TensorGroup>> {
        self.tensor_group().filter(|group| group.sequence())
    }

    /// Under sequence parallelism, whether parameter `name`'s gradient on this rank is its share
    /// of the sequence's, summed over the group: every parameter used on the pieces, the
    /// replicated ones but the position embedding (added before the sequence is cut).
    fn gradient_is_a_share(&self, name: &str) -> bool {
        self.sequence_group().is_some() && !self.split_of(name).is_split() && !name.contains(".wpe.")
    }
}
