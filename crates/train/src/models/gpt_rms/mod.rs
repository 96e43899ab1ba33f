//! The GPT with RMSNorm and no biases (`model.family = "gpt-rms"`): the GPT's token and position
//! embeddings, pre-norm blocks of causal self-attention (libtorch's scaled_dot_product_attention)
//! and a GELU MLP, a final norm and a head tied to the token embedding, but every norm an RMSNorm
//! with a scale and no shift, and no linear layer with a bias. Everything runs in libtorch's
//! graph: this family has no part by hand and keeps no casts across micro-batches. Parameter
//! names follow nanoGPT's with `bias=False` (an RMSNorm's scale is its `ln_*.weight`).
//!
//! Its blocks declare their tensor-parallel split (`Model::split_of`): attention's q, k and v and
//! the MLP's first matrix by output rows, both second matrices by input columns, the token
//! embedding (and so the tied head) by vocabulary rows. Cut over a group, it runs each branch
//! on its heads or inner slice between the `f` and `g` of `tensor_parallel`, through `ByHand`.

use std::sync::Arc;

use tch::{Device, Kind, Tensor};

use crate::config::{GptShape, Precision};
use crate::kernels::LayerNormStats;
use crate::models::embedding::{embed, embedding_unit, with_positions};
use crate::models::tensor_group::{Split, TensorGroup};
use crate::models::tensor_parallel::{nanogpt_split, Cut};
use crate::models::{Branch, BranchBackward, ByHand, CoreBackward, HeadLoss, Inputs, Model, Norm};
use crate::params::{FlatParams, Init, ParamSpec, UnitSpec};
use crate::precision::compute_kind;

/// The epsilon of LLaMA's and T5's RMSNorm.
const RMS_NORM_EPS: f64 = 1e-6;

/// The planner's description of this family at `shape` (`models::plan_model`): the GPT's, with
/// no biases and norms that hold a scale only.
pub(crate) fn plan_model(shape: GptShape) -> stoke_plan::ModelConfig {
    let gpt = stoke_plan::ModelConfig::gpt(shape.n_layer, shape.d_model, shape.n_head, shape.seq_len, shape.vocab_size);
    stoke_plan::ModelConfig { flash_attention: true, biases: false, ..gpt }
}

pub struct GptRms {
    shape: GptShape,
    params: FlatParams,
    /// Element type of the matrix multiplies (see `precision::compute_kind`).
    compute: Kind,
    /// Handles to the parameters, resolved once from `params` (they share its storage).
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<BlockParams>,
    ln_f: Tensor,
    /// The MLP's GELU is the tanh approximation (`model.gelu = "tanh"`).
    tanh_gelu: bool,
    /// Once cut (`Model::split_tensor`).
    tensor: Option<Cut>,
}

/// One block's parameters.
struct BlockParams {
    ln_1: Tensor,
    attn_w: Tensor,
    attn_proj_w: Tensor,
    ln_2: Tensor,
    fc_w: Tensor,
    mlp_proj_w: Tensor,
}

fn block_names(layer_idx: usize) -> [String; 6] {
    let p = format!("transformer.h.{layer_idx}");
    [
        format!("{p}.ln_1.weight"),
        format!("{p}.attn.c_attn.weight"),
        format!("{p}.attn.c_proj.weight"),
        format!("{p}.ln_2.weight"),
        format!("{p}.mlp.c_fc.weight"),
        format!("{p}.mlp.c_proj.weight"),
    ]
}

/// The handles a model keeps to its parameters (they share `params`' storage).
fn handles(params: &FlatParams, n_layer: usize) -> (Tensor, Tensor, Tensor, Vec<BlockParams>) {
    let get = |name: &str| params.get(name).shallow_clone();
    let blocks = (0..n_layer)
        .map(|layer_idx| {
            let n = block_names(layer_idx);
            BlockParams {
                ln_1: get(&n[0]),
                attn_w: get(&n[1]),
                attn_proj_w: get(&n[2]),
                ln_2: get(&n[3]),
                fc_w: get(&n[4]),
                mlp_proj_w: get(&n[5]),
            }
        })
        .collect();
    (get("transformer.wte.weight"), get("transformer.wpe.weight"), get("transformer.ln_f.weight"), blocks)
}

