//! `stoke export hf RUN --out DIR`: a run's model as a Hugging Face checkpoint folder.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

use stoke_train::Trainer;

use crate::config::StokeConfig;

#[derive(Debug, clap::Args)]
pub struct ExportArgs {
    #[command(subcommand)]
    pub command: ExportCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum ExportCommand {
    /// Write a checkpoint's model as `config.json` + `model.safetensors` that transformers'
    /// `from_pretrained` loads as `GPT2LMHeadModel` (family gpt) or `LlamaForCausalLM` (family
    /// llama) with the same outputs; a fine-tuned run's LoRA adapters are merged into the weights
    /// and its frozen parameters come from where the run took them (`model.from` or the seed).
    /// RUN is a run folder or its `checkpoints/` folder (the latest checkpoint is taken) or one
    /// `step-<n>/` folder; the model is the one saved in the checkpoint's config.
    Hf {
        run: PathBuf,
        /// The folder to write (made when missing; its two files are replaced).
        #[arg(long)]
        out: PathBuf,
    },
    /// Write a LoRA run's adapters as PEFT saves them (`adapter_model.safetensors` +
    /// `adapter_config.json`), for `PeftModel.from_pretrained` over the base model.
    Peft {
        run: PathBuf,
        /// The folder to write (made when missing).
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(args: ExportArgs) -> anyhow::Result<ExitCode> {
    let (run, out, peft) = match args.command {
        ExportCommand::Hf { run, out } => (run, out, false),
        ExportCommand::Peft { run, out } => (run, out, true),
    };
    let loaded = super::ckpt::load_named(&run)?;
    let manifest = loaded.path.join(stoke_ckpt::MANIFEST);
    let saved = loaded
        .manifest
        .meta
        .get("config_toml")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| anyhow::anyhow!("checkpoint {} holds no config (meta.config_toml)", manifest.display()))?;
    let config: StokeConfig =
        toml::from_str(saved).with_context(|| format!("the config saved in {} does not parse", manifest.display()))?;
    let model = loaded
        .files
        .get("model")
        .ok_or_else(|| anyhow::anyhow!("checkpoint {} has no model file", loaded.path.display()))?;
    let fine_tuned = config.train.lora.enabled() || !config.train.freeze.is_empty();
    let (what, bytes) = if peft || fine_tuned {
        // The checkpoint holds what trained; the rest is rebuilt as the run built it.
        let mut trainer = Trainer::new(&config.model, &config.train, &config.ckpt, tch::Device::Cpu)?;
        trainer.restore_loaded(&loaded)?;
        if peft {
            let bytes = stoke_train::export_peft(trainer.model(), &config.model, &config.train, &out)?;
            ("adapter_config.json and adapter_model.safetensors", bytes)
        } else {
            let merged = stoke_train::merged_parameters(trainer.model(), &config.train);
            (
                "config.json and model.safetensors (adapters merged)",
                stoke_train::export_hf(&config.model, &merged, &out)?,
            )
        }
    } else {
        ("config.json and model.safetensors", stoke_train::export_hf(&config.model, model, &out)?)
    };
    println!(
        "{}: {what} ({:.1} MB) of step {} from {}",
        out.display(),
        bytes as f64 / 1e6,
        loaded.manifest.step,
        loaded.path.display()
    );
    Ok(ExitCode::SUCCESS)
}
