//! The run's checkpoint writing: the store as this rank writes it, the background writer and
//! its settings, the mirror, and the figures printed and saved at the end of a run.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use stoke_ckpt::{CheckpointStore, CheckpointWriter, Mirror, WriterConfig};

use crate::config::StokeConfig;

/// The writer's settings from the `[ckpt]` section.
pub fn writer_config(config: &StokeConfig) -> WriterConfig {
    WriterConfig {
        background: config.ckpt.background,
        buffers: config.ckpt.host_buffers,
        keep: config.ckpt.keep,
        keep_every: config.ckpt.keep_every,
    }
}

/// The run's checkpoint folder as this rank writes it: rank 0 alone, or under ZeRO (`dist.zero`
/// > 0) every rank its own pieces, rank 0 waiting at most `dist.timeout_s` for the others'.
pub fn checkpoint_store(
    config: &StokeConfig,
    run_dir: &Path,
    rank: usize,
    world_size: usize,
) -> anyhow::Result<CheckpointStore> {
    let store = CheckpointStore::new(run_dir.join("checkpoints"));
    // ZeRO's shards and pipeline stages write their own pieces.
    if config.dist.zero == 0 && config.dist.pipeline <= 1 {
        return Ok(store);
    }
    let wait = std::time::Duration::from_secs_f64(config.dist.timeout_s.max(1.0));
    Ok(store.with_shard(stoke_ckpt::ShardRole { rank, world: world_size, wait })?)
}

/// A data-parallel rank other than 0: it trains with its own profiler (its `/metrics`, its step
/// report) and the launcher's heartbeat, and at the end sends its report to rank 0. It writes in

/// The mirror `ckpt.mirror` names, started on `store` (none when the key is empty).
pub fn start_mirror(config: &StokeConfig, store: &CheckpointStore) -> anyhow::Result<Option<Arc<Mirror>>> {
    Ok(match config.ckpt.mirror.as_str() {
        "" => None,
        url => {
            let mirror = Mirror::start(
                stoke_ckpt::MirrorStore::open(url)?,
                store,
                config.ckpt.mirror_keep,
                config.ckpt.mirror_keep_every,
            )?;
            Some(Arc::new(mirror))
        }
    })
}

/// Waits for the mirror's last upload and prints what it did.
pub fn finish_mirror(mirror: &Mirror) {
    let stats = mirror.finish();
    println!(
        "mirror: {} checkpoints, {:.1} MB uploaded in {:.2} s in the background to {}; {} deleted by ckpt.mirror_keep",
        stats.uploaded,
        stats.bytes as f64 / 1e6,
        stats.upload_s,
        mirror.url(),
        stats.deleted
    );
    if let Some(error) = &stats.error {
        eprintln!("stoke: warning: the mirror stopped after an error (local checkpoints are intact): {error}");
    }
}

/// Prints the writer's totals; nothing when it committed no checkpoint.
pub fn print_checkpoint_stats(writer: &CheckpointWriter) {
    let stats = writer.stats();
    if stats.commits == 0 {
        return;
    }
    println!(
        "checkpoints: {} written, {:.1} MB in {:.2} s ({:.2} GB/s){}; host buffers: {} of {:.1} MB; back-pressure waits {:.1} ms",
        stats.commits,
        stats.bytes_written as f64 / 1e6,
        stats.write_s,
        stats.bytes_written as f64 / stats.write_s.max(1e-9) / 1e9,
        if writer.config().background { " in the background" } else { " in the step" },
        stats.buffers,
        stats.host_bytes as f64 / 1e6,
        stats.wait_s * 1e3
    );
}

/// `checkpoint-stats.json`: the writer's totals and, after a resume, its load and restore times.
pub fn write_checkpoint_stats(writer: &CheckpointWriter, resume: serde_json::Value, path: &Path) -> anyhow::Result<()> {
    let stats = writer.stats();
    let json = serde_json::json!({
        "background": writer.config().background,
        "snapshots": stats.snapshots,
        "commits": stats.commits,
        "bytes_written": stats.bytes_written,
        "write_s": stats.write_s,
        "wait_s": stats.wait_s,
        "buffers": stats.buffers,
        "host_bytes": stats.host_bytes,
        "pinned_bytes": stats.pinned_bytes,
        "resume": resume,
    });
    std::fs::write(path, serde_json::to_string_pretty(&json)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))
}
