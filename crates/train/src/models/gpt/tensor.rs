//! The GPT cut over a tensor-parallel group (`dist.tensor`, Megatron-LM's split; see
//! `models::tensor_parallel`): attention's q, k and v weights and biases and the MLP's first
//! matrix and bias by output rows, both second matrices by input columns with their biases
//! replicated and added once after the sum over the group, the token embedding (and so the tied
//! head) by vocabulary rows; LayerNorms and the position embedding replicated. Cut, every branch
//! runs as a core by hand between `f` and `g`, and the head through the vocabulary-parallel
//! cross-entropy. The Rust kernels and unit casts are switched off (they assume whole weights);
//! the step's kept casts stay.

use std::sync::Arc;

use tch::{Kind, Tensor};

use super::parts::{handles, Gpt, Slot};
use crate::models::tensor_group::TensorGroup;
use crate::models::tensor_parallel::{nanogpt_split, Cut};
use crate::models::{CoreBackward, HeadLoss};
use crate::TrainError;

impl Gpt {
    /// Cuts the model over `group` (`Model::split_tensor`): each rank keeps its parts, and the
    /// kernels and unit casts that assume whole weights are off.
    pub(super) fn split_tensor(&mut self, group: Arc<TensorGroup>) -> Result<(), TrainError> {
        let heads = [("model.n_head", self.shape.n_head)];
        let cut = Cut::params(&mut self.params, group, &nanogpt_split, self.shape.vocab_size, &heads)?;
        (self.wte, self.wpe, self.ln_f, self.blocks) = handles(&self.params, self.shape.n_layer);
        self.fused_cross_entropy_threads = 0;
        self.fused_layer_norm_threads = 0;
        self.fused_softmax_threads = 0;
        self.fused_bias_gelu_threads = 0;
        self.unit_casts = false;
        self.end_step_casts();
        self.tensor = Some(cut);
        Ok(())
    }

    /// A row-parallel linear layer (attention's output projection, the MLP's second): cut, the
    /// partial product summed over the group (`g`), then the replicated bias, once; otherwise
    /// the plain linear layer.
    pub(super) fn row_parallel(&self, x: &Tensor, slot: Slot, weight: &Tensor, bias: &Tensor) -> Tensor {
        let Some(cut) = &self.tensor else { return self.linear(x, slot, weight, Some(bias)) };
        let partial = self.linear(x, slot, weight, None);
        let bias = if self.compute == Kind::Float { bias.shallow_clone() } else { self.cast(slot.bias(), bias) };
        cut.reduced(&partial) + bias
    }

    /// Cut: block `layer_idx`'s `branch` from `f`'s leaf of `normed` (`ByHand::branch_core`).
    pub(super) fn cut_branch<'m>(
        &'m self,
        layer_idx: usize,
        branch: crate::models::Branch,
        normed: &Tensor,
    ) -> Option<(Tensor, Box<dyn CoreBackward + 'm>)> {
        let cut = self.tensor.as_ref()?;
        Some(cut.branch(normed, |leaf| crate::models::Model::branch(self, layer_idx, branch, leaf)))
    }

    /// Cut: the vocabulary-parallel head from `f`'s leaf of the final norm's output, the leaf's
    /// gradient summed over the group before the norm's backward.
    pub(super) fn cut_head(
        &self,
        x: &Tensor,
        normed: bool,
        targets: &Tensor,
        loss_multiplier: f64,
    ) -> Option<HeadLoss<'_>> {
        let cut = self.tensor.as_ref()?;
        let normed = if normed { x.shallow_clone() } else { self.layer_norm(x, &self.ln_f) };
        Some(
            cut.head(&normed, loss_multiplier, |leaf| self.mean_cross_entropy(&self.head_logits_normed(leaf), targets)),
        )
    }
}
