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

/// `stoke_ckpt::into_fresh_dir` (what `stoke prep --out` does), its errors as `DataError`s.
fn into_fresh_dir<T>(out: &Path, force: bool, prepare: impl FnOnce(&Path) -> Result<T, DataError>) -> PyResult<T> {
    use stoke_ckpt::FreshDirError as F;
    let io = |source: std::io::Error| errors::data(DataError::Write { path: out.to_path_buf(), source });
    stoke_ckpt::into_fresh_dir(out, force, prepare).map_err(|err| match err {
        F::Occupied(n) => errors::DataError::new_err(format!(
            "{} already holds {n} entries; pass force=True to replace it whole, or choose another folder",
            out.display()
        )),
        F::Prepare(e) => errors::data(e),
        F::ReadOut(e) | F::Move(e) | F::Swap(e) | F::RemoveOld(_, e) => io(e),
    })
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