impl GptRms {
    /// A freshly initialized model (the GPT's init: N(0, 0.02), residual projections scaled by
    /// 1/sqrt(2·n_layer), norm scales at one). Seed libtorch first for a reproducible init. The
    /// flat buffers are laid out unit by unit: the embedding (wte, wpe), each block, then the
    /// final norm.
    pub fn new(shape: GptShape, precision: Precision, device: Device) -> GptRms {
        let d = shape.d_model as i64;
        let std = 0.02;
        let proj_std = 0.02 / (2.0 * shape.n_layer as f64).sqrt();
        let spec = |name: String, shape: &[i64], init: Init, decay: bool| ParamSpec {
            name,
            shape: shape.to_vec(),
            init,
            decay,
        };
        let mut units = vec![embedding_unit(shape, std)];
        for layer_idx in 0..shape.n_layer {
            let [ln_1, attn_w, attn_proj_w, ln_2, fc_w, mlp_proj_w] = block_names(layer_idx);
            units.push(UnitSpec {
                name: format!("transformer.h.{layer_idx}"),
                params: vec![
                    spec(ln_1, &[d], Init::Ones, false),
                    spec(attn_w, &[3 * d, d], Init::Normal { std }, true),
                    spec(attn_proj_w, &[d, d], Init::Normal { std: proj_std }, true),
                    spec(ln_2, &[d], Init::Ones, false),
                    spec(fc_w, &[4 * d, d], Init::Normal { std }, true),
                    spec(mlp_proj_w, &[d, 4 * d], Init::Normal { std: proj_std }, true),
                ],
            });
        }
        units.push(UnitSpec {
            name: "head".into(),
            params: vec![spec("transformer.ln_f.weight".into(), &[d], Init::Ones, false)],
        });
        let params = FlatParams::new(units, device);
        let (wte, wpe, ln_f, blocks) = handles(&params, shape.n_layer);
        GptRms {
            shape,
            wte,
            wpe,
            ln_f,
            blocks,
            params,
            compute: compute_kind(precision),
            tanh_gelu: false,
            tensor: None,
        }
    }

    /// The MLP's GELU as the tanh approximation (`model.gelu = "tanh"`) instead of the exact one.
    pub fn set_tanh_gelu(&mut self, enabled: bool) {
        self.tanh_gelu = enabled;
    }

    /// A linear layer without bias in the compute type: under 16-bit precision the input and
    /// the weight are cast for the multiply (what autocast does), and the result stays 16-bit.
    fn linear(&self, x: &Tensor, weight: &Tensor) -> Tensor {
        if self.compute == Kind::Float {
            return x.linear(weight, None::<&Tensor>);
        }
        x.to_kind(self.compute).linear(&weight.to_kind(self.compute), None::<&Tensor>)
    }

    /// RMSNorm in fp32: `x / sqrt(mean(x^2) + eps) * scale` over the last dimension.
    fn rms_norm(&self, x: &Tensor, scale: &Tensor) -> Tensor {
        let x = x.to_kind(Kind::Float);
        let mean_square = x.square().mean_dim([-1i64].as_slice(), true, Kind::Float);
        x * (mean_square + RMS_NORM_EPS).rsqrt() * scale
    }

    /// A row-parallel matrix's partial output summed over the group (`g`); itself when not cut.
    fn reduced(&self, partial: Tensor) -> Tensor {
        match &self.tensor {
            Some(cut) => cut.reduced(&partial),
            None => partial,
        }
    }

