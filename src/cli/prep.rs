//! `stoke prep`: offline data preparation. `text` tokenizes documents into packed token shards,
//! `records` decodes samples into record shards, `verify` reads a prepared directory completely
//! and checks every checksum and index.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Subcommand};
use stoke_data::{prepare_records, prepare_text, verify_prepared, PrepRecordsConfig, PrepTextConfig, RecordStore};

use super::UsageError;

#[derive(Debug, Args)]
pub struct PrepArgs {
    #[command(subcommand)]
    pub command: PrepCommand,
}

#[derive(Debug, Subcommand)]
pub enum PrepCommand {
    /// Tokenize text (.txt: one document per file; .jsonl: one per line's "text") into token shards.
    Text(PrepTextArgs),
    /// Decode images (ImageFolder layout: root/<class>/<file>) or files into record shards.
    Records(PrepRecordsArgs),
    /// Robot episodes (JSON lines: episode, t, instruction, state, action, one image per camera; or
    /// a LeRobot v2 dataset: Parquet tables and MP4 videos, decoded by ffmpeg) into frames,
    /// state/action statistics and instruction tokens.
    Episodes(PrepEpisodesArgs),
    /// Read a prepared directory (tokens or records) completely and check checksums and indexes.
    Verify(PrepVerifyArgs),
}

#[derive(Debug, Args)]
pub struct PrepTextArgs {
    /// Input files, in order.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// A HuggingFace tokenizer.json, or "bytes" for byte-level tokens.
    #[arg(long, default_value = "bytes")]
    pub tokenizer: String,
    /// Output directory (created if missing; one that holds anything is refused without --force).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace a non-empty --out: the new dataset is written beside it and swapped in whole, so
    /// no file of the old one is left behind and a failure leaves the old one as it was.
    #[arg(long)]
    pub force: bool,
    /// A token appended after every document, by its text (e.g. "<|endoftext|>").
    #[arg(long, default_value = "")]
    pub eos: String,
    /// Tokens per shard.
    #[arg(long, default_value_t = 1 << 28)]
    pub shard_tokens: u64,
    /// Tokenizer threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
}

#[derive(Debug, Args)]
pub struct PrepEpisodesArgs {
    /// A JSON-lines file, a folder of `*.jsonl` files (image paths are relative to each file), or
    /// a LeRobot v2 dataset folder (the one holding `meta/info.json`; needs `ffmpeg` on PATH).
    pub source: PathBuf,
    /// Output directory (created if missing; one that holds anything is refused without --force).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace a non-empty --out whole.
    #[arg(long)]
    pub force: bool,
    /// Side of the square frames decoded frames are resized to.
    #[arg(long, default_value_t = 64)]
    pub resolution: u32,
    /// Keep each frame's JPEG/PNG bytes, to decode (and augment) at training time (JSON-lines
    /// sources only: a LeRobot dataset's frames are in videos).
    #[arg(long)]
    pub keep_encoded: bool,
    /// A HuggingFace tokenizer.json for the instructions, or "bytes".
    #[arg(long, default_value = "bytes")]
    pub tokenizer: String,
}

#[derive(Debug, Args)]
pub struct PrepRecordsArgs {
    /// Input directories (root/<class>/<file>) or files.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// Output directory (created if missing; one that holds anything is refused without --force).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace a non-empty --out: the new dataset is written beside it and swapped in whole, so
    /// no file of the old one is left behind and a failure leaves the old one as it was.
    #[arg(long)]
    pub force: bool,
    /// Payload bytes per shard.
    #[arg(long, default_value_t = 256 << 20)]
    pub shard_bytes: u64,
    /// Decoder threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
}

#[derive(Debug, Args)]
pub struct PrepVerifyArgs {
    /// A directory written by `stoke prep text` or `stoke prep records`.
    pub dir: PathBuf,
}

pub fn run(args: PrepArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        PrepCommand::Text(args) => text(args),
        PrepCommand::Records(args) => records(args),
        PrepCommand::Episodes(args) => episodes(args),
        PrepCommand::Verify(args) => verify(args),
    }
}

fn text(args: PrepTextArgs) -> anyhow::Result<ExitCode> {
    if args.threads == 0 || args.shard_tokens == 0 {
        return Err(anyhow::Error::new(UsageError("--threads and --shard-tokens must be at least 1".into())));
    }
    for input in &args.inputs {
        if !input.is_file() {
            return Err(anyhow::Error::new(UsageError(format!("input {} is not a file", input.display()))));
        }
    }
    let config = PrepTextConfig {
        tokenizer: args.tokenizer,
        eos: args.eos,
        shard_tokens: args.shard_tokens,
        n_threads: args.threads,
        ..PrepTextConfig::default()
    };
    let manifest = into_fresh_dir(&args.out, args.force, |dir| prepare_text(&args.inputs, &config, dir))?;
    println!(
        "{}: {} tokens ({}) in {} documents, {} shards, vocabulary {}",
        args.out.display(),
        manifest.n_tokens,
        manifest.dtype.name(),
        manifest.n_documents,
        manifest.shards.len(),
        manifest.vocab_size
    );
    Ok(ExitCode::SUCCESS)
}

