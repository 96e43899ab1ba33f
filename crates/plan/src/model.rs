//! The shape of a decoder-only transformer and what follows from it: parameter counts, FLOPs and
//! activation bytes per layer.

use serde::{Deserialize, Serialize};

use crate::PlanError;

/// A GPT-style decoder. Sizes are those of the published configuration; counts derived from them
/// follow Megatron-LM's accounting (Narayanan et al., 2021, appendix) so that published throughput
/// figures can be compared one for one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Transformer blocks. Default 4 (the "tiny" preset).
    pub n_layer: usize,
    /// Model width h. Default 256.
    pub d_model: usize,
    /// Attention heads a. Default 4.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention); 0 means `n_head`. Default 0.
    pub n_kv_head: usize,
    /// Sequence length s in tokens. Default 128.
    pub seq_len: usize,
    /// Vocabulary size V. Default 256.
    pub vocab_size: usize,
    /// Hidden width of the MLP; 0 means 4·h. Default 0.
    pub ffn_hidden: usize,
    /// A gated MLP (SwiGLU: three matrices instead of two). Default false.
    pub gated_mlp: bool,
    /// Learned position embeddings (GPT-2) rather than rotary ones. Default true.
    pub learned_positions: bool,
    /// The output head shares the token embedding. Default true.
    pub tied_embeddings: bool,
    /// Linear layers and norms carry biases (GPT-2 yes, LLaMA no). Default true.
    pub biases: bool,
    /// Attention runs as one fused kernel (FlashAttention; PyTorch's scaled_dot_product_attention,
    /// which stoke's model calls) that keeps no s x s matrices and recomputes the scores in the
    /// backward. False is Korthikanti et al.'s accounting, Megatron-LM's unfused attention.
    /// Default false; true in the presets.
    pub flash_attention: bool,
    /// Fine-tuning with LoRA adapters of this rank (Hu et al., 2021) on the block matrices
    /// `lora_targets` names; every other weight is frozen: no gradient, no optimizer state, and in
    /// the backward only the gradient of its input. 0 trains every weight. Default 0.
    pub lora_rank: usize,
    /// The matrices that carry adapters, by Hugging Face's Llama names: `q_proj`, `k_proj`,
    /// `v_proj`, `o_proj`, `gate_proj`, `up_proj`, `down_proj` (`gate_proj` only in a gated MLP).
    /// Default q_proj and v_proj (PEFT's choice for Llama).
    pub lora_targets: Vec<String>,
    /// A model whose units are not a GPT's (a vision-language-action model: a vision tower, a
    /// projector, extra inputs): each unit's parameters and the FLOPs per token, as the family
    /// counts them. None: the GPT's accounting above. Default None.
    pub units: Option<ExplicitUnits>,
}

/// The units of a model that says them itself ([`ModelConfig::units`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExplicitUnits {
    /// Parameters of the embedding unit.
    pub embedding: u64,
    /// Parameters of each block, in order.
    pub blocks: Vec<u64>,
    /// Parameters of the head unit.
    pub head: u64,
    /// Training FLOPs per token (forward and backward).
    pub flops_per_token: f64,
}

/// The block matrices LoRA can target, by Hugging Face's Llama names.
pub const LORA_TARGETS: &[&str] = &["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig::gpt(4, 256, 4, 128, 256)
    }
}

fn default_lora_targets() -> Vec<String> {
    vec!["q_proj".into(), "v_proj".into()]
}

/// Names accepted by [`ModelConfig::preset`].
pub const MODEL_PRESETS: &[&str] = &["tiny", "small", "gpt2-124m", "gpt3-175b", "llama-7b", "llama-13b", "llama-70b"];

