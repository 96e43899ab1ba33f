//! A GPT decoder in nanoGPT's shape: token and position embeddings, pre-LayerNorm blocks of causal
//! self-attention (libtorch's scaled_dot_product_attention, or 16-bit batched matrix multiplies)
//! and a GELU MLP, a final LayerNorm and a head tied to the token embedding. Parameter names follow
//! nanoGPT, so a checkpoint's tensors load into its `GPT` by name.

mod attention;
mod by_hand;
mod casts;
mod parts;
mod tensor;

use std::cell::RefCell;
use std::sync::Arc;

use tch::{Device, Kind, Tensor};

use crate::config::{AttentionPrecision, GptShape, Precision, TrainConfig};
use crate::models::embedding::{embed, embedding_unit, with_positions};
use crate::models::tensor_group::{Split, TensorGroup};
use crate::models::{Branch, ByHand, HeadLoss, Inputs, Model, Norm};
use crate::params::{FlatParams, Init, ParamSpec, UnitSpec};
use crate::precision::compute_kind;

use attention::choose_attention;
pub(crate) use by_hand::{linear_backward, linear_backward_unbiased};
pub use parts::Gpt;
use parts::{block_names, handles, Attention, Slot, LAYER_NORM_EPS};

/// The planner's description of a GPT of `shape` (`models::plan_model`): Megatron-LM's GPT
/// (biases, LayerNorms, a 4h GELU MLP, learned positions, a tied head) with fused attention, since
/// the model keeps no whole `s x s` score matrix for its backward.
pub(crate) fn plan_model(shape: GptShape) -> stoke_plan::ModelConfig {
    let gpt = stoke_plan::ModelConfig::gpt(shape.n_layer, shape.d_model, shape.n_head, shape.seq_len, shape.vocab_size);
    stoke_plan::ModelConfig { flash_attention: true, ..gpt }
}

