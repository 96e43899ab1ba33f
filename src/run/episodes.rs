//! Robot episodes for a vla model: the dataset's input sizes filled into `[model]` when the config
//! loads, the built-in robot set (written and prepared once into the cache), and the training and
//! held-out loaders (the held-out part is the dataset's last episodes, `eval.holdout` of them).

use std::path::PathBuf;

use anyhow::Context;
use stoke_data::{BatchSource, EpisodeLoader, EpisodeLoaderConfig, EpisodeSource, EpisodeStore};

use crate::config::StokeConfig;
use crate::exit::UsageError;

/// The built-in robot set's steps per episode and frame side (`data.builtin_episodes` episodes; its
/// cameras, state and action widths are `episode_dims::BUILTIN_DIMS`).
const BUILTIN: (usize, u32) = (16, 64);

/// The prepared folder of the built-in robot set for `seed`, written into the cache on first use
/// (into a temporary folder renamed into place, so concurrent ranks agree on one copy).
fn builtin_episodes(n_episodes: usize, seed: u64) -> anyhow::Result<PathBuf> {
    let (steps, resolution) = BUILTIN;
    if n_episodes < 2 {
        return Err(UsageError(format!("data.builtin_episodes must be at least 2; got {n_episodes}")).into());
    }
    let root = crate::profiler::cache_dir().join("episodes");
    let done = root.join(format!("builtin-v3-{n_episodes}x{steps}-{resolution}px-seed{seed}"));
    if done.join("prepared/manifest.json").exists() {
        return Ok(done.join("prepared"));
    }
    let tmp = root.join(format!(".tmp-{}-{}", std::process::id(), done.file_name().unwrap().to_string_lossy()));
    let _ = std::fs::remove_dir_all(&tmp);
    let spec = stoke_data::SyntheticEpisodes { n_episodes, steps_per_episode: steps, resolution, seed };
    stoke_data::write_synthetic_episodes(&tmp.join("raw"), &spec)?;
    let prep = stoke_data::PrepEpisodesConfig { resolution, ..Default::default() };
    stoke_data::prepare_episodes(&tmp.join("raw"), &prep, &tmp.join("prepared"))?;
    // Training reads only the prepared folder; the JPEG files need not stay in the cache.
    std::fs::remove_dir_all(tmp.join("raw")).with_context(|| format!("cannot remove {}", tmp.join("raw").display()))?;
    if let Err(err) = std::fs::rename(&tmp, &done) {
        // Another process finished first: its copy is the same data.
        let _ = std::fs::remove_dir_all(&tmp);
        if !done.join("prepared/manifest.json").exists() {
            return Err(err).with_context(|| format!("cannot move the built-in robot set into {}", done.display()));
        }
    }
    Ok(done.join("prepared"))
}

/// The training part (`held_out` false) or the held-out part of a vla run's episodes, for rank
/// `rank` of `world_size`.
pub fn episode_source(
    config: &StokeConfig,
    rank: usize,
    world_size: usize,
    held_out: bool,
) -> anyhow::Result<Box<dyn BatchSource>> {
    let data = &config.data;
    if !data.blend.is_empty() {
        return Err(UsageError("robot episodes take no data.blend".into()).into());
    }
    let path = if data.path.is_empty() {
        builtin_episodes(data.builtin_episodes, config.train.seed)?
    } else {
        PathBuf::from(&data.path)
    };
    let store = EpisodeStore::open(&path, false)?;
    let shape = config.model.vla_shape()?;
    let n_episodes = store.episodes().len();
    let episodes = if config.eval.every > 0 {
        let tail = ((n_episodes as f64 * config.eval.holdout).round() as usize).max(1);
        if tail >= n_episodes {
            return Err(UsageError(format!(
                "eval.holdout = {} of {n_episodes} episodes leaves none to train on",
                config.eval.holdout
            ))
            .into());
        }
        Some(if held_out { n_episodes - tail..n_episodes } else { 0..n_episodes - tail })
    } else {
        None
    };
    let blank = match data.blank.as_str() {
        "frames" => stoke_data::Blank::Frames,
        "instructions" => stoke_data::Blank::Instructions,
        _ => stoke_data::Blank::Nothing,
    };
    let loader = EpisodeLoaderConfig {
        micro_batch: config.train.micro_batch,
        rank,
        world_size,
        seed: config.train.seed,
        chunk: shape.chunk,
        history: data.history,
        resolution: shape.image_side as u32,
        augment: (data.augment && !held_out).then(stoke_data::AugmentConfig::default),
        max_tokens: shape.instruction_tokens,
        workers: if held_out { 0 } else { data.workers },
        prefetch: data.prefetch,
        episodes,
        blank,
        channels_first: false,
    };
    Ok(Box::new(EpisodeSource::new(EpisodeLoader::new(store, loader)?)))
}
