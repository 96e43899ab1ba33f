//! A Hugging Face `config.json` read into `[model]` and written from it, for the two layouts
//! stoke shares with transformers: `gpt2` (stoke's family "gpt") and `llama`.
//!
//! Reading refuses what stoke's model would compute differently (another activation, biases in
//! a Llama, a per-layer attention scale) instead of importing weights into a model that gives
//! other outputs.

use std::path::Path;

use serde_json::{json, Map, Value};

use crate::config::{LlamaShape, ModelConfig};
use crate::TrainError;

/// stoke's GPT LayerNorm epsilon, which an imported GPT-2 must use.
const GPT_LAYER_NORM_EPS: f64 = 1e-5;

fn error(path: &Path, message: String) -> TrainError {
    TrainError::HfCheckpoint { path: path.to_path_buf(), message }
}

/// The `[model]` of the checkpoint `config.json` at `path` describes: family and every size set
/// explicitly. `user` holds what the run asked for: a size it sets must agree with the file
/// (a Llama may train on a shorter context than its `max_position_embeddings`).
pub(crate) fn model_config(path: &Path, json: &Value, user: &ModelConfig) -> Result<ModelConfig, TrainError> {
    let get = |key: &str| json.get(key).filter(|v| !v.is_null());
    let size = |key: &str| -> Result<usize, TrainError> {
        get(key)
            .and_then(Value::as_u64)
            .map(|v| v as usize)
            .ok_or_else(|| error(path, format!("config.json has no whole number {key:?}")))
    };
    let number = |key: &str, default: f64| get(key).and_then(Value::as_f64).unwrap_or(default);
    let flag = |key: &str, default: bool| get(key).and_then(Value::as_bool).unwrap_or(default);
    let refuse = |message: String| Err(error(path, message));
    let model_type = get("model_type").and_then(Value::as_str).unwrap_or("");
    let mut model = ModelConfig { from: user.from.clone(), ..ModelConfig::default() };
    match model_type {
        "gpt2" => {
            model.family = "gpt".into();
            model.n_layer = size("n_layer")?;
            model.n_head = size("n_head")?;
            model.d_model = size("n_embd")?;
            model.seq_len = size("n_positions")?;
            model.vocab_size = size("vocab_size")?;
            model.gelu = match get("activation_function").and_then(Value::as_str).unwrap_or("gelu_new") {
                "gelu" => "exact".into(),
                "gelu_new" | "gelu_pytorch_tanh" => "tanh".into(),
                other => return refuse(format!("activation_function {other:?}: stoke's GPT runs gelu or gelu_new")),
            };
            if let Some(inner) = get("n_inner").and_then(Value::as_u64) {
                if inner as usize != 4 * model.d_model {
                    return refuse(format!("n_inner {inner}: stoke's GPT has an MLP 4 x n_embd wide"));
                }
            }
            let eps = number("layer_norm_epsilon", GPT_LAYER_NORM_EPS);
            if (eps - GPT_LAYER_NORM_EPS).abs() > 1e-12 {
                return refuse(format!("layer_norm_epsilon {eps}: stoke's GPT uses {GPT_LAYER_NORM_EPS}"));
            }
            for key in ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"] {
                if flag(key, false) {
                    return refuse(format!("{key} is true: stoke's GPT scales attention by 1/sqrt(head width) only"));
                }
            }
            if !flag("scale_attn_weights", true) {
                return refuse("scale_attn_weights is false: stoke's GPT scales attention".into());
            }
            if !flag("tie_word_embeddings", true) {
                return refuse("tie_word_embeddings is false: stoke's GPT ties its head to wte".into());
            }
        }
        "llama" => {
            model.family = "llama".into();
            model.n_layer = size("num_hidden_layers")?;
            model.n_head = size("num_attention_heads")?;
            model.d_model = size("hidden_size")?;
            model.n_kv_head = get("num_key_value_heads").and_then(Value::as_u64).map_or(model.n_head, |v| v as usize);
            model.ffn_hidden = size("intermediate_size")?;
            model.seq_len = size("max_position_embeddings")?;
            model.vocab_size = size("vocab_size")?;
            model.norm_eps = number("rms_norm_eps", 1e-6);
            model.tie_head = flag("tie_word_embeddings", false);
            if let Some(act) = get("hidden_act").and_then(Value::as_str).filter(|a| *a != "silu") {
                return refuse(format!("hidden_act {act:?}: stoke's Llama runs SwiGLU (silu)"));
            }
            for key in ["attention_bias", "mlp_bias"] {
                if flag(key, false) {
                    return refuse(format!("{key} is true: stoke's Llama has no biases"));
                }
            }
            if let Some(head_dim) = get("head_dim").and_then(Value::as_u64) {
                if head_dim as usize * model.n_head != model.d_model {
                    return refuse(format!("head_dim {head_dim} x {} heads is not hidden_size", model.n_head));
                }
            }
            read_rope(path, json, &mut model)?;
        }
        other => return refuse(format!("model_type {other:?}: stoke imports \"gpt2\" and \"llama\"")),
    }
    agree_with_user(path, &mut model, user)?;
    Ok(model)
}

