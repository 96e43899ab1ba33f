//! Resuming a run: its newest good checkpoint (fetched from the mirror when that holds a newer
//! one), the configuration saved in it with the changes `resume_keys` allows, restoring the
//! trainer and the loader from it, and the command a launcher restarts a run with.

use std::path::{Path, PathBuf};

use anyhow::Context;
use stoke_ckpt::{CheckpointStore, Loaded};
use stoke_data::BatchSource;
use stoke_train::Trainer;

use super::folder::{latest_checkpoint, locate_run, write_config, RunLock};
use super::resume_keys::resume_may_change;
use super::source::ConfigSource;
use crate::config::StokeConfig;
use crate::exit::UsageError;

/// `--resume`: the run's newest good checkpoint, and the config saved in it with the command
/// line's changes, which may touch only `resume_may_change` keys. The process that writes the
/// folder locks it first (a live run of it is refused).
pub fn prepare_resume(
    source: &ConfigSource,
    fallback: bool,
    writer: bool,
) -> anyhow::Result<(StokeConfig, PathBuf, Resume, Option<RunLock>)> {
    // The command line names the run (run.dir, run.name); the checkpoint holds its config.
    let mut located = source.load()?;
    let run_dir = locate_run(&mut located, true)?;
    let lock = if writer {
        // A resume from the mirror alone may find no local folder yet.
        std::fs::create_dir_all(&run_dir).with_context(|| format!("cannot create run folder {}", run_dir.display()))?;
        Some(RunLock::acquire(&run_dir)?)
    } else {
        None
    };
    let store = CheckpointStore::new(run_dir.join("checkpoints"));
    let (tier, fetch_s) = fetch_from_mirror(&store, &located.ckpt.mirror)?;
    let start = std::time::Instant::now();
    let loaded = pick_checkpoint(&store, fallback)?;
    let load_s = start.elapsed().as_secs_f64();
    println!("resuming from step {} of the {tier}", loaded.manifest.step);
    let step = loaded.manifest.step;
    let manifest_path = loaded.path.join(stoke_ckpt::MANIFEST);
    let saved_toml = loaded.manifest.meta.get("config_toml").and_then(serde_json::Value::as_str).ok_or_else(|| {
        anyhow::anyhow!(
            "checkpoint {} holds no config (meta.config_toml); it was not written by stoke train",
            manifest_path.display()
        )
    })?;
    let saved: StokeConfig = toml::from_str(saved_toml)
        .with_context(|| format!("the config saved in {} does not parse", manifest_path.display()))?;
    let mut config = source.load_over(&saved)?;
    config.run.name = located.run.name.clone();
    config.run.dir = located.run.dir.clone();
    let refused: Vec<String> = saved
        .differing_keys(&config)
        .into_iter()
        .filter(|key| !resume_may_change(key))
        .map(|key| format!("{key} (checkpoint: {}, asked: {})", saved.value_of(&key), config.value_of(&key)))
        .collect();
    if !refused.is_empty() {
        return Err(UsageError(format!(
            "--resume from step {step} of {}: these keys would change the run's trajectory: {}; \
             resume without them, or start a new run",
            run_dir.display(),
            refused.join(", ")
        ))
        .into());
    }
    if config.train.steps <= step {
        // Nothing to train: the run folder (config, trace, metrics) stays as it is. What a writer
        // killed after its last commit left (a temporary or the trash of retention) goes, as a
        // run that trains removes it: the lock is held, so no writer of this run is alive.
        if writer {
            store.remove_all_leftovers()?;
        }
        return Err(AlreadyDone { step, steps: config.train.steps, run_dir: run_dir.clone() }.into());
    }
    if config.train.steps != saved.train.steps && config.train.lr_horizon == saved.train.lr_horizon {
        // An extension keeps the schedule of the steps already run.
        config.train.lr_horizon = saved.train.horizon();
    }
    if writer {
        write_config(&config, &run_dir)?;
    }
    Ok((config, run_dir, Resume { loaded, load_s, tier, fetch_s }, lock))
}

