//! `stoke prep`: offline data preparation. `text` tokenizes documents into packed token shards,
//! `records` decodes samples into record shards, `verify` reads a prepared directory completely
//! and checks every checksum and index.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Subcommand};
use stoke_data::{
    prepare_records, prepare_text, verify_prepared, PrepRecordsConfig, PrepTextConfig, RecordStore, TokenStore,
};

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
    /// Output directory (created if missing).
    #[arg(long)]
    pub out: PathBuf,
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
pub struct PrepRecordsArgs {
    /// Input directories (root/<class>/<file>) or files.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// Output directory (created if missing).
    #[arg(long)]
    pub out: PathBuf,
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
    let manifest =
        prepare_text(&args.inputs, &config, &args.out).with_context(|| format!("preparing {}", args.out.display()))?;
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
    let manifest = prepare_records(&args.inputs, &config, &args.out)
        .with_context(|| format!("preparing {}", args.out.display()))?;
    println!(
        "{}: {} records, {} classes, {} shards",
        args.out.display(),
        manifest.n_records,
        manifest.classes.len(),
        manifest.shards.len()
    );
    Ok(ExitCode::SUCCESS)
}

fn verify(args: PrepVerifyArgs) -> anyhow::Result<ExitCode> {
    let manifest_path = args.dir.join("manifest.json");
    let manifest = stoke_fsio::read_to_string_capped(&manifest_path, stoke_fsio::MANIFEST_CAP)
        .with_context(|| format!("reading {}", manifest_path.display()))?;
    if manifest.contains("\"stoke-records\"") {
        let store = RecordStore::open(&args.dir, true)?;
        for record_idx in 0..store.len() {
            store.get(record_idx)?;
        }
        println!("{}: ok, {} records", args.dir.display(), store.len());
    } else {
        let manifest = verify_prepared(&args.dir)?;
        let store = TokenStore::open(&args.dir)?;
        println!("{}: ok, {} tokens in {} shards", args.dir.display(), store.n_tokens(), manifest.shards.len());
    }
    Ok(ExitCode::SUCCESS)
}
