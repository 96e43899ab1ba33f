//! The vla's blocks whole by hand on a CPU (`train.fused_branches` with `train.fused_layer_norm`):
//! a block's two branches run outside libtorch's graph, forward and backward, as one executor
//! segment.
//!
//! The body of a block is GPT-2's. Under bf16: the LayerNorm kernel reads the fp32 stream and
//! writes the bf16 the q, k, v product takes (its weights cut from one cast of the block); the
//! heads are cut from that product in one copy; the scores' product, then the softmax kernel
//! scales them and takes each row's keys only (the backbone's prefix mask as per-row counts;
//! every key of its frame in the tower) in place; weighted sums, the output projection, the
//! residual add in fp32; then the MLP with its first product's bias and GELU in one kernel pass.
//! Under fp32 the same with the LayerNorm and bias + GELU kernels' fp32 outputs, libtorch's
//! softmax in the tower and its flash attention under the additive prefix mask in the backbone,
//! and each residual add done by the output projection's matrix multiply into the stream plus its
//! bias. The backward is the same products by hand (in fp32 the weights' gradients multiplied
//! into the flat buffer), the kernels' backward (the GELU kernel's with the bias's gradient summed
//! in its pass), and the LayerNorm kernel's backward adding the residual's gradient in place: no
//! autograd graph, no casts of 16-bit gradients between layers, no bias copies before the
//! products. What comes before a body stays in libtorch's graph, small beside it: a vision
//! block's FiLM (the tower's tokens scaled and shifted by the instruction's summary) and the first
//! backbone block's projector and keypoints. The rest of the stream passes a vision block
//! untouched, its gradient too.

use tch::{Device, Kind, Tensor};

use super::{Vla, LAYER_NORM_EPS};
use crate::executor::backward_from;
use crate::kernels::{
    bias_gelu, bias_gelu_backward, layer_norm_bf16, layer_norm_bf16_backward, layer_norm_f32,
    prefix_softmax_backward_bf16, prefix_softmax_bf16, LayerNormStats,
};
use crate::models::gpt::{linear_backward, linear_backward_unbiased};
use crate::models::BlockBackward;

/// What a block's body keeps for its backward.
struct Body {
    /// The body's input, fp32 `[batch, tokens, d]` contiguous.
    h: Tensor,
    ln_1: LayerNormStats,
    /// The first LayerNorm's output, bf16.
    normed_1: Tensor,
    /// The q, k, v weight `[3d, d]` in bf16.
    qkv_weight: Tensor,
    /// q, k and v, `[3, rows * n_head, tokens per row, head_dim]`.
    heads: Tensor,
    attention: Attention,
    /// The weighted sums in the output projection's layout, bf16 `[batch, tokens, d]`.
    y: Tensor,
    proj_weight: Tensor,
    /// The stream after the attention's residual, fp32.
    h_2: Tensor,
    ln_2: LayerNormStats,
    normed_2: Tensor,
    fc_weight: Tensor,
    /// The MLP's first product without its bias, and the GELU of it plus the bias, bf16.
    pre: Tensor,
    act: Tensor,
    mlp_proj_weight: Tensor,
    /// The attention's rows (frames in the tower, samples in the backbone) and their length.
    rows: i64,
    per_row: i64,
}

/// What an attention keeps for its backward besides q, k and v.
enum Attention {
    /// The softmax's output `[rows * n_head, tokens per row, tokens per row]`.
    Probs(Tensor),
    /// libtorch's flash attention's output `[batch, n_head, tokens, head_dim]` and its rows'
    /// log-sum-exps (the fp32 backbone).
    Flash { out: Tensor, lse: Tensor },
}

/// A block by hand between its forward and its backward.
struct BlockByHand<'m> {
    model: &'m Vla,
    layer_idx: usize,
    /// What runs in libtorch's graph before the body: the block's input (a leaf that requires
    /// grad) and the body's input with its graph back to it. None when the body starts at the
    /// block's input.
    entry: Option<(Tensor, Tensor)>,
    body: Body,
}

impl Vla {
    /// On a CPU, the block executor runs each block whole by hand (see the module doc), its
    /// kernels on `n_threads` threads. `false` (the default of `new`) runs the blocks
    /// in libtorch's graph.
    pub fn set_blocks_by_hand(&mut self, enabled: bool, n_threads: usize) {
        self.by_hand_threads = if enabled { n_threads.max(1) } else { 0 };
    }

