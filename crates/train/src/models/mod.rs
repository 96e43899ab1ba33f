//! The seam between a model and what drives it. The block executor, recomputation, ZeRO's units
//! and checkpoints see a model only through [`Model`]: a sequence of units (the embedding, the
//! blocks, the head with the loss) over one pair of flat parameter buffers ([`FlatParams`](crate::FlatParams), whose
//! units and entries give ZeRO its ranges and checkpoints their names and shapes). A block is two
//! residual branches, each `x + branch(norm(x))`; the executor cuts the autograd graph around a
//! block or a branch to run it, recompute it, or hook between units. Parts a family runs
//! outside libtorch's graph, with its backward written by hand, it offers through [`ByHand`].
//!
//! Families live in folders beside this file; [`build_model`] makes the one `model.family` names.

mod embedding;
mod finetune;
mod gpt;
mod gpt_rms;
mod hf;
mod llama;
mod seam;
mod tensor_group;
mod tensor_parallel;
mod vla;

use tch::Device;

pub use crate::config::TENSOR_PARALLEL_FAMILIES;
use crate::config::{ModelConfig, TrainConfig, MODEL_FAMILIES};
use crate::TrainError;

pub use finetune::{export_peft, merged_parameters};
pub use gpt::Gpt;
pub use gpt_rms::GptRms;
pub use hf::{export_hf, resolve_from};
pub use llama::Llama;
pub use seam::{
    BlockBackward, Branch, BranchBackward, ByHand, CoreBackward, EpisodeInputs, HeadBackward, HeadLoss, Inputs, Model,
    Norm,
};
pub use tensor_group::{Split, TensorGroup};
pub use vla::Vla;

/// A model of the family `model.family` names, with the kernels and casts `train` asks for (their
/// Rust kernels split over `kernel_threads`): freshly initialized (seed libtorch first for a
/// reproducible init), or with the weights of the checkpoint `model.from` names (`model` resolved
/// by [`resolve_from`] first).
pub fn build_model(
    model: &ModelConfig,
    train: &TrainConfig,
    kernel_threads: usize,
    device: Device,
) -> Result<Box<dyn Model>, TrainError> {
    let mut built = build_initialized(model, train, kernel_threads, device)?;
    hf::load_weights(built.params(), model)?;
    finetune::freeze(built.as_mut(), &model.family, train)?;
    finetune::set_lr_multipliers(built.as_mut(), train)?;
    Ok(built)
}

fn build_initialized(
    model: &ModelConfig,
    train: &TrainConfig,
    kernel_threads: usize,
    device: Device,
) -> Result<Box<dyn Model>, TrainError> {
    let shape = model.shape()?;
    if train.instruction_lm > 0.0 && model.family != "vla" {
        return Err(TrainError::InvalidConfig {
            key: "train.instruction_lm",
            message: format!(
                "is the vla family's loss on its instruction; model.family {:?} has none (leave it at 0)",
                model.family
            ),
        });
    }
    match model.family.as_str() {
        "gpt" => {
            let mut gpt = Gpt::for_training(shape, train, kernel_threads, device);
            gpt.set_tanh_gelu(model.gelu == "tanh");
            Ok(Box::new(gpt))
        }
        "gpt-rms" => {
            let mut gpt_rms = GptRms::new(shape, train.precision, device);
            gpt_rms.set_tanh_gelu(model.gelu == "tanh");
            Ok(Box::new(gpt_rms))
        }
        "llama" => {
            let mut llama = Llama::with_lora(model.llama_shape()?, train.precision, &train.lora, device);
            llama.set_fused_rms_norm(train.fused_layer_norm, kernel_threads);
            llama.set_branches_by_hand(train.fused_branches);
            llama.set_fused_cross_entropy(train.fused_cross_entropy.enabled(shape.vocab_size), kernel_threads);
            Ok(Box::new(llama))
        }
        "vla" => {
            let mut vla = Vla::new(model.vla_shape()?, train.precision, train.action_loss, device);
            vla.set_instruction_lm(train.instruction_lm);
            vla.set_blocks_by_hand(train.fused_branches && train.fused_layer_norm, kernel_threads);
            Ok(Box::new(vla))
        }
        other => Err(unknown_family(other)),
    }
}

