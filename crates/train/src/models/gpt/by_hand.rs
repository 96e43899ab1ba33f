//! The GPT's parts by hand, outside libtorch's graph: the fused LayerNorm, the attention's core
//! with the causal softmax kernel, the MLP's bias and GELU kernel, the fused cross-entropy head,
//! each with its backward, and whole branches after the fused LayerNorm with no graph at all.

use tch::{Kind, Tensor};

use super::attention::math_heads;
use super::parts::{Gpt, Slot, LAYER_NORM_EPS};
use crate::kernels::{attention_core, attention_core_backward, AttentionCore, LayerNormStats};
use crate::models::{Branch, BranchBackward, ByHand, CoreBackward, HeadBackward, HeadLoss, Norm};
use crate::precision::Products;

/// The fused cross-entropy's head, for its backward by hand: the logits' gradient came with the
/// loss, so the head's matrix multiplies are backward-ed here instead of through autograd, whose
/// backward starts only from a scalar (a `<logits, gradient>` seed over the whole `[rows, vocab]`
/// would cost more than the kernel saves).
pub(super) struct FusedHead<'m> {
    model: &'m Gpt,
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

/// The backward by hand of the 16-bit linear layer `x W^T + b` from its output's gradient `grad`
/// (16-bit, `[.., out]`): adds the weight's gradient `grad^T x` (a 16-bit product, as autograd's
/// is) and the bias's (summed in fp32) into the fp32 parameters' (`master`) gradients, and returns
/// the input's, `grad W`. A layer that narrows (`out < in`, an MLP's second) takes its weight's
/// gradient as `(x^T grad)^T`: oneDNN's bf16 product over the rows ran about 25% faster with the
/// wider side as its output's rows (at the vla-small's `[384, 1536]` over 1,960 rows, 1.75 ms
/// against 2.37 ms, and 2.30 ms against 2.60 ms with the transposed add), and the sum is the same.
pub(crate) fn linear_backward(
    products: Products,
    grad: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    (master_w, master_b): (&Tensor, &Tensor),
) -> Tensor {
    let out = *grad.size().last().expect("a width");
    let mut b_grad = master_b.grad();
    b_grad += grad.reshape([-1, out]).sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
    linear_backward_unbiased(products, grad, x, weight, master_w)
}

/// `linear_backward` but for the bias's gradient (which the caller has summed).
pub(crate) fn linear_backward_unbiased(
    products: Products,
    grad: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    master_w: &Tensor,
) -> Tensor {
    let (out, d_in) = (*grad.size().last().expect("a width"), *x.size().last().expect("a width"));
    let grad = products.operand(grad);
    let rows = grad.reshape([-1, out]);
    let mut w_grad = master_w.grad();
    if out < d_in {
        let mut w_grad_t = w_grad.tr();
        w_grad_t += products.mm(&x.reshape([-1, d_in]).tr(), &rows);
    } else {
        w_grad += products.mm(&rows.tr(), &x.reshape([-1, d_in]));
    }
    products.matmul(&grad, weight)
}

impl Gpt {
    /// LayerNorm `which` of `x` (fp32) by the kernel, in bf16, with what its backward needs;
    /// `None` when the kernel is off or does not take `x` (the caller runs libtorch's ops).
    pub(crate) fn fused_norm(&self, which: Norm, x: &Tensor) -> Option<(Tensor, LayerNormStats)> {
        if !self.fused_layer_norm() {
            return None;
        }
        let (weight, bias) = self.norm_params(which);
        crate::kernels::layer_norm_bf16(x, weight, bias, LAYER_NORM_EPS, self.fused_layer_norm_threads)
    }

    /// LayerNorm `which` of `x` by libtorch's op, fp32.
    pub(crate) fn norm_by_libtorch(&self, which: Norm, x: &Tensor) -> Tensor {
        self.layer_norm(x, self.norm_params(which))
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
        let (weight, bias) = self.norm_params(which);
        crate::kernels::layer_norm_bf16_backward(
            grad,
            x,
            stats,
            weight,
            residual.map(|r| r.contiguous()),
            &weight.grad(),
            &bias.grad(),
            None,
            self.fused_layer_norm_threads,
        )
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
            linear_backward(
                self.native_products(),
                &grad_qkv,
                &half.normed,
                &half.qkv_weight,
                (&block.attn_w, &block.attn_b),
            )
        })
    }

    /// The backward of a branch's last linear layer (`weight` in the compute type, `master` the
    /// fp32 weight and bias) from the half's output gradient `grad` (fp32; the residual adds the
    /// branch in the compute type, so the branch's gradient is `grad`'s cast): the layer's input's
    /// gradient.
    pub(super) fn branch_output_backward(
        &self,
        grad: &Tensor,
        input: &Tensor,
        weight: &Tensor,
        master: (&Tensor, &Tensor),
    ) -> Tensor {
        linear_backward(self.native_products(), &grad.to_kind(self.compute), input, weight, master)
    }

    /// The GPT's by-hand products run in the compute type on every CPU.
    fn native_products(&self) -> Products {
        Products::with(self.compute, false)
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
    pub(super) fn mlp_core(&self, layer_idx: usize, input: Tensor) -> MlpCore {
        let block = &self.blocks[layer_idx];
        let (weight, pre, act) = tch::no_grad(|| {
            let weight = self.weight16(layer_idx, Slot::weight(layer_idx, Slot::FC), &block.fc_w);
            let pre = input.detach().linear(&weight, None::<&Tensor>);
            let act = crate::kernels::bias_gelu(&pre, &block.fc_b, self.fused_bias_gelu_threads)
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
            let grad_pre = crate::kernels::bias_gelu_backward(
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
    ) -> HeadLoss<'_> {
        if let Some(head) = self.cut_head(x, normed, targets, loss_multiplier) {
            return head;
        }
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
                    by_hand: Some(Box::new(FusedHead { model: self, input, weight, logits_grad: fused.grad })),
                };
            }
        }
        let logits = if normed { self.head_logits_normed(x) } else { self.head_logits(x) };
        HeadLoss { loss: self.mean_cross_entropy(&logits, targets), by_hand: None }
    }

    /// The fused head's backward by hand: adds the tied weight's gradient (`logits_grad^T x
    /// input`) to the embedding's and returns the head's input in the compute type with its
    /// gradient (`logits_grad x weight`), for the caller to backward from. The same two matrix
    /// multiplies as autograd's backward of the head's linear layer, with no seed over the logits.
    pub(super) fn fused_head_backward(&self, input: Tensor, weight: Tensor, logits_grad: Tensor) -> (Tensor, Tensor) {
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

    /// The attention's core outside libtorch's graph (`kernels::attention_core`) with this
    /// model's heads, causal query blocks and softmax threads.
    fn attention_core(&self, heads: Tensor, shape: &[i64]) -> AttentionCore {
        let n_head = self.shape.n_head as i64;
        attention_core(heads, shape, n_head, self.causal_block_rows, self.fused_softmax_threads)
    }

    /// `kernels::attention_core_backward` with this model's heads and softmax threads.
    pub(super) fn attention_core_backward(&self, core: &AttentionCore, grad_y: &Tensor) -> Tensor {
        attention_core_backward(core, grad_y, self.shape.n_head as i64, self.fused_softmax_threads)
    }
}

