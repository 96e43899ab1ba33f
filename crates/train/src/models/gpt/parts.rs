//! The GPT's state: the struct and the plain types its fields hold (the attention variant, the
//! slots of kept casts, a block's parameter handles). Behaviour lives in the files beside it
//! (`mod.rs` the model and its forward, `attention.rs`, `casts.rs`, `by_hand.rs`), which all read
//! this one, so none of them imports another in a loop.

use std::cell::RefCell;

use tch::{Kind, Tensor};

use crate::config::GptShape;
use crate::models::tensor_parallel::Cut;
use crate::params::FlatParams;

pub struct Gpt {
    pub(super) shape: GptShape,
    pub(super) params: FlatParams,
    /// Element type of the matrix multiplies (see `precision::compute_kind`).
    pub(super) compute: Kind,
    pub(super) attention: Attention,
    /// Handles to the parameters, resolved once from `params` (they share its storage).
    pub(super) wte: Tensor,
    pub(super) wpe: Tensor,
    pub(super) blocks: Vec<BlockParams>,
    pub(super) ln_f: (Tensor, Tensor),
    /// `[seq_len, seq_len]` additive causal mask in the compute type, for `Attention::Math`.
    pub(super) causal_mask: Option<Tensor>,
    /// Threads of the fused cross-entropy kernel; 0 leaves the loss to libtorch's ops (see
    /// `set_fused_cross_entropy`).
    pub(super) fused_cross_entropy_threads: usize,
    /// Threads of the fused LayerNorm kernels; 0 leaves the norms to libtorch's ops (see
    /// `set_fused_layer_norm`).
    pub(super) fused_layer_norm_threads: usize,
    /// Query rows per block of `Attention::Math`; 0 takes the whole context at once (see
    /// `set_causal_block_rows`).
    pub(super) causal_block_rows: usize,
    /// Threads of the causal softmax kernel; 0 leaves the attention's core to libtorch's ops and
    /// autograd (see `set_fused_softmax`).
    pub(super) fused_softmax_threads: usize,
    /// Threads of the bias + GELU kernels; 0 leaves the MLP's first bias and GELU to libtorch's
    /// ops and autograd (see `set_fused_bias_gelu`).
    pub(super) fused_bias_gelu_threads: usize,
    /// The MLP's GELU is the tanh approximation (GPT-2's `gelu_new`; see `set_tanh_gelu`).
    pub(super) tanh_gelu: bool,
    /// The weights and biases cast to the compute type, made at their first use in a step and
    /// reused by its later micro-batches (see `begin_step_casts`); indexed by `Slot`.
    pub(super) casts: RefCell<Vec<Option<Tensor>>>,
    /// Whether this step keeps its casts for reuse.
    pub(super) reuse_casts: bool,
    /// Whether the linear layers take 16-bit leaves cut from one cast of their block (see
    /// `set_unit_casts`).
    pub(super) unit_casts: bool,
    /// With `unit_casts`: each block's parameters in the compute type, cast in one op at the
    /// block's first forward with autograd in a step; indexed by layer.
    pub(super) block_casts: RefCell<Vec<Option<Tensor>>>,
    /// With `unit_casts`: the 16-bit leaves a forward with autograd handed the linear layers,
    /// until `add_cast_grads` adds their gradients into the fp32 buffer; indexed by `Slot`.
    pub(super) leaves: RefCell<Vec<Option<Tensor>>>,
    /// Once cut over a tensor-parallel group (`Model::split_tensor`, see `tensor.rs`).
    pub(super) tensor: Option<Cut>,
}

/// libtorch's default, nanoGPT's and GPT-2's.
pub(super) const LAYER_NORM_EPS: f64 = 1e-5;

/// Block `layer_idx`'s parameter names, nanoGPT's, in the unit's order.
pub(super) fn block_names(layer_idx: usize) -> [String; 12] {
    let p = format!("transformer.h.{layer_idx}");
    [
        format!("{p}.ln_1.weight"),
        format!("{p}.ln_1.bias"),
        format!("{p}.attn.c_attn.weight"),
        format!("{p}.attn.c_attn.bias"),
        format!("{p}.attn.c_proj.weight"),
        format!("{p}.attn.c_proj.bias"),
        format!("{p}.ln_2.weight"),
        format!("{p}.ln_2.bias"),
        format!("{p}.mlp.c_fc.weight"),
        format!("{p}.mlp.c_fc.bias"),
        format!("{p}.mlp.c_proj.weight"),
        format!("{p}.mlp.c_proj.bias"),
    ]
}

