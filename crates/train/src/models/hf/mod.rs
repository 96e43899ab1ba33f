//! Hugging Face checkpoints in and out: `model.from = "hf:DIR"` starts a run from a folder
//! `save_pretrained` wrote (`config.json` and `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`), and [`export_hf`] writes a run's model as such a folder.
//!
//! stoke's names are transformers' names (nanoGPT's GPT names are GPT-2's; the llama family uses
//! `LlamaForCausalLM`'s), so the only mapping is GPT-2's `Conv1D` layers, which store their
//! matrices `[in, out]` where `nn.Linear` (and stoke) store `[out, in]`. Shards are memory-mapped
//! and copied into the parameters one tensor at a time, so an import never holds a second copy of
//! the model in memory.

mod config;
mod export;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use tch::{Kind, Tensor};

use crate::config::ModelConfig;
use crate::params::FlatParams;
use crate::TrainError;

pub use export::export_hf;
pub(crate) use export::write_safetensors;

/// The folder `model.from` names, when it names a Hugging Face checkpoint.
fn hf_dir(model: &ModelConfig) -> Result<Option<PathBuf>, TrainError> {
    if model.from.is_empty() {
        return Ok(None);
    }
    match model.from.strip_prefix("hf:") {
        Some(dir) if !dir.is_empty() => Ok(Some(PathBuf::from(dir))),
        _ => Err(TrainError::InvalidConfig {
            key: "model.from",
            message: format!("must be \"\" or \"hf:DIR\" (a Hugging Face checkpoint folder); got {:?}", model.from),
        }),
    }
}

fn error(path: &Path, message: String) -> TrainError {
    TrainError::HfCheckpoint { path: path.to_path_buf(), message }
}

fn read_json(path: &Path) -> Result<serde_json::Value, TrainError> {
    let text = std::fs::read_to_string(path).map_err(|source| TrainError::Io { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text).map_err(|e| error(path, format!("not JSON: {e}")))
}

/// `model` with the family and every size read from the `config.json` of the checkpoint
/// `model.from` names (unchanged when it names none). Sizes `model` sets itself must agree.
pub fn resolve_from(model: &ModelConfig) -> Result<ModelConfig, TrainError> {
    let Some(dir) = hf_dir(model)? else { return Ok(model.clone()) };
    let path = dir.join("config.json");
    let resolved = config::model_config(&path, &read_json(&path)?, model)?;
    resolved.shape()?;
    Ok(resolved)
}

/// Whether the file tensor `name` is one stoke has no parameter for and may skip: GPT-2's
/// attention-mask buffers, older checkpoints' rotary frequencies, and the head of a tied model
/// (the embedding's matrix again).
fn skippable(name: &str, tied_head: bool) -> bool {
    name.ends_with(".attn.bias")
        || name.ends_with(".attn.masked_bias")
        || name.ends_with(".rotary_emb.inv_freq")
        || (tied_head && name == "lm_head.weight")
}

/// GPT-2's `Conv1D` layers, stored transposed relative to stoke's `[out, in]`.
fn conv1d(family: &str, name: &str) -> bool {
    family == "gpt"
        && [".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"]
            .iter()
            .any(|suffix| name.ends_with(suffix))
}

/// The safetensors files of the checkpoint in `dir`: each file and the tensors it holds.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, TrainError> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let json = read_json(&index)?;
        let map = json
            .get("weight_map")
            .and_then(serde_json::Value::as_object)
            .ok_or_else(|| error(&index, "no \"weight_map\" object".into()))?;
        let files: BTreeSet<&str> = map.values().filter_map(serde_json::Value::as_str).collect();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    Err(error(dir, "holds neither model.safetensors nor model.safetensors.index.json".into()))
}

/// A shard, memory-mapped.
struct Shard {
    path: PathBuf,
    map: memmap2::Mmap,
}

fn kind_of(dtype: Dtype) -> Option<Kind> {
    match dtype {
        Dtype::F32 => Some(Kind::Float),
        Dtype::BF16 => Some(Kind::BFloat16),
        Dtype::F16 => Some(Kind::Half),
        Dtype::F64 => Some(Kind::Double),
        _ => None,
    }
}

