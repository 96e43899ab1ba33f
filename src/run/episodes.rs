//! Robot episodes for a vla model: the dataset's input sizes filled into `[model]` when the config
//! loads, the built-in robot set (written and prepared once into the cache), and the training and
//! held-out loaders (the held-out part is the dataset's last episodes, `eval.holdout` of them).

use std::path::{Path, PathBuf};

use anyhow::Context;
use stoke_data::{BatchSource, EpisodeLoader, EpisodeLoaderConfig, EpisodeSource, EpisodeStore};
use stoke_train::ModelConfig;

use crate::config::{DataConfig, StokeConfig};
use crate::exit::UsageError;

/// The built-in robot set's steps per episode and frame side (`data.builtin_episodes` episodes; its
/// cameras, state and action widths are [`BUILTIN_DIMS`]).
const BUILTIN: (usize, u32) = (16, 64);
/// Cameras, state width and action width of the built-in robot set.
const BUILTIN_DIMS: (usize, usize, usize) = (1, 2, 2);

/// `model` with `frames`, `state_dim` and `action_dim` taken from the episodes `data` names when
/// 0, and checked against them when set. Other families pass unchanged. Errors: (key, message).
pub fn resolve_episode_dims(model: &ModelConfig, data: &DataConfig) -> Result<ModelConfig, (&'static str, String)> {
    if !["none", "frames", "instructions"].contains(&data.blank.as_str()) {
        return Err(("data.blank", format!("must be \"none\", \"frames\" or \"instructions\"; got {:?}", data.blank)));
    }
    if model.family != "vla" {
        if data.blank != "none" || data.history != 0 {
            let key = if data.history != 0 { "data.history" } else { "data.blank" };
            return Err((
                key,
                format!("applies to robot episodes (model.family = \"vla\"); this model is {:?}", model.family),
            ));
        }
        return Ok(model.clone());
    }
    let (cameras, state_dim, action_dim) = if data.path.is_empty() {
        BUILTIN_DIMS
    } else {
        let store = EpisodeStore::open(Path::new(&data.path), false).map_err(|err| {
            ("data.path", format!("model.family = \"vla\" reads a folder from `stoke prep episodes`: {err}"))
        })?;
        let manifest = store.manifest();
        (manifest.cameras.len(), manifest.state_dim, manifest.action_dim)
    };
    let mut resolved = model.clone();
    let frames = cameras * (data.history + 1);
    for (key, value, dataset) in [
        ("model.frames", &mut resolved.frames, frames),
        ("model.state_dim", &mut resolved.state_dim, state_dim),
        ("model.action_dim", &mut resolved.action_dim, action_dim),
    ] {
        if *value == 0 {
            *value = dataset;
        } else if *value != dataset {
            return Err((key, format!("is {value}, but the episodes in data.path give {dataset}")));
        }
    }
    Ok(resolved)
}

/// The prepared folder of the built-in robot set for `seed`, written into the cache on first use
/// (into a temporary folder renamed into place, so concurrent ranks agree on one copy).
fn builtin_episodes(n_episodes: usize, seed: u64) -> anyhow::Result<PathBuf> {
    let (steps, resolution) = BUILTIN;
    if n_episodes < 2 {
        return Err(UsageError(format!("data.builtin_episodes must be at least 2; got {n_episodes}")).into());
    }
    let root = crate::profiler::cache_dir().join("episodes");
    let done = root.join(format!("builtin-{n_episodes}x{steps}-{resolution}px-seed{seed}"));
    if done.join("prepared/manifest.json").exists() {
        return Ok(done.join("prepared"));
    }
    let tmp = root.join(format!(".tmp-{}-{}", std::process::id(), done.file_name().unwrap().to_string_lossy()));
    let _ = std::fs::remove_dir_all(&tmp);
    let spec = stoke_data::SyntheticEpisodes { n_episodes, steps_per_episode: steps, resolution, seed };
    stoke_data::write_synthetic_episodes(&tmp.join("raw"), &spec)?;
    let prep = stoke_data::PrepEpisodesConfig { resolution, ..Default::default() };
    stoke_data::prepare_episodes(&tmp.join("raw"), &prep, &tmp.join("prepared"))?;
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
    };
    Ok(Box::new(EpisodeSource::new(EpisodeLoader::new(store, loader)?)))
}