/// The handles a model keeps to its parameters (they share `params`' storage): wte, wpe, the
/// final norm's and every block's.
pub(super) type Handles = (Tensor, Tensor, (Tensor, Tensor), Vec<BlockParams>);

/// Resolves [`Handles`] from `params`, at construction and again once the model is cut.
pub(super) fn handles(params: &FlatParams, n_layer: usize) -> Handles {
    let get = |name: &str| params.get(name).shallow_clone();
    let blocks = (0..n_layer)
        .map(|layer_idx| {
            let n = block_names(layer_idx);
            BlockParams {
                ln_1: (get(&n[0]), get(&n[1])),
                attn_w: get(&n[2]),
                attn_b: get(&n[3]),
                attn_proj_w: get(&n[4]),
                attn_proj_b: get(&n[5]),
                ln_2: (get(&n[6]), get(&n[7])),
                fc_w: get(&n[8]),
                fc_b: get(&n[9]),
                mlp_proj_w: get(&n[10]),
                mlp_proj_b: get(&n[11]),
            }
        })
        .collect();
    let ln_f = (get("transformer.ln_f.weight"), get("transformer.ln_f.bias"));
    (get("transformer.wte.weight"), get("transformer.wpe.weight"), ln_f, blocks)
}

/// One block's parameters.
pub(super) struct BlockParams {
    pub(super) ln_1: (Tensor, Tensor),
    pub(super) attn_w: Tensor,
    pub(super) attn_b: Tensor,
    pub(super) attn_proj_w: Tensor,
    pub(super) attn_proj_b: Tensor,
    pub(super) ln_2: (Tensor, Tensor),
    pub(super) fc_w: Tensor,
    pub(super) fc_b: Tensor,
    pub(super) mlp_proj_w: Tensor,
    pub(super) mlp_proj_b: Tensor,
}

/// How a block computes causal self-attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Attention {
    /// libtorch's scaled_dot_product_attention, q, k and v cast to this element type.
    Sdpa(Kind),
    /// Explicit batched matrix multiplies in this 16-bit type: scores (with an additive causal
    /// mask), softmax (fp32 inside, 16-bit out), probabilities times v.
    Math(Kind),
}

/// Where a cast weight or bias is kept in `Gpt::casts`: block `layer_idx`'s linear layers in
/// forward order, a weight then its bias (8 per block), then the head's tied embedding.
#[derive(Clone, Copy)]
pub(super) struct Slot(pub(super) usize);

impl Slot {
    pub(super) const PER_BLOCK: usize = 8;
    pub(super) const ATTN: usize = 0;
    pub(super) const ATTN_PROJ: usize = 2;
    pub(super) const FC: usize = 4;
    pub(super) const MLP_PROJ: usize = 6;

    /// The weight of linear layer `layer` (one of the constants) of block `layer_idx`.
    pub(super) fn weight(layer_idx: usize, layer: usize) -> Slot {
        Slot(layer_idx * Slot::PER_BLOCK + layer)
    }

    pub(super) fn bias(self) -> Slot {
        Slot(self.0 + 1)
    }

    pub(super) fn head(n_layer: usize) -> Slot {
        Slot(n_layer * Slot::PER_BLOCK)
    }

    /// The block of a block's slot; `None` for the head's.
    pub(super) fn layer(self, n_layer: usize) -> Option<usize> {
        (self.0 < n_layer * Slot::PER_BLOCK).then_some(self.0 / Slot::PER_BLOCK)
    }

    /// The index of the slot's parameter among its block's, in `block_names` order.
    pub(super) fn param_in_block(self) -> usize {
        // ln_1's two parameters come first, and ln_2's two sit between the attention's and the MLP's.
        const PARAM: [usize; Slot::PER_BLOCK] = [2, 3, 4, 5, 8, 9, 10, 11];
        PARAM[self.0 % Slot::PER_BLOCK]
    }
}