impl Gpt {
    /// A freshly initialized model (nanoGPT's init: N(0, 0.02), residual projections scaled by
    /// 1/sqrt(2·n_layer)). Seed libtorch first for a reproducible init. The flat buffers are laid
    /// out unit by unit: the embedding (wte, wpe), each block, then the final norm.
    pub fn new(shape: GptShape, precision: Precision, attention: AttentionPrecision, device: Device) -> Gpt {
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
            let [ln1_w, ln1_b, attn_w, attn_b, attn_proj_w, attn_proj_b, ln2_w, ln2_b, fc_w, fc_b, mlp_proj_w, mlp_proj_b] =
                block_names(layer_idx);
            units.push(UnitSpec {
                name: format!("transformer.h.{layer_idx}"),
                params: vec![
                    spec(ln1_w, &[d], Init::Ones, false),
                    spec(ln1_b, &[d], Init::Zeros, false),
                    spec(attn_w, &[3 * d, d], Init::Normal { std }, true),
                    spec(attn_b, &[3 * d], Init::Zeros, false),
                    spec(attn_proj_w, &[d, d], Init::Normal { std: proj_std }, true),
                    spec(attn_proj_b, &[d], Init::Zeros, false),
                    spec(ln2_w, &[d], Init::Ones, false),
                    spec(ln2_b, &[d], Init::Zeros, false),
                    spec(fc_w, &[4 * d, d], Init::Normal { std }, true),
                    spec(fc_b, &[4 * d], Init::Zeros, false),
                    spec(mlp_proj_w, &[d, 4 * d], Init::Normal { std: proj_std }, true),
                    spec(mlp_proj_b, &[d], Init::Zeros, false),
                ],
            });
        }
        units.push(UnitSpec {
            name: "head".into(),
            params: vec![
                spec("transformer.ln_f.weight".into(), &[d], Init::Ones, false),
                spec("transformer.ln_f.bias".into(), &[d], Init::Zeros, false),
            ],
        });
        let params = FlatParams::new(units, device);
        let (wte, wpe, ln_f, blocks) = handles(&params, shape.n_layer);
        let attention = choose_attention(precision, attention, shape, device);
        let causal_mask = match attention {
            Attention::Math(kind) => {
                let seq = shape.seq_len as i64;
                Some(Tensor::full([seq, seq], f64::NEG_INFINITY, (kind, device)).triu(1))
            }
            Attention::Sdpa(_) => None,
        };
        Gpt {
            shape,
            wte,
            wpe,
            ln_f,
            blocks,
            params,
            compute: compute_kind(precision),
            attention,
            causal_mask,
            fused_cross_entropy_threads: 0,
            fused_layer_norm_threads: 0,
            causal_block_rows: 0,
            fused_softmax_threads: 0,
            fused_bias_gelu_threads: 0,
            tanh_gelu: false,
            casts: RefCell::new((0..shape.n_layer * Slot::PER_BLOCK + 1).map(|_| None).collect()),
            reuse_casts: false,
            unit_casts: false,
            block_casts: RefCell::new((0..shape.n_layer).map(|_| None).collect()),
            leaves: RefCell::new((0..shape.n_layer * Slot::PER_BLOCK + 1).map(|_| None).collect()),
            tensor: None,
        }
    }

    /// Under 16-bit precision, in a forward with autograd, each block's parameters are cast to
    /// the compute type in one op (kept for the step) and its linear layers take 16-bit leaves
    /// cut from that cast, instead of one cast per weight and bias, each with its own backward
    /// (a 32-bit copy of the gradient) and accumulation. The leaves' gradients stay 16-bit until
    /// `add_cast_grads` adds them into the fp32 gradient buffer, which gives the same bits as
    /// autograd's cast backward and accumulation. The caller must call `add_cast_grads` after
    /// every backward (the block executor and the single-graph step do). `false` (the default of
    /// `new`) keeps a cast per use (`train.unit_casts`).
    pub fn set_unit_casts(&mut self, enabled: bool) {
        self.unit_casts = enabled;
    }

    /// `new` with the kernels and casts `train` asks for (`train.fused_*`, `causal_block_rows`,
    /// `unit_casts`), the Rust kernels on `kernel_threads` threads.
    pub fn for_training(shape: GptShape, train: &TrainConfig, kernel_threads: usize, device: Device) -> Gpt {
        let mut model = Gpt::new(shape, train.precision, train.attention, device);
        let fused_cross_entropy = train.fused_cross_entropy.enabled(shape.vocab_size);
        model.set_fused_cross_entropy(fused_cross_entropy, kernel_threads);
        model.set_fused_layer_norm(train.fused_layer_norm, kernel_threads);
        model.set_causal_block_rows(train.causal_block_rows);
        model.set_fused_softmax(train.fused_softmax, kernel_threads);
        model.set_fused_bias_gelu(train.fused_bias_gelu, kernel_threads);
        model.set_unit_casts(train.unit_casts);
        model
    }

    /// Under bf16 on a CPU, the block executor takes the head's loss and its gradient with
    /// respect to the logits from the fused kernel (`kernels::cross_entropy_bf16`, on `n_threads`
    /// threads) instead of libtorch's cast, log-softmax and NLL (`train.fused_cross_entropy`).
    /// `false` (the default of `new`) keeps libtorch's ops.
    pub fn set_fused_cross_entropy(&mut self, enabled: bool, n_threads: usize) {
        self.fused_cross_entropy_threads = if enabled { n_threads.max(1) } else { 0 };
    }

    /// Under bf16 on a CPU, the block executor runs every LayerNorm as a Rust kernel that reads
    /// the fp32 residual stream and writes the bf16 the next linear layer takes, and its backward
    /// as one that adds the residual branch's gradient in the same pass
    /// (`kernels::layer_norm_bf16`, on `n_threads` threads; `train.fused_layer_norm`) instead of
    /// libtorch's fp32 LayerNorm and casts. `false` (the default of `new`) keeps libtorch's ops.
    pub fn set_fused_layer_norm(&mut self, enabled: bool, n_threads: usize) {
        self.fused_layer_norm_threads = if enabled { n_threads.max(1) } else { 0 };
    }

    /// The bf16-math attention takes its queries `rows` at a time, each block against only the
    /// keys at or before its last row (`train.causal_block_rows`): the score and weighted-sum
    /// matrix multiplies, the softmax and the kept probabilities shrink to the causal triangle
    /// plus one diagonal block per block, `(n + 1) / 2n` of the whole square with `n` blocks. 0 (the
    /// default of `new`), or `rows` at least the context, computes the whole square and masks it.
    pub fn set_causal_block_rows(&mut self, rows: usize) {
        self.causal_block_rows = rows;
    }

    /// Under bf16-math attention on a CPU, the block executor runs each attention's core (scores,
    /// causal softmax, weighted sum) outside libtorch's graph: plain `bmm`s of the causal blocks
    /// into one buffer and the softmax kernel (`kernels::causal_softmax_bf16`, on `n_threads`
    /// threads; `train.fused_softmax`), which skips the masked keys, with its backward by hand
    /// between the output projection's and the q, k, v projection's. `false` (the default of
    /// `new`) keeps libtorch's masked `baddbmm`, softmax and autograd.
    pub fn set_fused_softmax(&mut self, enabled: bool, n_threads: usize) {
        self.fused_softmax_threads = if enabled { n_threads.max(1) } else { 0 };
    }

    /// Whether the executor runs the attention's core by hand (see `set_fused_softmax`).
    pub(crate) fn fused_softmax(&self) -> bool {
        self.fused_softmax_threads > 0
            && self.attention == Attention::Math(Kind::BFloat16)
            && self.wte.device() == Device::Cpu
    }

    /// Under bf16 on a CPU, the block executor runs each MLP's first linear layer without its
    /// bias, and the bias and GELU as one Rust kernel outside libtorch's graph
    /// (`kernels::bias_gelu`, on `n_threads` threads; `train.fused_bias_gelu`), with the
    /// backward by hand: the kernel's (the bias's gradient summed in the same pass) and the
    /// linear layer's two matrix multiplies. `false` (the default of `new`) keeps libtorch's
    /// `addmm`, `gelu` and autograd.
    pub fn set_fused_bias_gelu(&mut self, enabled: bool, n_threads: usize) {
        self.fused_bias_gelu_threads = if enabled && !self.tanh_gelu { n_threads.max(1) } else { 0 };
    }

    /// The MLP's GELU as the tanh approximation (`model.gelu = "tanh"`, GPT-2's `gelu_new`, so
    /// imported GPT-2 weights give GPT-2's outputs) instead of the exact one. The bias-GELU
    /// kernel computes the exact GELU, so this turns it off.
    pub fn set_tanh_gelu(&mut self, enabled: bool) {
        self.tanh_gelu = enabled;
        if enabled {
            self.fused_bias_gelu_threads = 0;
        }
    }

    /// Whether the executor runs the MLP's bias and GELU by hand (see `set_fused_bias_gelu`).
    pub(crate) fn fused_bias_gelu(&self) -> bool {
        self.fused_bias_gelu_threads > 0 && self.compute == Kind::BFloat16 && self.wte.device() == Device::Cpu
    }

    /// Whether the executor takes the LayerNorms from the kernel (see `set_fused_layer_norm`).
    pub(crate) fn fused_layer_norm(&self) -> bool {
        self.fused_layer_norm_threads > 0 && self.compute == Kind::BFloat16 && self.wte.device() == Device::Cpu
    }

    fn norm_params(&self, which: Norm) -> &(Tensor, Tensor) {
        match which {
            Norm::Attention(layer_idx) => &self.blocks[layer_idx].ln_1,
            Norm::Mlp(layer_idx) => &self.blocks[layer_idx].ln_2,
            Norm::Final => &self.ln_f,
        }
    }

    pub fn shape(&self) -> GptShape {
        self.shape
    }

    pub fn params(&self) -> &FlatParams {
        &self.params
    }

    /// For moving the buffers (ZeRO's releasable memory); the handles the model resolved share
    /// each parameter's tensor, so they follow.
    pub fn params_mut(&mut self) -> &mut FlatParams {
        &mut self.params
    }

    /// The number of units the executor runs: the embedding, each block, the head.
    pub fn n_units(&self) -> usize {
        self.shape.n_layer + 2
    }

    /// A linear layer in the compute type. Under 16-bit precision the input, weight and bias are
    /// cast for the multiply (what autocast does for `linear`), and the result stays 16-bit.
    /// `slot` names the weight, for the step's kept casts (`begin_step_casts`).
    fn linear(&self, x: &Tensor, slot: Slot, weight: &Tensor, bias: Option<&Tensor>) -> Tensor {
        if self.compute == Kind::Float {
            return x.linear(weight, bias);
        }
        if self.unit_casts && x.requires_grad() {
            let b16 = bias.map(|_| self.leaf(slot.bias()));
            return x.to_kind(self.compute).linear(&self.leaf(slot), b16.as_ref());
        }
        let b16 = bias.map(|b| self.cast(slot.bias(), b));
        x.to_kind(self.compute).linear(&self.cast(slot, weight), b16.as_ref())
    }

    /// LayerNorm always in fp32 (`precision::FP32_OPS`).
    fn layer_norm(&self, x: &Tensor, (weight, bias): &(Tensor, Tensor)) -> Tensor {
        let d = self.shape.d_model as i64;
        x.to_kind(Kind::Float).layer_norm([d], Some(weight), Some(bias), LAYER_NORM_EPS, true)
    }

    /// The embedding unit: token plus position embeddings, `[batch, seq, d]` fp32.
    pub fn embed(&self, inputs: &Tensor) -> Tensor {
        match &self.tensor {
            Some(cut) => with_positions(cut.embedding(&self.wte, inputs), &self.wpe, inputs),
            None => embed(&self.wte, &self.wpe, inputs),
        }
    }

    /// The first half of block `layer_idx`: `x + attention(ln_1(x))`.
    pub fn attention_residual(&self, layer_idx: usize, x: &Tensor) -> Tensor {
        x + self.attention_branch(layer_idx, &self.layer_norm(x, &self.blocks[layer_idx].ln_1))
    }

    /// The second half of block `layer_idx`: `x + mlp(ln_2(x))`.
    pub fn mlp_residual(&self, layer_idx: usize, x: &Tensor) -> Tensor {
        x + self.mlp_branch(layer_idx, &self.layer_norm(x, &self.blocks[layer_idx].ln_2))
    }

    /// The MLP of block `layer_idx` on `h`, its input already normed, in the compute type.
    pub(crate) fn mlp_branch(&self, layer_idx: usize, h: &Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        let h = self
            .linear(h, Slot::weight(layer_idx, Slot::FC), &block.fc_w, Some(&block.fc_b))
            .gelu(if self.tanh_gelu { "tanh" } else { "none" });
        self.row_parallel(&h, Slot::weight(layer_idx, Slot::MLP_PROJ), &block.mlp_proj_w, &block.mlp_proj_b)
    }

    /// Logits `[batch, seq, vocab]` from the last block's output (16-bit under 16-bit precision).
    pub fn head_logits(&self, x: &Tensor) -> Tensor {
        self.head_logits_normed(&self.layer_norm(x, &self.ln_f))
    }

    /// Logits from the final LayerNorm's output.
    fn head_logits_normed(&self, h: &Tensor) -> Tensor {
        self.linear(h, Slot::head(self.shape.n_layer), &self.wte, None)
    }

    /// Mean cross-entropy (fp32) of the head's predictions against `targets` `[batch, seq]`.
    pub fn head_loss(&self, x: &Tensor, targets: &Tensor) -> Tensor {
        self.mean_cross_entropy(&self.head_logits(x), targets)
    }

    /// libtorch's cross-entropy in fp32 of `logits` `[.., vocab]` against `targets`.
    fn mean_cross_entropy(&self, logits: &Tensor, targets: &Tensor) -> Tensor {
        if let Some(cut) = &self.tensor {
            return cut.cross_entropy(&logits.to_kind(Kind::Float), targets);
        }
        let vocab = self.shape.vocab_size as i64;
        logits.to_kind(Kind::Float).view([-1, vocab]).cross_entropy_for_logits(&targets.view([-1]))
    }

    /// Mean cross-entropy of predicting `targets` from `inputs`, both `[batch, seq]` int64, as
    /// one autograd graph (the executor runs the same functions unit by unit).
    pub fn loss(&self, inputs: &Tensor, targets: &Tensor) -> Tensor {
        self.head_loss(&self.trunk(inputs), targets)
    }

    /// Logits `[batch, seq, vocab]` (16-bit under 16-bit precision), as one graph.
    pub fn forward(&self, inputs: &Tensor) -> Tensor {
        self.head_logits(&self.trunk(inputs))
    }

    fn trunk(&self, inputs: &Tensor) -> Tensor {
        let mut x = self.embed(inputs);
        for layer_idx in 0..self.shape.n_layer {
            x = self.attention_residual(layer_idx, &x);
            x = self.mlp_residual(layer_idx, &x);
        }
        x
    }
}

