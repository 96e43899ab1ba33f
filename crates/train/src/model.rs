//! A GPT decoder in nanoGPT's shape: token and position embeddings, pre-LayerNorm blocks of causal
//! self-attention (libtorch's scaled_dot_product_attention, or 16-bit batched matrix multiplies)
//! and a GELU MLP, a final LayerNorm and a head tied to the token embedding. Parameter names follow
//! nanoGPT, so a checkpoint's tensors load into its `GPT` by name.

use std::cell::RefCell;

use tch::{Device, Kind, Tensor};

use crate::config::{AttentionPrecision, GptShape, Precision};
use crate::kernels::{CausalBlock, LayerNormStats};
use crate::params::{FlatParams, Init, ParamEntry, ParamSpec, UnitRange, UnitSpec};
use crate::precision::compute_kind;

pub struct Gpt {
    shape: GptShape,
    params: FlatParams,
    /// Element type of the matrix multiplies (see `precision::compute_kind`).
    compute: Kind,
    attention: Attention,
    /// Handles to the parameters, resolved once from `params` (they share its storage).
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<BlockParams>,
    ln_f: (Tensor, Tensor),
    /// `[seq_len, seq_len]` additive causal mask in the compute type, for `Attention::Math`.
    causal_mask: Option<Tensor>,
    /// Threads of the fused cross-entropy kernel; 0 leaves the loss to libtorch's ops (see
    /// `set_fused_cross_entropy`).
    fused_cross_entropy_threads: usize,
    /// Threads of the fused LayerNorm kernels; 0 leaves the norms to libtorch's ops (see
    /// `set_fused_layer_norm`).
    fused_layer_norm_threads: usize,
    /// Query rows per block of `Attention::Math`; 0 takes the whole context at once (see
    /// `set_causal_block_rows`).
    causal_block_rows: usize,
    /// Threads of the causal softmax kernel; 0 leaves the attention's core to libtorch's ops and
    /// autograd (see `set_fused_softmax`).
    fused_softmax_threads: usize,
    /// Threads of the bias + GELU kernels; 0 leaves the MLP's first bias and GELU to libtorch's
    /// ops and autograd (see `set_fused_bias_gelu`).
    fused_bias_gelu_threads: usize,
    /// The weights and biases cast to the compute type, made at their first use in a step and
    /// reused by its later micro-batches (see `begin_step_casts`); indexed by `Slot`.
    casts: RefCell<Vec<Option<Tensor>>>,
    /// Whether this step keeps its casts for reuse.
    reuse_casts: bool,
    /// Whether the linear layers take 16-bit leaves cut from one cast of their block (see
    /// `set_unit_casts`).
    unit_casts: bool,
    /// With `unit_casts`: each block's parameters in the compute type, cast in one op at the
    /// block's first forward with autograd in a step; indexed by layer.
    block_casts: RefCell<Vec<Option<Tensor>>>,
    /// With `unit_casts`: the 16-bit leaves a forward with autograd handed the linear layers,
    /// until `add_cast_grads` adds their gradients into the fp32 buffer; indexed by `Slot`.
    leaves: RefCell<Vec<Option<Tensor>>>,
}

/// libtorch's default, nanoGPT's and GPT-2's.
const LAYER_NORM_EPS: f64 = 1e-5;

/// One of the model's LayerNorms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Norm {
    /// Block `layer_idx`'s `ln_1`, before the attention.
    Attention(usize),
    /// Block `layer_idx`'s `ln_2`, before the MLP.
    Mlp(usize),
    /// `ln_f`, before the head.
    Final,
}

/// Where a cast weight or bias is kept in `Gpt::casts`: block `layer_idx`'s linear layers in
/// forward order, a weight then its bias (8 per block), then the head's tied embedding.
#[derive(Clone, Copy)]
struct Slot(usize);

impl Slot {
    const PER_BLOCK: usize = 8;
    const ATTN: usize = 0;
    const ATTN_PROJ: usize = 2;
    const FC: usize = 4;
    const MLP_PROJ: usize = 6;

    /// The weight of linear layer `layer` (one of the constants) of block `layer_idx`.
    fn weight(layer_idx: usize, layer: usize) -> Slot {
        Slot(layer_idx * Slot::PER_BLOCK + layer)
    }

    fn bias(self) -> Slot {
        Slot(self.0 + 1)
    }

    fn head(n_layer: usize) -> Slot {
        Slot(n_layer * Slot::PER_BLOCK)
    }

    /// The block of a block's slot; `None` for the head's.
    fn layer(self, n_layer: usize) -> Option<usize> {
        (self.0 < n_layer * Slot::PER_BLOCK).then_some(self.0 / Slot::PER_BLOCK)
    }

    /// The index of the slot's parameter among its block's, in `block_names` order.
    fn param_in_block(self) -> usize {
        // ln_1's two parameters come first, and ln_2's two sit between the attention's and the MLP's.
        const PARAM: [usize; Slot::PER_BLOCK] = [2, 3, 4, 5, 8, 9, 10, 11];
        PARAM[self.0 % Slot::PER_BLOCK]
    }
}

/// The head's loss, ready for its backward (`Gpt::head_loss_for_backward`).
pub(crate) struct HeadLoss {
    /// The mean loss, fp32; part of the autograd graph when `fused` is `None`.
    pub loss: Tensor,
    /// With the fused kernel: what the head's backward by hand needs (`Gpt::fused_head_backward`).
    pub fused: Option<FusedHead>,
}

/// The fused cross-entropy's head, for its backward by hand: the logits' gradient came with the
/// loss, so the head's matrix multiplies are backward-ed here instead of through autograd, whose
/// backward starts only from a scalar (a `<logits, gradient>` seed over the whole `[rows, vocab]`
/// would cost more than the kernel saves).
pub(crate) struct FusedHead {
    /// The head's input in the compute type `[batch, seq, d]`: the fused LayerNorm's leaf, or
    /// libtorch's LayerNorm cast, part of the graph back to the head's input.
    input: Tensor,
    /// The head's weight (the tied embedding) in the compute type, outside the graph.
    weight: Tensor,
    /// The gradient of the loss times the multiplier with respect to the logits, `[rows, vocab]`.
    logits_grad: Tensor,
}