    fn attention(&self, layer_idx: usize, h: &Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        let (batch, seq, d) = h.size3().expect("activations are [batch, seq, d]");
        let head_dim = d / self.shape.n_head as i64;
        // This rank's heads (all of them when not cut).
        let n_head = self.tensor.as_ref().map_or(self.shape.n_head as i64, |cut| cut.local(self.shape.n_head));
        let d = n_head * head_dim;
        let qkv = self.linear(h, &block.attn_w);
        let parts = qkv.split(d, 2);
        let heads = |t: &Tensor| t.view([batch, seq, n_head, head_dim]).transpose(1, 2);
        let (q, k, v) = (heads(&parts[0]), heads(&parts[1]), heads(&parts[2]));
        let y = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, true, None, false);
        let y = y.transpose(1, 2).contiguous().view([batch, seq, d]);
        self.reduced(self.linear(&y, &block.attn_proj_w))
    }

    fn mlp(&self, layer_idx: usize, h: &Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        let inner = self.linear(h, &block.fc_w).gelu(if self.tanh_gelu { "tanh" } else { "none" });
        self.reduced(self.linear(&inner, &block.mlp_proj_w))
    }

    /// The mean cross-entropy of the head on `normed` (the final norm's output); cut, on this
    /// rank's vocabulary rows.
    fn cross_entropy(&self, normed: &Tensor, targets: &Tensor) -> Tensor {
        let logits = self.linear(normed, &self.wte).to_kind(Kind::Float);
        match &self.tensor {
            Some(cut) => cut.cross_entropy(&logits, targets),
            None => logits.view([-1, self.shape.vocab_size as i64]).cross_entropy_for_logits(&targets.view([-1])),
        }
    }

    fn head_loss(&self, x: &Tensor, targets: &Tensor) -> Tensor {
        self.cross_entropy(&self.rms_norm(x, &self.ln_f), targets)
    }

    fn embed_tokens(&self, inputs: &Tensor) -> Tensor {
        match &self.tensor {
            Some(cut) => with_positions(cut.embedding(&self.wte, inputs), &self.wpe, inputs),
            None => embed(&self.wte, &self.wpe, inputs),
        }
    }

    fn trunk(&self, inputs: &Tensor) -> Tensor {
        let mut x = self.embed_tokens(inputs);
        for layer_idx in 0..self.shape.n_layer {
            x = self.residual(layer_idx, Branch::Attention, &x);
            x = self.residual(layer_idx, Branch::Mlp, &x);
        }
        x
    }
}

impl Model for GptRms {
    fn shape(&self) -> GptShape {
        self.shape
    }

    fn params(&self) -> &FlatParams {
        &self.params
    }

    fn params_mut(&mut self) -> &mut FlatParams {
        &mut self.params
    }

    fn n_params(&self) -> usize {
        let (d, n_layer) = (self.shape.d_model, self.shape.n_layer);
        let per_block = 2 * d + 3 * d * d + d * d + 4 * d * d + 4 * d * d;
        self.shape.vocab_size * d + self.shape.seq_len * d + n_layer * per_block + d
    }

    /// 6N for the matrix multiplies plus 12·L·d·T for attention (PaLM, appendix B), with N
    /// excluding the position embedding, as the GPT's; a frozen matrix (`train.freeze`) costs 4
    /// per weight, not 6 (no gradient of its own in the backward).
    fn flops_per_token(&self) -> f64 {
        let shape = self.shape;
        let n = (self.n_params() - shape.seq_len * shape.d_model) as f64;
        let frozen_matmul: i64 = self
            .params
            .frozen_entries()
            .iter()
            .filter(|e| e.shape.len() == 2 && e.name != "transformer.wpe.weight")
            .map(|e| e.numel)
            .sum();
        6.0 * n - 2.0 * frozen_matmul as f64 + 12.0 * (shape.n_layer * shape.d_model * shape.seq_len) as f64
    }

    fn embed(&self, inputs: &Inputs) -> Tensor {
        self.embed_tokens(&inputs.tokens)
    }

