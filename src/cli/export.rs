//! `stoke export hf RUN --out DIR`: a run's model as a Hugging Face checkpoint folder.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

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
    /// llama) with the same outputs. RUN is a run folder or its `checkpoints/` folder (the latest
    /// checkpoint is taken) or one `step-<n>/` folder; the model's shape is the one saved in the
    /// checkpoint.
    Hf {
        run: PathBuf,
        /// The folder to write (made when missing; its two files are replaced).
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(args: ExportArgs) -> anyhow::Result<ExitCode> {
    let ExportCommand::Hf { run, out } = args.command;
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
    let bytes = stoke_train::export_hf(&config.model, model, &out)?;
    println!(
        "{}: config.json and model.safetensors ({} tensors, {:.1} MB) of step {} from {}",
        out.display(),
        model.len(),
        bytes as f64 / 1e6,
        loaded.manifest.step,
        loaded.path.display()
    );
    Ok(ExitCode::SUCCESS)
}