    /// Whether blocks run by hand: asked for, on a CPU, in bf16 (attention by batched matrix
    /// multiplies) or fp32 (the tower's so, the backbone's by flash attention).
    pub(super) fn runs_blocks_by_hand(&self) -> bool {
        let attention = match self.compute {
            Kind::BFloat16 => [true, true],
            Kind::Float => [true, false],
            _ => return false,
        };
        self.by_hand_threads > 0 && self.params.device() == Device::Cpu && self.math_attention == attention
    }

    /// Block `layer_idx` by hand from the stream `x` (fp32, detached); None when the block has a
    /// frozen parameter (its gradients are not all bound to the flat buffer) or blocks do not run
    /// by hand.
    pub(super) fn block_forward_by_hand(
        &self,
        layer_idx: usize,
        x: &Tensor,
    ) -> Option<(Tensor, Box<dyn BlockBackward + '_>)> {
        if !self.runs_blocks_by_hand() || !self.block_params(layer_idx).iter().all(|p| p.requires_grad()) {
            return None;
        }
        let vision = self.shape.vision_tokens() as i64;
        let rest = self.shape.base.seq_len as i64 - vision;
        let tower = layer_idx < self.shape.vision_layers;
        let entry = if tower {
            let input = x.detach().set_requires_grad(true);
            let parts = input.split_with_sizes([vision, rest], 1);
            let body_input = self.film(layer_idx, &parts[1], &parts[0]);
            Some((input, body_input))
        } else if layer_idx == self.shape.vision_layers {
            let input = x.detach().set_requires_grad(true);
            let body_input = self.project_tower(&input);
            Some((input, body_input))
        } else {
            None
        };
        let h = match &entry {
            Some((_, body_input)) => body_input.detach().contiguous(),
            None => x.contiguous(),
        };
        let (output, body) = tch::no_grad(|| self.body_forward(layer_idx, h));
        let output = if tower { Tensor::cat(&[&output, &x.narrow(1, vision, rest)], 1) } else { output };
        Some((output, Box::new(BlockByHand { model: self, layer_idx, entry, body })))
    }

