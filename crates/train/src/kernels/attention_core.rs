//! The core of a causal attention outside libtorch's graph, around the causal softmax kernel:
//! the scores of each causal query block `bmm`-ed into one buffer, the kernel's probabilities, the
//! weighted sums; and the backward of the same by hand.

use tch::{Device, Kind, Tensor};

use super::CausalBlock;

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

/// The attention's core outside libtorch's graph from q, k and v `heads` of activations shaped
/// `shape` (`[batch, seq, d]`): the scores of each causal query block
/// (`train.causal_block_rows`) are `bmm`-ed into one buffer, the kernel turns them into
/// probabilities in place, and their products with v make the weighted sums, in the output
/// projection's layout.
pub(crate) fn attention_core(
    heads: Tensor,
    shape: &[i64],
    n_head: i64,
    block_rows: usize,
    n_threads: usize,
) -> AttentionCore {
    let (batch, seq, d) = (shape[0], shape[1], shape[2]);
    let head_dim = d / n_head;
    let bh = batch * n_head;
    let (blocks, total) = CausalBlock::layout(seq as usize, block_rows, bh as usize);
    let scale = 1.0 / (head_dim as f64).sqrt();
    let (probs, y) = tch::no_grad(|| {
        let parts = heads.detach();
        let (q, k, v) = (parts.get(0), parts.get(1), parts.get(2));
        let probs = Tensor::empty([total as i64], (Kind::BFloat16, Device::Cpu));
        for b in &blocks {
            let keys = k.narrow(1, 0, b.cols as i64).transpose(1, 2);
            let _ = q.narrow(1, b.first as i64, b.rows as i64).bmm_out(&b.matrices(&probs, bh as usize), &keys);
        }
        super::causal_softmax_bf16(&probs, &blocks, bh as usize, scale as f32, n_threads);
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
pub(crate) fn attention_core_backward(core: &AttentionCore, grad_y: &Tensor, n_head: i64, n_threads: usize) -> Tensor {
    tch::no_grad(|| {
        let (_, bh, seq, head_dim) = core.heads.size4().expect("q, k and v are [3, heads, seq, head_dim]");
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
        super::causal_softmax_backward_bf16(
            &core.probs,
            &grad_probs,
            &core.blocks,
            bh as usize,
            core.scale as f32,
            n_threads,
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