/// What the backward by hand of an MLP's bias and GELU needs (`Gpt::mlp_branch_by_hand`).
pub(crate) struct MlpCore {
    /// The first linear layer's input in bf16, with libtorch's graph back to the half's input
    /// (none in an `MlpHalf`): the backward by hand ends with this tensor's gradient.
    pub input: Tensor,
    /// The first weight in bf16 `[4d, d]`, outside the graph.
    weight: Tensor,
    /// The product `input W^T` without the bias, bf16.
    pre: Tensor,
    /// `gelu(pre + bias)`: a leaf that requires grad, where the second linear layer's graph
    /// starts (a plain tensor in an `MlpHalf`).
    pub act: Tensor,
}

/// A part of a half that the executor backward-s by hand: between two of libtorch's graphs
/// (`Attention`, `Mlp`), or the whole branch after the fused LayerNorm, with no graph at all
/// (`AttentionHalf`, `MlpHalf`).
pub(crate) enum Core {
    Attention(AttentionCore),
    Mlp(MlpCore),
    AttentionHalf(AttentionHalf),
    MlpHalf(MlpHalf),
}

/// An attention branch run whole outside libtorch's graph, from the fused LayerNorm's bf16
/// output (`Gpt::attention_half_by_hand`): what its backward by hand needs.
pub(crate) struct AttentionHalf {
    /// The normed input, bf16 `[batch, seq, d]`.
    normed: Tensor,
    /// The q, k, v projection's weight `[3d, d]` and the output projection's `[d, d]`, bf16.
    qkv_weight: Tensor,
    proj_weight: Tensor,
    core: AttentionCore,
}

/// An MLP branch run whole outside libtorch's graph, from the fused LayerNorm's bf16 output
/// (`Gpt::mlp_half_by_hand`): what its backward by hand needs.
pub(crate) struct MlpHalf {
    /// The second linear layer's weight, bf16 `[d, 4d]` (its input is `core.act`).
    proj_weight: Tensor,
    core: MlpCore,
}

/// An attention core run outside libtorch's graph (`Gpt::attention_branch_by_hand`): what its
/// backward by hand (`Gpt::attention_core_backward`) needs.
pub(crate) struct AttentionCore {
    /// q, k and v `[3, batch * n_head, seq, head_dim]`, with libtorch's graph back to the half's
    /// input (none in an `AttentionHalf`): the backward by hand ends with this tensor's gradient.
    pub heads: Tensor,
    /// Every query block's probabilities, one buffer (`blocks` says where each lies).
    probs: Tensor,
    blocks: Vec<CausalBlock>,
    /// The weighted sums `[batch, seq, n_head * head_dim]` (heads side by side, the output
    /// projection's input): a leaf that requires grad, where that projection's graph starts (a
    /// plain tensor in an `AttentionHalf`).
    pub y: Tensor,
    scale: f64,
}

/// q, k and v of the math attention from the projection `qkv` `[batch, seq, 3d]`, into head-major
/// order in one copy, `[3, batch * n_head, seq, head_dim]` (cast to `kind` while contiguous).
fn math_heads(qkv: &Tensor, kind: Kind, n_head: i64) -> Tensor {
    let (batch, seq, d3) = qkv.size3().expect("the projection is [batch, seq, 3d]");
    let head_dim = d3 / 3 / n_head;
    qkv.to_kind(kind).view([batch, seq, 3, n_head, head_dim]).permute([2, 0, 3, 1, 4]).contiguous().view([
        3,
        batch * n_head,
        seq,
        head_dim,
    ])
}

/// The backward by hand of the 16-bit linear layer `x W^T + b` from its output's gradient `grad`
/// (16-bit, `[.., out]`): adds the weight's gradient `grad^T x` (a 16-bit product, as autograd's
/// is) and the bias's (summed in fp32) into the fp32 parameters' (`master`) gradients, and returns
/// the input's, `grad W`.
fn linear_backward(grad: &Tensor, x: &Tensor, weight: &Tensor, (master_w, master_b): (&Tensor, &Tensor)) -> Tensor {
    let (out, d_in) = (*grad.size().last().expect("a width"), *x.size().last().expect("a width"));
    let rows = grad.reshape([-1, out]);
    let mut w_grad = master_w.grad();
    w_grad += rows.tr().mm(&x.reshape([-1, d_in]));
    let mut b_grad = master_b.grad();
    b_grad += rows.sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
    grad.matmul(weight)
}

/// One block's parameters.
struct BlockParams {
    ln_1: (Tensor, Tensor),
    attn_w: Tensor,
    attn_b: Tensor,
    attn_proj_w: Tensor,
    attn_proj_b: Tensor,
    ln_2: (Tensor, Tensor),
    fc_w: Tensor,
    fc_b: Tensor,
    mlp_proj_w: Tensor,
    mlp_proj_b: Tensor,
}

/// How a block computes causal self-attention.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Attention {
    /// libtorch's scaled_dot_product_attention, q, k and v cast to this element type.
    Sdpa(Kind),
    /// Explicit batched matrix multiplies in this 16-bit type: scores (with an additive causal
    /// mask), softmax (fp32 inside, 16-bit out), probabilities times v.
    Math(Kind),
}

/// The longest context "auto" runs as bf16-math on a CPU: the probabilities it keeps for the
/// backward grow with its square. At 1024 (gpt2-124m, micro-batch 1) it took 0.86-0.91 of fp32
/// SDPA's step time in three interleaved rounds (2026-12-01, `benches/stoke_attention_cpu.sh`), and
/// the PyTorch peer's bf16 matmul attention beat its SDPA there too (1846 against 2162 ms).
const MATH_ATTENTION_MAX_SEQ: usize = 1024;