/// A resume whose newest checkpoint is already at or past `train.steps`: there is nothing to
/// train, and nothing in the run folder is changed but a killed writer's leftovers removed.
#[derive(Debug)]
pub struct AlreadyDone {
    pub step: u64,
    pub steps: u64,
    pub run_dir: PathBuf,
}

impl std::fmt::Display for AlreadyDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "nothing to do: the newest checkpoint of {} is at step {}, and train.steps is {}; \
             raise train.steps (--set train.steps=N) to train further",
            self.run_dir.display(),
            self.step,
            self.steps
        )
    }
}

impl std::error::Error for AlreadyDone {}

/// With a mirror (`ckpt.mirror`): when it holds a newer complete checkpoint than the local folder
/// (or the local folder has none), downloads it into the local folder (committed with the local
/// protocol). Returns the tier the resume reads and the seconds the download took.
fn fetch_from_mirror(store: &CheckpointStore, url: &str) -> anyhow::Result<(String, f64)> {
    let local = store.latest()?;
    if url.is_empty() {
        return Ok(("local tier".into(), 0.0));
    }
    let mirror = stoke_ckpt::MirrorStore::open(url)?;
    // The mirror's latest, when it is newer than the local folder's.
    let Some(remote) = mirror.latest()?.filter(|&r| local.is_none_or(|l| r > l)) else {
        return match local {
            Some(_) => Ok(("local tier".into(), 0.0)),
            None => {
                Err(UsageError(format!("--resume: no checkpoint in {} nor on the mirror {url}", store.dir().display()))
                    .into())
            }
        };
    };
    let start = std::time::Instant::now();
    mirror.download(remote, store)?;
    let fetch_s = start.elapsed().as_secs_f64();
    let had = local.map_or("none".to_string(), |s| format!("step {s}"));
    println!("fetched step {remote} from the mirror {url} in {fetch_s:.2} s (the local tier had {had})");
    Ok((format!("mirror {url}"), fetch_s))
}

/// A checkpoint to resume from, loaded and verified, and how long that took.
pub struct Resume {
    pub loaded: Loaded,
    pub load_s: f64,
    /// The tier the checkpoint came from ("local tier" or "mirror URL").
    pub tier: String,
    /// Seconds spent downloading it from the mirror first (0 from the local tier).
    pub fetch_s: f64,
}

/// The newest checkpoint, which must load and verify: its manifest present and parsed, every
/// file of the listed size and CRC-32. One rule for any damage: without `fallback` it is refused
/// and named; with it, older checkpoints are tried, each one skipped named with its reason.
fn pick_checkpoint(store: &CheckpointStore, fallback: bool) -> anyhow::Result<Loaded> {
    let steps = store.all_steps()?;
    let mut skipped = Vec::new();
    for &step in steps.iter().rev() {
        match store.load(step) {
            Ok(loaded) => return Ok(loaded),
            Err(e) if fallback => {
                eprintln!("stoke: --fallback: skipping the damaged checkpoint step {step}: {e}");
                skipped.push(format!("step {step}: {e}"));
            }
            Err(e) => {
                return Err(anyhow::Error::new(e).context(format!(
                    "cannot resume: the latest checkpoint (step {step} in {}) is damaged; \
                     `--resume --fallback` resumes from the newest good one before it",
                    store.dir().display()
                )))
            }
        }
    }
    anyhow::bail!(
        "--fallback: none of the {} checkpoints in {} passes its checks: {}",
        steps.len(),
        store.dir().display(),
        skipped.join("; ")
    )
}

/// What restoring a checkpoint left for the rest of the run: the figures for
/// `checkpoint-stats.json` (null for a fresh run) and this rank's compression residuals.
pub struct Restored {
    pub stats: serde_json::Value,
    pub residuals: Vec<(String, Vec<f32>)>,
}

