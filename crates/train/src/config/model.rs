//! `[model]`: which family and what shape, plain data.

use serde::{Deserialize, Serialize};

use crate::TrainError;

/// `[model]`: the model's family and shape. Sizes left at 0 come from the preset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// The kind of model: "gpt" (nanoGPT's GPT-2: LayerNorm, biases) or "gpt-rms" (the same
    /// decoder with RMSNorm and no biases; runs every op in libtorch's graph, so the
    /// `train.fused_*` kernels do not apply to it). Default "gpt".
    pub family: String,
    /// Named shape: "tiny" (4 layers, d 256), "small" (6 layers, d 384), "gpt2-124m". Default "tiny".
    pub preset: String,
    /// Transformer blocks; 0 takes the preset's. Default 0.
    pub n_layer: usize,
    /// Attention heads; 0 takes the preset's. Default 0.
    pub n_head: usize,
    /// Model width; 0 takes the preset's. Default 0.
    pub d_model: usize,
    /// Context length in tokens; 0 takes the preset's. Default 0.
    pub seq_len: usize,
    /// Vocabulary size; 0 takes the preset's (256 byte tokens for tiny and small). Default 0.
    pub vocab_size: usize,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            family: "gpt".into(),
            preset: "tiny".into(),
            n_layer: 0,
            n_head: 0,
            d_model: 0,
            seq_len: 0,
            vocab_size: 0,
        }
    }
}

/// The resolved shape of a GPT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GptShape {
    pub n_layer: usize,
    pub n_head: usize,
    pub d_model: usize,
    pub seq_len: usize,
    pub vocab_size: usize,
}

impl GptShape {
    /// Parameters, counting the tied embedding once.
    pub fn n_params(&self) -> usize {
        let d = self.d_model;
        let per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
        self.vocab_size * d + self.seq_len * d + self.n_layer * per_block + 2 * d
    }

    /// Training FLOPs per token: 6N for the matrix multiplies plus 12·L·d·T for attention
    /// (PaLM, appendix B), with N excluding the position embedding.
    pub fn flops_per_token(&self) -> f64 {
        let n = (self.n_params() - self.seq_len * self.d_model) as f64;
        6.0 * n + 12.0 * (self.n_layer * self.d_model * self.seq_len) as f64
    }
}

/// The values `model.family` takes.
pub const MODEL_FAMILIES: &[&str] = &["gpt", "gpt-rms"];

impl ModelConfig {
    /// The names `model.preset` accepts.
    pub const PRESETS: &'static [&'static str] = &["tiny", "small", "gpt2-124m"];

    /// The resolved shape, after checking the section (`model.family` too).
    pub fn shape(&self) -> Result<GptShape, TrainError> {
        if !MODEL_FAMILIES.contains(&self.family.as_str()) {
            return Err(TrainError::InvalidConfig {
                key: "model.family",
                message: format!("must be one of {}; got {:?}", MODEL_FAMILIES.join(", "), self.family),
            });
        }
        let preset = match self.preset.as_str() {
            "tiny" => GptShape { n_layer: 4, n_head: 4, d_model: 256, seq_len: 128, vocab_size: 256 },
            "small" => GptShape { n_layer: 6, n_head: 6, d_model: 384, seq_len: 256, vocab_size: 256 },
            "gpt2-124m" => GptShape { n_layer: 12, n_head: 12, d_model: 768, seq_len: 1024, vocab_size: 50304 },
            other => {
                return Err(TrainError::InvalidConfig {
                    key: "model.preset",
                    message: format!("must be one of {}; got {other:?}", ModelConfig::PRESETS.join(", ")),
                })
            }
        };
        let pick = |value: usize, preset: usize| if value == 0 { preset } else { value };
        let shape = GptShape {
            n_layer: pick(self.n_layer, preset.n_layer),
            n_head: pick(self.n_head, preset.n_head),
            d_model: pick(self.d_model, preset.d_model),
            seq_len: pick(self.seq_len, preset.seq_len),
            vocab_size: pick(self.vocab_size, preset.vocab_size),
        };
        if shape.d_model % shape.n_head != 0 {
            return Err(TrainError::InvalidConfig {
                key: "model.n_head",
                message: format!("must divide model.d_model = {}; got {}", shape.d_model, shape.n_head),
            });
        }
        Ok(shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_shape_has_124m_parameters() {
        let cfg = ModelConfig { preset: "gpt2-124m".into(), vocab_size: 50257, ..ModelConfig::default() };
        let n = cfg.shape().unwrap().n_params();
        assert_eq!(n, 124_439_808, "nanoGPT reports 124.44M with the position embedding");
    }

    #[test]
    fn bad_head_count_names_the_key() {
        let cfg = ModelConfig { n_head: 5, ..ModelConfig::default() };
        let err = cfg.shape().unwrap_err().to_string();
        assert!(err.contains("model.n_head"), "{err}");
    }

    #[test]
    fn unknown_family_names_the_key_and_the_families() {
        let cfg = ModelConfig { family: "llama".into(), ..ModelConfig::default() };
        let err = cfg.shape().unwrap_err().to_string();
        assert!(err.contains("model.family") && err.contains("gpt, gpt-rms") && err.contains("\"llama\""), "{err}");
    }
}