/// Copies every parameter of `params` (a model of the family `model.family`) from the checkpoint
/// `model.from` names, converted to fp32. Every parameter must be there with its shape (GPT-2's
/// `Conv1D` matrices transposed); a tensor stoke has no parameter for is an error unless it is a
/// known buffer. Errors name the file and the tensor.
pub(crate) fn load_weights(params: &FlatParams, model: &ModelConfig) -> Result<(), TrainError> {
    let Some(dir) = hf_dir(model)? else { return Ok(()) };
    let tied_head = model.family != "llama" || model.tie_head;
    let mut shards = Vec::new();
    for path in shard_files(&dir)? {
        let file = std::fs::File::open(&path).map_err(|source| TrainError::Io { path: path.clone(), source })?;
        // SAFETY: the map is read while this function runs; the checkpoint folder is an input the
        // user does not rewrite during the import (as with any file stoke reads).
        let map =
            unsafe { memmap2::Mmap::map(&file) }.map_err(|source| TrainError::Io { path: path.clone(), source })?;
        shards.push(Shard { path, map });
    }
    let mut parsed = Vec::with_capacity(shards.len());
    // Where each tensor is: its shard's index.
    let mut location: BTreeMap<String, usize> = BTreeMap::new();
    // LoRA adapters are stoke's own; the base checkpoint has none.
    let entries = params.entries().iter().filter(|e| !super::llama::is_adapter(&e.name));
    for (idx, shard) in shards.iter().enumerate() {
        let tensors =
            SafeTensors::deserialize(&shard.map).map_err(|e| error(&shard.path, format!("not safetensors: {e}")))?;
        for name in tensors.names() {
            location.insert(name.to_string(), idx);
        }
        parsed.push(tensors);
    }
    let mut used = BTreeSet::new();
    tch::no_grad(|| -> Result<(), TrainError> {
        for entry in entries {
            // GPT2Model (no head) saves its names without the `transformer.` prefix.
            let stripped = entry.name.strip_prefix("transformer.").unwrap_or(&entry.name);
            let name = [entry.name.as_str(), stripped].into_iter().find(|n| location.contains_key(*n));
            let Some(name) = name else {
                return Err(TrainError::HfTensor {
                    path: dir.clone(),
                    tensor: entry.name.clone(),
                    message: "missing from the checkpoint".into(),
                });
            };
            let shard = location[name];
            let path = &shards[shard].path;
            let tensor_error =
                |message: String| TrainError::HfTensor { path: path.clone(), tensor: name.into(), message };
            let view = parsed[shard].tensor(name).map_err(|e| tensor_error(e.to_string()))?;
            let kind = kind_of(view.dtype())
                .ok_or_else(|| tensor_error(format!("dtype {:?} is not a float", view.dtype())))?;
            let shape: Vec<i64> = view.shape().iter().map(|&s| s as i64).collect();
            let transpose = conv1d(&model.family, &entry.name);
            let expected: Vec<i64> =
                if transpose { entry.shape.iter().rev().copied().collect() } else { entry.shape.clone() };
            if shape != expected {
                return Err(tensor_error(format!("shape {shape:?}, this model's is {expected:?}")));
            }
            let mut values = Tensor::from_data_size(view.data(), &shape, kind).to_kind(Kind::Float);
            if transpose {
                values = values.t_copy();
            }
            params.flat().narrow(0, entry.offset, entry.numel).copy_(&values.reshape([-1]));
            used.insert(name.to_string());
        }
        Ok(())
    })?;
    if let Some(extra) = location.keys().find(|n| !used.contains(*n) && !skippable(n, tied_head)) {
        return Err(TrainError::HfTensor {
            path: shards[location[extra]].path.clone(),
            tensor: extra.clone(),
            message: format!("is no parameter of this {} model", model.family),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_conv1d_layers_are_the_transposed_ones() {
        assert!(conv1d("gpt", "transformer.h.3.attn.c_attn.weight"));
        assert!(conv1d("gpt", "transformer.h.3.mlp.c_proj.weight"));
        assert!(!conv1d("gpt", "transformer.h.3.attn.c_attn.bias"));
        assert!(!conv1d("gpt", "transformer.wte.weight"));
        assert!(!conv1d("llama", "model.layers.0.mlp.down_proj.weight"));
        assert!(skippable("transformer.h.0.attn.bias", false));
        assert!(!skippable("transformer.h.0.attn.c_attn.bias", true));
        assert!(skippable("lm_head.weight", true) && !skippable("lm_head.weight", false));
    }

    #[test]
    fn from_must_name_a_hugging_face_folder() {
        let bad = ModelConfig { from: "gs://bucket".into(), ..ModelConfig::default() };
        assert!(resolve_from(&bad).unwrap_err().to_string().contains("model.from"));
        let missing = ModelConfig { from: "hf:/nonexistent/stoke-test".into(), ..ModelConfig::default() };
        let err = resolve_from(&missing).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/stoke-test/config.json"), "{err}");
    }
}
