//! The GPT's causal self-attention: libtorch's scaled_dot_product_attention, or 16-bit batched
//! matrix multiplies of the whole square or of causal blocks of queries.

use tch::{Device, Kind, Tensor};

use super::parts::{Attention, Gpt, Slot};
use crate::config::{AttentionPrecision, GptShape, Precision};

/// q, k and v of the math attention from the projection `qkv` `[batch, seq, 3d]`, into head-major
/// order in one copy, `[3, batch * n_head, seq, head_dim]` (cast to `kind` while contiguous).
pub(super) fn math_heads(qkv: &Tensor, kind: Kind, n_head: i64) -> Tensor {
    let (batch, seq, d3) = qkv.size3().expect("the projection is [batch, seq, 3d]");
    let head_dim = d3 / 3 / n_head;
    qkv.to_kind(kind).view([batch, seq, 3, n_head, head_dim]).permute([2, 0, 3, 1, 4]).contiguous().view([
        3,
        batch * n_head,
        seq,
        head_dim,
    ])
}

/// The longest context "auto" runs as bf16-math on a CPU: the probabilities it keeps for the
/// backward grow with its square. At 1024 (gpt2-124m, micro-batch 1) it took 0.86-0.91 of fp32
/// SDPA's step time in three interleaved rounds (2026-12-01, `benches/stoke_attention_cpu.sh`), and
/// the PyTorch peer's bf16 matmul attention beat its SDPA there too (1846 against 2162 ms).
pub(super) const MATH_ATTENTION_MAX_SEQ: usize = 1024;

pub(super) fn choose_attention(
    precision: Precision,
    attention: AttentionPrecision,
    shape: GptShape,
    device: Device,
) -> Attention {
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
    /// The attention of block `layer_idx` on `h`, its input already normed (fp32, or bf16 from
    /// the fused LayerNorm), in the compute type.
    pub(crate) fn attention_branch(&self, layer_idx: usize, h: &Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        let (batch, seq, width) = h.size3().expect("activations are [batch, seq, d]");
        let head_dim = width / self.shape.n_head as i64;
        // This rank's heads (all of them when not cut) and their width.
        let n_head = self.tensor.as_ref().map_or(self.shape.n_head as i64, |cut| cut.local(self.shape.n_head));
        let d = n_head * head_dim;
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
    pub(super) fn attention_out(&self, layer_idx: usize, y: &Tensor) -> Tensor {
        let block = &self.blocks[layer_idx];
        let (batch, n_head, seq, head_dim) = y.size4().expect("weighted sums are [batch, n_head, seq, head_dim]");
        let y = y.transpose(1, 2).contiguous().view([batch, seq, n_head * head_dim]);
        self.row_parallel(&y, Slot::weight(layer_idx, Slot::ATTN_PROJ), &block.attn_proj_w, &block.attn_proj_b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::Gpt;

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
}
