//! `stoke corpus`: write the built-in corpus to a file, so peers and other tools train on exactly
//! the bytes stoke trains on; `--episodes DIR` writes the built-in robot dataset instead (JPEG
//! frames and JSON lines, or with `--lerobot` the LeRobot v2 layout: Parquet tables and MP4
//! videos encoded by ffmpeg).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

#[derive(Debug, clap::Args)]
pub struct CorpusArgs {
    /// Where to write the corpus.
    #[arg(long, value_name = "FILE", required_unless_present = "episodes")]
    pub out: Option<PathBuf>,
    /// Write the built-in robot episodes into this folder instead: three coloured blocks, an
    /// instruction naming one, actions moving the effector to it.
    #[arg(long, value_name = "DIR", conflicts_with = "out")]
    pub episodes: Option<PathBuf>,
    /// With --episodes: write the LeRobot v2 layout (Parquet tables, MP4 videos encoded by ffmpeg,
    /// meta/*.json*) instead of JSON lines and JPEG frames; the same episodes either way.
    #[arg(long, requires = "episodes", conflicts_with = "out")]
    pub lerobot: bool,
    /// With --episodes: how many episodes.
    #[arg(long, default_value_t = 64)]
    pub n_episodes: usize,
    /// With --episodes: time steps per episode.
    #[arg(long, default_value_t = 16)]
    pub steps: usize,
    /// With --episodes: side of the square frames in pixels.
    #[arg(long, default_value_t = 64)]
    pub resolution: u32,
    /// Size in bytes (the default run uses data.builtin_bytes = 4194304).
    #[arg(long, default_value_t = 4 << 20)]
    pub bytes: usize,
    /// Generator seed (the default run uses train.seed = 1337).
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
}

pub fn run(args: CorpusArgs) -> anyhow::Result<ExitCode> {
    if let Some(dir) = &args.episodes {
        if args.n_episodes == 0 || args.steps == 0 || !(8..=1024).contains(&args.resolution) {
            return Err(super::UsageError(
                "--n-episodes and --steps must be at least 1, --resolution 8 to 1024".into(),
            )
            .into());
        }
        let spec = stoke_data::SyntheticEpisodes {
            n_episodes: args.n_episodes,
            steps_per_episode: args.steps,
            resolution: args.resolution,
            seed: args.seed,
        };
        let (n_steps, written) = if args.lerobot {
            (stoke_data::write_synthetic_lerobot(dir, &spec)?, dir.join("meta/info.json"))
        } else {
            (stoke_data::write_synthetic_episodes(dir, &spec)?, dir.join("episodes.jsonl"))
        };
        println!("{} episodes, {n_steps} steps -> {}", args.n_episodes, written.display());
        return Ok(ExitCode::SUCCESS);
    }
    let out = args.out.as_ref().expect("clap requires --out without --episodes");
    let text = stoke_data::builtin_corpus(args.seed, args.bytes);
    std::fs::write(out, &text).with_context(|| format!("cannot write {}", out.display()))?;
    println!(
        "{} bytes, unigram entropy {:.3} nats/byte -> {}",
        text.len(),
        stoke_data::unigram_entropy_nats(&text),
        out.display()
    );
    Ok(ExitCode::SUCCESS)
}