    fn norm(&self, which: Norm, x: &Tensor) -> Tensor {
        let scale = match which {
            Norm::Attention(layer_idx) => &self.blocks[layer_idx].ln_1,
            Norm::Mlp(layer_idx) => &self.blocks[layer_idx].ln_2,
            Norm::Final => &self.ln_f,
        };
        self.rms_norm(x, scale)
    }

    fn branch(&self, layer_idx: usize, branch: Branch, normed: &Tensor) -> Tensor {
        match branch {
            Branch::Attention => self.attention(layer_idx, normed),
            Branch::Mlp => self.mlp(layer_idx, normed),
        }
    }

    fn head_loss_for_backward(&self, x: &Tensor, normed: bool, inputs: &Inputs, loss_multiplier: f64) -> HeadLoss<'_> {
        debug_assert!(!normed, "gpt-rms runs no norm by hand");
        match &self.tensor {
            // Cut: the vocabulary-parallel head from `f`'s leaf, the leaf's gradient summed
            // over the group before the final norm's backward.
            Some(cut) => cut
                .head(&self.rms_norm(x, &self.ln_f), loss_multiplier, |leaf| self.cross_entropy(leaf, &inputs.targets)),
            None => HeadLoss { loss: self.head_loss(x, &inputs.targets), by_hand: None },
        }
    }

    fn loss(&self, inputs: &Inputs) -> Tensor {
        self.head_loss(&self.trunk(&inputs.tokens), &inputs.targets)
    }

    /// The logits; None when cut (each rank holds its vocabulary rows' only).
    fn forward(&self, inputs: &Tensor) -> Option<Tensor> {
        if self.tensor.is_some() {
            return None;
        }
        Some(self.linear(&self.rms_norm(&self.trunk(inputs), &self.ln_f), &self.wte))
    }

    fn by_hand(&self) -> Option<&dyn ByHand> {
        self.tensor.as_ref().map(|_| self as &dyn ByHand)
    }

    fn split_tensor(&mut self, group: Arc<TensorGroup>) -> Result<(), crate::TrainError> {
        let heads = [("model.n_head", self.shape.n_head)];
        let cut = Cut::params(&mut self.params, group, &nanogpt_split, self.shape.vocab_size, &heads)?;
        (self.wte, self.wpe, self.ln_f, self.blocks) = handles(&self.params, self.shape.n_layer);
        self.tensor = Some(cut);
        Ok(())
    }

    fn split_of(&self, name: &str) -> Split {
        nanogpt_split(name)
    }

    fn tensor_group(&self) -> Option<&Arc<TensorGroup>> {
        self.tensor.as_ref().map(|cut| &cut.group)
    }
}

/// Cut over a group, every branch runs as a core by hand: `f` (`copy_to_ranks`) before it, its
/// heads or inner slice in libtorch's graph, `g` inside it. The norms stay in the graph.
impl ByHand for GptRms {
    fn norms(&self) -> bool {
        false
    }

    fn branch(&self, _branch: Branch) -> bool {
        self.tensor.is_some()
    }

    fn norm(&self, _which: Norm, _x: &Tensor) -> Option<(Tensor, LayerNormStats)> {
        None
    }

    fn norm_backward(&self, _: Norm, _: &Tensor, _: &Tensor, _: &LayerNormStats, _: Option<Tensor>) -> Tensor {
        unreachable!("gpt-rms runs no norm by hand")
    }

    fn branch_core<'m>(
        &'m self,
        layer_idx: usize,
        branch: Branch,
        normed: &Tensor,
    ) -> (Tensor, Box<dyn CoreBackward + 'm>) {
        let cut = self.tensor.as_ref().expect("a branch runs by hand only when cut");
        cut.branch(normed, |leaf| Model::branch(self, layer_idx, branch, leaf))
    }

    fn branch_whole<'m>(&'m self, _: usize, _: Branch, _: &Tensor) -> (Tensor, Box<dyn BranchBackward + 'm>) {
        unreachable!("gpt-rms runs no norm by hand, so no whole branch")
    }
}
