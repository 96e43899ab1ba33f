//! The whole-run benchmarks behind `stoke bench`: `fullchain` (naive and optimized stoke against
//! two PyTorch peers on the same data and tokens), `limits` (the machine's matmul peak, memory and
//! disk bandwidth, also measured beside the other benchmarks' runs) and `ckpt` (what a checkpoint
//! costs the step, in the background against a synchronous save, its throughput against the disk,
//! resume time, PyTorch's savers as peers; its runs in `ckpt_runs`) and `episodes` (the episode
//! loader's frames per second, decoding and augmenting, against `benches/peers/episodes_torch.py`).
//!
//! Every configuration runs as its own `stoke train` process (so peak memory is per
//! configuration) on the same corpus, in one invocation; figures are read back from each run's
//! `report.json`, `metrics.jsonl` or `checkpoint-stats.json` and the peers' JSON line. Each ratio
//! is printed beside its reference figure; none is judged here.

mod ckpt;
mod ckpt_runs;
mod episodes;
mod fullchain;
mod limits;
mod time_to_loss;

pub use ckpt::ckpt;
pub use ckpt_runs::CkptBench;
pub use episodes::{episodes, EpisodesBench};
pub use fullchain::{fullchain, Fullchain};
pub use limits::{limits, Limits};