impl HeadBackward for FusedHead<'_> {
    fn backward(self: Box<Self>) -> (Tensor, Tensor) {
        let FusedHead { model, input, weight, logits_grad } = *self;
        model.fused_head_backward(input, weight, logits_grad)
    }
}

/// A branch whole by hand, with the model that runs its backward.
enum WholeBranch<'m> {
    Attention(&'m Gpt, usize, AttentionHalf),
    Mlp(&'m Gpt, usize, MlpHalf),
}

impl BranchBackward for WholeBranch<'_> {
    fn backward(&self, grad_output: &Tensor) -> Tensor {
        match self {
            WholeBranch::Attention(model, layer_idx, half) => {
                model.attention_half_backward(*layer_idx, half, grad_output)
            }
            WholeBranch::Mlp(model, layer_idx, half) => model.mlp_half_backward(*layer_idx, half, grad_output),
        }
    }
}

/// A branch's core by hand, with the model that runs its backward.
enum BranchCore<'m> {
    Attention(&'m Gpt, AttentionCore),
    Mlp(&'m Gpt, usize, MlpCore),
}

impl CoreBackward for BranchCore<'_> {
    fn backward(&self) -> (Tensor, Tensor) {
        match self {
            BranchCore::Attention(model, core) => {
                (core.heads.shallow_clone(), model.attention_core_backward(core, &core.y.grad()))
            }
            BranchCore::Mlp(model, layer_idx, core) => {
                (core.input.shallow_clone(), model.mlp_core_backward(*layer_idx, core, &core.act.grad()))
            }
        }
    }
}

impl ByHand for Gpt {
    fn norms(&self) -> bool {
        self.fused_layer_norm()
    }

    fn branch(&self, branch: Branch) -> bool {
        if self.tensor.is_some() {
            return true;
        }
        match branch {
            Branch::Attention => self.fused_softmax(),
            Branch::Mlp => self.fused_bias_gelu(),
        }
    }

    fn norm(&self, which: Norm, x: &Tensor) -> Option<(Tensor, LayerNormStats)> {
        self.fused_norm(which, x)
    }

    fn norm_backward(
        &self,
        which: Norm,
        grad: &Tensor,
        x: &Tensor,
        stats: &LayerNormStats,
        residual: Option<Tensor>,
    ) -> Tensor {
        self.fused_norm_backward(which, grad, x, stats, residual)
    }

    fn branch_core<'m>(
        &'m self,
        layer_idx: usize,
        branch: Branch,
        normed: &Tensor,
    ) -> (Tensor, Box<dyn CoreBackward + 'm>) {
        if let Some(cut) = self.cut_branch(layer_idx, branch, normed) {
            return cut;
        }
        match branch {
            Branch::Attention => {
                let (output, core) = self.attention_branch_by_hand(layer_idx, normed);
                (output, Box::new(BranchCore::Attention(self, core)))
            }
            Branch::Mlp => {
                let (output, core) = self.mlp_branch_by_hand(layer_idx, normed);
                (output, Box::new(BranchCore::Mlp(self, layer_idx, core)))
            }
        }
    }

    fn branch_whole<'m>(
        &'m self,
        layer_idx: usize,
        branch: Branch,
        normed: &Tensor,
    ) -> (Tensor, Box<dyn BranchBackward + 'm>) {
        match branch {
            Branch::Attention => {
                let (output, half) = self.attention_half_by_hand(layer_idx, normed);
                (output, Box::new(WholeBranch::Attention(self, layer_idx, half)))
            }
            Branch::Mlp => {
                let (output, half) = self.mlp_half_by_hand(layer_idx, normed);
                (output, Box::new(WholeBranch::Mlp(self, layer_idx, half)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;
    use crate::config::{AttentionPrecision, GptShape, Precision};

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
            assert_eq!(head.by_hand.is_some(), fused, "{precision:?}, enabled {enabled}");
        }
    }
}