impl ModelConfig {
    /// A GPT-2/Megatron-style model: 4h MLP with GELU, learned positions, tied head, biases.
    pub fn gpt(n_layer: usize, d_model: usize, n_head: usize, seq_len: usize, vocab_size: usize) -> ModelConfig {
        ModelConfig {
            n_layer,
            d_model,
            n_head,
            n_kv_head: 0,
            seq_len,
            vocab_size,
            ffn_hidden: 0,
            gated_mlp: false,
            learned_positions: true,
            tied_embeddings: true,
            biases: true,
            flash_attention: false,
            lora_rank: 0,
            lora_targets: default_lora_targets(),
            units: None,
        }
    }

    fn llama(
        n_layer: usize,
        d_model: usize,
        n_head: usize,
        n_kv_head: usize,
        ffn_hidden: usize,
        seq_len: usize,
    ) -> Self {
        ModelConfig {
            n_layer,
            d_model,
            n_head,
            n_kv_head,
            seq_len,
            vocab_size: 32000,
            ffn_hidden,
            gated_mlp: true,
            learned_positions: false,
            tied_embeddings: false,
            biases: false,
            flash_attention: true,
            lora_rank: 0,
            lora_targets: default_lora_targets(),
            units: None,
        }
    }

    /// A named model, with fused attention. tiny, small and gpt2-124m are stoke's own presets (the shapes `stoke train`
    /// knows); gpt3-175b is Brown et al. (2020), Table 2.1; llama-7b and llama-13b are Touvron et
    /// al. (2023), Table 2 (sequence 2048); llama-70b is Llama 2 70B (grouped-query attention with
    /// 8 key/value heads, sequence 4096).
    pub fn preset(name: &str) -> Result<ModelConfig, PlanError> {
        let fused = |model: ModelConfig| ModelConfig { flash_attention: true, ..model };
        Ok(match name {
            "tiny" => fused(ModelConfig::gpt(4, 256, 4, 128, 256)),
            "small" => fused(ModelConfig::gpt(6, 384, 6, 256, 256)),
            "gpt2-124m" => fused(ModelConfig::gpt(12, 768, 12, 1024, 50304)),
            "gpt3-175b" => fused(ModelConfig::gpt(96, 12288, 96, 2048, 50257)),
            "llama-7b" => ModelConfig::llama(32, 4096, 32, 0, 11008, 2048),
            "llama-13b" => ModelConfig::llama(40, 5120, 40, 0, 13824, 2048),
            "llama-70b" => ModelConfig::llama(80, 8192, 64, 8, 28672, 4096),
            other => {
                return Err(PlanError::UnknownPreset {
                    kind: "model",
                    name: other.to_string(),
                    known: MODEL_PRESETS.join(", "),
                })
            }
        })
    }

