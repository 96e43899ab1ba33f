//! `stoke bench episodes`: the episode loader's throughput alone (no model), what the trainer
//! would be fed: frames per second through decoding (encoded frames) and augmentation, with the
//! workers' decode and augment time per batch and their busy share. Prints one JSON line, the
//! shape `benches/peers/episodes_torch.py` prints for PyTorch's DataLoader.

use std::path::PathBuf;
use std::time::Instant;

use stoke_data::{AugmentConfig, EpisodeLoader, EpisodeLoaderConfig, EpisodeStore};

/// What to measure. Plain data.
#[derive(Debug, Clone)]
pub struct EpisodesBench {
    /// A prepared episode folder (`stoke prep episodes`, decoded or `--keep-encoded`).
    pub data: PathBuf,
    pub batches: usize,
    /// Batches taken before the clock starts (threads started, caches warm).
    pub warmup: usize,
    pub micro_batch: usize,
    pub workers: usize,
    /// Side of the batch's frames; 0 keeps the prepared resolution.
    pub resolution: u32,
    pub history: usize,
    /// Random resized crop and colour jitter (false: whole frames as stored).
    pub augment: bool,
}

pub fn episodes(bench: &EpisodesBench) -> anyhow::Result<std::process::ExitCode> {
    let store = EpisodeStore::open(&bench.data, false)?;
    let config = EpisodeLoaderConfig {
        micro_batch: bench.micro_batch,
        workers: bench.workers,
        resolution: bench.resolution,
        history: bench.history,
        augment: bench.augment.then(AugmentConfig::default),
        prefetch: 2 * bench.workers.max(1),
        ..EpisodeLoaderConfig::default()
    };
    let mut loader = EpisodeLoader::new(store, config)?;
    for _ in 0..bench.warmup {
        loader.next_batch()?;
    }
    let before = loader.stats();
    let start = Instant::now();
    for _ in 0..bench.batches {
        let batch = loader.next_batch()?;
        std::hint::black_box(&batch.frames);
    }
    let wall_s = start.elapsed().as_secs_f64();
    let after = loader.stats();
    let frames = after.frames - before.frames;
    let per_batch_ms = |ns: u64| ns as f64 / 1e6 / bench.batches as f64;
    let threads = bench.workers.max(1) as f64;
    let line = serde_json::json!({
        "loader": "stoke",
        "encoded": !loader.store().frames_decoded(),
        "workers": bench.workers,
        "batches": bench.batches,
        "frames": frames,
        "wall_s": wall_s,
        "frames_per_s": frames as f64 / wall_s,
        "decode_ms_per_batch": per_batch_ms(after.decode_ns - before.decode_ns),
        "augment_ms_per_batch": per_batch_ms(after.augment_ns - before.augment_ns),
        "busy_share": (after.busy_ns - before.busy_ns) as f64 / 1e9 / (wall_s * threads),
        "waited_batches": after.waited - before.waited,
    });
    println!("{line}");
    Ok(std::process::ExitCode::SUCCESS)
}
