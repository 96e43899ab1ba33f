//! `stoke.data`'s native half: stoke-data's `Loader` and `EpisodeLoader` behind Python iterators
//! whose batches leave as DLPack buffers, filled on worker threads while the GIL is released.
//!
//! A token batch's buffer goes to the consumer whole; when its deleter runs (the last tensor
//! viewing it is freed) the buffer comes back over a channel, and the next `next()` hands it to
//! the loader to refill, so a loop that drops its batches allocates nothing in steady state.

use std::path::PathBuf;
use std::sync::Mutex;

use crossbeam_channel::{Receiver, Sender};
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use stoke_data::{
    AugmentConfig, Batch, BatchSource, EpisodeLoader, EpisodeLoaderConfig, EpisodeStore, Loader, LoaderConfig,
    TokenStore,
};

use crate::dlpack::{ElemType, Exported};
use crate::errors;

/// A batch buffer on loan to Python; dropping it (in the consumer's deleter, on any thread, GIL or
/// not) sends it home.
struct Lent {
    buffer: Vec<i64>,
    home: Sender<Vec<i64>>,
}

impl Drop for Lent {
    fn drop(&mut self) {
        // The loader may be gone already; the buffer is then simply freed.
        let _ = self.home.send(std::mem::take(&mut self.buffer));
    }
}

struct TokenState {
    loader: Loader,
    returned: Receiver<Vec<i64>>,
    home: Sender<Vec<i64>>,
}

/// Rows of `seq_len + 1` tokens from a prepared dataset (or Megatron `.bin`, or a raw token file),
/// in the Rust loader's order, rank split and resume state.
#[pyclass(module = "stoke._native", frozen)]
pub struct TokenLoader {
    state: Mutex<TokenState>,
    config: LoaderConfig,
    n_tokens: u64,
    samples_per_epoch: Option<u64>,
}

fn open_store(path: &str) -> PyResult<TokenStore> {
    TokenStore::open(&PathBuf::from(path)).map_err(errors::data)
}

#[pymethods]
impl TokenLoader {
    #[new]
    #[pyo3(signature = (path, seq_len, micro_batch, *, seed=0, rank=0, world_size=1, workers=2, prefetch=4, drop_last=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: String,
        seq_len: usize,
        micro_batch: usize,
        seed: u64,
        rank: usize,
        world_size: usize,
        workers: usize,
        prefetch: usize,
        drop_last: bool,
    ) -> PyResult<TokenLoader> {
        let config = LoaderConfig {
            seq_len,
            micro_batch,
            seed,
            rank,
            world_size,
            n_workers: workers,
            prefetch_depth: prefetch,
            drop_last,
        };
        let (loader, n_tokens) = py.detach(|| {
            let store = open_store(&path)?;
            let n_tokens = store.n_tokens();
            Loader::new(store, config.clone()).map(|loader| (loader, n_tokens)).map_err(errors::data)
        })?;
        let (home, returned) = crossbeam_channel::unbounded();
        let samples_per_epoch = loader.samples_per_epoch();
        Ok(TokenLoader {
            state: Mutex::new(TokenState { loader, returned, home }),
            config,
            n_tokens,
            samples_per_epoch,
        })
    }

    /// The next batch as a DLPack buffer of shape `[micro_batch, seq_len + 1]`, int64.
    fn next_buffer(&self, py: Python<'_>) -> PyResult<Exported> {
        let (micro_batch, width) = (self.config.micro_batch, self.config.seq_len + 1);
        let (tokens, home) = py.detach(|| {
            let mut state = self.state.lock().expect("never poisoned");
            let TokenState { loader, returned, home } = &mut *state;
            for buffer in returned.try_iter() {
                loader.recycle(Batch {
                    micro_batch,
                    seq_len: width - 1,
                    tokens: buffer,
                    loss_mask: Vec::new(),
                    episode: None,
                });
            }
            loader.next_batch().map(|batch| (batch.tokens, home.clone())).map_err(errors::data)
        })?;
        let mut lent = Box::new(Lent { buffer: tokens, home });
        let data = lent.buffer.as_mut_ptr() as *mut u8;
        Ok(Exported::from_owner(data, lent, ElemType::I64, vec![micro_batch as i64, width as i64]))
    }

    /// The resume state: `{"seed", "epoch", "samples_consumed"}` (samples of all ranks).
    fn state(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let state = self.state.lock().expect("never poisoned").loader.state();
        let dict = PyDict::new(py);
        dict.set_item("seed", state.seed)?;
        dict.set_item("epoch", state.epoch)?;
        dict.set_item("samples_consumed", state.samples_consumed)?;
        Ok(dict.unbind())
    }

    /// Continues from a state `state()` returned (in this or another process, at any world size).
    fn load_state(&self, py: Python<'_>, state: &Bound<'_, PyDict>) -> PyResult<()> {
        let seed = item(state, "seed")?;
        if seed != self.config.seed {
            return Err(PyValueError::new_err(format!(
                "the state was saved with seed {seed}, this loader has seed {}",
                self.config.seed
            )));
        }
        let position = item(state, "samples_consumed")?;
        py.detach(|| self.state.lock().expect("never poisoned").loader.seek(position));
        Ok(())
    }

    /// Batches handed out and, of those, how many were not ready when asked for.
    fn stats(&self) -> (u64, u64) {
        let stats = self.state.lock().expect("never poisoned").loader.stats();
        (stats.batches, stats.waited)
    }

    #[getter]
    fn n_tokens(&self) -> u64 {
        self.n_tokens
    }

    #[getter]
    fn samples_per_epoch(&self) -> Option<u64> {
        self.samples_per_epoch
    }
}

