//! The llama family's parts by hand under bf16 on a CPU: each block's attention and MLP branch
//! whole, from the RMSNorm kernel's output (`train.fused_branches`), and the head's loss through
//! the fused cross-entropy (`train.fused_cross_entropy`).
//!
//! A branch's linear layers that read the same input run as one matrix multiply (q, k and v; gate
//! and up), each LoRA adapter's two products beside it as two more for the whole group (the `A`s
//! stacked, the scaled `B`s block-diagonal, added into the product by `addmm`), and the backward
//! is the same products by hand: no autograd graph, no gradient sums between the layers that
//! share an input, and none of a frozen weight's gradient. Between the products the rotary
//! positions and SwiGLU's gate are Rust kernels (`kernels::rope_split_bf16`,
//! `kernels::swiglu_bf16`) and attention is libtorch's CPU flash attention, forward and backward,
//! with its own grouped-query reading. Frozen weights are cast to bf16 once and kept
//! (`Llama::compute_weights`); trained ones are cast each micro-batch, as autograd's path does.

use tch::{Kind, Tensor};

use super::{Linear, Llama};
use crate::kernels::{rope_split_bf16, rope_split_bf16_backward, swiglu_bf16, swiglu_bf16_backward};
use crate::models::{Branch, BranchBackward, HeadBackward, HeadLoss, Inputs};

/// What a group of linear layers on one input keeps for its backward.
struct GroupSaved<'m> {
    layers: Vec<&'m Linear>,
    /// The input `[rows, in]`, bf16.
    input: Tensor,
    /// The layers' weights stacked `[sum of outs, in]`, bf16, outside any graph.
    weight: Tensor,
    lora: Option<LoraSaved>,
}

/// The LoRA adapters of a group: `A`s stacked `[sum of ranks, in]`, the `B`s times the scale
/// block-diagonal `[sum of outs, sum of ranks]` (bf16), and the input's product with the `A`s.
struct LoraSaved {
    a: Tensor,
    b: Tensor,
    t: Tensor,
    /// Per layer with an adapter: its index in the group, its rows of the output and of `t`.
    pieces: Vec<(usize, (i64, i64), (i64, i64))>,
}

/// Adds `value` (bf16 or fp32) into `param`'s fp32 gradient when it trains.
fn add_grad(param: &Tensor, value: &Tensor) {
    if param.requires_grad() {
        let mut grad = param.grad();
        grad += value;
    }
}

impl Llama {
    /// The group's product on `input` `[rows, in]` bf16: `input W^T` for the stacked weights,
    /// plus each adapter's `scale (input A^T) B^T` in its layer's columns.
    fn group_forward<'m>(&'m self, input: &Tensor, layers: &[&'m Linear]) -> (Tensor, GroupSaved<'m>) {
        let weights: Vec<&Tensor> = layers.iter().map(|l| &l.weight).collect();
        let weight = self.compute_weights(&weights);
        let mut out = input.mm(&weight.tr());
        let adapted: Vec<usize> = (0..layers.len()).filter(|&i| layers[i].lora.is_some()).collect();
        let lora = (!adapted.is_empty()).then(|| {
            let (mut pieces, mut a_parts) = (Vec::new(), Vec::new());
            let (outs, mut rank_at): (Vec<i64>, i64) = (layers.iter().map(|l| l.weight.size()[0]).collect(), 0);
            let total_out: i64 = outs.iter().sum();
            for &i in &adapted {
                let (a, _) = layers[i].lora.as_ref().expect("adapted");
                let rank = a.size()[0];
                let out_at: i64 = outs[..i].iter().sum();
                pieces.push((i, (out_at, outs[i]), (rank_at, rank)));
                a_parts.push(a.detach().to_kind(Kind::BFloat16));
                rank_at += rank;
            }
            let a = Tensor::cat(&a_parts, 0);
            let b = Tensor::zeros([total_out, rank_at], (Kind::BFloat16, input.device()));
            for &(i, (out_at, out_n), (r_at, r)) in &pieces {
                let (_, lora_b) = layers[i].lora.as_ref().expect("adapted");
                b.narrow(0, out_at, out_n).narrow(1, r_at, r).copy_(&(lora_b.detach() * self.lora_scale));
            }
            let t = input.mm(&a.tr());
            let _ = out.addmm_(&t, &b.tr());
            LoraSaved { a, b, t, pieces }
        });
        (out, GroupSaved { layers: layers.to_vec(), input: input.shallow_clone(), weight, lora })
    }

