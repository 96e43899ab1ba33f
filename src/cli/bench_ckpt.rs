//! `stoke bench ckpt`: the arguments of the checkpoint benchmark (`crate::bench::ckpt`).

use std::path::PathBuf;
use std::process::ExitCode;

use crate::bench::CkptBench;

#[derive(Debug, clap::Args)]
pub struct CkptBenchArgs {
    /// Working folder: the runs, the disk test file, the peers' files.
    #[arg(long, default_value = "runs/bench-ckpt")]
    pub dir: PathBuf,
    /// Pairs of runs (background, synchronous), interleaved.
    #[arg(long, default_value_t = 3)]
    pub pairs: usize,
    /// Checkpoints each run writes (at least 4: the warm figures leave out the first two, whose
    /// host buffers fault in, and the last, whose write outlasts the run).
    #[arg(long, default_value_t = 8)]
    pub checkpoints: u64,
    /// Steps between checkpoints.
    #[arg(long, default_value_t = 6)]
    pub every: u64,
    /// More overrides for every run (for example another model size).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Python with torch for the peers.
    #[arg(long, default_value = ".stoke/venv/bin/python")]
    pub python: PathBuf,
    #[arg(long, default_value = "benches/peers/ckpt_torch.py")]
    pub peer_script: PathBuf,
    #[arg(long)]
    pub no_peers: bool,
    /// The `stoke` binary whose `train` the runs use (default: this one): to compare two builds
    /// under the same measurement.
    #[arg(long, value_name = "BIN")]
    pub trainer: Option<PathBuf>,
    /// Also write the figures as JSON here.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

pub fn run(args: CkptBenchArgs) -> anyhow::Result<ExitCode> {
    crate::bench::ckpt(&CkptBench {
        dir: args.dir,
        pairs: args.pairs,
        checkpoints: args.checkpoints,
        every: args.every,
        overrides: args.overrides,
        python: args.python,
        peer_script: args.peer_script,
        no_peers: args.no_peers,
        trainer: args.trainer,
        json: args.json,
    })
}
