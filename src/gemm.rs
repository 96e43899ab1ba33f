//! A model's matrix multiplies alone: the reference the effective compute ratio and the regression
//! gate divide by. Built from the planner's description of the model (`stoke_plan::ModelConfig`,
//! which every family gives: widths, key/value heads, gated MLP, head, LoRA adapters), in the run's
//! precision on its device and threads, at its micro-batch.
//!
//! Per block: the query/key/value projection, the output projection, the MLP's two (or, gated,
//! three) matrices, and the attention's two batched products; then the head. Forward is `x @ W^T`.
//! Backward is `dY @ W` for every matrix and `dY^T @ X` for those that train (not the frozen base
//! weights of a LoRA run, whose adapters' own products are timed instead), and the attention's
//! four batched products. Weights of one shape are shared by the blocks and activations of one
//! shape by the products, as their values do not matter, so the reference holds about one block's
//! tensors whatever the depth.

use std::collections::BTreeMap;
use std::time::Instant;

use stoke_prof::Precision;
use tch::{Device, Kind, Tensor};

/// The products of one micro-batch of a model, forward and backward, ready to time.
pub struct GemmReference {
    forward: Vec<(Tensor, Tensor)>,
    backward: Vec<(Tensor, Tensor)>,
    device: Device,
    products: stoke_train::Products,
}

/// Milliseconds of one pass of each part of a `GemmReference`.
#[derive(Debug, Clone, Copy)]
pub struct ReferenceTimes {
    pub forward_ms: f64,
    pub backward_ms: f64,
}

impl ReferenceTimes {
    pub fn total_ms(&self) -> f64 {
        self.forward_ms + self.backward_ms
    }
}

impl GemmReference {
    /// With `widen`, bf16 products run as the model's widened ones (`stoke_train::Products`).
    pub fn new(
        model: &stoke_plan::ModelConfig,
        micro_batch: usize,
        precision: Precision,
        widen: bool,
        device: Device,
    ) -> Self {
        let kind = match precision {
            Precision::Fp32 => Kind::Float,
            Precision::Bf16 => Kind::BFloat16,
            Precision::Fp16 => Kind::Half,
        };
        let _guard = tch::no_grad_guard();
        let randn = |dims: &[i64]| Tensor::randn(dims, (kind, device));
        let (d, t, heads) = (model.d_model as i64, model.seq_len as i64, model.n_head as i64);
        let (bt, bh, head_dim) = (micro_batch as i64 * t, micro_batch as i64 * heads, d / heads);
        let (kv, ffn) = (model.kv_dim() as i64, model.ffn() as i64);
        let lora = model.lora_rank > 0;
        let mut activations: BTreeMap<i64, (Tensor, Tensor)> = BTreeMap::new();
        let mut weights: BTreeMap<(i64, i64), Tensor> = BTreeMap::new();
        let (mut forward, mut backward) = (Vec::new(), Vec::new());
        let mut linear = |n_in: i64, n_out: i64, trains: bool| {
            let x =
                activations.entry(n_in).or_insert_with(|| (randn(&[bt, n_in]), randn(&[bt, n_in]))).0.shallow_clone();
            let dy = activations
                .entry(n_out)
                .or_insert_with(|| (randn(&[bt, n_out]), randn(&[bt, n_out])))
                .1
                .shallow_clone();
            let w = weights.entry((n_out, n_in)).or_insert_with(|| randn(&[n_out, n_in])).shallow_clone();
            forward.push((x.shallow_clone(), w.tr()));
            backward.push((dy.shallow_clone(), w));
            if trains {
                backward.push((dy.tr(), x));
            }
        };
        let mlp_in = if model.gated_mlp { 2 * ffn } else { ffn };
        let matrices = [("qkv", d, d + 2 * kv), ("o_proj", d, d), ("up", d, mlp_in), ("down_proj", ffn, d)];
        for _ in 0..model.n_layer {
            for (_, n_in, n_out) in matrices {
                linear(n_in, n_out, !lora);
            }
            if lora {
                for name in &model.lora_targets {
                    let (n_in, n_out) = match name.as_str() {
                        "q_proj" | "o_proj" => (d, d),
                        "k_proj" | "v_proj" => (d, kv),
                        "gate_proj" | "up_proj" => (d, ffn),
                        "down_proj" => (ffn, d),
                        _ => continue,
                    };
                    let r = model.lora_rank as i64;
                    linear(n_in, r, true);
                    linear(r, n_out, true);
                }
            }
        }
        linear(d, model.vocab_size as i64, !lora);
        let (q, k, v) = (randn(&[bh, t, head_dim]), randn(&[bh, t, head_dim]), randn(&[bh, t, head_dim]));
        let (probs, grad_out) = (randn(&[bh, t, t]), randn(&[bh, t, head_dim]));
        for _ in 0..model.n_layer {
            forward.push((q.shallow_clone(), k.transpose(1, 2)));
            forward.push((probs.shallow_clone(), v.shallow_clone()));
            backward.push((grad_out.shallow_clone(), v.transpose(1, 2)));
            backward.push((probs.transpose(1, 2), grad_out.shallow_clone()));
            backward.push((probs.shallow_clone(), k.shallow_clone()));
            backward.push((probs.transpose(1, 2), q.shallow_clone()));
        }
        let products = stoke_train::Products::with(kind, widen);
        let reference = GemmReference { forward, backward, device, products };
        reference.time(); // warm-up: first-touch pages and libtorch's kernel choice
        reference
    }