/// Restores `trainer` and moves `source` to the checkpoint's data position (nothing for a fresh
/// run), after saying how a change of world size affects the global batch.
pub fn restore(
    config: &StokeConfig,
    resume: Option<Resume>,
    trainer: &mut Trainer,
    source: &mut dyn BatchSource,
    rank: usize,
    world_size: usize,
) -> anyhow::Result<Restored> {
    if let Some(saved) = resume.as_ref().and_then(|r| r.loaded.manifest.meta.get("world_size")).and_then(|v| v.as_u64())
    {
        if saved as usize != world_size {
            let train = config.train.for_world(world_size)?;
            if config.train.global_batch == 0 {
                eprintln!(
                    "stoke: warning: the checkpoint was written by {saved} rank(s), this run has {world_size}: the global \
                     batch changes from {} to {} sequences (set train.global_batch to keep it)",
                    saved as usize * train.micro_batch * train.grad_accum,
                    world_size * train.micro_batch * train.grad_accum
                );
            } else {
                println!(
                    "resuming on {world_size} rank(s) (checkpoint: {saved}): {} accumulated micro-batches keep the global \
                     batch of {} sequences",
                    train.grad_accum, config.train.global_batch
                );
            }
        }
    }
    let mut resume_stats = serde_json::Value::Null;
    // This rank's compression residuals in the checkpoint (written by a run of the same size).
    let residuals: Vec<(String, Vec<f32>)> = resume
        .as_ref()
        .and_then(|r| r.loaded.files.get("dist"))
        .map(|tensors| {
            let suffix = format!("@rank{rank}");
            tensors
                .iter()
                .filter_map(|t| {
                    let name = t.name.strip_suffix(&suffix)?;
                    let values = t.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                    Some((name.to_string(), values))
                })
                .collect()
        })
        .unwrap_or_default();
    if let Some(Resume { loaded, load_s, tier, fetch_s }) = resume {
        let start = std::time::Instant::now();
        let position = trainer.restore_loaded(&loaded)?;
        source.seek(position);
        let restore_s = start.elapsed().as_secs_f64();
        let bytes = loaded.manifest.total_bytes();
        println!(
            "resumed from step {} ({:.1} MB): loaded and verified in {load_s:.3} s, restored in {restore_s:.3} s",
            loaded.manifest.step,
            bytes as f64 / 1e6
        );
        resume_stats = serde_json::json!({
            "step": loaded.manifest.step,
            "bytes": bytes,
            "tier": tier,
            "fetch_s": fetch_s,
            "load_s": load_s,
            "restore_s": restore_s,
        });
    }
    Ok(Restored { stats: resume_stats, residuals })
}

/// The worker command a launcher restarts a run with: the original one resuming its run (by
/// folder) when that has a checkpoint, else starting it afresh in the same folder; a command
/// other than `train`, or a job that failed before rank 0 named its folder, as it was.
pub fn restart_command(original: &[String], run_dir: Option<&Path>) -> Vec<String> {
    let mut command = original.to_vec();
    let Some(run_dir) = run_dir else { return command };
    if command.first().map(String::as_str) != Some("train") {
        return command;
    }
    let has_checkpoint = latest_checkpoint(run_dir).is_some();
    let name = run_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let dir = run_dir.parent().map(|p| p.display().to_string()).unwrap_or_default();
    if has_checkpoint && !command.iter().any(|a| a == "--resume") {
        command.insert(1, "--resume".into());
    }
    for (key, value) in [("run.dir", dir), ("run.name", name)] {
        command.push("--set".into());
        command.push(format!("{key}={}", toml::Value::String(value)));
    }
    command
}

#[cfg(test)]
mod tests {
    use super::restart_command;

    #[test]
    fn a_restart_resumes_the_named_run_once() {
        let dir = std::env::temp_dir().join(format!("stoke-launch-test-{}", std::process::id()));
        let run = dir.join("runs").join("job");
        std::fs::create_dir_all(&run).unwrap();
        let original: Vec<String> = ["train", "--quiet", "--set", "train.steps=9"].map(String::from).to_vec();
        // No checkpoint yet: a fresh start of the same run folder.
        let fresh = restart_command(&original, Some(&run));
        assert!(!fresh.contains(&"--resume".to_string()), "{fresh:?}");
        assert!(fresh.ends_with(&["--set".into(), "run.name=\"job\"".into()]), "{fresh:?}");
        // Not a train command: as it was.
        let other: Vec<String> = vec!["config".into()];
        assert_eq!(restart_command(&other, Some(&run)), other);
        assert_eq!(restart_command(&original, None), original);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
