//! Fine-tuning a built model: freezing (`train.freeze`, a LoRA's base) and what leaves a
//! fine-tuned run: every weight with its adapter merged in, or the adapters alone in PEFT's
//! layout.

use std::path::Path;

use serde_json::json;
use stoke_ckpt::{DType, TensorRecord};
use tch::{Kind, Tensor};

use super::llama::{adapter_names, is_adapter};
use super::Model;
use crate::config::{glob_match, ModelConfig, TrainConfig};
use crate::TrainError;

/// Freezes the parameters `train.freeze` names and, under LoRA, every parameter but the adapters.
/// Refused for a family with parts by hand (their kernels write gradients at fixed offsets), for a
/// pattern that matches nothing (a typo would otherwise train everything), and when nothing would
/// train.
pub(super) fn freeze(model: &mut dyn Model, family: &str, train: &TrainConfig) -> Result<(), TrainError> {
    if train.freeze.is_empty() && !train.lora.enabled() {
        return Ok(());
    }
    let key = if train.lora.enabled() { "train.lora.rank" } else { "train.freeze" };
    if family == "gpt" {
        return Err(TrainError::InvalidConfig {
            key,
            message: "needs a family that runs in libtorch's graph (gpt-rms, llama, vla); the gpt family's kernels \
                      write gradients by hand"
                .into(),
        });
    }
    if train.lora.enabled() && family != "llama" {
        return Err(TrainError::InvalidConfig {
            key,
            message: format!("applies to the llama family; this model is {family:?}"),
        });
    }
    let names: Vec<String> = model.params().entries().iter().map(|e| e.name.clone()).collect();
    for pattern in &train.freeze {
        if !names.iter().any(|n| glob_match(pattern, n)) {
            return Err(TrainError::InvalidConfig {
                key: "train.freeze",
                message: format!("{pattern:?} matches no parameter (names look like {:?})", names.get(1)),
            });
        }
    }
    if train.lora.enabled() && !names.iter().any(|n| is_adapter(n)) {
        return Err(TrainError::InvalidConfig {
            key: "train.lora.targets",
            message: format!("{:?} match no linear layer of the blocks", train.lora.targets),
        });
    }
    let lora = train.lora.enabled();
    let frozen = |name: &str| (lora && !is_adapter(name)) || train.freeze.iter().any(|p| glob_match(p, name));
    model.params_mut().freeze(&frozen);
    if model.params().n_elements() == 0 {
        return Err(TrainError::InvalidConfig { key: "train.freeze", message: "freezes every parameter".into() });
    }
    Ok(())
}

/// Sets each trained parameter's factor on the learning rate from `train.lr_multipliers` (1 where
/// no pattern matches). Refused: a pattern that matches no trained parameter (a typo, or a frozen
/// one), and a parameter that two patterns match (which factor was meant is not clear).
pub(super) fn set_lr_multipliers(model: &mut dyn Model, train: &TrainConfig) -> Result<(), TrainError> {
    if train.lr_multipliers.is_empty() {
        return Ok(());
    }
    let bad = |message: String| TrainError::InvalidConfig { key: "train.lr_multipliers", message };
    let names: Vec<String> = model.params().entries().iter().map(|e| e.name.clone()).collect();
    for pattern in train.lr_multipliers.keys() {
        if !names.iter().any(|n| glob_match(pattern, n)) {
            return Err(bad(format!("{pattern:?} matches no trained parameter (names look like {:?})", names.get(1))));
        }
    }
    let mut factors = std::collections::HashMap::new();
    for name in &names {
        let matched: Vec<(&String, &f64)> = train.lr_multipliers.iter().filter(|(p, _)| glob_match(p, name)).collect();
        match matched.as_slice() {
            [] => {}
            [(_, factor)] => {
                factors.insert(name.as_str(), **factor);
            }
            [(first, _), (second, _), ..] => return Err(bad(format!("{name} matches both {first:?} and {second:?}"))),
        }
    }
    model.params_mut().set_lr_scales(&|name| factors.get(name).copied().unwrap_or(1.0));
    Ok(())
}

fn record(name: String, values: &Tensor) -> TensorRecord {
    let values = values.detach().to_kind(Kind::Float).contiguous();
    let shape: Vec<usize> = values.size().iter().map(|&s| s as usize).collect();
    let mut data = vec![0u8; 4 * values.numel()];
    values.copy_data_u8(&mut data, values.numel());
    TensorRecord { name, dtype: DType::F32, shape, data }
}

/// Every weight of `model` (trained and frozen), each with its LoRA adapter merged in (`W +
/// scale B A`) and the adapters left out: the model a plain export writes.
pub fn merged_parameters(model: &dyn Model, train: &TrainConfig) -> Vec<TensorRecord> {
    let params = model.params();
    let all: Vec<_> = params.entries().iter().chain(params.frozen_entries()).collect();
    tch::no_grad(|| {
        all.iter()
            .filter(|e| !is_adapter(&e.name))
            .map(|e| {
                let (a, b) = adapter_names(&e.name);
                let weight = if train.lora.enabled() && all.iter().any(|x| x.name == a) {
                    e.tensor.detach() + params.get(&b).matmul(params.get(&a)) * train.lora.scale()
                } else {
                    e.tensor.detach()
                };
                record(e.name.clone(), &weight)
            })
            .collect()
    })
}

/// Writes the LoRA adapters of `model` as PEFT saves them: `adapter_model.safetensors` (names
/// `base_model.model.<module>.lora_A.weight`) and `adapter_config.json`, which `peft`'s
/// `PeftModel.from_pretrained` loads over the base model `model_config.from` names. Returns the
/// bytes of the tensor file.
pub fn export_peft(
    model: &dyn Model,
    model_config: &ModelConfig,
    train: &TrainConfig,
    out: &Path,
) -> Result<u64, TrainError> {
    if !train.lora.enabled() {
        return Err(TrainError::InvalidConfig {
            key: "train.lora.rank",
            message: "is 0: the run has no adapters".into(),
        });
    }
    let params = model.params();
    let adapters: Vec<TensorRecord> = tch::no_grad(|| {
        params
            .entries()
            .iter()
            .filter(|e| is_adapter(&e.name))
            .map(|e| record(format!("base_model.model.{}", e.name), &e.tensor))
            .collect()
    });
    let mut modules: Vec<String> =
        params.entries().iter().filter_map(|e| e.name.strip_suffix(".lora_A.weight").map(str::to_string)).collect();
    modules.sort();
    let base = model_config.from.strip_prefix("hf:").map(|dir| dir.to_string());
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": train.lora.rank,
        "lora_alpha": train.lora.alpha,
        "lora_dropout": train.lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": null,
        "base_model_name_or_path": base,
    });
    std::fs::create_dir_all(out).map_err(|source| TrainError::Io { path: out.to_path_buf(), source })?;
    let file = out.join("adapter_model.safetensors");
    let tensors = adapters.iter().map(|r| (r.name.as_str(), r.shape.as_slice(), r.data.as_slice()));
    super::hf::write_safetensors(&file, tensors)?;
    let config_path = out.join("adapter_config.json");
    let text = serde_json::to_string_pretty(&config).expect("a JSON value serializes") + "\n";
    std::fs::write(&config_path, text).map_err(|source| TrainError::Io { path: config_path.clone(), source })?;
    Ok(std::fs::metadata(&file).map_err(|source| TrainError::Io { path: file.clone(), source })?.len())
}