    /// The gradient of the group's input from its output's `grad` `[rows, sum of outs]` bf16; the
    /// adapters' and trained weights' gradients go into the flat gradient buffer.
    fn group_backward(&self, saved: &GroupSaved<'_>, grad: &Tensor) -> Tensor {
        let mut dx = grad.mm(&saved.weight);
        if let Some(lora) = &saved.lora {
            let dt = grad.mm(&lora.b);
            let _ = dx.addmm_(&dt, &lora.a);
            for &(i, (out_at, out_n), (r_at, r)) in &lora.pieces {
                let (a, b) = saved.layers[i].lora.as_ref().expect("adapted");
                let grad_b = grad.narrow(1, out_at, out_n).tr().mm(&lora.t.narrow(1, r_at, r)) * self.lora_scale;
                add_grad(b, &grad_b);
                add_grad(a, &dt.narrow(1, r_at, r).tr().mm(&saved.input));
            }
        }
        if saved.layers.iter().any(|l| l.weight.requires_grad()) {
            let grad_w = grad.tr().mm(&saved.input);
            let mut at = 0;
            for layer in &saved.layers {
                let rows = layer.weight.size()[0];
                add_grad(&layer.weight, &grad_w.narrow(0, at, rows));
                at += rows;
            }
        }
        dx
    }

    /// Whether the blocks' branches run whole by hand (see the module doc).
    pub(super) fn branches_by_hand(&self) -> bool {
        self.branches_by_hand && self.fused_rms_norm() && self.compute == Kind::BFloat16
    }

    /// Block `layer_idx`'s `branch` by hand on `normed` `[batch, seq, d]` bf16.
    pub(super) fn branch_by_hand<'m>(
        &'m self,
        layer_idx: usize,
        branch: Branch,
        normed: &Tensor,
    ) -> (Tensor, Box<dyn BranchBackward + 'm>) {
        let _guard = tch::no_grad_guard();
        let shape = normed.size();
        let d = shape[2];
        let x = normed.contiguous().view([-1, d]);
        let block = &self.blocks[layer_idx];
        let threads = self.fused_norm_threads;
        match branch {
            Branch::Attention => {
                let (b, s) = (shape[0], shape[1]);
                let n_q = self.shape.base.n_head;
                let n_kv = self.shape.n_kv_head;
                let hd = d / n_q as i64;
                let (qkv, qkv_saved) = self.group_forward(&x, &[&block.q_proj, &block.k_proj, &block.v_proj]);
                let qkv = qkv.view([b, s, (n_q + 2 * n_kv) as i64, hd]);
                let (q, k, v) = rope_split_bf16(&qkv, n_q, n_kv, &self.cos, &self.sin, threads)
                    .expect("the product is contiguous bf16 on the CPU and the tables cover the context");
                drop(qkv);
                let (out, lse) = Tensor::internal_scaled_dot_product_flash_attention_for_cpu(
                    &q,
                    &k,
                    &v,
                    0.0,
                    true,
                    None::<&Tensor>,
                    None,
                );
                let y = out.transpose(1, 2).contiguous().view([b * s, d]);
                let (o, o_saved) = self.group_forward(&y, &[&block.o_proj]);
                let saved = AttentionSaved { qkv: qkv_saved, q, k, v, out, lse, o: o_saved };
                (o.view(shape.as_slice()), Box::new(BranchSaved { model: self, shape, saved: Saved::Attention(saved) }))
            }
            Branch::Mlp => {
                let (gate_up, gate_up_saved) = self.group_forward(&x, &[&block.gate_proj, &block.up_proj]);
                let act = swiglu_bf16(&gate_up, threads).expect("the product is contiguous bf16 on the CPU");
                let (o, down_saved) = self.group_forward(&act, &[&block.down_proj]);
                let saved = MlpSaved { gate_up_saved, gate_up, down: down_saved };
                (o.view(shape.as_slice()), Box::new(BranchSaved { model: self, shape, saved: Saved::Mlp(saved) }))
            }
        }
    }

    /// The head's loss through the fused cross-entropy: the final norm in libtorch's graph, the
    /// logits outside it; `None` where the kernel does not run (not bf16 on the CPU, cut, or
    /// masked targets).
    pub(super) fn fused_head(&self, x: &Tensor, inputs: &Inputs, loss_multiplier: f64) -> Option<HeadLoss<'_>> {
        let on_cpu = self.lm_head.device() == tch::Device::Cpu;
        if self.fused_ce_threads == 0 || self.compute != Kind::BFloat16 || self.tensor.is_some() || !on_cpu {
            return None;
        }
        // Masked targets (an instruction's prompt) are libtorch's: checked before the norm runs.
        let targets = inputs.targets.reshape([-1]);
        let vocab = self.shape.base.vocab_size as i64;
        if targets.numel() == 0 || targets.min().int64_value(&[]) < 0 || targets.max().int64_value(&[]) >= vocab {
            return None;
        }
        let input = self.rms_norm(x, &self.norm).to_kind(Kind::BFloat16);
        let weight = self.compute_weights(&[&self.lm_head]);
        let d = *input.size().last().expect("[batch, seq, d]");
        let logits = tch::no_grad(|| input.detach().reshape([-1, d]).mm(&weight.tr()));
        let fused = crate::kernels::cross_entropy_bf16(&logits, &targets, loss_multiplier, self.fused_ce_threads)?;
        let head = FusedHead { model: self, input, weight, logits_grad: fused.grad };
        Some(HeadLoss { loss: fused.loss, by_hand: Some(Box::new(head)) })
    }
}