/// The planner's description of the model `model` names: the plain data `stoke plan` computes
/// memory and time from (parameters per unit, FLOPs, activations). A pure function of the config,
/// so a plan never builds the model; each family describes itself beside its code.
pub fn plan_model(model: &ModelConfig) -> Result<stoke_plan::ModelConfig, TrainError> {
    let shape = model.shape()?;
    match model.family.as_str() {
        "gpt" => Ok(gpt::plan_model(shape)),
        "gpt-rms" => Ok(gpt_rms::plan_model(shape)),
        "llama" => Ok(llama::plan_model(&model.llama_shape()?)),
        "vla" => Ok(vla::plan_model(&model.vla_shape()?)),
        other => Err(unknown_family(other)),
    }
}

/// [`plan_model`] of the model as `train` trains it: under LoRA with the adapters' rank and the
/// block matrices their globs pick (by the llama family's names), the rest frozen.
pub fn plan_model_for(model: &ModelConfig, train: &TrainConfig) -> Result<stoke_plan::ModelConfig, TrainError> {
    let mut plan = plan_model(model)?;
    if train.lora.enabled() {
        plan.lora_rank = train.lora.rank;
        plan.lora_targets = stoke_plan::LORA_TARGETS
            .iter()
            .filter(|name| {
                let part = if ["gate_proj", "up_proj", "down_proj"].contains(name) { "mlp" } else { "self_attn" };
                train.lora.targets_weight(&format!("model.layers.0.{part}.{name}.weight"))
            })
            .map(|name| name.to_string())
            .collect();
    }
    Ok(plan)
}

fn unknown_family(name: &str) -> TrainError {
    TrainError::InvalidConfig {
        key: "model.family",
        message: format!("must be one of {}; got {name:?}", MODEL_FAMILIES.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The planner's description of every family holds the parameters the built model holds, unit
    /// by unit, so a plan's memory and FLOPs are the trained model's.
    #[test]
    fn every_family_describes_itself_to_the_planner_as_it_is_built() {
        let train = TrainConfig { precision: crate::config::Precision::Fp32, ..TrainConfig::default() };
        let overrides = [
            ("tiny", 0, 0, 0),
            ("tiny", 3, 64, 2),
            ("tiny", 2, 96, 3),
            ("llama-tiny", 2, 0, 0),
            ("vla-tiny", 0, 0, 0),
            ("vla-tiny", 1, 64, 2),
        ];
        for family in MODEL_FAMILIES {
            for (preset, n_layer, d_model, n_head) in overrides {
                let preset_family = preset.split('-').next().unwrap_or(preset);
                let own_preset = ["llama", "vla"].contains(&preset_family);
                if (own_preset && *family != preset_family) || (!own_preset && *family == "vla") {
                    continue;
                }
                let vla = *family == "vla";
                let config = ModelConfig {
                    family: family.to_string(),
                    preset: preset.into(),
                    n_layer,
                    d_model,
                    n_head,
                    frames: if vla { 2 } else { 0 },
                    state_dim: if vla { 3 } else { 0 },
                    action_dim: if vla { 2 } else { 0 },
                    ..ModelConfig::default()
                };
                let plan = plan_model(&config).unwrap();
                let model = build_model(&config, &train, 1, Device::Cpu).unwrap();
                assert_eq!(plan.n_params(), model.n_params(), "{family} {n_layer}x{d_model}: parameters");
                let built: Vec<u64> =
                    model.params().units().iter().map(|u| (u.range.end - u.range.start) as u64).collect();
                assert_eq!(stoke_plan::model_units(&plan), built, "{family} {n_layer}x{d_model}: units");
            }
        }
        // Llama 3's shapes, planned without building them: grouped-query attention and an untied head.
        let llama3 = ModelConfig { family: "llama".into(), preset: "llama3-8b".into(), ..ModelConfig::default() };
        let plan = plan_model(&llama3).unwrap();
        assert_eq!((plan.n_kv_head, plan.tied_embeddings, plan.n_params()), (8, false, 8_030_261_248));
        let unknown = ModelConfig { family: "nosuch".into(), ..ModelConfig::default() };
        assert!(plan_model(&unknown).unwrap_err().to_string().contains("model.family"));
    }
}
