//! The Llama family (`model.family = "llama"`): a token embedding without positions, pre-norm
//! blocks of causal self-attention with rotary position embeddings and grouped-query attention
//! (`n_kv_head` key/value heads shared by groups of query heads) and a SwiGLU MLP (gate, up and
//! down projections), RMSNorms with a scale only, no biases anywhere, a final norm and a head tied
//! to the embedding or not. Everything runs in libtorch's graph, but on a CPU the blocks'
//! RMSNorms (`train.fused_layer_norm`): a Rust kernel from the fp32 residual stream straight into
//! the compute type, with its backward by hand (`kernels::rms_norm_bf16`, through the block
//! executor's `ByHand` norms).
//!
//! Parameter names are Hugging Face's `LlamaForCausalLM` names (`model.layers.0.self_attn.q_proj.
//! weight`, ...), so checkpoints, adapters and exports need no renaming, and LoRA target globs
//! written for transformers' models match stoke's. LoRA adapters (`[train.lora]`) sit beside the
//! linear layers they target under PEFT's names (`...q_proj.lora_A.weight`), in the same unit.
//!
//! Its blocks declare their tensor-parallel split (`Model::split_of`, as gpt-rms): q, k and v by
//! heads (query and key/value heads alike), gate and up by rows, o and down by columns, the
//! embedding and head by vocabulary rows; cut, the RMSNorms stay in libtorch's graph.

mod by_hand;
mod rope;

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use tch::{Device, Kind, Tensor};

use crate::config::{GptShape, LlamaShape, LoraConfig, Precision};
use crate::kernels::LayerNormStats;
use crate::models::tensor_group::{Split, TensorGroup};
use crate::models::tensor_parallel::Cut;
use crate::models::{Branch, BranchBackward, ByHand, CoreBackward, HeadLoss, Inputs, Model, Norm};
use crate::params::{FlatParams, Init, ParamSpec, UnitSpec};
use crate::precision::compute_kind;

/// The planner's description of this family at `shape` (`models::plan_model`).
pub(crate) fn plan_model(shape: &LlamaShape) -> stoke_plan::ModelConfig {
    let base = shape.base;
    stoke_plan::ModelConfig {
        n_layer: base.n_layer,
        d_model: base.d_model,
        n_head: base.n_head,
        n_kv_head: shape.n_kv_head,
        seq_len: base.seq_len,
        vocab_size: base.vocab_size,
        ffn_hidden: shape.ffn_hidden,
        gated_mlp: true,
        learned_positions: false,
        tied_embeddings: shape.tie_head,
        biases: false,
        flash_attention: true,
        ..stoke_plan::ModelConfig::default()
    }
}

/// The token embedding's name; the head's matrix when tied.
const EMBED: &str = "model.embed_tokens.weight";
const FINAL_NORM: &str = "model.norm.weight";
const HEAD: &str = "lm_head.weight";

pub struct Llama {
    shape: LlamaShape,
    params: FlatParams,
    /// Element type of the matrix multiplies (see `precision::compute_kind`).
    compute: Kind,
    /// Handles to the parameters, resolved once from `params` (they share its storage).
    embed_tokens: Tensor,
    blocks: Vec<BlockParams>,
    norm: Tensor,
    /// The head's matrix: `embed_tokens` itself when tied.
    lm_head: Tensor,
    /// The rotary tables `[seq_len, head_dim]`, fp32 (constants, not parameters).
    cos: Tensor,
    sin: Tensor,
    /// The LoRA adapters' scale, alpha / rank.
    lora_scale: f64,
    /// Threads of the blocks' RMSNorm kernel; 0 keeps libtorch's ops (`set_fused_rms_norm`).
    fused_norm_threads: usize,
    /// With the norms by hand under bf16, the branches too (`set_branches_by_hand`).
    branches_by_hand: bool,
    /// Threads of the fused cross-entropy; 0 keeps libtorch's ops (`set_fused_cross_entropy`).
    fused_ce_threads: usize,
    /// Frozen weights in the compute type, cast once (`compute_weights`): by the first weight's
    /// address and the number stacked, with the weights' version counters at the cast.
    frozen_casts: RefCell<HashMap<(usize, usize), (Vec<i64>, Tensor)>>,
    /// Once cut (`Model::split_tensor`).
    tensor: Option<Cut>,
}