    /// Block `layer_idx`'s parameters in the compute type: in bf16 from one cast of its unit's
    /// range of the flat buffer (the FiLM's or projector's with them), in fp32 the parameters; a
    /// function that gives a parameter's. Under widened products the bf16 values are held in
    /// fp32, the products' operands, so no product casts a weight again.
    fn block_cast(&self, layer_idx: usize) -> impl Fn(&Tensor) -> Tensor + '_ {
        let unit = &self.params.units()[layer_idx + 1];
        let flat = self.params.flat();
        let fp32 = self.compute == Kind::Float;
        let cast = (!fp32).then(|| {
            let cast = flat.narrow(0, unit.range.start, unit.range.end - unit.range.start).to_kind(self.compute);
            self.products.operand(&cast)
        });
        move |param: &Tensor| {
            let Some(cast) = &cast else { return param.detach() };
            let entry = self.params.entries()[unit.entries.clone()]
                .iter()
                .find(|e| e.tensor.data_ptr() == param.data_ptr())
                .expect("a block's parameter is in its unit");
            cast.narrow(0, entry.offset - unit.range.start, entry.numel).view(entry.shape.as_slice())
        }
    }

    /// The keys each attention row of block `layer_idx` sees (`per_row` rows): all of its frame's
    /// in the tower, the prefix mask's counts in the backbone.
    fn keys(&self, layer_idx: usize, per_row: i64) -> &[usize] {
        if layer_idx < self.shape.vision_layers {
            &self.tower_keys
        } else {
            debug_assert_eq!(self.backbone_keys.len() as i64, per_row);
            &self.backbone_keys
        }
    }

    /// 1 / sqrt(head_dim), in the kernel's fp32.
    fn softmax_scale(&self, head_dim: i64) -> f32 {
        (1.0 / (head_dim as f64).sqrt()) as f32
    }

    /// The block's parameters the body reads.
    fn block_params(&self, layer_idx: usize) -> [&Tensor; 12] {
        let b = &self.blocks[layer_idx];
        [
            &b.ln_1.0,
            &b.ln_1.1,
            &b.attn.0,
            &b.attn.1,
            &b.attn_proj.0,
            &b.attn_proj.1,
            &b.ln_2.0,
            &b.ln_2.1,
            &b.fc.0,
            &b.fc.1,
            &b.mlp_proj.0,
            &b.mlp_proj.1,
        ]
    }

    /// The block's body from `h` (fp32 `[batch, tokens, d]` contiguous): its output, fp32.
    fn body_forward(&self, layer_idx: usize, h: Tensor) -> (Tensor, Body) {
        let block = &self.blocks[layer_idx];
        let threads = self.by_hand_threads;
        let fp32 = self.compute == Kind::Float;
        let (batch, tokens, d) = h.size3().expect("activations are [batch, tokens, d]");
        let n_head = self.shape.base.n_head as i64;
        let head_dim = d / n_head;
        let tower = layer_idx < self.shape.vision_layers;
        // The tower attends within each frame's patches, the backbone over the whole sequence.
        let (rows, per_row) = if tower {
            let per_frame = self.shape.patches_per_frame() as i64;
            (batch * tokens / per_frame, per_frame)
        } else {
            (batch, tokens)
        };
        let norm = |x: &Tensor, (weight, bias): &(Tensor, Tensor)| {
            let normed = if fp32 { layer_norm_f32 } else { layer_norm_bf16 };
            normed(x, weight, bias, LAYER_NORM_EPS, threads)
                .expect("the stream is contiguous fp32 on the CPU and the norm's parameters fit it")
        };
        let cast = self.block_cast(layer_idx);
        let (normed_1, ln_1) = norm(&h, &block.ln_1);
        let qkv_weight = cast(&block.attn.0);
        let qkv = self.products.linear(&normed_1, &qkv_weight, Some(&cast(&block.attn.1)));
        let heads = qkv.view([rows, per_row, 3, n_head, head_dim]).permute([2, 0, 3, 1, 4]).contiguous().view([
            3,
            rows * n_head,
            per_row,
            head_dim,
        ]);
        drop(qkv);
        let scale = self.softmax_scale(head_dim);
        let (y, attention) = if fp32 && !tower {
            // libtorch's flash attention under the additive prefix mask, its output
            // `[batch, n_head, tokens, head_dim]` and row log-sum-exps kept for its backward.
            let four = |t: Tensor| t.view([batch, n_head, tokens, head_dim]);
            let (out, lse) = Tensor::internal_scaled_dot_product_flash_attention_for_cpu(
                &four(heads.get(0)),
                &four(heads.get(1)),
                &four(heads.get(2)),
                0.0,
                false,
                Some(&self.backbone_bias),
                None,
            );
            let y = out.transpose(1, 2).contiguous().view([batch, tokens, d]);
            (y, Attention::Flash { out, lse })
        } else {
            // The unscaled scores; the kernel (bf16) scales them, takes each row's keys only (the
            // mask's per-row counts) and writes the probabilities in place; in fp32 (the tower,
            // unmasked) libtorch's softmax.
            let scores = self.products.bmm(&heads.get(0), &heads.get(1).transpose(1, 2));
            let probs = if fp32 {
                (scores * f64::from(scale)).softmax(-1, Kind::Float)
            } else {
                prefix_softmax_bf16(&scores, self.keys(layer_idx, per_row), scale, threads);
                scores
            };
            let y = self
                .products
                .bmm(&probs, &heads.get(2))
                .view([rows, n_head, per_row, head_dim])
                .transpose(1, 2)
                .contiguous()
                .view([batch, tokens, d]);
            (y, Attention::Probs(probs))
        };
        let proj_weight = cast(&block.attn_proj.0);
        let h_2 = self.residual_linear(&h, &y, &proj_weight, &cast(&block.attn_proj.1));
        let (normed_2, ln_2) = norm(&h_2, &block.ln_2);
        let fc_weight = cast(&block.fc.0);
        let pre = self.products.linear(&normed_2, &fc_weight, None);
        let act = bias_gelu(&pre, &block.fc.1, threads)
            .expect("the MLP's product is contiguous in the compute type and its bias a contiguous fp32 view");
        let mlp_proj_weight = cast(&block.mlp_proj.0);
        let output = self.residual_linear(&h_2, &act, &mlp_proj_weight, &cast(&block.mlp_proj.1));
        let body = Body {
            h,
            ln_1,
            normed_1,
            qkv_weight,
            heads,
            attention,
            y,
            proj_weight,
            h_2,
            ln_2,
            normed_2,
            fc_weight,
            pre,
            act,
            mlp_proj_weight,
            rows,
            per_row,
        };
        (output, body)
    }

    /// The residual stream `h` (fp32 `[batch, tokens, d]`) plus the linear layer `x W^T + b` in the
    /// compute type: in bf16 the layer's output added; in fp32 `h + b` with the product added
    /// into it by the matrix multiply itself (no output of the layer's own, no pass to add it).
    fn residual_linear(&self, h: &Tensor, x: &Tensor, weight: &Tensor, bias: &Tensor) -> Tensor {
        if self.compute != Kind::Float {
            return h + self.products.linear(x, weight, Some(bias));
        }
        let d = *h.size().last().expect("a width");
        let out = h + bias;
        let _ = out.view([-1, d]).addmm_(&x.view([-1, *x.size().last().expect("a width")]), &weight.tr());
        out
    }

    /// The backward by hand of `x W^T + b` from its output's gradient `grad` (`[.., out]`, the
    /// compute type) and input `x`: the weight's and bias's gradients added into the flat buffer
    /// (`master`, the fp32 parameters; in fp32 the weight's by the matrix multiply into it), the
    /// input's returned.
    fn linear_grads(&self, grad: &Tensor, x: &Tensor, weight: &Tensor, master: &(Tensor, Tensor)) -> Tensor {
        if self.compute != Kind::Float {
            return linear_backward(self.products, grad, x, weight, (&master.0, &master.1));
        }
        let (out, d_in) = (*grad.size().last().expect("a width"), *x.size().last().expect("a width"));
        let rows = grad.reshape([-1, out]);
        let _ = master.0.grad().addmm_(&rows.tr(), &x.reshape([-1, d_in]));
        let mut bias_grad = master.1.grad();
        bias_grad += rows.sum_dim_intlist([0i64].as_slice(), false, Kind::Float);
        grad.matmul(weight)
    }

    /// The body's backward from its output's gradient `grad` (fp32 contiguous, written in place):
    /// the gradient of its input; every parameter's goes into the flat gradient buffer.
    fn body_backward(&self, layer_idx: usize, body: &Body, grad: Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        let kind = self.compute;
        let fp32 = kind == Kind::Float;
        let threads = self.by_hand_threads;
        let (batch, tokens, d) = body.h.size3().expect("activations are [batch, tokens, d]");
        let n_head = self.shape.base.n_head as i64;
        let head_dim = d / n_head;
        let (rows, per_row) = (body.rows, body.per_row);
        let norm_backward = |grad_normed: &Tensor,
                             x: &Tensor,
                             stats: &LayerNormStats,
                             (weight, bias): &(Tensor, Tensor),
                             residual: Tensor,
                             copy: Option<(&Tensor, &Tensor)>| {
            layer_norm_bf16_backward(
                grad_normed,
                x,
                stats,
                weight,
                Some(residual),
                &weight.grad(),
                &bias.grad(),
                copy,
                threads,
            )
        };
        // The MLP.
        let grad_act = self.linear_grads(&grad.to_kind(kind), &body.act, &body.mlp_proj_weight, &block.mlp_proj);
        let grad_pre = bias_gelu_backward(&grad_act, &body.pre, &block.fc.1, &block.fc.1.grad(), threads);
        drop(grad_act);
        let (grad_rows, normed_rows) = (grad_pre.view([-1, 4 * d]), body.normed_2.view([-1, d]));
        if fp32 {
            let _ = block.fc.0.grad().addmm_(&grad_rows.tr(), &normed_rows);
        } else {
            let mut fc_grad = block.fc.0.grad();
            fc_grad += self.products.mm(&grad_rows.tr(), &normed_rows);
        }
        let grad_normed_2 = self.products.matmul(&grad_pre, &body.fc_weight);
        drop((grad_pre, grad_rows));
        // The attention's output projection: in bf16 the norm's backward also gives its
        // gradient's bf16 and the projection's bias gradient, in its pass.
        let copy = (!fp32).then(|| Tensor::empty(grad.size(), (kind, Device::Cpu)));
        let proj_bias_grad = block.attn_proj.1.grad();
        let copy_to = copy.as_ref().map(|copy| (copy, &proj_bias_grad));
        let grad = norm_backward(&grad_normed_2, &body.h_2, &body.ln_2, &block.ln_2, grad, copy_to);
        drop(grad_normed_2);
        let grad_y = match &copy {
            Some(copy) => linear_backward_unbiased(self.products, copy, &body.y, &body.proj_weight, &block.attn_proj.0),
            None => self.linear_grads(&grad, &body.y, &body.proj_weight, &block.attn_proj),
        };
        let grad_heads = match &body.attention {
            Attention::Flash { out, lse } => {
                let grad_out = grad_y.view([batch, tokens, n_head, head_dim]).transpose(1, 2).contiguous();
                let four = |t: Tensor| t.view([batch, n_head, tokens, head_dim]);
                let (dq, dk, dv) = Tensor::internal_scaled_dot_product_flash_attention_for_cpu_backward(
                    &grad_out,
                    &four(body.heads.get(0)),
                    &four(body.heads.get(1)),
                    &four(body.heads.get(2)),
                    out,
                    lse,
                    0.0,
                    false,
                    Some(&self.backbone_bias),
                    None,
                );
                Tensor::stack(&[dq, dk, dv], 0).view([3, rows * n_head, per_row, head_dim])
            }
            Attention::Probs(probs) => {
                let grad_y = grad_y.view([rows, per_row, n_head, head_dim]).transpose(1, 2).contiguous().view([
                    rows * n_head,
                    per_row,
                    head_dim,
                ]);
                // Read by two products each: widened once.
                let grad_y = self.products.operand(&grad_y);
                let (q, k, v) = (body.heads.get(0), body.heads.get(1), body.heads.get(2));
                let grad_heads = Tensor::empty(body.heads.size(), (kind, Device::Cpu));
                // The probabilities' gradient, turned into the unscaled scores'.
                let grad_probs = self.products.bmm(&grad_y, &v.transpose(1, 2));
                self.products.bmm_out(&grad_heads.get(2), &probs.transpose(1, 2), &grad_y);
                drop(grad_y);
                let scale = self.softmax_scale(head_dim);
                let grad_scores = if fp32 {
                    Tensor::internal_softmax_backward_data(&grad_probs, probs, -1, kind) * f64::from(scale)
                } else {
                    prefix_softmax_backward_bf16(probs, &grad_probs, self.keys(layer_idx, per_row), scale, threads);
                    self.products.operand(&grad_probs)
                };
                self.products.bmm_out(&grad_heads.get(0), &grad_scores, &k);
                self.products.bmm_out(&grad_heads.get(1), &grad_scores.transpose(1, 2), &q);
                grad_heads
            }
        };
        // From head-major order back to the projection's `[.., 3d]`.
        let grad_qkv = grad_heads.view([3, rows, n_head, per_row, head_dim]).permute([1, 3, 0, 2, 4]).reshape([
            batch,
            tokens,
            3 * d,
        ]);
        drop(grad_heads);
        let grad_normed_1 = self.linear_grads(&grad_qkv, &body.normed_1, &body.qkv_weight, &block.attn);
        drop(grad_qkv);
        norm_backward(&grad_normed_1, &body.h, &body.ln_1, &block.ln_1, grad, None)
    }
}

impl BlockBackward for BlockByHand<'_> {
    fn backward(&self, grad_output: Tensor) -> Tensor {
        let model = self.model;
        let vision = model.shape.vision_tokens() as i64;
        let tower = self.layer_idx < model.shape.vision_layers;
        // The body's output gradient: in the tower the vision tokens' rows, a copy of its own
        // (the norm's backward writes into it).
        let grad = if tower { grad_output.narrow(1, 0, vision).contiguous() } else { grad_output.contiguous() };
        let grad_body = tch::no_grad(|| model.body_backward(self.layer_idx, &self.body, grad));
        let Some((input, body_input)) = &self.entry else { return grad_body };
        backward_from(body_input, &grad_body);
        drop(grad_body);
        let grad_input = input.grad();
        if tower {
            // The rest of the stream passed the block: its gradient passes back, beside what the
            // FiLM's summary of the instruction adds to it.
            let rest = grad_output.size()[1] - vision;
            tch::no_grad(|| {
                let mut passed = grad_input.narrow(1, vision, rest);
                passed += grad_output.narrow(1, vision, rest);
            });
        }
        grad_input
    }
}
