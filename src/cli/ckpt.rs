//! `stoke ckpt verify DIR`: a full pass over a run's checkpoints (or one checkpoint folder).
//! `stoke ckpt consolidate DIR --out FILE`: the model of a checkpoint as one safetensors file.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub struct CkptArgs {
    #[command(subcommand)]
    pub command: CkptCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum CkptCommand {
    /// Check every checkpoint: the manifest, each file's size and CRC-32, the safetensors format.
    /// DIR is a run folder, its `checkpoints/` folder, or one `step-<n>/` folder. Exit 1 when
    /// any checkpoint is damaged (naming the file) or there is none.
    Verify { dir: PathBuf },
    /// Write a checkpoint's model (every parameter, fp32, by nanoGPT's names, so PyTorch loads it
    /// with `safetensors.torch.load_file` into nanoGPT's `GPT`) as one safetensors file. DIR is a
    /// run folder or its `checkpoints/` folder (the latest checkpoint is taken) or one `step-<n>/`
    /// folder. Every file is verified first. A sharded run's checkpoint is whole already: its
    /// ranks gather their slices before rank 0 writes it.
    Consolidate {
        dir: PathBuf,
        /// The file to write (replaced atomically).
        #[arg(long)]
        out: PathBuf,
    },
}

pub fn run(args: CkptArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        CkptCommand::Verify { dir } => verify(&dir),
        CkptCommand::Consolidate { dir, out } => consolidate(&dir, &out),
    }
}

/// The checkpoint `dir` names, verified: a run folder or its `checkpoints/` folder (the latest
/// checkpoint) or one `step-<n>/` folder.
pub(super) fn load_named(dir: &Path) -> anyhow::Result<stoke_ckpt::Loaded> {
    let run_checkpoints = dir.join("checkpoints");
    let folder = if run_checkpoints.is_dir() { run_checkpoints } else { dir.to_path_buf() };
    if folder.join("manifest.json").is_file() {
        return Ok(stoke_ckpt::load_dir(&folder)?);
    }
    let store = stoke_ckpt::CheckpointStore::new(&folder);
    let step = store.latest()?.ok_or_else(|| anyhow::anyhow!("no checkpoint in {}", folder.display()))?;
    Ok(store.load(step)?)
}

fn consolidate(dir: &Path, out: &Path) -> anyhow::Result<ExitCode> {
    let loaded = load_named(dir)?;
    let model = loaded
        .files
        .get("model")
        .ok_or_else(|| anyhow::anyhow!("checkpoint {} has no model file", loaded.path.display()))?;
    let bytes = stoke_ckpt::write_safetensors(out, model)?;
    println!(
        "{}: {} tensors of step {} ({:.1} MB) from {}",
        out.display(),
        model.len(),
        loaded.manifest.step,
        bytes as f64 / 1e6,
        loaded.path.display()
    );
    Ok(ExitCode::SUCCESS)
}

fn verify(dir: &Path) -> anyhow::Result<ExitCode> {
    let run_checkpoints = dir.join("checkpoints");
    let dir = if run_checkpoints.is_dir() { run_checkpoints } else { dir.to_path_buf() };
    if !dir.is_dir() {
        anyhow::bail!("no such folder: {}", dir.display());
    }
    let report = stoke_ckpt::verify_dir(&dir)?;
    let mut first_damage = None;
    for (path, result) in &report.checkpoints {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        match result {
            Ok(manifest) => println!(
                "ok       {name}: step {}, {} files, {:.1} MB",
                manifest.step,
                manifest.files.len(),
                manifest.total_bytes() as f64 / 1e6
            ),
            Err(e) => {
                println!("DAMAGED  {name}: {e}");
                first_damage.get_or_insert_with(|| e.to_string());
            }
        }
    }
    for path in &report.leftovers {
        println!("leftover {} (never a checkpoint; its writer removes it at its next save)", path.display());
    }
    let (n, damaged) = (report.checkpoints.len(), report.damaged());
    if let Some(first) = first_damage {
        anyhow::bail!("{damaged} of {n} checkpoints in {} are damaged; first: {first}", dir.display());
    }
    if n == 0 {
        anyhow::bail!("no checkpoint in {}", dir.display());
    }
    println!("{n} checkpoints in {} verified", dir.display());
    Ok(ExitCode::SUCCESS)
}
