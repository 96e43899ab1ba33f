//! `stoke.prep`'s native half: offline preparation of text and episodes (what `stoke prep` does),
//! with the GIL released; manifests leave as JSON.

use std::path::{Path, PathBuf};

use pyo3::prelude::*;
use stoke_data::{
    prepare_episodes, prepare_text, verify_prepared, write_synthetic_episodes, DataError, PrepEpisodesConfig,
    PrepTextConfig, SyntheticEpisodes,
};

use crate::errors;

fn to_json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("a manifest serializes")
}

/// Runs `prepare` into a new folder beside `out` and puts it in `out`'s place only once it has
/// succeeded, as `stoke prep --out` does: a folder that holds anything is refused without
/// `force`, and with it the old dataset is swapped out whole and removed. A failure removes the
/// new folder and leaves `out` untouched.
fn into_fresh_dir<T>(out: &Path, force: bool, prepare: impl FnOnce(&Path) -> Result<T, DataError>) -> PyResult<T> {
    let io = |source: std::io::Error| errors::data(DataError::Write { path: out.to_path_buf(), source });
    let existing = match std::fs::read_dir(out) {
        Ok(entries) => Some(entries.count()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(io(e)),
    };
    if let (Some(n), false) = (existing.filter(|&n| n > 0), force) {
        return Err(errors::DataError::new_err(format!(
            "{} already holds {n} entries; pass force=True to replace it whole, or choose another folder",
            out.display()
        )));
    }
    let name = out.file_name().map_or("out".into(), |n| n.to_string_lossy().into_owned());
    let fresh = out.with_file_name(format!(".{name}.prep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&fresh);
    let value = prepare(&fresh).inspect_err(|_| {
        let _ = std::fs::remove_dir_all(&fresh);
    });
    let value = value.map_err(errors::data)?;
    match existing {
        None => std::fs::rename(&fresh, out).map_err(io)?,
        Some(_) => {
            stoke_ckpt::rename_exchange(&fresh, out).map_err(io)?;
            // `fresh` now names the old dataset.
            std::fs::remove_dir_all(&fresh).map_err(io)?;
        }
    }
    Ok(value)
}

/// Tokenizes text files (`.txt` one document each, `.jsonl` one per line's "text") into token
/// shards in `out`; returns the manifest as JSON.
#[pyfunction]
#[pyo3(signature = (inputs, out, *, tokenizer="bytes".to_string(), eos=String::new(), shard_tokens=1 << 28, threads=2, force=false))]
#[allow(clippy::too_many_arguments)]
pub fn text(
    py: Python<'_>,
    inputs: Vec<String>,
    out: String,
    tokenizer: String,
    eos: String,
    shard_tokens: u64,
    threads: usize,
    force: bool,
) -> PyResult<String> {
    let config = PrepTextConfig { tokenizer, eos, shard_tokens, n_threads: threads, ..PrepTextConfig::default() };
    let inputs: Vec<PathBuf> = inputs.into_iter().map(PathBuf::from).collect();
    let out = PathBuf::from(out);
    py.detach(|| into_fresh_dir(&out, force, |dir| prepare_text(&inputs, &config, dir)).map(|m| to_json(&m)))
}

/// Prepares robot episodes (the JSON-lines layout) into `out`: frames decoded and resized once
/// (or kept encoded), statistics, instruction tokens, CRC-32s; returns the manifest as JSON.
#[pyfunction]
#[pyo3(signature = (source, out, *, resolution=64, keep_encoded=false, tokenizer="bytes".to_string(), force=false))]
pub fn episodes(
    py: Python<'_>,
    source: String,
    out: String,
    resolution: u32,
    keep_encoded: bool,
    tokenizer: String,
    force: bool,
) -> PyResult<String> {
    let config = PrepEpisodesConfig { resolution, keep_encoded, tokenizer, ..PrepEpisodesConfig::default() };
    let (source, out) = (PathBuf::from(source), PathBuf::from(out));
    py.detach(|| into_fresh_dir(&out, force, |dir| prepare_episodes(&source, &config, dir)).map(|m| to_json(&m)))
}

/// Checks every file of a prepared token dataset against its manifest (sizes, CRC-32s, indexes).
#[pyfunction]
pub fn verify(py: Python<'_>, dir: String) -> PyResult<String> {
    let dir = PathBuf::from(dir);
    py.detach(|| verify_prepared(&dir).map(|m| to_json(&m))).map_err(errors::data)
}

/// Writes the built-in robot episodes (real JPEG frames) in the JSON-lines layout; returns steps.
#[pyfunction]
#[pyo3(signature = (dir, *, n_episodes=64, steps_per_episode=16, resolution=64, seed=1337))]
pub fn synthetic_episodes(
    py: Python<'_>,
    dir: String,
    n_episodes: usize,
    steps_per_episode: usize,
    resolution: u32,
    seed: u64,
) -> PyResult<u64> {
    let spec = SyntheticEpisodes { n_episodes, steps_per_episode, resolution, seed };
    let dir = PathBuf::from(dir);
    py.detach(|| write_synthetic_episodes(&dir, &spec)).map_err(errors::data)
}
