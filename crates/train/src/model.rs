//! A GPT decoder in nanoGPT's shape: token and position embeddings, pre-LayerNorm blocks of causal
//! self-attention (libtorch's scaled_dot_product_attention, or bf16 batched matrix multiplies) and a
//! GELU MLP, a final LayerNorm and a head tied to the token embedding. Parameter names follow
//! nanoGPT, so a checkpoint's tensors load into its `GPT` by name.

use tch::{Device, Kind, Tensor};

use crate::config::{AttentionPrecision, GptShape, Precision};
use crate::params::{FlatParams, Init, ParamSpec};

pub struct Gpt {
    shape: GptShape,
    params: FlatParams,
    precision: Precision,
    attention: Attention,
}

/// How a block computes causal self-attention.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Attention {
    /// libtorch's scaled_dot_product_attention, q, k and v cast to this element type.
    Sdpa(Kind),
    /// Explicit bf16 batched matrix multiplies: scores (with an additive causal mask), softmax
    /// (fp32 inside, bf16 out), probabilities times v.
    Bf16Math,
}

/// The longest context "auto" runs as bf16-math on a CPU: the probabilities it keeps for the
/// backward grow with its square.
const MATH_ATTENTION_MAX_SEQ: usize = 256;

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

impl Gpt {
    /// A freshly initialized model (nanoGPT's init: N(0, 0.02), residual projections scaled by
    /// 1/sqrt(2·n_layer)). Seed libtorch first for a reproducible init.
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
        let mut specs = vec![
            spec("transformer.wte.weight".into(), &[shape.vocab_size as i64, d], Init::Normal { std }, true),
            spec("transformer.wpe.weight".into(), &[shape.seq_len as i64, d], Init::Normal { std }, true),
        ];
        for layer_idx in 0..shape.n_layer {
            let [ln1_w, ln1_b, attn_w, attn_b, attn_proj_w, attn_proj_b, ln2_w, ln2_b, fc_w, fc_b, mlp_proj_w, mlp_proj_b] =
                block_names(layer_idx);
            specs.extend([
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
            ]);
        }
        specs.push(spec("transformer.ln_f.weight".into(), &[d], Init::Ones, false));
        specs.push(spec("transformer.ln_f.bias".into(), &[d], Init::Zeros, false));
        let attention = match (precision, attention) {
            (Precision::Fp32, _) | (Precision::Bf16, AttentionPrecision::Fp32) => Attention::Sdpa(Kind::Float),
            (Precision::Bf16, AttentionPrecision::Bf16) => Attention::Sdpa(Kind::BFloat16),
            (Precision::Bf16, AttentionPrecision::Bf16Math) => Attention::Bf16Math,
            (Precision::Bf16, AttentionPrecision::Auto) if device == Device::Cpu => {
                if shape.seq_len <= MATH_ATTENTION_MAX_SEQ {
                    Attention::Bf16Math
                } else {
                    Attention::Sdpa(Kind::Float)
                }
            }
            (Precision::Bf16, AttentionPrecision::Auto) => Attention::Sdpa(Kind::BFloat16),
        };
        Gpt { shape, params: FlatParams::new(specs, device), precision, attention }
    }

    pub fn shape(&self) -> GptShape {
        self.shape
    }

    pub fn params(&self) -> &FlatParams {
        &self.params
    }

    pub fn params_mut(&mut self) -> &mut FlatParams {
        &mut self.params
    }

    /// A linear layer in the run's precision. Under bf16 the input, weight and bias are cast for
    /// the multiply (what autocast does for `linear`), and the result stays bf16.
    fn linear(&self, x: &Tensor, weight: &str, bias: Option<&str>) -> Tensor {
        let w = self.params.get(weight);
        let b = bias.map(|name| self.params.get(name));
        match self.precision {
            Precision::Fp32 => x.linear(w, b),
            Precision::Bf16 => {
                let b16 = b.map(|b| b.to_kind(Kind::BFloat16));
                x.to_kind(Kind::BFloat16).linear(&w.to_kind(Kind::BFloat16), b16.as_ref())
            }
        }
    }

    /// LayerNorm always in fp32 (autocast's policy too).
    fn layer_norm(&self, x: &Tensor, weight: &str, bias: &str) -> Tensor {
        let d = self.shape.d_model as i64;
        x.to_kind(Kind::Float).layer_norm([d], Some(self.params.get(weight)), Some(self.params.get(bias)), 1e-5, true)
    }

    /// Mean cross-entropy of predicting `targets` from `inputs`, both `[batch, seq]` int64.
    pub fn loss(&self, inputs: &Tensor, targets: &Tensor) -> Tensor {
        let logits = self.forward(inputs);
        let vocab = self.shape.vocab_size as i64;
        logits.to_kind(Kind::Float).view([-1, vocab]).cross_entropy_for_logits(&targets.view([-1]))
    }

    /// Logits `[batch, seq, vocab]` (bf16 under bf16 precision).
    pub fn forward(&self, inputs: &Tensor) -> Tensor {
        let (batch, seq) = inputs.size2().expect("inputs are [batch, seq]");
        let d = self.shape.d_model as i64;
        let n_head = self.shape.n_head as i64;
        let head_dim = d / n_head;
        let device = inputs.device();
        let wte = self.params.get("transformer.wte.weight");
        let positions = Tensor::arange(seq, (Kind::Int64, device));
        let mut x = Tensor::embedding(wte, inputs, -1, false, false)
            + Tensor::embedding(self.params.get("transformer.wpe.weight"), &positions, -1, false, false);
        let mut causal_mask: Option<Tensor> = None;
        for layer_idx in 0..self.shape.n_layer {
            let [ln1_w, ln1_b, attn_w, attn_b, attn_proj_w, attn_proj_b, ln2_w, ln2_b, fc_w, fc_b, mlp_proj_w, mlp_proj_b] =
                block_names(layer_idx);
            let h = self.layer_norm(&x, &ln1_w, &ln1_b);
            let qkv = self.linear(&h, &attn_w, Some(&attn_b));
            let parts = qkv.split(d, 2);
            let y = match self.attention {
                Attention::Sdpa(kind) => {
                    let heads = |t: &Tensor| t.view([batch, seq, n_head, head_dim]).transpose(1, 2).to_kind(kind);
                    let (q, k, v) = (heads(&parts[0]), heads(&parts[1]), heads(&parts[2]));
                    Tensor::scaled_dot_product_attention(&q, &k, &v, None::<&Tensor>, 0.0, true, None, false)
                }
                Attention::Bf16Math => {
                    let mask = causal_mask.get_or_insert_with(|| {
                        Tensor::full([seq, seq], f64::NEG_INFINITY, (Kind::BFloat16, device)).triu(1)
                    });
                    let heads = |t: &Tensor| {
                        t.view([batch, seq, n_head, head_dim]).transpose(1, 2).reshape([batch * n_head, seq, head_dim])
                    };
                    let (q, k, v) = (heads(&parts[0]), heads(&parts[1]), heads(&parts[2]));
                    let scale = 1.0 / (head_dim as f64).sqrt();
                    let scores =
                        mask.expand([batch * n_head, seq, seq], false).baddbmm(&q, &k.transpose(1, 2), 1.0, scale);
                    scores.softmax(-1, None).bmm(&v).view([batch, n_head, seq, head_dim])
                }
            };
            let y = y.transpose(1, 2).contiguous().view([batch, seq, d]);
            x = x + self.linear(&y, &attn_proj_w, Some(&attn_proj_b));
            let h = self.layer_norm(&x, &ln2_w, &ln2_b);
            let h = self.linear(&h, &fc_w, Some(&fc_b)).gelu("none");
            x = x + self.linear(&h, &mlp_proj_w, Some(&mlp_proj_b));
        }
        let x = self.layer_norm(&x, "transformer.ln_f.weight", "transformer.ln_f.bias");
        self.linear(&x, "transformer.wte.weight", None)
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
        assert_eq!(math.attention, Attention::Bf16Math);
        assert_eq!(model(AttentionPrecision::Auto).attention, Attention::Bf16Math, "auto on a CPU at context 32");
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
}