fn records(args: PrepRecordsArgs) -> anyhow::Result<ExitCode> {
    if args.threads == 0 || args.shard_bytes == 0 {
        return Err(anyhow::Error::new(UsageError("--threads and --shard-bytes must be at least 1".into())));
    }
    let config = PrepRecordsConfig { shard_bytes: args.shard_bytes, n_threads: args.threads };
    let manifest = into_fresh_dir(&args.out, args.force, |dir| prepare_records(&args.inputs, &config, dir))?;
    println!(
        "{}: {} records, {} classes, {} shards",
        args.out.display(),
        manifest.n_records,
        manifest.classes.len(),
        manifest.shards.len()
    );
    Ok(ExitCode::SUCCESS)
}

/// Runs `prepare` into a new folder beside `out` and puts it in `out`'s place only once it has
/// succeeded: a folder that holds anything is refused without `force`, and with it the old
/// dataset is swapped out whole (one atomic exchange of names) and removed, so none of its shards
/// is left among the new ones. A failure removes the new folder and leaves `out` untouched.
fn into_fresh_dir<T, E>(out: &Path, force: bool, prepare: impl FnOnce(&Path) -> Result<T, E>) -> anyhow::Result<T>
where
    E: std::error::Error + Send + Sync + 'static,
{
    use stoke_ckpt::FreshDirError as F;
    stoke_ckpt::into_fresh_dir(out, force, prepare).map_err(|err| match err {
        F::Occupied(n) => UsageError(format!(
            "--out {} already holds {n} entries; pass --force to replace it whole, or choose another folder",
            out.display()
        ))
        .into(),
        F::ReadOut(e) => anyhow::Error::new(e).context(format!("--out {}", out.display())),
        F::Prepare(e) => anyhow::Error::new(e).context(format!("preparing {}", out.display())),
        F::Move(e) => anyhow::Error::new(e).context(format!("moving the dataset into {}", out.display())),
        F::Swap(e) => anyhow::Error::new(e).context(format!("swapping the new dataset into {}", out.display())),
        F::RemoveOld(old, e) => {
            anyhow::Error::new(e).context(format!("removing the replaced dataset (now {})", old.display()))
        }
    })
}

fn episodes(args: PrepEpisodesArgs) -> anyhow::Result<ExitCode> {
    let config = stoke_data::PrepEpisodesConfig {
        resolution: args.resolution,
        keep_encoded: args.keep_encoded,
        tokenizer: args.tokenizer,
        ..stoke_data::PrepEpisodesConfig::default()
    };
    let manifest =
        into_fresh_dir(&args.out, args.force, |dir| stoke_data::prepare_episodes(&args.source, &config, dir))?;
    println!(
        "{}: {} episodes, {} steps, state {}, action {}, cameras {}, frames {}",
        args.out.display(),
        manifest.n_episodes,
        manifest.n_steps,
        manifest.state_dim,
        manifest.action_dim,
        manifest.cameras.join(","),
        if args.keep_encoded { "encoded".to_string() } else { format!("{0}x{0} rgb", manifest.resolution) }
    );
    Ok(ExitCode::SUCCESS)
}

fn verify(args: PrepVerifyArgs) -> anyhow::Result<ExitCode> {
    let manifest_path = args.dir.join("manifest.json");
    let manifest = stoke_fsio::read_to_string_capped(&manifest_path, stoke_fsio::MANIFEST_CAP)
        .with_context(|| format!("reading {}", manifest_path.display()))?;
    if manifest.contains(&format!("\"{}\"", stoke_data::EPISODES_FORMAT)) {
        let store = stoke_data::EpisodeStore::open(&args.dir, true)?;
        for step_idx in 0..store.n_steps() {
            store.step(step_idx)?;
        }
        println!("{}: ok, {} episodes, {} steps", args.dir.display(), store.episodes().len(), store.n_steps());
    } else if manifest.contains("\"stoke-records\"") {
        let store = RecordStore::open(&args.dir, true)?;
        for record_idx in 0..store.len() {
            store.get(record_idx)?;
        }
        println!("{}: ok, {} records", args.dir.display(), store.len());
    } else {
        let manifest = verify_prepared(&args.dir)?;
        println!("{}: ok, {} tokens in {} shards", args.dir.display(), manifest.n_tokens, manifest.shards.len());
    }
    Ok(ExitCode::SUCCESS)
}