/// A linear layer without bias, with its LoRA adapter when it has one.
struct Linear {
    weight: Tensor,
    /// `A` `[rank, in]` and `B` `[out, rank]`.
    lora: Option<(Tensor, Tensor)>,
}

/// One block's parameters.
struct BlockParams {
    input_layernorm: Tensor,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    post_attention_layernorm: Tensor,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

/// The names of the adapter of the linear layer whose weight is `weight_name`.
pub(crate) fn adapter_names(weight_name: &str) -> (String, String) {
    let module = weight_name.strip_suffix(".weight").unwrap_or(weight_name);
    (format!("{module}.lora_A.weight"), format!("{module}.lora_B.weight"))
}

/// Whether `name` is a LoRA adapter's parameter.
pub(crate) fn is_adapter(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// Block `layer_idx`'s parameter names, in the order `BlockParams` holds them.
fn block_names(layer_idx: usize) -> [String; 9] {
    let p = format!("model.layers.{layer_idx}");
    [
        format!("{p}.input_layernorm.weight"),
        format!("{p}.self_attn.q_proj.weight"),
        format!("{p}.self_attn.k_proj.weight"),
        format!("{p}.self_attn.v_proj.weight"),
        format!("{p}.self_attn.o_proj.weight"),
        format!("{p}.post_attention_layernorm.weight"),
        format!("{p}.mlp.gate_proj.weight"),
        format!("{p}.mlp.up_proj.weight"),
        format!("{p}.mlp.down_proj.weight"),
    ]
}

/// The handles a model keeps to its parameters (they share `params`' storage): the embedding,
/// the final norm, the head's matrix and the blocks'.
fn handles(params: &FlatParams, shape: &LlamaShape) -> (Tensor, Tensor, Tensor, Vec<BlockParams>) {
    let get = |name: &str| params.get(name).shallow_clone();
    let declared = |name: &str| params.entries().iter().any(|e| e.name == name);
    let linear = |name: &str| {
        let (a, b) = adapter_names(name);
        Linear { weight: get(name), lora: declared(&a).then(|| (get(&a), get(&b))) }
    };
    let blocks = (0..shape.base.n_layer)
        .map(|layer_idx| {
            let n = block_names(layer_idx);
            BlockParams {
                input_layernorm: get(&n[0]),
                q_proj: linear(&n[1]),
                k_proj: linear(&n[2]),
                v_proj: linear(&n[3]),
                o_proj: linear(&n[4]),
                post_attention_layernorm: get(&n[5]),
                gate_proj: linear(&n[6]),
                up_proj: linear(&n[7]),
                down_proj: linear(&n[8]),
            }
        })
        .collect();
    (get(EMBED), get(FINAL_NORM), get(if shape.tie_head { EMBED } else { HEAD }), blocks)
}

/// How parameter `name` is cut over a tensor-parallel group (see the module doc).
fn split_of(name: &str) -> Split {
    let rows = [EMBED, HEAD].contains(&name)
        || [".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".gate_proj.weight", ".up_proj.weight"]
            .iter()
            .any(|end| name.ends_with(end));
    if rows {
        Split::Rows { blocks: 1 }
    } else if name.ends_with(".o_proj.weight") || name.ends_with(".down_proj.weight") {
        Split::Cols { blocks: 1 }
    } else {
        Split::Replicated
    }
}

impl Llama {
    /// A freshly initialized model (transformers' init: N(0, 0.02) for matrices and the
    /// embedding, the residual projections `o_proj` and `down_proj` scaled by 1/sqrt(2·n_layer) as
    /// the GPT's, norm scales at one). Seed libtorch first for a reproducible init. The flat
    /// buffers are laid out unit by unit: the embedding, each block, then the final norm and an
    /// untied head.
    pub fn new(shape: LlamaShape, precision: Precision, device: Device) -> Llama {
        Llama::with_lora(shape, precision, &LoraConfig::default(), device)
    }

    /// `new` with the LoRA adapters `lora` asks for (none when its rank is 0) beside the block
    /// linear layers it targets; the caller freezes the base (`models::build_model`).
    pub fn with_lora(shape: LlamaShape, precision: Precision, lora: &LoraConfig, device: Device) -> Llama {
        let base = shape.base;
        let (d, kv, ffn, vocab) =
            (base.d_model as i64, shape.kv_dim() as i64, shape.ffn_hidden as i64, base.vocab_size as i64);
        let std = 0.02;
        let proj_std = 0.02 / (2.0 * base.n_layer.max(1) as f64).sqrt();
        let spec = |name: String, shape: &[i64], init: Init, decay: bool| ParamSpec {
            name,
            shape: shape.to_vec(),
            init,
            decay,
        };
        let mut units = vec![UnitSpec {
            name: "embedding".into(),
            params: vec![spec(EMBED.into(), &[vocab, d], Init::Normal { std }, true)],
        }];
        for layer_idx in 0..base.n_layer {
            let [ln_1, q, k, v, o, ln_2, gate, up, down] = block_names(layer_idx);
            let mut params = vec![
                spec(ln_1, &[d], Init::Ones, false),
                spec(q, &[d, d], Init::Normal { std }, true),
                spec(k, &[kv, d], Init::Normal { std }, true),
                spec(v, &[kv, d], Init::Normal { std }, true),
                spec(o, &[d, d], Init::Normal { std: proj_std }, true),
                spec(ln_2, &[d], Init::Ones, false),
                spec(gate, &[ffn, d], Init::Normal { std }, true),
                spec(up, &[ffn, d], Init::Normal { std }, true),
                spec(down, &[d, ffn], Init::Normal { std: proj_std }, true),
            ];
            if lora.enabled() {
                let rank = lora.rank as i64;
                let targeted: Vec<(String, i64, i64)> = params
                    .iter()
                    .filter(|p| p.shape.len() == 2 && lora.targets_weight(&p.name))
                    .map(|p| (p.name.clone(), p.shape[0], p.shape[1]))
                    .collect();
                for (name, out, inp) in targeted {
                    let (a, b) = adapter_names(&name);
                    let bound = 1.0 / (inp as f64).sqrt();
                    params.push(spec(a, &[rank, inp], Init::Uniform { bound }, true));
                    params.push(spec(b, &[out, rank], Init::Zeros, true));
                }
            }
            units.push(UnitSpec { name: format!("model.layers.{layer_idx}"), params });
        }
        let mut head = vec![spec(FINAL_NORM.into(), &[d], Init::Ones, false)];
        if !shape.tie_head {
            head.push(spec(HEAD.into(), &[vocab, d], Init::Normal { std }, true));
        }
        units.push(UnitSpec { name: "head".into(), params: head });
        let params = FlatParams::new(units, device);
        let (embed_tokens, norm, lm_head, blocks) = handles(&params, &shape);
        let (cos, sin) = rope::tables(&shape, device);
        Llama {
            shape,
            embed_tokens,
            norm,
            lm_head,
            blocks,
            params,
            compute: compute_kind(precision),
            cos,
            sin,
            lora_scale: if lora.enabled() { lora.scale() } else { 0.0 },
            fused_norm_threads: 0,
            branches_by_hand: false,
            fused_ce_threads: 0,
            frozen_casts: RefCell::new(HashMap::new()),
            tensor: None,
        }
    }

    /// Under bf16 with the norms by hand (`set_fused_rms_norm`), each block's attention and MLP
    /// branch whole by hand (`by_hand.rs`; `train.fused_branches`).
    pub fn set_branches_by_hand(&mut self, enabled: bool) {
        self.branches_by_hand = enabled;
    }

    /// Under bf16 on a CPU, the head's loss and the logits' gradient by the fused kernel
    /// (`kernels::cross_entropy_bf16`, on `n_threads` threads; `train.fused_cross_entropy`) and
    /// the head's products backward-ed by hand, instead of libtorch's cast, log-softmax and NLL.
    pub fn set_fused_cross_entropy(&mut self, enabled: bool, n_threads: usize) {
        self.fused_ce_threads = if enabled { n_threads.max(1) } else { 0 };
    }

    /// `weights` in the compute type stacked by rows, outside any graph: on a CPU frozen ones (a
    /// LoRA's base) cast once and kept while their values stay (their version counters), trained
    /// ones cast on each call. A bf16 copy of a frozen base costs half its fp32 bytes and saves a
    /// pass over every weight each micro-batch (`memory_fit` counts it).
    fn compute_weights(&self, weights: &[&Tensor]) -> Tensor {
        // Each weight cast straight into its rows of the stack: one pass, no concatenation.
        let cast = || {
            tch::no_grad(|| {
                if let [weight] = weights {
                    return weight.detach().to_kind(self.compute);
                }
                let rows: i64 = weights.iter().map(|w| w.size()[0]).sum();
                let cols = weights[0].size()[1];
                let stack = Tensor::empty([rows, cols], (self.compute, weights[0].device()));
                let mut at = 0;
                for w in weights {
                    let n = w.size()[0];
                    stack.narrow(0, at, n).copy_(w);
                    at += n;
                }
                stack
            })
        };
        // On a GPU, memory is the scarce resource: a frozen weight is cast on each call too.
        if weights.iter().any(|w| w.requires_grad()) || weights[0].device() != Device::Cpu {
            return cast();
        }
        let key = (weights[0].data_ptr() as usize, weights.len());
        let versions: Vec<i64> = weights.iter().map(|w| w.internal_version()).collect();
        let mut kept = self.frozen_casts.borrow_mut();
        if let Some((at, tensor)) = kept.get(&key) {
            if *at == versions {
                return tensor.shallow_clone();
            }
        }
        let tensor = cast();
        kept.insert(key, (versions, tensor.shallow_clone()));
        tensor
    }

    /// On a CPU, the block executor runs the blocks' RMSNorms as a Rust kernel that reads the
    /// fp32 residual stream and writes what the next linear layers take (bf16, or fp32), and their
    /// backward by hand with the residual's gradient added in the same pass
    /// (`kernels::rms_norm_bf16`, on `n_threads` threads; `train.fused_layer_norm`), instead of
    /// libtorch's square, mean, rsqrt, products and cast. `false` (the default of `new`) keeps
    /// libtorch's ops. The final norm stays libtorch's.
    pub fn set_fused_rms_norm(&mut self, enabled: bool, n_threads: usize) {
        self.fused_norm_threads = if enabled { n_threads.max(1) } else { 0 };
    }

    /// The blocks' norms by the kernel: not once cut (each branch is then a core by hand).
    fn fused_rms_norm(&self) -> bool {
        self.fused_norm_threads > 0
            && self.tensor.is_none()
            && matches!(self.compute, Kind::BFloat16 | Kind::Float)
            && self.embed_tokens.device() == Device::Cpu
    }

    /// The scale of block norm `which` (None for the final norm, which is not run by hand).
    fn block_norm_scale(&self, which: Norm) -> Option<&Tensor> {
        match which {
            Norm::Attention(layer_idx) => Some(&self.blocks[layer_idx].input_layernorm),
            Norm::Mlp(layer_idx) => Some(&self.blocks[layer_idx].post_attention_layernorm),
            Norm::Final => None,
        }
    }

    /// The llama-specific shape (key/value heads, MLP width, rotary settings).
    pub fn llama_shape(&self) -> LlamaShape {
        self.shape
    }

    /// A linear layer without bias in the compute type: under 16-bit precision the input and
    /// the weight are cast for the multiply (what autocast does), and the result stays 16-bit.
    /// A frozen weight's cast is the kept one (`compute_weights`).
    fn matmul(&self, x: &Tensor, weight: &Tensor) -> Tensor {
        if self.compute == Kind::Float {
            return x.linear(weight, None::<&Tensor>);
        }
        let weight =
            if weight.requires_grad() { weight.to_kind(self.compute) } else { self.compute_weights(&[weight]) };
        x.to_kind(self.compute).linear(&weight, None::<&Tensor>)
    }

    /// `layer` on `x`: `W x`, plus `scale B A x` when it has an adapter.
    fn linear(&self, x: &Tensor, layer: &Linear) -> Tensor {
        let base = self.matmul(x, &layer.weight);
        match &layer.lora {
            None => base,
            Some((a, b)) => base + self.matmul(&self.matmul(x, a), b) * self.lora_scale,
        }
    }

    /// RMSNorm in fp32: `x / sqrt(mean(x^2) + eps) * scale` over the last dimension.
    fn rms_norm(&self, x: &Tensor, scale: &Tensor) -> Tensor {
        let x = x.to_kind(Kind::Float);
        let mean_square = x.square().mean_dim([-1i64].as_slice(), true, Kind::Float);
        x * (mean_square + self.shape.norm_eps).rsqrt() * scale
    }

    /// Causal self-attention with rotary positions; each key/value head serves `n_head /
    /// n_kv_head` query heads.
    fn attention(&self, layer_idx: usize, h: &Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        let (batch, seq, d) = h.size3().expect("activations are [batch, seq, d]");
        let head_dim = d / self.shape.base.n_head as i64;
        // This rank's heads (all of them when not cut).
        let (n_head, n_kv_head) = match &self.tensor {
            Some(cut) => (cut.local(self.shape.base.n_head), cut.local(self.shape.n_kv_head)),
            None => (self.shape.base.n_head as i64, self.shape.n_kv_head as i64),
        };
        let heads = |t: Tensor, n: i64| t.view([batch, seq, n, head_dim]).transpose(1, 2);
        let q = rope::apply(&heads(self.linear(h, &block.q_proj), n_head), &self.cos, &self.sin);
        let k = rope::apply(&heads(self.linear(h, &block.k_proj), n_kv_head), &self.cos, &self.sin);
        let v = heads(self.linear(h, &block.v_proj), n_kv_head);
        // Each key/value head serves a group of query heads: SDPA's own grouping, which reads the
        // shared heads in place instead of repeating them (transformers' `repeat_kv`).
        let y = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, true, None, n_kv_head != n_head);
        let y = y.transpose(1, 2).contiguous().view([batch, seq, n_head * head_dim]);
        self.reduced(self.linear(&y, &block.o_proj))
    }

    /// A row-parallel matrix's partial output summed over the group (`g`); itself when not cut.
    fn reduced(&self, partial: Tensor) -> Tensor {
        match &self.tensor {
            Some(cut) => cut.reduced(&partial),
            None => partial,
        }
    }

    fn embed_tokens(&self, tokens: &Tensor) -> Tensor {
        match &self.tensor {
            Some(cut) => cut.embedding(&self.embed_tokens, tokens),
            None => Tensor::embedding(&self.embed_tokens, tokens, -1, false, false),
        }
    }

    /// The mean cross-entropy of the head on `normed`, the final norm's output; cut, on this
    /// rank's vocabulary rows.
    fn cross_entropy(&self, normed: &Tensor, targets: &Tensor) -> Tensor {
        let logits = self.matmul(normed, &self.lm_head).to_kind(Kind::Float);
        match &self.tensor {
            Some(cut) => cut.cross_entropy(&logits, targets),
            None => logits.view([-1, self.shape.base.vocab_size as i64]).cross_entropy_for_logits(&targets.view([-1])),
        }
    }

    /// SwiGLU: `down(silu(gate(h)) * up(h))`.
    fn mlp(&self, layer_idx: usize, h: &Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        let gated = self.linear(h, &block.gate_proj).silu() * self.linear(h, &block.up_proj);
        self.reduced(self.linear(&gated, &block.down_proj))
    }

    fn head_loss(&self, x: &Tensor, targets: &Tensor) -> Tensor {
        self.cross_entropy(&self.rms_norm(x, &self.norm), targets)
    }

    fn trunk(&self, inputs: &Tensor) -> Tensor {
        let mut x = self.embed_tokens(inputs);
        for layer_idx in 0..self.shape.base.n_layer {
            x = self.residual(layer_idx, Branch::Attention, &x);
            x = self.residual(layer_idx, Branch::Mlp, &x);
        }
        x
    }
}

impl Model for Llama {
    fn shape(&self) -> GptShape {
        self.shape.base
    }

    fn params(&self) -> &FlatParams {
        &self.params
    }

    fn params_mut(&mut self) -> &mut FlatParams {
        &mut self.params
    }

    /// The model's parameters and its LoRA adapters'.
    fn n_params(&self) -> usize {
        let adapters: i64 = self.params.entries().iter().filter(|e| is_adapter(&e.name)).map(|e| e.numel).sum();
        self.shape.n_params() + adapters as usize
    }

    /// 6N for the matrix multiplies plus 12·L·d·T for attention (PaLM, appendix B), with N
    /// excluding the input embedding when the head has its own matrix (a lookup multiplies
    /// nothing). A frozen matrix costs 4 per weight, not 6: the backward still carries the
    /// gradient through it but computes none for it (LoRA's base).
    fn flops_per_token(&self) -> f64 {
        let base = self.shape.base;
        let lookup = if self.shape.tie_head { 0 } else { base.vocab_size * base.d_model };
        let n = (self.n_params() - lookup) as f64;
        let frozen_matmul: i64 = self
            .params
            .frozen_entries()
            .iter()
            .filter(|e| e.shape.len() == 2 && (self.shape.tie_head || e.name != EMBED))
            .map(|e| e.numel)
            .sum();
        6.0 * n - 2.0 * frozen_matmul as f64 + 12.0 * (base.n_layer * base.d_model * base.seq_len) as f64
    }

    fn embed(&self, inputs: &Inputs) -> Tensor {
        self.embed_tokens(&inputs.tokens)
    }

    fn head_ties_embedding(&self) -> bool {
        self.shape.tie_head
    }

    fn norm(&self, which: Norm, x: &Tensor) -> Tensor {
        let scale = match which {
            Norm::Attention(layer_idx) => &self.blocks[layer_idx].input_layernorm,
            Norm::Mlp(layer_idx) => &self.blocks[layer_idx].post_attention_layernorm,
            Norm::Final => &self.norm,
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
        debug_assert!(!normed, "llama runs its final norm in libtorch's graph");
        match &self.tensor {
            Some(cut) => cut
                .head(&self.rms_norm(x, &self.norm), loss_multiplier, |leaf| self.cross_entropy(leaf, &inputs.targets)),
            None => self
                .fused_head(x, inputs, loss_multiplier)
                .unwrap_or_else(|| HeadLoss { loss: self.head_loss(x, &inputs.targets), by_hand: None }),
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
        Some(self.matmul(&self.rms_norm(&self.trunk(inputs), &self.norm), &self.lm_head))
    }

    fn by_hand(&self) -> Option<&dyn ByHand> {
        (self.fused_rms_norm() || self.tensor.is_some()).then_some(self as &dyn ByHand)
    }

    fn split_tensor(&mut self, group: Arc<TensorGroup>) -> Result<(), crate::TrainError> {
        let heads = [("model.n_head", self.shape.base.n_head), ("model.n_kv_head", self.shape.n_kv_head)];
        let cut = Cut::params(&mut self.params, group, &split_of, self.shape.base.vocab_size, &heads)?;
        (self.embed_tokens, self.norm, self.lm_head, self.blocks) = handles(&self.params, &self.shape);
        self.tensor = Some(cut);
        Ok(())
    }

    fn split_of(&self, name: &str) -> Split {
        split_of(name)
    }

    fn tensor_group(&self) -> Option<&Arc<TensorGroup>> {
        self.tensor.as_ref().map(|cut| &cut.group)
    }
}

/// The blocks' RMSNorms by the kernel, every branch in libtorch's graph; or, cut, every branch a
/// core by hand between `f` and `g` (`tensor_parallel`) and the norms in the graph.
impl ByHand for Llama {
    fn norms(&self) -> bool {
        self.fused_rms_norm()
    }

    fn branch(&self, _branch: Branch) -> bool {
        self.tensor.is_some() || self.branches_by_hand()
    }

    fn norm(&self, which: Norm, x: &Tensor) -> Option<(Tensor, LayerNormStats)> {
        if !self.fused_rms_norm() {
            return None;
        }
        let scale = self.block_norm_scale(which)?;
        if self.compute == Kind::Float {
            return crate::kernels::rms_norm_f32(x, scale, self.shape.norm_eps, self.fused_norm_threads);
        }
        crate::kernels::rms_norm_bf16(x, scale, self.shape.norm_eps, self.fused_norm_threads)
    }

    fn norm_backward(
        &self,
        which: Norm,
        grad: &Tensor,
        x: &Tensor,
        stats: &LayerNormStats,
        residual: Option<Tensor>,
    ) -> Tensor {
        let scale = self.block_norm_scale(which).expect("only the blocks' norms run by hand");
        // A frozen scale (a LoRA's base, `train.freeze`) has no gradient to add to.
        let scale_grad = scale.requires_grad().then(|| scale.grad());
        crate::kernels::rms_norm_bf16_backward(
            grad,
            x,
            stats,
            scale,
            residual.map(|r| r.contiguous()),
            scale_grad.as_ref(),
            self.fused_norm_threads,
        )
    }

    fn branch_core<'m>(
        &'m self,
        layer_idx: usize,
        branch: Branch,
        normed: &Tensor,
    ) -> (Tensor, Box<dyn CoreBackward + 'm>) {
        let cut = self.tensor.as_ref().expect("llama runs a branch by hand only when cut");
        cut.branch(normed, |leaf| Model::branch(self, layer_idx, branch, leaf))
    }

    fn branch_whole<'m>(
        &'m self,
        layer_idx: usize,
        branch: Branch,
        normed: &Tensor,
    ) -> (Tensor, Box<dyn BranchBackward + 'm>) {
        self.branch_by_hand(layer_idx, branch, normed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n_kv_head: usize, tie_head: bool) -> LlamaShape {
        LlamaShape {
            base: GptShape { n_layer: 2, n_head: 4, d_model: 32, seq_len: 16, vocab_size: 48 },
            n_kv_head,
            ffn_hidden: 40,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            tie_head,
            rope_scaling: None,
        }
    }

    #[test]
    fn parameters_count_as_declared_tied_or_not() {
        for tie_head in [false, true] {
            let model = Llama::new(shape(2, tie_head), Precision::Fp32, Device::Cpu);
            assert_eq!(model.params().n_elements() as usize, model.n_params());
            assert!(model.params().entries().iter().all(|e| !e.name.ends_with(".bias")), "a bias was declared");
            assert_eq!(model.params().entries().iter().any(|e| e.name == HEAD), !tie_head);
        }
        let model = Llama::new(shape(2, false), Precision::Fp32, Device::Cpu);
        let k = model.params().entries().iter().find(|e| e.name == "model.layers.1.self_attn.k_proj.weight").unwrap();
        assert_eq!(k.shape, [16, 32], "2 key/value heads of width 8");
    }

    /// Grouped-query attention with every key/value head repeated is multi-head attention with
    /// those heads' weights copied: the same logits.
    #[test]
    fn grouped_query_attention_equals_attention_with_repeated_heads() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap();
        tch::manual_seed(3);
        let grouped = Llama::new(shape(2, false), Precision::Fp32, Device::Cpu);
        let full = Llama::new(shape(4, false), Precision::Fp32, Device::Cpu);
        tch::no_grad(|| {
            for (g, f) in grouped.params().entries().iter().zip(full.params().entries()) {
                if g.shape == f.shape {
                    f.tensor.detach().copy_(&g.tensor);
                } else {
                    // [kv heads * head_dim, d] -> each head's rows twice, in order.
                    let rows = g.tensor.view([2, 1, 8, 32]).expand([2, 2, 8, 32], false).reshape([32, 32]);
                    f.tensor.detach().copy_(&rows);
                }
            }
        });
        let inputs = Tensor::arange(32, (Kind::Int64, Device::Cpu)).remainder(48).view([2, 16]);
        let (a, b) = tch::no_grad(|| (grouped.forward(&inputs).unwrap(), full.forward(&inputs).unwrap()));
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "{diff}");
    }

    /// PEFT's init: B starts at zero, so adapters change nothing until they train; freezing the
    /// base leaves only the adapters trainable and takes the base's weight gradients off the FLOPs.
    #[test]
    fn a_fresh_adapter_changes_nothing_and_a_frozen_base_costs_less() {
        let lora = LoraConfig { rank: 4, ..LoraConfig::default() };
        let mut adapted = Llama::with_lora(shape(2, false), Precision::Fp32, &lora, Device::Cpu);
        let plain = Llama::new(shape(2, false), Precision::Fp32, Device::Cpu);
        tch::no_grad(|| {
            for entry in plain.params().entries() {
                entry.tensor.detach().copy_(adapted.params().get(&entry.name));
            }
        });
        let inputs = Tensor::arange(32, (Kind::Int64, Device::Cpu)).remainder(48).view([2, 16]);
        let (a, b) = tch::no_grad(|| (adapted.forward(&inputs).unwrap(), plain.forward(&inputs).unwrap()));
        assert_eq!((a - b).abs().max().double_value(&[]), 0.0);
        // q [32, 32] and v [16, 32] per block: A [4, 32] each, B [32, 4] and [16, 4].
        let adapters = 2 * (128 + 128 + 128 + 64);
        assert_eq!(adapted.n_params(), plain.n_params() + adapters);
        let before = adapted.flops_per_token();
        adapted.params_mut().freeze(&|name| !is_adapter(name));
        assert_eq!(adapted.params().n_elements() as usize, adapters);
        let frozen_matrices = (adapted.n_params() - adapters - 48 * 32) as f64 - (2.0 * 2.0 * 32.0 + 32.0);
        assert_eq!(before - adapted.flops_per_token(), 2.0 * frozen_matrices);
    }

    /// A frozen weight's bf16 cast is made once and kept, a stack of weights apart from each of
    /// them, and made again once the weight's values change in place (its version counter).
    #[test]
    fn a_kept_cast_of_a_frozen_weight_follows_its_values() {
        let mut model = Llama::new(shape(2, false), Precision::Bf16, Device::Cpu);
        model.params_mut().freeze(&|name| name.contains(".self_attn."));
        let (q, k) = (model.blocks[0].q_proj.weight.shallow_clone(), model.blocks[0].k_proj.weight.shallow_clone());
        let first = model.compute_weights(&[&q]);
        assert_eq!(first.data_ptr(), model.compute_weights(&[&q]).data_ptr(), "not kept");
        let stack = model.compute_weights(&[&q, &k]);
        assert_eq!(stack.size(), [48, 32]);
        assert_eq!(first.data_ptr(), model.compute_weights(&[&q]).data_ptr(), "the stack replaced the single cast");
        tch::no_grad(|| q.detach().copy_(&(q.detach() * 2.0)));
        let changed = model.compute_weights(&[&q]);
        assert_ne!(changed.data_ptr(), first.data_ptr());
        assert!(changed.equal(&q.to_kind(Kind::BFloat16)), "the cast after the change has the new values");
        let restacked = model.compute_weights(&[&q, &k]);
        assert!(restacked.narrow(0, 0, 32).equal(&changed));
        // A trained weight is cast on each call.
        let up = model.blocks[0].up_proj.weight.shallow_clone();
        assert_ne!(model.compute_weights(&[&up]).data_ptr(), model.compute_weights(&[&up]).data_ptr());
    }

    #[test]
    fn a_later_token_leaves_earlier_logits_alone() {
        let model = Llama::new(shape(2, true), Precision::Fp32, Device::Cpu);
        let inputs = Tensor::arange(32, (Kind::Int64, Device::Cpu)).remainder(48).view([2, 16]);
        let changed = inputs.copy();
        let _ = changed.narrow(1, 15, 1).fill_(7);
        let (a, b) = tch::no_grad(|| (model.forward(&inputs).unwrap(), model.forward(&changed).unwrap()));
        let earlier = (a.narrow(1, 0, 15) - b.narrow(1, 0, 15)).abs().max().double_value(&[]);
        assert_eq!(earlier, 0.0, "a later token leaked into earlier positions");
    }
}