    /// Checks that the sizes are positive and the heads divide the width.
    pub fn validate(&self) -> Result<(), PlanError> {
        let positive = [
            ("model.n_layer", self.n_layer),
            ("model.d_model", self.d_model),
            ("model.n_head", self.n_head),
            ("model.seq_len", self.seq_len),
            ("model.vocab_size", self.vocab_size),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err(PlanError::InvalidConfig { key, message: "must be positive".into() });
            }
        }
        if self.d_model % self.n_head != 0 {
            return Err(PlanError::InvalidConfig {
                key: "model.n_head",
                message: format!("must divide d_model = {}; got {}", self.d_model, self.n_head),
            });
        }
        if self.n_kv_head != 0 && self.n_head % self.n_kv_head != 0 {
            return Err(PlanError::InvalidConfig {
                key: "model.n_kv_head",
                message: format!("must divide n_head = {}; got {}", self.n_head, self.n_kv_head),
            });
        }
        if self.lora_rank > 0 {
            if let Some(bad) = self.lora_targets.iter().find(|name| self.matrix_dims(name).is_none()) {
                return Err(PlanError::InvalidConfig {
                    key: "model.lora_targets",
                    message: format!(
                        "{bad:?} is not a block matrix of this model; one of {}",
                        LORA_TARGETS
                            .iter()
                            .filter(|n| self.matrix_dims(n).is_some())
                            .copied()
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
            }
            if self.lora_targets.is_empty() {
                return Err(PlanError::InvalidConfig {
                    key: "model.lora_targets",
                    message: "LoRA needs at least one target matrix".into(),
                });
            }
        }
        Ok(())
    }

    /// MLP hidden width f.
    pub fn ffn(&self) -> usize {
        if self.ffn_hidden == 0 {
            4 * self.d_model
        } else {
            self.ffn_hidden
        }
    }

    /// Width of the key and value projections.
    pub fn kv_dim(&self) -> usize {
        let kv_heads = if self.n_kv_head == 0 { self.n_head } else { self.n_kv_head };
        kv_heads * (self.d_model / self.n_head)
    }

    /// Weights of the matrix multiplies of one block (what 2 FLOPs per weight per token apply to).
    pub fn matmul_params_per_layer(&self) -> usize {
        let h = self.d_model;
        let attention = h * (h + 2 * self.kv_dim()) + h * h;
        let mlp = if self.gated_mlp { 3 } else { 2 } * h * self.ffn();
        attention + mlp
    }

    /// All parameters of one block, biases and norms included.
    pub fn params_per_layer(&self) -> usize {
        let h = self.d_model;
        let small = if self.biases {
            // qkv and output biases, MLP biases, two LayerNorms with weight and bias.
            (h + 2 * self.kv_dim()) + h + if self.gated_mlp { 0 } else { self.ffn() + h } + 4 * h
        } else {
            2 * h
        };
        self.matmul_params_per_layer() + small
    }

    /// Parameters outside the blocks: embeddings, the final norm and an untied head.
    pub fn embedding_params(&self) -> usize {
        let h = self.d_model;
        let positions = if self.learned_positions { self.seq_len * h } else { 0 };
        let head = if self.tied_embeddings { 0 } else { self.vocab_size * h };
        let final_norm = if self.biases { 2 * h } else { h };
        self.vocab_size * h + positions + head + final_norm
    }

    /// All parameters, a tied embedding counted once, adapters included.
    pub fn n_params(&self) -> usize {
        if let Some(units) = &self.units {
            return (units.embedding + units.blocks.iter().sum::<u64>() + units.head) as usize;
        }
        self.n_layer * (self.params_per_layer() + self.lora_params_per_layer()) + self.embedding_params()
    }

    /// Forward FLOPs of one block for `micro_batch` sequences: 2 per weight per token plus the two
    /// attention products, 4·b·s²·h (Megatron counts the full square, not the causal half).
    pub fn layer_forward_flops(&self, micro_batch: usize) -> f64 {
        let tokens = (micro_batch * self.seq_len) as f64;
        let weights = self.matmul_params_per_layer() + self.lora_params_per_layer();
        2.0 * tokens * weights as f64 + self.attention_core_forward_flops(micro_batch)
    }

    /// FLOPs of one block's training step for `micro_batch` sequences, without recomputation:
    /// forward, and a backward of twice the forward, less the weight gradients frozen matrices do
    /// not need under LoRA (their backward computes only the gradient of their input).
    pub fn layer_training_flops(&self, micro_batch: usize) -> f64 {
        let frozen_weight_grads = if self.lora_rank == 0 {
            0.0
        } else {
            2.0 * (micro_batch * self.seq_len) as f64 * self.matmul_params_per_layer() as f64
        };
        3.0 * self.layer_forward_flops(micro_batch) - frozen_weight_grads
    }

    /// FLOPs of the head's training step: three forwards, two under LoRA (the head is frozen).
    pub fn head_training_flops(&self, micro_batch: usize) -> f64 {
        let passes = if self.lora_rank == 0 { 3.0 } else { 2.0 };
        passes * self.head_forward_flops(micro_batch)
    }

    /// Forward FLOPs of the attention products alone (what selective recomputation repeats).
    pub fn attention_core_forward_flops(&self, micro_batch: usize) -> f64 {
        4.0 * micro_batch as f64 * (self.seq_len as f64).powi(2) * self.d_model as f64
    }

    /// Forward FLOPs of the output projection onto the vocabulary.
    pub fn head_forward_flops(&self, micro_batch: usize) -> f64 {
        2.0 * (micro_batch * self.seq_len) as f64 * (self.d_model * self.vocab_size) as f64
    }

    /// The (input, output) widths of block matrix `name` (one of [`LORA_TARGETS`]).
    fn matrix_dims(&self, name: &str) -> Option<(usize, usize)> {
        let (h, kv, f) = (self.d_model, self.kv_dim(), self.ffn());
        Some(match name {
            "q_proj" | "o_proj" => (h, h),
            "k_proj" | "v_proj" => (h, kv),
            "gate_proj" if self.gated_mlp => (h, f),
            "up_proj" => (h, f),
            "down_proj" => (f, h),
            _ => return None,
        })
    }

    /// Adapter weights of one block: r·(in + out) per targeted matrix; 0 without LoRA.
    pub fn lora_params_per_layer(&self) -> usize {
        if self.lora_rank == 0 {
            return 0;
        }
        self.lora_targets.iter().filter_map(|name| self.matrix_dims(name)).map(|(i, o)| self.lora_rank * (i + o)).sum()
    }

    /// The parameters that train: all of them, or under LoRA the adapters alone.
    pub fn trainable_params(&self) -> usize {
        if self.lora_rank == 0 {
            self.n_params()
        } else {
            self.n_layer * self.lora_params_per_layer()
        }
    }

    /// Model FLOPs per token of one training step (forward and backward, no recomputation): 6 per
    /// matmul weight plus 12·L·h·s for attention, PaLM's accounting (Chowdhery et al., 2022,
    /// appendix B), which is also what `stoke train` reports as `flops_per_token`.
    pub fn model_flops_per_token(&self) -> f64 {
        if let Some(units) = &self.units {
            return units.flops_per_token;
        }
        let per_layer = self.layer_training_flops(1) / self.seq_len as f64;
        let head = self.head_training_flops(1) / self.seq_len as f64;
        self.n_layer as f64 * per_layer + head
    }
}

/// Activation bytes of one block for one micro-batch, after Korthikanti et al. (2022), "Reducing
/// Activation Recomputation in Large Transformer Models", section 4: with 16-bit activations and
/// 1-byte dropout masks a block keeps s·b·h·(34 + 5·a·s/h) bytes. The 34 splits into 10·s·b·h that
/// plain tensor parallelism replicates (layer-norm inputs, the inputs of the two parallel regions,
/// the two dropout masks) and 24·s·b·h it divides by t; sequence parallelism divides all of it by t.
/// The 5·a·s²·b of the attention core is what selective recomputation drops.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerActivations {
    /// Bytes tensor parallelism divides by t (the 24·s·b·h of a 4h MLP).
    pub split_bytes: f64,
    /// Bytes plain tensor parallelism keeps on every rank (10·s·b·h); sequence parallelism splits them.
    pub replicated_bytes: f64,
    /// Bytes of the attention core: softmax, its dropout mask and output, 5·a·s²·b (0 when the
    /// attention is fused).
    pub attention_core_bytes: f64,
    /// Bytes of the block's input, 2·s·b·h, all that full recomputation keeps.
    pub input_bytes: f64,
}

impl ModelConfig {
    /// Activation bytes of one block for `micro_batch` sequences at 16-bit precision.
    pub fn layer_activations(&self, micro_batch: usize) -> LayerActivations {
        let s = self.seq_len as f64;
        let b = micro_batch as f64;
        let h = self.d_model as f64;
        let f = self.ffn() as f64;
        let a = self.n_head as f64;
        let sbh = s * b * h;
        // Attention: Q, K, V (4sbh for Q and K, 2sbh for V) and the output projection input
        // (2sbh) are split by t; the block input to the QKV projection (2sbh), its layer-norm
        // input (2sbh) and the dropout mask after the projection (sbh) are not.
        // MLP: the two f-wide activations before and after the GELU (4·s·b·f, a third under a
        // gated MLP) are split; the input (2sbh), its layer-norm input (2sbh) and the dropout
        // mask (sbh) are not. For f = 4h this is Korthikanti's 24 + 10.
        let gated_extra = if self.gated_mlp { 2.0 * s * b * f } else { 0.0 };
        let split = 8.0 * sbh + 4.0 * s * b * f + gated_extra;
        let replicated = 10.0 * sbh;
        LayerActivations {
            split_bytes: split,
            replicated_bytes: replicated,
            // A fused kernel keeps only per-row softmax statistics, negligible beside s·b·h.
            attention_core_bytes: if self.flash_attention { 0.0 } else { 5.0 * a * s * s * b },
            input_bytes: 2.0 * sbh,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(model: &ModelConfig, expected_params: usize) {
        assert_eq!(model.n_params(), expected_params, "{model:?}");
    }

    #[test]
    fn gpt2_small_has_124m_parameters() {
        // GPT-2 small with the vocabulary padded to 50304, nanoGPT's count: 124,475,904 with
        // position embeddings (the 124M of Radford et al., 2019, for vocab 50257 is 124,439,808).
        check(&ModelConfig::preset("gpt2-124m").unwrap(), 124_475_904);
        let mut original = ModelConfig::preset("gpt2-124m").unwrap();
        original.vocab_size = 50257;
        check(&original, 124_439_808);
    }

    #[test]
    fn lora_on_llama_7b_trains_peft_s_count_and_skips_the_frozen_weight_gradients() {
        let mut model = ModelConfig::preset("llama-7b").unwrap();
        let full_flops = model.model_flops_per_token();
        model.lora_rank = 16;
        model.validate().unwrap();
        // PEFT's print_trainable_parameters for r = 16 on q_proj and v_proj of Llama 7B.
        assert_eq!(model.trainable_params(), 8_388_608);
        assert_eq!(model.n_params(), 6_738_415_616 + 8_388_608);
        // Frozen matrices run forward and input gradient only: about 4 of the 6 FLOPs per weight.
        let ratio = model.model_flops_per_token() / full_flops;
        assert!((0.66..0.70).contains(&ratio), "{ratio}");
        model.lora_targets = vec!["gate_proj".into(), "w_q".into()];
        let err = model.validate().unwrap_err().to_string();
        assert!(err.contains("w_q") && err.contains("q_proj"), "{err}");
    }

    #[test]
    fn llama_7b_has_6_7b_parameters() {
        // Touvron et al. (2023), Table 2: "6.7B"; the released checkpoint has 6,738,415,616.
        check(&ModelConfig::preset("llama-7b").unwrap(), 6_738_415_616);
    }

    #[test]
    fn per_layer_activations_are_34_sbh_plus_5_as2b() {
        let model = ModelConfig::gpt(1, 1024, 16, 512, 1000);
        let act = model.layer_activations(2);
        let sbh = 512.0 * 2.0 * 1024.0;
        assert_eq!(act.split_bytes + act.replicated_bytes, 34.0 * sbh);
        assert_eq!(act.attention_core_bytes, 5.0 * 16.0 * 512.0 * 512.0 * 2.0);
    }

    #[test]
    fn model_flops_match_palm_accounting() {
        let model = ModelConfig::preset("tiny").unwrap();
        let n_matmul = (model.n_layer * model.matmul_params_per_layer() + model.vocab_size * model.d_model) as f64;
        let expected = 6.0 * n_matmul + 12.0 * (model.n_layer * model.d_model * model.seq_len) as f64;
        assert_eq!(model.model_flops_per_token(), expected);
    }
}