/// The rotary settings: transformers 5 writes them as `rope_parameters` (with `rope_type`), 4 as
/// `rope_theta` and `rope_scaling`.
fn read_rope(path: &Path, json: &Value, model: &mut ModelConfig) -> Result<(), TrainError> {
    let parameters = json.get("rope_parameters").filter(|v| v.is_object());
    let scaling = json.get("rope_scaling").filter(|v| v.is_object()).or(parameters);
    model.rope_theta = parameters
        .and_then(|p| p.get("rope_theta"))
        .or_else(|| json.get("rope_theta"))
        .and_then(Value::as_f64)
        .unwrap_or(10000.0);
    let Some(scaling) = scaling else { return Ok(()) };
    let kind = scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(Value::as_str).unwrap_or("default");
    match kind {
        "default" => Ok(()),
        "llama3" => {
            let field = |key: &str| {
                scaling
                    .get(key)
                    .and_then(Value::as_f64)
                    .ok_or_else(|| error(path, format!("rope scaling of type llama3 without {key:?}")))
            };
            model.rope_scaling = "llama3".into();
            model.rope_factor = field("factor")?;
            model.rope_low_freq_factor = field("low_freq_factor")?;
            model.rope_high_freq_factor = field("high_freq_factor")?;
            model.rope_original_context = field("original_max_position_embeddings")? as usize;
            Ok(())
        }
        other => Err(error(path, format!("rope scaling of type {other:?}: stoke computes \"default\" and \"llama3\""))),
    }
}

/// A size the run sets itself must be the checkpoint's; a Llama's context may be shorter.
fn agree_with_user(path: &Path, model: &mut ModelConfig, user: &ModelConfig) -> Result<(), TrainError> {
    let sizes = [
        ("model.n_layer", user.n_layer, model.n_layer),
        ("model.n_head", user.n_head, model.n_head),
        ("model.d_model", user.d_model, model.d_model),
        ("model.vocab_size", user.vocab_size, model.vocab_size),
        ("model.n_kv_head", user.n_kv_head, model.n_kv_head),
        ("model.ffn_hidden", user.ffn_hidden, model.ffn_hidden),
    ];
    for (key, asked, found) in sizes {
        if asked != 0 && asked != found {
            return Err(error(path, format!("{key} is {asked}, the checkpoint's is {found}")));
        }
    }
    if user.seq_len != 0 {
        if model.family == "llama" && user.seq_len <= model.seq_len {
            model.seq_len = user.seq_len;
        } else if user.seq_len != model.seq_len {
            return Err(error(
                path,
                format!("model.seq_len is {}, the checkpoint's is {}", user.seq_len, model.seq_len),
            ));
        }
    }
    Ok(())
}

/// The `config.json` transformers reads for a model of `[model]` `model` (family "gpt" or
/// "llama"), with the architecture class `from_pretrained` builds.
pub(crate) fn config_json(model: &ModelConfig) -> Result<Value, TrainError> {
    let shape = model.shape()?;
    let unsupported = |family: &str| TrainError::InvalidConfig {
        key: "model.family",
        message: format!("{family:?} has no Hugging Face layout; export takes \"gpt\" and \"llama\""),
    };
    let mut json = Map::new();
    match model.family.as_str() {
        "gpt" => {
            json.extend([
                ("architectures".into(), json!(["GPT2LMHeadModel"])),
                ("model_type".into(), json!("gpt2")),
                ("n_layer".into(), json!(shape.n_layer)),
                ("n_head".into(), json!(shape.n_head)),
                ("n_embd".into(), json!(shape.d_model)),
                ("n_positions".into(), json!(shape.seq_len)),
                ("n_ctx".into(), json!(shape.seq_len)),
                ("vocab_size".into(), json!(shape.vocab_size)),
                ("n_inner".into(), Value::Null),
                ("activation_function".into(), json!(if model.gelu == "tanh" { "gelu_new" } else { "gelu" })),
                ("layer_norm_epsilon".into(), json!(GPT_LAYER_NORM_EPS)),
                ("tie_word_embeddings".into(), json!(true)),
                ("resid_pdrop".into(), json!(0.0)),
                ("embd_pdrop".into(), json!(0.0)),
                ("attn_pdrop".into(), json!(0.0)),
            ]);
        }
        "llama" => {
            let llama: LlamaShape = model.llama_shape()?;
            let mut rope = json!({"rope_type": "default", "rope_theta": llama.rope_theta});
            if let Some(s) = llama.rope_scaling {
                rope = json!({
                    "rope_type": "llama3",
                    "rope_theta": llama.rope_theta,
                    "factor": s.factor,
                    "low_freq_factor": s.low_freq_factor,
                    "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_context,
                });
            }
            json.extend([
                ("architectures".into(), json!(["LlamaForCausalLM"])),
                ("model_type".into(), json!("llama")),
                ("num_hidden_layers".into(), json!(shape.n_layer)),
                ("num_attention_heads".into(), json!(shape.n_head)),
                ("num_key_value_heads".into(), json!(llama.n_kv_head)),
                ("hidden_size".into(), json!(shape.d_model)),
                ("head_dim".into(), json!(llama.head_dim())),
                ("intermediate_size".into(), json!(llama.ffn_hidden)),
                ("max_position_embeddings".into(), json!(shape.seq_len)),
                ("vocab_size".into(), json!(shape.vocab_size)),
                ("rms_norm_eps".into(), json!(llama.norm_eps)),
                ("tie_word_embeddings".into(), json!(llama.tie_head)),
                ("hidden_act".into(), json!("silu")),
                ("attention_bias".into(), json!(false)),
                ("mlp_bias".into(), json!(false)),
                ("attention_dropout".into(), json!(0.0)),
                // Both spellings: transformers 5 reads rope_parameters, 4 rope_theta and rope_scaling.
                ("rope_theta".into(), json!(llama.rope_theta)),
                ("rope_scaling".into(), if llama.rope_scaling.is_some() { rope.clone() } else { Value::Null }),
                ("rope_parameters".into(), rope),
            ]);
        }
        other => return Err(unsupported(other)),
    }
    json.insert("torch_dtype".into(), json!("float32"));
    Ok(Value::Object(json))
}