    fn sync(&self) {
        if let Device::Cuda(ordinal) = self.device {
            tch::Cuda::synchronize(ordinal as i64);
        }
    }

    /// One pass of each part.
    pub fn time(&self) -> ReferenceTimes {
        let _guard = tch::no_grad_guard();
        let pass = |pairs: &[(Tensor, Tensor)]| {
            let start = Instant::now();
            for (a, b) in pairs {
                drop(self.products.matmul(a, b));
            }
            self.sync();
            start.elapsed().as_secs_f64() * 1e3
        };
        ReferenceTimes { forward_ms: pass(&self.forward), backward_ms: pass(&self.backward) }
    }

    /// The fastest of `passes` passes of each part: on a shared machine noise only adds.
    pub fn fastest(&self, passes: usize) -> ReferenceTimes {
        let mut best = ReferenceTimes { forward_ms: f64::INFINITY, backward_ms: f64::INFINITY };
        for _ in 0..passes.max(1) {
            let t = self.time();
            best.forward_ms = best.forward_ms.min(t.forward_ms);
            best.backward_ms = best.backward_ms.min(t.backward_ms);
        }
        best
    }

    /// FLOPs of one pass of both parts (2 per multiply-add).
    pub fn flops(&self) -> f64 {
        let pair_flops = |(a, b): &(Tensor, Tensor)| {
            let (sa, sb) = (a.size(), b.size());
            let batch: i64 = sa[..sa.len() - 2].iter().product();
            2.0 * (batch * sa[sa.len() - 2] * sa[sa.len() - 1] * sb[sb.len() - 1]) as f64
        };
        self.forward.iter().chain(&self.backward).map(pair_flops).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reference_multiplies_what_the_planner_counts() {
        // A gpt model: 2·(forward) + 4·(backward) FLOPs per weight per token, plus attention.
        let model = stoke_plan::ModelConfig::gpt(2, 64, 2, 16, 256);
        let reference = GemmReference::new(&model, 3, Precision::Fp32, false, Device::Cpu);
        let tokens = 3.0 * 16.0;
        let weights = (model.matmul_params_per_layer() * 2 + 64 * 256) as f64;
        let attention = 3.0 * model.attention_core_forward_flops(3) * 2.0;
        assert_eq!(reference.flops(), 6.0 * tokens * weights + attention);
        // Under LoRA the frozen weights lose their weight gradient; the adapters add theirs.
        let mut lora = stoke_plan::ModelConfig::preset("llama-7b").unwrap();
        (lora.n_layer, lora.d_model, lora.n_head, lora.seq_len, lora.ffn_hidden, lora.vocab_size) =
            (2, 64, 4, 16, 160, 256);
        lora.lora_rank = 4;
        let frozen = GemmReference::new(&lora, 1, Precision::Fp32, false, Device::Cpu);
        let full = GemmReference::new(
            &stoke_plan::ModelConfig { lora_rank: 0, ..lora.clone() },
            1,
            Precision::Fp32,
            false,
            Device::Cpu,
        );
        let base = 16.0 * (lora.matmul_params_per_layer() * 2 + 64 * 256) as f64;
        let adapters = 16.0 * (lora.lora_params_per_layer() * 2) as f64;
        assert_eq!(full.flops() - frozen.flops(), 2.0 * base - 6.0 * adapters);
        let times = frozen.fastest(2);
        assert!(times.forward_ms > 0.0 && times.backward_ms > 0.0);
    }
}
