//! Fine-tuning: which parameters train (`train.freeze`) and LoRA adapters (`[train.lora]`),
//! plain data and the glob matching both use.

use serde::{Deserialize, Serialize};

use crate::TrainError;

/// `[train.lora]`: low-rank adapters (Hu et al., 2021) beside chosen linear layers; the base
/// model is frozen and only the adapters train. `W x` becomes `W x + (alpha / rank) B A x`, `A`
/// `[rank, in]` from U(-1/sqrt(in), 1/sqrt(in)) and `B` `[out, rank]` zero, as PEFT starts them,
/// so a fresh adapter leaves the model's outputs unchanged. Names follow PEFT
/// (`<module>.lora_A.weight`), and `stoke export peft` writes the layout `peft` loads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoraConfig {
    /// The adapters' rank; 0 turns LoRA off. Default 0.
    pub rank: usize,
    /// The adapters' output is scaled by alpha / rank. Default 16.
    pub alpha: f64,
    /// Dropout on the adapters' input. Only 0 is accepted for now: a dropout mask drawn from
    /// libtorch's global generator would make a resumed run differ from an uninterrupted one.
    /// Default 0.
    pub dropout: f64,
    /// The linear layers that get adapters: globs over module names (a parameter's name without
    /// `.weight`); a pattern without `*`, `?` or `.` matches the last part of the name, as PEFT's
    /// `target_modules` does. Default ["q_proj", "v_proj"] (PEFT's choice for Llama).
    pub targets: Vec<String>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig { rank: 0, alpha: 16.0, dropout: 0.0, targets: vec!["q_proj".into(), "v_proj".into()] }
    }
}

impl LoraConfig {
    pub fn enabled(&self) -> bool {
        self.rank > 0
    }

    /// The adapters' scale, alpha / rank.
    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Whether the linear layer whose weight is `weight_name` gets an adapter.
    pub fn targets_weight(&self, weight_name: &str) -> bool {
        let Some(module) = weight_name.strip_suffix(".weight") else { return false };
        self.targets.iter().any(|pattern| {
            if pattern.contains(['*', '?', '.']) {
                glob_match(pattern, module)
            } else {
                module.rsplit('.').next() == Some(pattern.as_str())
            }
        })
    }

    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |key: &'static str, message: String| Err(TrainError::InvalidConfig { key, message });
        if !(0.0..1.0).contains(&self.dropout) {
            return bad("train.lora.dropout", format!("must be in [0, 1); got {}", self.dropout));
        }
        if self.dropout != 0.0 {
            return bad(
                "train.lora.dropout",
                "only 0 for now: dropout masks from libtorch's global generator would break bit-identical resumes"
                    .into(),
            );
        }
        if self.enabled() && self.targets.is_empty() {
            return bad("train.lora.targets", "must name at least one linear layer".into());
        }
        if self.enabled() && !(self.alpha > 0.0) {
            return bad("train.lora.alpha", format!("must be positive; got {}", self.alpha));
        }
        Ok(())
    }
}

/// Whether `text` matches `pattern`, where `*` matches any run of characters (dots too) and `?`
/// any one character.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    // Invariant: `star` is the last `*` seen and `resume` the text position it matched up to.
    let (mut pi, mut ti, mut star, mut resume) = (0, 0, None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            resume = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            resume += 1;
            ti = resume;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_whole_names() {
        assert!(glob_match("model.embed_tokens.*", "model.embed_tokens.weight"));
        assert!(glob_match("model.layers.*.mlp.*", "model.layers.10.mlp.up_proj.weight"));
        assert!(glob_match("*norm*", "model.layers.0.input_layernorm.weight"));
        assert!(glob_match("model.layers.?.self_attn.q_proj.weight", "model.layers.3.self_attn.q_proj.weight"));
        assert!(!glob_match("model.layers.?.self_attn.q_proj.weight", "model.layers.13.self_attn.q_proj.weight"));
        assert!(!glob_match("model.embed_tokens", "model.embed_tokens.weight"));
    }

    #[test]
    fn lora_targets_match_module_names_as_peft_does() {
        let lora = LoraConfig { rank: 4, ..LoraConfig::default() };
        assert!(lora.targets_weight("model.layers.0.self_attn.q_proj.weight"));
        assert!(lora.targets_weight("model.layers.7.self_attn.v_proj.weight"));
        assert!(!lora.targets_weight("model.layers.0.self_attn.k_proj.weight"));
        assert!(!lora.targets_weight("model.layers.0.self_attn.q_proj.lora_A.weight"));
        let mlp = LoraConfig { targets: vec!["model.layers.*.mlp.*".into()], ..lora };
        assert!(mlp.targets_weight("model.layers.1.mlp.down_proj.weight"));
        assert!(!mlp.targets_weight("model.layers.1.self_attn.o_proj.weight"));
    }
}