struct AttentionSaved<'m> {
    qkv: GroupSaved<'m>,
    /// Rotated q and k, and v, `[batch, heads, seq, head_dim]`.
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// Flash attention's output `[batch, heads, seq, head_dim]` and log-sum-exp.
    out: Tensor,
    lse: Tensor,
    o: GroupSaved<'m>,
}

struct MlpSaved<'m> {
    gate_up_saved: GroupSaved<'m>,
    /// The gate and up product `[rows, 2 ffn]`, SwiGLU's input.
    gate_up: Tensor,
    down: GroupSaved<'m>,
}

enum Saved<'m> {
    Attention(AttentionSaved<'m>),
    Mlp(MlpSaved<'m>),
}

struct BranchSaved<'m> {
    model: &'m Llama,
    /// The branch's input and output shape `[batch, seq, d]`.
    shape: Vec<i64>,
    saved: Saved<'m>,
}

impl BranchBackward for BranchSaved<'_> {
    fn backward(&self, grad_output: &Tensor) -> Tensor {
        let _guard = tch::no_grad_guard();
        let model = self.model;
        let d = self.shape[2];
        let grad = grad_output.to_kind(Kind::BFloat16).contiguous().view([-1, d]);
        let threads = model.fused_norm_threads;
        let dx = match &self.saved {
            Saved::Attention(s) => {
                let (b, seq) = (self.shape[0], self.shape[1]);
                let dy = model.group_backward(&s.o, &grad);
                let n_q = s.q.size()[1];
                let d_out = dy.view([b, seq, n_q, d / n_q]).transpose(1, 2);
                let (dq, dk, dv) = Tensor::internal_scaled_dot_product_flash_attention_for_cpu_backward(
                    &d_out,
                    &s.q,
                    &s.k,
                    &s.v,
                    &s.out,
                    &s.lse,
                    0.0,
                    true,
                    None::<&Tensor>,
                    None,
                );
                let dqkv = rope_split_bf16_backward(&dq, &dk, &dv, &model.cos, &model.sin, threads);
                let width: i64 = dqkv.size().iter().rev().take(2).product();
                model.group_backward(&s.qkv, &dqkv.view([-1, width]))
            }
            Saved::Mlp(s) => {
                let d_act = model.group_backward(&s.down, &grad);
                let d_gate_up = swiglu_bf16_backward(&d_act, &s.gate_up, threads);
                model.group_backward(&s.gate_up_saved, &d_gate_up)
            }
        };
        dx.view(self.shape.as_slice())
    }
}

/// The fused head's backward: the head's input (in the graph back to the final norm's input)
/// and its gradient `logits_grad W`; the head's weight gradient `logits_grad^T input` when it
/// trains.
struct FusedHead<'m> {
    model: &'m Llama,
    input: Tensor,
    weight: Tensor,
    logits_grad: Tensor,
}

impl HeadBackward for FusedHead<'_> {
    fn backward(self: Box<Self>) -> (Tensor, Tensor) {
        let FusedHead { model, input, weight, logits_grad } = *self;
        tch::no_grad(|| {
            let shape = input.size();
            let d = *shape.last().expect("[batch, seq, d]");
            let grad_input = logits_grad.mm(&weight).view(shape.as_slice());
            drop(weight);
            if model.lm_head.requires_grad() {
                add_grad(&model.lm_head, &logits_grad.tr().mm(&input.detach().reshape([-1, d])));
            }
            (input, grad_input)
        })
    }
}
