//! `stoke corpus`: write the built-in corpus to a file, so peers and other tools train on exactly
//! the bytes stoke trains on.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

#[derive(Debug, clap::Args)]
pub struct CorpusArgs {
    /// Where to write the corpus.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// Size in bytes (the default run uses data.builtin_bytes = 4194304).
    #[arg(long, default_value_t = 4 << 20)]
    pub bytes: usize,
    /// Generator seed (the default run uses train.seed = 1337).
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
}

pub fn run(args: CorpusArgs) -> anyhow::Result<ExitCode> {
    let text = stoke_data::builtin_corpus(args.seed, args.bytes);
    std::fs::write(&args.out, &text).with_context(|| format!("cannot write {}", args.out.display()))?;
    println!(
        "{} bytes, unigram entropy {:.3} nats/byte -> {}",
        text.len(),
        stoke_data::unigram_entropy_nats(&text),
        args.out.display()
    );
    Ok(ExitCode::SUCCESS)
}