fn item(dict: &Bound<'_, PyDict>, key: &str) -> PyResult<u64> {
    dict.get_item(key)?.ok_or_else(|| PyKeyError::new_err(format!("the state has no {key:?}")))?.extract()
}

/// Samples of a prepared episode directory, in the Rust episode loader's order, rank split and
/// resume state: frames (augmented), state, action chunk and masks, instruction tokens.
#[pyclass(module = "stoke._native", frozen)]
pub struct EpisodeBatches {
    loader: Mutex<EpisodeLoader>,
    seed: u64,
    dims: EpisodeDims,
}

#[derive(Clone, Copy)]
struct EpisodeDims {
    channels_first: bool,
    micro_batch: usize,
    chunk: usize,
    max_tokens: usize,
    state_dim: usize,
    action_dim: usize,
}

#[pymethods]
impl EpisodeBatches {
    #[new]
    #[pyo3(signature = (path, micro_batch, *, seed=1337, rank=0, world_size=1, chunk=8, history=0, resolution=0,
        augment=true, max_tokens=32, workers=2, prefetch=4, verify=true, channels_first=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: String,
        micro_batch: usize,
        seed: u64,
        rank: usize,
        world_size: usize,
        chunk: usize,
        history: usize,
        resolution: u32,
        augment: bool,
        max_tokens: usize,
        workers: usize,
        prefetch: usize,
        verify: bool,
        channels_first: bool,
    ) -> PyResult<EpisodeBatches> {
        let config = EpisodeLoaderConfig {
            micro_batch,
            rank,
            world_size,
            seed,
            chunk,
            history,
            resolution,
            augment: augment.then(AugmentConfig::default),
            max_tokens,
            workers,
            prefetch,
            channels_first,
            ..EpisodeLoaderConfig::default()
        };
        let loader = py.detach(|| {
            let store = EpisodeStore::open(&PathBuf::from(&path), verify).map_err(errors::data)?;
            EpisodeLoader::new(store, config).map_err(errors::data)
        })?;
        let manifest = loader.store().manifest();
        let dims = EpisodeDims {
            channels_first,
            micro_batch,
            chunk,
            max_tokens,
            state_dim: manifest.state_dim,
            action_dim: manifest.action_dim,
        };
        Ok(EpisodeBatches { loader: Mutex::new(loader), seed, dims })
    }

    /// The next batch: a dict of DLPack buffers (`frames` `[B, F, S, S, 3]` uint8, or
    /// `[B, F, 3, S, S]` with `channels_first`, `state`
    /// `[B, state_dim]` and `actions` `[B, chunk, action_dim]` float32, `action_mask` `[B, chunk]`
    /// and `token_mask` `[B, max_tokens]` uint8, `tokens` `[B, max_tokens]` int64, `steps` `[B]`
    /// int64).
    fn next_buffers(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let batch = py.detach(|| self.loader.lock().expect("never poisoned").next_batch().map_err(errors::data))?;
        let d = self.dims;
        let (b, side, n_frames) = (d.micro_batch as i64, batch.side as i64, batch.n_frames as i64);
        let steps: Vec<i64> = batch.steps.iter().map(|&s| s as i64).collect();
        let dict = PyDict::new(py);
        let frame = if d.channels_first { vec![b, n_frames, 3, side, side] } else { vec![b, n_frames, side, side, 3] };
        dict.set_item("frames", Exported::from_vec(batch.frames, ElemType::U8, frame))?;
        dict.set_item("state", Exported::from_vec(batch.state, ElemType::F32, vec![b, d.state_dim as i64]))?;
        let chunk = d.chunk as i64;
        dict.set_item(
            "actions",
            Exported::from_vec(batch.actions, ElemType::F32, vec![b, chunk, d.action_dim as i64]),
        )?;
        dict.set_item("action_mask", Exported::from_vec(batch.action_mask, ElemType::U8, vec![b, chunk]))?;
        let tokens = d.max_tokens as i64;
        dict.set_item("tokens", Exported::from_vec(batch.tokens, ElemType::I64, vec![b, tokens]))?;
        dict.set_item("token_mask", Exported::from_vec(batch.token_mask, ElemType::U8, vec![b, tokens]))?;
        dict.set_item("steps", Exported::from_vec(steps, ElemType::I64, vec![b]))?;
        Ok(dict.unbind())
    }

    /// The resume state: `{"seed", "samples_consumed"}`.
    fn state(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let dict = PyDict::new(py);
        dict.set_item("seed", self.seed)?;
        dict.set_item("samples_consumed", self.loader.lock().expect("never poisoned").position())?;
        Ok(dict.unbind())
    }

    fn load_state(&self, py: Python<'_>, state: &Bound<'_, PyDict>) -> PyResult<()> {
        let seed = item(state, "seed")?;
        if seed != self.seed {
            return Err(PyValueError::new_err(format!(
                "the state was saved with seed {seed}, this loader has seed {}",
                self.seed
            )));
        }
        let position = item(state, "samples_consumed")?;
        py.detach(|| self.loader.lock().expect("never poisoned").seek(position));
        Ok(())
    }

    /// Steps (samples) in the dataset.
    #[getter]
    fn n_steps(&self) -> u64 {
        self.loader.lock().expect("never poisoned").store().n_steps()
    }
}