impl Model for Gpt {
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
        self.shape.n_params()
    }

    fn flops_per_token(&self) -> f64 {
        self.shape.flops_per_token()
    }

    fn begin_step_casts(&mut self, reuse: bool) {
        Gpt::begin_step_casts(self, reuse)
    }

    /// A leaf serves every forward until its block's backward adds its gradient and drops it, so
    /// a later micro-batch's forward before that backward would share it and lose its part.
    fn interleave_micro_batches(&mut self) {
        self.unit_casts = false;
        self.end_step_casts();
    }

    fn end_step_casts(&mut self) {
        Gpt::end_step_casts(self)
    }

    fn add_cast_grads(&self, layer_idx: Option<usize>) {
        Gpt::add_cast_grads(self, layer_idx)
    }

    fn add_all_cast_grads(&self) {
        Gpt::add_all_cast_grads(self)
    }

    fn embed(&self, inputs: &Inputs) -> Tensor {
        Gpt::embed(self, &inputs.tokens)
    }

    fn norm(&self, which: Norm, x: &Tensor) -> Tensor {
        self.norm_by_libtorch(which, x)
    }

    fn branch(&self, layer_idx: usize, branch: Branch, normed: &Tensor) -> Tensor {
        match branch {
            Branch::Attention => self.attention_branch(layer_idx, normed),
            Branch::Mlp => self.mlp_branch(layer_idx, normed),
        }
    }

    fn residual(&self, layer_idx: usize, branch: Branch, x: &Tensor) -> Tensor {
        match branch {
            Branch::Attention => self.attention_residual(layer_idx, x),
            Branch::Mlp => self.mlp_residual(layer_idx, x),
        }
    }

    fn head_loss_for_backward(&self, x: &Tensor, normed: bool, inputs: &Inputs, loss_multiplier: f64) -> HeadLoss<'_> {
        Gpt::head_loss_for_backward(self, x, normed, &inputs.targets, loss_multiplier)
    }

    fn loss(&self, inputs: &Inputs) -> Tensor {
        Gpt::loss(self, &inputs.tokens, &inputs.targets)
    }

    /// The logits; None when cut (each rank holds its vocabulary rows' only).
    fn forward(&self, inputs: &Tensor) -> Option<Tensor> {
        self.tensor.is_none().then(|| Gpt::forward(self, inputs))
    }

    fn by_hand(&self) -> Option<&dyn ByHand> {
        Some(self)
    }

    fn split_tensor(&mut self, group: Arc<TensorGroup>) -> Result<(), crate::TrainError> {
        Gpt::split_tensor(self, group)
    }

    fn split_of(&self, name: &str) -> Split {
        crate::models::tensor_parallel::nanogpt_split(name)
    }

    fn tensor_group(&self) -> Option<&Arc<TensorGroup>> {
        self.tensor.as_ref().map(|cut| &cut.group)
    }
}
