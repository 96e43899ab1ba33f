//! `stoke bench`: the arguments of the whole-run benchmarks (`crate::bench`) and of the
//! regression gate (`crate::gate`).

use std::path::PathBuf;
use std::process::ExitCode;

use crate::bench::{Fullchain, Limits};

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum BenchCommand {
    /// Naive stoke, optimized stoke and two PyTorch peers on the same data and tokens; one table.
    Fullchain(FullchainArgs),
    /// This machine's matmul peak (fp32, bf16), memcpy bandwidth and disk bandwidth.
    Limits(LimitsArgs),
    /// A small fixed run whose step, forward, backward and optimizer times over the same model's
    /// matrix multiplies (timed between its steps) and phase shares are compared with a baseline
    /// recorded on the same kind of machine (exit 4 on a regression).
    Gate(super::gate::GateArgs),
    /// Checkpoints: the step's stall in the background vs a synchronous save, save throughput vs
    /// the disk, resume time, torch.save and DCP async_save as peers.
    Ckpt(super::bench_ckpt::CkptBenchArgs),
    /// The episode loader alone: frames per second through decoding and augmentation (one JSON
    /// line; `benches/episodes_vs_torch.sh` runs it against PyTorch's DataLoader).
    Episodes(EpisodesArgs),
}

#[derive(Debug, clap::Args)]
pub struct EpisodesArgs {
    /// A prepared episode folder (`stoke prep episodes`).
    pub data: PathBuf,
    #[arg(long, default_value_t = 50)]
    pub batches: usize,
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    #[arg(long, default_value_t = 32)]
    pub micro_batch: usize,
    /// Loader threads (0: on the caller's thread).
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Side of the batch's frames (0: the prepared resolution).
    #[arg(long, default_value_t = 0)]
    pub resolution: u32,
    #[arg(long, default_value_t = 0)]
    pub history: usize,
    /// Whole frames, colours kept (no random resized crop or jitter).
    #[arg(long)]
    pub no_augment: bool,
}

#[derive(Debug, clap::Args)]
pub struct FullchainArgs {
    /// Tokens each configuration trains on (rounded to whole steps). The default is long enough
    /// that the larger batch of the optimized configuration, with a quarter of the steps, reaches
    /// the naive configuration's loss.
    #[arg(long, default_value_t = 1_310_720)]
    pub tokens: u64,
    /// Working folder for the corpus, the runs and the peers' checkpoints.
    #[arg(long, default_value = "runs/bench")]
    pub dir: PathBuf,
    /// Python with torch for the peers (`cargo xtask peers` installs what they import).
    #[arg(long, default_value = ".stoke/venv/bin/python")]
    pub python: PathBuf,
    /// The peers' script.
    #[arg(long, default_value = "benches/peers/train_gpt.py")]
    pub peer_script: PathBuf,
    /// Run only the stoke configurations.
    #[arg(long)]
    pub no_peers: bool,
    /// Also write the table as JSON here.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Seeds of the naive and optimized stoke runs (interleaved): the time to the naive run's final
    /// held-out loss, per seed and its median.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    pub seeds: Vec<u64>,
    /// The optimized configuration trains this many times `--tokens` (its schedule stretched to
    /// them): its time to the naive run's final held-out loss is what is compared, and its larger
    /// batch needs more tokens to get there.
    #[arg(long, default_value_t = 2.0)]
    pub optimized_tokens: f64,
}

#[derive(Debug, clap::Args)]
pub struct LimitsArgs {
    /// Folder for the disk test file (deleted afterwards).
    #[arg(long, default_value = "runs")]
    pub dir: PathBuf,
    /// Bytes for the memcpy and disk tests.
    #[arg(long, default_value_t = 1 << 30)]
    pub bytes: usize,
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Also time one training step's matrix multiplies alone for this preset (tiny, small,
    /// gpt2-124m) in bf16: every linear layer and the tied head forward and backward, and the
    /// attention's whole causal square, at the model's shapes (`gemm::GemmReference`). No
    /// implementation that runs those products through libtorch steps faster than this.
    #[arg(long)]
    pub preset: Option<String>,
    /// Sequences per step for `--preset`.
    #[arg(long, default_value_t = 1)]
    pub micro_batch: usize,
}

pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    match args.what {
        BenchCommand::Fullchain(args) => crate::bench::fullchain(&Fullchain {
            tokens: args.tokens,
            dir: args.dir,
            python: args.python,
            peer_script: args.peer_script,
            no_peers: args.no_peers,
            json: args.json,
            seeds: args.seeds,
            optimized_tokens: args.optimized_tokens,
        }),
        BenchCommand::Limits(args) => crate::bench::limits(&Limits {
            dir: args.dir,
            bytes: args.bytes,
            json: args.json,
            preset: args.preset,
            micro_batch: args.micro_batch,
        }),
        BenchCommand::Gate(args) => super::gate::run(args),
        BenchCommand::Ckpt(args) => super::bench_ckpt::run(args),
        BenchCommand::Episodes(args) => crate::bench::episodes(&crate::bench::EpisodesBench {
            data: args.data,
            batches: args.batches,
            warmup: args.warmup,
            micro_batch: args.micro_batch,
            workers: args.workers,
            resolution: args.resolution,
            history: args.history,
            augment: !args.no_augment,
        }),
    }
}