fn block_names(layer_idx: usize) -> [String; 12] {
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

fn choose_attention(precision: Precision, attention: AttentionPrecision, shape: GptShape, device: Device) -> Attention {
    let short = shape.seq_len <= MATH_ATTENTION_MAX_SEQ;
    match (precision, attention) {
        (Precision::Fp32, _) | (_, AttentionPrecision::Fp32) => Attention::Sdpa(Kind::Float),
        (Precision::Bf16, AttentionPrecision::Bf16) => Attention::Sdpa(Kind::BFloat16),
        (Precision::Bf16, AttentionPrecision::Bf16Math) => Attention::Math(Kind::BFloat16),
        (Precision::Bf16, AttentionPrecision::Auto) if device == Device::Cpu => {
            if short {
                Attention::Math(Kind::BFloat16)
            } else {
                Attention::Sdpa(Kind::Float)
            }
        }
        (Precision::Bf16, AttentionPrecision::Auto) => Attention::Sdpa(Kind::BFloat16),
        // Under fp16 the 16-bit choices run in fp16; a CPU has no fast fp16 attention kernel.
        (Precision::Fp16, AttentionPrecision::Bf16) => Attention::Sdpa(Kind::Half),
        (Precision::Fp16, AttentionPrecision::Bf16Math) => Attention::Math(Kind::Half),
        (Precision::Fp16, AttentionPrecision::Auto) if device == Device::Cpu => Attention::Sdpa(Kind::Float),
        (Precision::Fp16, AttentionPrecision::Auto) => Attention::Sdpa(Kind::Half),
    }
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
        let mut units = vec![UnitSpec {
            name: "embedding".into(),
            params: vec![
                spec("transformer.wte.weight".into(), &[shape.vocab_size as i64, d], Init::Normal { std }, true),
                spec("transformer.wpe.weight".into(), &[shape.seq_len as i64, d], Init::Normal { std }, true),
            ],
        }];
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
        let get = |name: &str| params.get(name).shallow_clone();
        let blocks = (0..shape.n_layer)
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
            wte: get("transformer.wte.weight"),
            wpe: get("transformer.wpe.weight"),
            ln_f: (get("transformer.ln_f.weight"), get("transformer.ln_f.bias")),
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
            casts: RefCell::new((0..shape.n_layer * Slot::PER_BLOCK + 1).map(|_| None).collect()),
            reuse_casts: false,
            unit_casts: false,
            block_casts: RefCell::new((0..shape.n_layer).map(|_| None).collect()),
            leaves: RefCell::new((0..shape.n_layer * Slot::PER_BLOCK + 1).map(|_| None).collect()),
        }
    }

    /// Starts a step's casts of the weights to the compute type: drops the previous step's
    /// (the parameters have changed since), and with `reuse` keeps each cast made with autograd
    /// on for the step's later micro-batches, so a step of k accumulated micro-batches casts each
    /// weight once instead of k times. The kept cast stays in every micro-batch's graph: its
    /// backward (the cast's, which saves no tensor, so it can run once per micro-batch) adds each
    /// micro-batch's gradient into the fp32 master's, as before. With one micro-batch there is
    /// nothing to reuse, and keeping them would only hold memory (under recomputation, or a
    /// ZeRO stage-3 step that releases the parameters) until `end_step_casts`.
    pub fn begin_step_casts(&mut self, reuse: bool) {
        self.end_step_casts();
        self.reuse_casts = reuse && self.compute != Kind::Float;
    }

    /// Drops the step's kept casts (before the optimizer changes the weights).
    pub fn end_step_casts(&mut self) {
        self.casts.get_mut().iter_mut().for_each(|cast| *cast = None);
        self.block_casts.get_mut().iter_mut().for_each(|cast| *cast = None);
        // Leaves are left only by a micro-batch that stopped between its forward and backward.
        self.leaves.get_mut().iter_mut().for_each(|leaf| *leaf = None);
        self.reuse_casts = false;
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

    /// Adds the gradients of the 16-bit leaves a backward just reached (block `layer_idx`'s, or
    /// with `None` the head's tied embedding) into the fp32 gradient buffer and drops those
    /// leaves; leaves the backward has not reached yet (the other half of a block run as two
    /// segments) keep theirs. Without `set_unit_casts` there are none.
    pub(crate) fn add_cast_grads(&self, layer_idx: Option<usize>) {
        if !self.unit_casts {
            return;
        }
        let n_layer = self.shape.n_layer;
        let slots = match layer_idx {
            Some(layer_idx) => layer_idx * Slot::PER_BLOCK..(layer_idx + 1) * Slot::PER_BLOCK,
            None => n_layer * Slot::PER_BLOCK..n_layer * Slot::PER_BLOCK + 1,
        };
        let mut leaves = self.leaves.borrow_mut();
        for slot in slots.clone() {
            let Some(leaf) = &leaves[slot] else { continue };
            let grad = leaf.grad();
            if !grad.defined() {
                continue;
            }
            tch::no_grad(|| {
                let mut master = self.param_of(Slot(slot)).grad();
                master += &grad;
            });
            leaves[slot] = None;
        }
        if let Some(layer_idx) = layer_idx {
            if !self.reuse_casts && leaves[slots].iter().all(Option::is_none) {
                self.block_casts.borrow_mut()[layer_idx] = None;
            }
        }
    }

    /// `add_cast_grads` for every block and the head.
    pub(crate) fn add_all_cast_grads(&self) {
        for layer_idx in 0..self.shape.n_layer {
            self.add_cast_grads(Some(layer_idx));
        }
        self.add_cast_grads(None);
    }

    /// The fp32 parameter behind `slot` (the leaf view of the flat buffer whose `.grad` is a view
    /// of the flat gradient).
    fn param_of(&self, slot: Slot) -> &Tensor {
        match slot.layer(self.shape.n_layer) {
            Some(layer_idx) => &self.block_entry(layer_idx, slot).1.tensor,
            None => &self.wte,
        }
    }

    /// Block `layer_idx`'s unit and the entry of its parameter in `slot`.
    fn block_entry(&self, layer_idx: usize, slot: Slot) -> (&UnitRange, &ParamEntry) {
        let unit = &self.params.units()[layer_idx + 1];
        (unit, &self.params.entries()[unit.entries.start + slot.param_in_block()])
    }

    /// The 16-bit leaf of `slot` for a forward with autograd (see `set_unit_casts`): the one
    /// handed out since the last `add_cast_grads` of its block, or a new one, cut from the block's
    /// one cast (made now if the step has none yet). The head's is its own cast of the embedding.
    fn leaf(&self, slot: Slot) -> Tensor {
        if let Some(leaf) = &self.leaves.borrow()[slot.0] {
            return leaf.shallow_clone();
        }
        let values = match slot.layer(self.shape.n_layer) {
            None => tch::no_grad(|| self.wte.to_kind(self.compute)),
            Some(layer_idx) => self.block_cast_of(layer_idx, slot),
        };
        let leaf = values.detach().set_requires_grad(true);
        self.leaves.borrow_mut()[slot.0] = Some(leaf.shallow_clone());
        leaf
    }

    /// Slot `slot`'s part of block `layer_idx`'s one cast (made now if the step has none yet).
    fn block_cast_of(&self, layer_idx: usize, slot: Slot) -> Tensor {
        let (unit, entry) = self.block_entry(layer_idx, slot);
        let cast = self.block_casts.borrow_mut()[layer_idx]
            .get_or_insert_with(|| {
                let len = unit.range.end - unit.range.start;
                tch::no_grad(|| self.params.flat().narrow(0, unit.range.start, len).to_kind(self.compute))
            })
            .shallow_clone();
        cast.narrow(0, entry.offset - unit.range.start, entry.numel).view(entry.shape.as_slice())
    }

    /// How many casts the step keeps now (each weight and bias of the linear layers once reuse
    /// is on and a micro-batch ran with autograd).
    pub fn kept_casts(&self) -> usize {
        self.casts.borrow().iter().filter(|cast| cast.is_some()).count()
    }

    /// `tensor` in the compute type: the step's kept cast if there is one; a new one otherwise,
    /// kept when reuse is on and it is part of the autograd graph (a cast made under `no_grad`,
    /// an evaluation or a recomputed forward, has no path to the master's gradient).
    fn cast(&self, slot: Slot, tensor: &Tensor) -> Tensor {
        if let Some(cast) = &self.casts.borrow()[slot.0] {
            return cast.shallow_clone();
        }
        let cast = tensor.to_kind(self.compute);
        if self.reuse_casts && cast.requires_grad() {
            self.casts.borrow_mut()[slot.0] = Some(cast.shallow_clone());
        }
        cast
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
    /// (`kernels::bias_gelu_bf16`, on `n_threads` threads; `train.fused_bias_gelu`), with the
    /// backward by hand: the kernel's (the bias's gradient summed in the same pass) and the
    /// linear layer's two matrix multiplies. `false` (the default of `new`) keeps libtorch's
    /// `addmm`, `gelu` and autograd.
    pub fn set_fused_bias_gelu(&mut self, enabled: bool, n_threads: usize) {
        self.fused_bias_gelu_threads = if enabled { n_threads.max(1) } else { 0 };
    }

    /// Whether the executor runs the MLP's bias and GELU by hand (see `set_fused_bias_gelu`).
    pub(crate) fn fused_bias_gelu(&self) -> bool {
        self.fused_bias_gelu_threads > 0 && self.compute == Kind::BFloat16 && self.wte.device() == Device::Cpu
    }

    /// Whether the executor takes the LayerNorms from the kernel (see `set_fused_layer_norm`).
    pub(crate) fn fused_layer_norm(&self) -> bool {
        self.fused_layer_norm_threads > 0 && self.compute == Kind::BFloat16 && self.wte.device() == Device::Cpu
    }

    fn norm(&self, which: Norm) -> &(Tensor, Tensor) {
        match which {
            Norm::Attention(layer_idx) => &self.blocks[layer_idx].ln_1,
            Norm::Mlp(layer_idx) => &self.blocks[layer_idx].ln_2,
            Norm::Final => &self.ln_f,
        }
    }

    /// LayerNorm `which` of `x` (fp32) by the kernel, in bf16, with what its backward needs;
    /// `None` when the kernel is off or does not take `x` (the caller runs libtorch's ops).
    pub(crate) fn fused_norm(&self, which: Norm, x: &Tensor) -> Option<(Tensor, LayerNormStats)> {
        if !self.fused_layer_norm() {
            return None;
        }
        let (weight, bias) = self.norm(which);
        crate::kernels::layer_norm_bf16(x, weight, bias, LAYER_NORM_EPS, self.fused_layer_norm_threads)
    }

    /// LayerNorm `which` of `x` by libtorch's op, fp32.
    pub(crate) fn norm_by_libtorch(&self, which: Norm, x: &Tensor) -> Tensor {
        self.layer_norm(x, self.norm(which))
    }

    /// The backward of a `fused_norm`: the gradient with respect to `x` given the normed
    /// output's `grad`, added in place to `residual` when given; the weight's and bias's
    /// gradients go into their views of the flat gradient buffer.
    pub(crate) fn fused_norm_backward(
        &self,
        which: Norm,
        grad: &Tensor,
        x: &Tensor,
        stats: &LayerNormStats,
        residual: Option<Tensor>,
    ) -> Tensor {
        let (weight, bias) = self.norm(which);
        crate::kernels::layer_norm_bf16_backward(
            grad,
            x,
            stats,
            weight,
            residual.map(|r| r.contiguous()),
            &weight.grad(),
            &bias.grad(),
            self.fused_layer_norm_threads,
        )
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
        let seq = inputs.size()[1];
        let positions = Tensor::arange(seq, (Kind::Int64, inputs.device()));
        Tensor::embedding(&self.wte, inputs, -1, false, false)
            + Tensor::embedding(&self.wpe, &positions, -1, false, false)
    }

    /// The first half of block `layer_idx`: `x + attention(ln_1(x))`.
    pub fn attention_residual(&self, layer_idx: usize, x: &Tensor) -> Tensor {
        x + self.attention_branch(layer_idx, &self.layer_norm(x, &self.blocks[layer_idx].ln_1))
    }

    /// The attention of block `layer_idx` on `h`, its input already normed (fp32, or bf16 from
    /// the fused LayerNorm), in the compute type.
    pub(crate) fn attention_branch(&self, layer_idx: usize, h: &Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        let (batch, seq, d) = h.size3().expect("activations are [batch, seq, d]");
        let n_head = self.shape.n_head as i64;
        let head_dim = d / n_head;
        let qkv = self.linear(h, Slot::weight(layer_idx, Slot::ATTN), &block.attn_w, Some(&block.attn_b));
        let y = match self.attention {
            Attention::Sdpa(kind) => {
                // Cast once while contiguous (a no-op when the projection already ran in `kind`):
                // casting each head view after its transpose is three strided copies instead.
                let parts = qkv.to_kind(kind).split(d, 2);
                let heads = |t: &Tensor| t.view([batch, seq, n_head, head_dim]).transpose(1, 2);
                let (q, k, v) = (heads(&parts[0]), heads(&parts[1]), heads(&parts[2]));
                Tensor::scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, true, None, false)
            }
            Attention::Math(kind) => {
                let mask = self
                    .causal_mask
                    .as_ref()
                    .expect("math attention builds its mask")
                    .narrow(0, 0, seq)
                    .narrow(1, 0, seq);
                let heads = math_heads(&qkv, kind, n_head).unbind(0);
                let (q, k, v) = (&heads[0], &heads[1], &heads[2]);
                let scale = 1.0 / (head_dim as f64).sqrt();
                let rows = self.causal_block_rows as i64;
                let bh = batch * n_head;
                if rows == 0 || rows >= seq {
                    let scores = mask.expand([bh, seq, seq], false).baddbmm(q, &k.transpose(1, 2), 1.0, scale);
                    scores.softmax(-1, None).bmm(v).view([batch, n_head, seq, head_dim])
                } else {
                    // Queries [start, end) see keys [0, end): every block's scores are the
                    // causal rows of the square, masked only where they cross the diagonal.
                    let blocks: Vec<Tensor> = (0..seq)
                        .step_by(rows as usize)
                        .map(|start| {
                            let len = rows.min(seq - start);
                            let end = start + len;
                            let keys = k.narrow(1, 0, end);
                            let scores = mask
                                .narrow(0, start, len)
                                .narrow(1, 0, end)
                                .expand([bh, len, end], false)
                                .baddbmm(&q.narrow(1, start, len), &keys.transpose(1, 2), 1.0, scale);
                            scores.softmax(-1, None).bmm(&v.narrow(1, 0, end))
                        })
                        .collect();
                    Tensor::cat(&blocks, 1).view([batch, n_head, seq, head_dim])
                }
            }
        };
        self.attention_out(layer_idx, &y)
    }

    /// The attention's output projection of the heads' weighted sums `[batch, n_head, seq,
    /// head_dim]`.
    fn attention_out(&self, layer_idx: usize, y: &Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        let (batch, n_head, seq, head_dim) = y.size4().expect("weighted sums are [batch, n_head, seq, head_dim]");
        let y = y.transpose(1, 2).contiguous().view([batch, seq, n_head * head_dim]);
        self.linear(&y, Slot::weight(layer_idx, Slot::ATTN_PROJ), &block.attn_proj_w, Some(&block.attn_proj_b))
    }

    /// `attention_branch` with the core by hand (see `set_fused_softmax`): the q, k, v projection
    /// and the output projection run in libtorch's graph, the core (`attention_core`) between
    /// them, its weighted sums a new leaf where the projection's graph starts. The branch, and what
    /// `attention_core_backward` needs.
    pub(crate) fn attention_branch_by_hand(&self, layer_idx: usize, h: &Tensor) -> (Tensor, AttentionCore) {
        let block = &self.blocks[layer_idx];
        let qkv = self.linear(h, Slot::weight(layer_idx, Slot::ATTN), &block.attn_w, Some(&block.attn_b));
        let heads = math_heads(&qkv, Kind::BFloat16, self.shape.n_head as i64);
        let mut core = self.attention_core(heads, &h.size());
        core.y = core.y.set_requires_grad(true);
        let slot = Slot::weight(layer_idx, Slot::ATTN_PROJ);
        let branch = self.linear(&core.y, slot, &block.attn_proj_w, Some(&block.attn_proj_b));
        (branch, core)
    }

    /// The whole attention branch by hand, outside libtorch's graph, from the fused LayerNorm's
    /// bf16 output `normed`: the projections' matrix multiplies as libtorch's linear layers run
    /// them, the core between them. The branch (bf16, no graph), and what
    /// `attention_half_backward` needs.
    pub(crate) fn attention_half_by_hand(&self, layer_idx: usize, normed: &Tensor) -> (Tensor, AttentionHalf) {
        let block = &self.blocks[layer_idx];
        tch::no_grad(|| {
            let (qkv, qkv_weight) = self.linear16(normed, layer_idx, Slot::ATTN, (&block.attn_w, &block.attn_b));
            let core = self.attention_core(math_heads(&qkv, Kind::BFloat16, self.shape.n_head as i64), &normed.size());
            drop(qkv);
            let (branch, proj_weight) =
                self.linear16(&core.y, layer_idx, Slot::ATTN_PROJ, (&block.attn_proj_w, &block.attn_proj_b));
            (branch, AttentionHalf { normed: normed.shallow_clone(), qkv_weight, proj_weight, core })
        })
    }

    /// The backward by hand of an `attention_half_by_hand` from its output's gradient `grad`
    /// (fp32 `[batch, seq, d]`): every parameter's gradient added into the flat gradient buffer,
    /// and the normed input's returned (bf16).
    pub(crate) fn attention_half_backward(&self, layer_idx: usize, half: &AttentionHalf, grad: &Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        tch::no_grad(|| {
            let grad_y = self.branch_output_backward(
                grad,
                &half.core.y,
                &half.proj_weight,
                (&block.attn_proj_w, &block.attn_proj_b),
            );
            let grad_heads = self.attention_core_backward(&half.core, &grad_y);
            drop(grad_y);
            let (batch, seq, d) = half.normed.size3().expect("activations are [batch, seq, d]");
            let n_head = self.shape.n_head as i64;
            // `math_heads` backward: from head-major order back to the projection's `[.., 3d]`.
            let grad_qkv = grad_heads.view([3, batch, n_head, seq, d / n_head]).permute([1, 3, 0, 2, 4]).reshape([
                batch,
                seq,
                3 * d,
            ]);
            drop(grad_heads);
            linear_backward(&grad_qkv, &half.normed, &half.qkv_weight, (&block.attn_w, &block.attn_b))
        })
    }

    /// The backward of a branch's last linear layer (`weight` in the compute type, `master` the
    /// fp32 weight and bias) from the half's output gradient `grad` (fp32; the residual adds the
    /// branch in the compute type, so the branch's gradient is `grad`'s cast): the layer's input's
    /// gradient.
    fn branch_output_backward(
        &self,
        grad: &Tensor,
        input: &Tensor,
        weight: &Tensor,
        master: (&Tensor, &Tensor),
    ) -> Tensor {
        linear_backward(&grad.to_kind(self.compute), input, weight, master)
    }

    /// The attention's core outside libtorch's graph from q, k and v `heads` of activations shaped
    /// `shape` (`[batch, seq, d]`): the scores of each causal query block
    /// (`train.causal_block_rows`) are `bmm`-ed into one buffer, the kernel turns them into
    /// probabilities in place, and their products with v make the weighted sums, in the output
    /// projection's layout.
    fn attention_core(&self, heads: Tensor, shape: &[i64]) -> AttentionCore {
        let (batch, seq, d) = (shape[0], shape[1], shape[2]);
        let n_head = self.shape.n_head as i64;
        let head_dim = d / n_head;
        let bh = batch * n_head;
        let (blocks, total) = CausalBlock::layout(seq as usize, self.causal_block_rows, bh as usize);
        let scale = 1.0 / (head_dim as f64).sqrt();
        let (probs, y) = tch::no_grad(|| {
            let parts = heads.detach();
            let (q, k, v) = (parts.get(0), parts.get(1), parts.get(2));
            let probs = Tensor::empty([total as i64], (Kind::BFloat16, Device::Cpu));
            for b in &blocks {
                let keys = k.narrow(1, 0, b.cols as i64).transpose(1, 2);
                let _ = q.narrow(1, b.first as i64, b.rows as i64).bmm_out(&b.matrices(&probs, bh as usize), &keys);
            }
            crate::kernels::causal_softmax_bf16(&probs, &blocks, bh as usize, scale as f32, self.fused_softmax_threads);
            let sums: Vec<Tensor> =
                blocks.iter().map(|b| b.matrices(&probs, bh as usize).bmm(&v.narrow(1, 0, b.cols as i64))).collect();
            let y = if sums.len() == 1 { sums[0].shallow_clone() } else { Tensor::cat(&sums, 1) };
            // In the output projection's layout, heads side by side: the tensor the projection
            // keeps for its backward, not a second copy of the weighted sums.
            let y = y.view([batch, n_head, seq, head_dim]).transpose(1, 2).contiguous().view([batch, seq, d]);
            (probs, y)
        });
        AttentionCore { heads, probs, blocks, y, scale }
    }

    /// The backward by hand of an attention core from its weighted sums' gradient `grad_y` (the
    /// output projection's backward ran): the gradient of its `heads`, `[3, batch *
    /// n_head, seq, head_dim]` bf16. Per query block: the probabilities' gradient `dY V^T` into one
    /// buffer, `dV += P^T dY`; the kernel turns the buffer into the scores' gradient in place;
    /// then `dQ = dS K` and `dK += dS^T Q`.
    pub(crate) fn attention_core_backward(&self, core: &AttentionCore, grad_y: &Tensor) -> Tensor {
        tch::no_grad(|| {
            let (_, bh, seq, head_dim) = core.heads.size4().expect("q, k and v are [3, heads, seq, head_dim]");
            let n_head = self.shape.n_head as i64;
            let grad_y = grad_y.view([bh / n_head, seq, n_head, head_dim]).transpose(1, 2).reshape([bh, seq, head_dim]);
            let parts = core.heads.detach();
            let (q, k, v) = (parts.get(0), parts.get(1), parts.get(2));
            // One block covers every key: its products are written straight into the gradient.
            let whole = core.blocks.len() == 1;
            let options = (Kind::BFloat16, Device::Cpu);
            let grad_heads = if whole {
                Tensor::empty([3, bh, seq, head_dim], options)
            } else {
                Tensor::zeros([3, bh, seq, head_dim], options)
            };
            let (dq, dk, dv) = (grad_heads.get(0), grad_heads.get(1), grad_heads.get(2));
            let grad_probs = Tensor::empty_like(&core.probs);
            for b in &core.blocks {
                let (first, rows, cols) = (b.first as i64, b.rows as i64, b.cols as i64);
                let grad_y = grad_y.narrow(1, first, rows);
                let _ = grad_y.bmm_out(&b.matrices(&grad_probs, bh as usize), &v.narrow(1, 0, cols).transpose(1, 2));
                let probs_t = b.matrices(&core.probs, bh as usize).transpose(1, 2);
                if whole {
                    let _ = probs_t.bmm_out(&dv, &grad_y);
                } else {
                    let mut dv = dv.narrow(1, 0, cols);
                    dv += probs_t.bmm(&grad_y);
                }
            }
            crate::kernels::causal_softmax_backward_bf16(
                &core.probs,
                &grad_probs,
                &core.blocks,
                bh as usize,
                core.scale as f32,
                self.fused_softmax_threads,
            );
            for b in &core.blocks {
                let (first, rows, cols) = (b.first as i64, b.rows as i64, b.cols as i64);
                let grad_scores = b.matrices(&grad_probs, bh as usize);
                let (keys, queries) = (k.narrow(1, 0, cols), q.narrow(1, first, rows));
                if whole {
                    let _ = grad_scores.bmm_out(&dq, &keys);
                    let _ = grad_scores.transpose(1, 2).bmm_out(&dk, &queries);
                } else {
                    dq.narrow(1, first, rows).copy_(&grad_scores.bmm(&keys));
                    let mut dk = dk.narrow(1, 0, cols);
                    dk += grad_scores.transpose(1, 2).bmm(&queries);
                }
            }
            grad_heads
        })
    }

    /// The second half of block `layer_idx`: `x + mlp(ln_2(x))`.
    pub fn mlp_residual(&self, layer_idx: usize, x: &Tensor) -> Tensor {
        x + self.mlp_branch(layer_idx, &self.layer_norm(x, &self.blocks[layer_idx].ln_2))
    }

    /// The MLP of block `layer_idx` on `h`, its input already normed, in the compute type.
    pub(crate) fn mlp_branch(&self, layer_idx: usize, h: &Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        let h = self.linear(h, Slot::weight(layer_idx, Slot::FC), &block.fc_w, Some(&block.fc_b)).gelu("none");
        self.linear(&h, Slot::weight(layer_idx, Slot::MLP_PROJ), &block.mlp_proj_w, Some(&block.mlp_proj_b))
    }

    /// `mlp_branch` with the first bias and the GELU by hand (see `set_fused_bias_gelu`): `h`
    /// cast to bf16 in libtorch's graph, then outside it the core (`mlp_core`), whose activation
    /// is a new leaf where the second linear layer's graph starts. The branch, and what
    /// `mlp_core_backward` needs.
    pub(crate) fn mlp_branch_by_hand(&self, layer_idx: usize, h: &Tensor) -> (Tensor, MlpCore) {
        let block = &self.blocks[layer_idx];
        let mut core = self.mlp_core(layer_idx, h.to_kind(self.compute));
        core.act = core.act.set_requires_grad(true);
        let branch =
            self.linear(&core.act, Slot::weight(layer_idx, Slot::MLP_PROJ), &block.mlp_proj_w, Some(&block.mlp_proj_b));
        (branch, core)
    }

    /// The whole MLP branch by hand, outside libtorch's graph, from the fused LayerNorm's bf16
    /// output `normed`: the core, then the second linear layer as libtorch's runs it. The branch
    /// (bf16, no graph), and what `mlp_half_backward` needs.
    pub(crate) fn mlp_half_by_hand(&self, layer_idx: usize, normed: &Tensor) -> (Tensor, MlpHalf) {
        let block = &self.blocks[layer_idx];
        tch::no_grad(|| {
            let core = self.mlp_core(layer_idx, normed.shallow_clone());
            let (branch, proj_weight) =
                self.linear16(&core.act, layer_idx, Slot::MLP_PROJ, (&block.mlp_proj_w, &block.mlp_proj_b));
            (branch, MlpHalf { proj_weight, core })
        })
    }

    /// `attention_half_backward` for an `mlp_half_by_hand`.
    pub(crate) fn mlp_half_backward(&self, layer_idx: usize, half: &MlpHalf, grad: &Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        tch::no_grad(|| {
            let grad_act = self.branch_output_backward(
                grad,
                &half.core.act,
                &half.proj_weight,
                (&block.mlp_proj_w, &block.mlp_proj_b),
            );
            self.mlp_core_backward(layer_idx, &half.core, &grad_act)
        })
    }

    /// The MLP's first linear layer without its bias, then the bias and GELU by the kernel, all
    /// outside libtorch's graph, from `input` (bf16).
    fn mlp_core(&self, layer_idx: usize, input: Tensor) -> MlpCore {
        let block = &self.blocks[layer_idx];
        let (weight, pre, act) = tch::no_grad(|| {
            let weight = self.weight16(layer_idx, Slot::weight(layer_idx, Slot::FC), &block.fc_w);
            let pre = input.detach().linear(&weight, None::<&Tensor>);
            let act = crate::kernels::bias_gelu_bf16(&pre, &block.fc_b, self.fused_bias_gelu_threads)
                .expect("the MLP's product is contiguous bf16 and its bias a contiguous fp32 view");
            (weight, pre, act)
        });
        MlpCore { input, weight, pre, act }
    }

    /// The backward by hand of an MLP core from its activation's gradient `grad_act` (the second
    /// linear layer's backward ran): the gradient of its `input`. The kernel gives the product's
    /// gradient and adds the bias's into the flat gradient buffer; the weight's gradient, `dP^T
    /// h`, is added there too (as the bf16 leaf's would be), and the input's is `dP W`.
    pub(crate) fn mlp_core_backward(&self, layer_idx: usize, core: &MlpCore, grad_act: &Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        tch::no_grad(|| {
            let grad_pre = crate::kernels::bias_gelu_bf16_backward(
                grad_act,
                &core.pre,
                &block.fc_b,
                &block.fc_b.grad(),
                self.fused_bias_gelu_threads,
            );
            let hidden = *grad_pre.size().last().expect("the product is [.., 4d]");
            let d = *core.weight.size().last().expect("the weight is [4d, d]");
            let rows = grad_pre.view([-1, hidden]);
            let mut weight_grad = block.fc_w.grad();
            weight_grad += rows.transpose(0, 1).mm(&core.input.detach().view([-1, d]));
            grad_pre.matmul(&core.weight)
        })
    }

    /// Linear layer `layer` (a `Slot` constant) of block `layer_idx` on `x` in the compute type,
    /// outside the graph, from its fp32 weight and bias `master`: the output and the weight as
    /// cast (`weight16`), which the layer's backward by hand takes.
    fn linear16(&self, x: &Tensor, layer_idx: usize, layer: usize, master: (&Tensor, &Tensor)) -> (Tensor, Tensor) {
        let slot = Slot::weight(layer_idx, layer);
        let weight = self.weight16(layer_idx, slot, master.0);
        let out = tch::no_grad(|| x.linear(&weight, Some(&self.weight16(layer_idx, slot.bias(), master.1))));
        (out, weight)
    }

    /// Slot `slot`'s weight or bias (`master`, fp32) in the compute type, outside the graph: its
    /// part of the block's one cast with unit casts, else a cast of its own.
    fn weight16(&self, layer_idx: usize, slot: Slot, master: &Tensor) -> Tensor {
        if self.unit_casts {
            self.block_cast_of(layer_idx, slot)
        } else {
            tch::no_grad(|| master.to_kind(self.compute))
        }
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
        let vocab = self.shape.vocab_size as i64;
        logits.to_kind(Kind::Float).view([-1, vocab]).cross_entropy_for_logits(&targets.view([-1]))
    }

    /// The head's loss for the block executor's backward, which starts from `loss x
    /// loss_multiplier`: with the fused kernel (see `set_fused_cross_entropy`) the gradient of the
    /// logits comes with the loss and the head's logits are computed outside the graph (see
    /// `fused_head_backward`); otherwise as `head_loss`. The losses agree within fp32 rounding
    /// (the kernel's exponential is its own). `normed`: `x` is already the final LayerNorm's
    /// output (the fused LayerNorm's).
    pub(crate) fn head_loss_for_backward(
        &self,
        x: &Tensor,
        normed: bool,
        targets: &Tensor,
        loss_multiplier: f64,
    ) -> HeadLoss {
        if self.fused_cross_entropy_threads > 0 && self.compute == Kind::BFloat16 {
            let input =
                if normed { x.to_kind(self.compute) } else { self.layer_norm(x, &self.ln_f).to_kind(self.compute) };
            let weight = self.cast(Slot::head(self.shape.n_layer), &self.wte).detach();
            let vocab = self.shape.vocab_size as i64;
            let logits = input.detach().matmul(&weight.tr()).view([-1, vocab]);
            let fused = crate::kernels::cross_entropy_bf16(
                &logits,
                &targets.view([-1]),
                loss_multiplier,
                self.fused_cross_entropy_threads,
            );
            if let Some(fused) = fused {
                return HeadLoss {
                    loss: fused.loss,
                    fused: Some(FusedHead { input, weight, logits_grad: fused.grad }),
                };
            }
        }
        let logits = if normed { self.head_logits_normed(x) } else { self.head_logits(x) };
        HeadLoss { loss: self.mean_cross_entropy(&logits, targets), fused: None }
    }

    /// The fused head's backward by hand: adds the tied weight's gradient (`logits_grad^T x
    /// input`) to the embedding's and returns the head's input in the compute type with its
    /// gradient (`logits_grad x weight`), for the caller to backward from. The same two matrix
    /// multiplies as autograd's backward of the head's linear layer, with no seed over the logits.
    pub(crate) fn fused_head_backward(&self, head: FusedHead) -> (Tensor, Tensor) {
        let FusedHead { input, weight, logits_grad } = head;
        let shape = input.size();
        let d = *shape.last().expect("the head's input has a width");
        let grad_input = logits_grad.mm(&weight).view(shape.as_slice());
        drop(weight);
        let grad_weight = logits_grad.tr().mm(&input.detach().view([-1, d]));
        drop(logits_grad);
        tch::no_grad(|| {
            let mut grad = self.wte.grad();
            grad += &grad_weight;
        });
        (input, grad_input)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn model(attention: AttentionPrecision) -> Gpt {
        tch::manual_seed(11);
        let shape = GptShape { n_layer: 2, n_head: 4, d_model: 64, seq_len: 32, vocab_size: 64 };
        Gpt::new(shape, Precision::Bf16, attention, Device::Cpu)
    }

    #[test]
    fn bf16_math_attention_is_causal_sdpa_in_bf16() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let inputs = Tensor::randint(64, [3, 32], (Kind::Int64, Device::Cpu));
        let reference = model(AttentionPrecision::Fp32);
        let math = model(AttentionPrecision::Bf16Math);
        // The same weights whatever other tests do to libtorch's global generator meanwhile.
        tch::no_grad(|| math.params().flat().shallow_clone().copy_(reference.params().flat()));
        assert_eq!(math.attention, Attention::Math(Kind::BFloat16));
        assert_eq!(
            model(AttentionPrecision::Auto).attention,
            Attention::Math(Kind::BFloat16),
            "auto on a CPU at context 32"
        );
        let (a, b) = (reference.forward(&inputs).to_kind(Kind::Float), math.forward(&inputs).to_kind(Kind::Float));
        // The difference is bf16 rounding of scores and probabilities.
        let worst = (&a - &b).abs().max().double_value(&[]);
        let scale = a.abs().max().double_value(&[]);
        assert!(worst < 0.05 * scale, "logits differ by {worst} (largest {scale})");
        // Causal: changing the last token leaves every earlier position's logits alone.
        let changed = inputs.copy();
        let mut last = changed.narrow(1, 31, 1);
        last.copy_(&((inputs.narrow(1, 31, 1) + 1).remainder(64)));
        let c = math.forward(&changed).to_kind(Kind::Float);
        let earlier = (b.narrow(1, 0, 31) - c.narrow(1, 0, 31)).abs().max().double_value(&[]);
        assert_eq!(earlier, 0.0, "a later token leaked into earlier positions");
    }

    #[test]
    fn blocked_causal_attention_is_the_whole_square_masked() {
        let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let inputs = Tensor::randint(64, [3, 32], (Kind::Int64, Device::Cpu));
        let targets = Tensor::randint(64, [3, 32], (Kind::Int64, Device::Cpu));
        let whole = model(AttentionPrecision::Bf16Math);
        // Weights large enough that the attention is far from uniform: with the init's N(0, 0.02)
        // every softmax is near 1/n, and keys in a wrong order would give the same output.
        tch::no_grad(|| {
            let flat = whole.params().flat();
            flat.shallow_clone().copy_(&(flat.randn_like() * 0.5));
        });
        let run = |m: &Gpt| {
            m.params().zero_grad();
            let logits = m.forward(&inputs).to_kind(Kind::Float);
            logits.view([-1, 64]).cross_entropy_for_logits(&targets.view([-1])).backward();
            (logits, m.params().flat_grad().copy())
        };
        let (logits, grad) = run(&whole);
        // 4 even blocks, uneven ones (12, 12, 8), and one block as large as the context.
        for rows in [8, 12, 32] {
            let mut blocked = model(AttentionPrecision::Bf16Math);
            tch::no_grad(|| blocked.params().flat().shallow_clone().copy_(whole.params().flat()));
            blocked.set_causal_block_rows(rows);
            let (l, g) = run(&blocked);
            let worst = (&l - &logits).abs().max().double_value(&[]);
            assert!(worst < 1e-2 * logits.abs().max().double_value(&[]), "rows {rows}: logits differ by {worst}");
            let worst = (&g - &grad).abs().max().double_value(&[]);
            let scale = grad.abs().max().double_value(&[]);
            assert!(worst < 2e-2 * scale, "rows {rows}: gradients differ by {worst} (largest {scale})");
            assert!(g.abs().sum(Kind::Double).double_value(&[]) > 0.0, "rows {rows}: no gradient");
        }
    }

    #[test]
    fn the_fused_head_gives_the_logits_gradient_under_bf16_only() {
        let shape = GptShape { n_layer: 1, n_head: 2, d_model: 16, seq_len: 8, vocab_size: 32 };
        let x = Tensor::randn([2, 8, 16], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let targets = Tensor::randint(32, [2, 8], (Kind::Int64, Device::Cpu));
        for (precision, enabled, fused) in
            [(Precision::Bf16, true, true), (Precision::Bf16, false, false), (Precision::Fp32, true, false)]
        {
            let mut model = Gpt::new(shape, precision, AttentionPrecision::Auto, Device::Cpu);
            model.set_fused_cross_entropy(enabled, 2);
            let head = model.head_loss_for_backward(&x, false, &targets, 1.0);
            assert_eq!(head.fused.is_some(), fused, "{precision:?}, enabled {enabled}");
        }
    }
}
