//! `stoke.ckpt`'s native half: a `state_dict`'s tensors (read through DLPack, no copy until the
//! host buffer) saved by stoke-ckpt's background writer, and checkpoints read back (every CRC-32
//! checked) as DLPack buffers.

use std::path::PathBuf;
use std::sync::Mutex;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use stoke_ckpt::{
    load_dir, stream_copy, CheckpointStore, CheckpointWriter, Committed, DType, Loaded, WriterConfig, MANIFEST,
};

use crate::dlpack::{read_dlpack, Borrowed, ElemType, Exported};
use crate::errors;

/// Threads of the copy into the host buffer (the part of a save the caller waits for).
const COPY_THREADS: usize = 2;

fn ckpt_dtype(elem: ElemType, what: &str) -> PyResult<DType> {
    match elem {
        ElemType::F32 => Ok(DType::F32),
        ElemType::BF16 => Ok(DType::BF16),
        ElemType::I64 => Ok(DType::I64),
        other => Err(PyTypeError::new_err(format!(
            "{what}: {} tensors are not stored by stoke checkpoints (float32, bfloat16 and int64 are)",
            other.name()
        ))),
    }
}

fn elem_type(dtype: DType) -> ElemType {
    match dtype {
        DType::F32 => ElemType::F32,
        DType::BF16 => ElemType::BF16,
        DType::I64 => ElemType::I64,
    }
}

fn committed_dicts(py: Python<'_>, committed: Vec<Committed>) -> PyResult<Vec<Py<PyDict>>> {
    committed
        .into_iter()
        .map(|c| {
            let dict = PyDict::new(py);
            dict.set_item("step", c.step)?;
            dict.set_item("path", c.path.to_string_lossy().into_owned())?;
            dict.set_item("bytes", c.bytes)?;
            dict.set_item("write_s", c.write_s)?;
            dict.set_item("deleted", c.deleted)?;
            Ok(dict.unbind())
        })
        .collect()
}

/// A checkpoint folder's writer: each `save` copies the tensors into a host buffer and returns;
/// a background thread writes, fsyncs and commits the step by renaming a complete folder.
#[pyclass(module = "stoke._native", frozen)]
pub struct Writer {
    writer: Mutex<Option<CheckpointWriter>>,
    dir: PathBuf,
}

impl Writer {
    fn with<T>(&self, f: impl FnOnce(&mut CheckpointWriter) -> Result<T, stoke_ckpt::CkptError>) -> PyResult<T> {
        let mut guard = self.writer.lock().expect("never poisoned");
        let writer = guard.as_mut().ok_or_else(|| {
            errors::CheckpointError::new_err(format!("the writer of {} is closed", self.dir.display()))
        })?;
        f(writer).map_err(errors::ckpt)
    }
}

#[pymethods]
impl Writer {
    #[new]
    #[pyo3(signature = (dir, *, keep=3, keep_every=0, buffers=2, background=true))]
    fn new(dir: String, keep: usize, keep_every: u64, buffers: usize, background: bool) -> PyResult<Writer> {
        if buffers == 0 {
            return Err(PyValueError::new_err("buffers must be at least 1"));
        }
        let dir = PathBuf::from(dir);
        let store = CheckpointStore::new(&dir);
        let config = WriterConfig { background, buffers, keep, keep_every };
        let writer = CheckpointWriter::new(store, config).map_err(errors::ckpt)?;
        Ok(Writer { writer: Mutex::new(Some(writer)), dir })
    }

    /// Saves `tensors` (pairs of name and a CPU tensor with `__dlpack__`) as checkpoint `step`,
    /// in file `<stem>.safetensors`, with `meta_json` in the manifest. Returns the seconds spent
    /// waiting for a free host buffer; the write goes on in the background.
    #[pyo3(signature = (step, tensors, meta_json=None, stem="model"))]
    fn save(
        &self,
        py: Python<'_>,
        step: u64,
        tensors: Vec<(String, Bound<'_, PyAny>)>,
        meta_json: Option<String>,
        stem: &str,
    ) -> PyResult<f64> {
        let meta = match meta_json {
            Some(text) => serde_json::from_str(&text).map_err(|e| PyValueError::new_err(format!("meta: {e}")))?,
            None => serde_json::Value::Null,
        };
        let mut borrowed: Vec<(String, DType, Borrowed)> = Vec::with_capacity(tensors.len());
        for (name, tensor) in &tensors {
            let view = read_dlpack(tensor, name)?;
            borrowed.push((name.clone(), ckpt_dtype(view.elem, name)?, view));
        }
        let waited = py.detach(|| {
            self.with(|writer| {
                let mut snapshot = writer.begin(step)?;
                for (name, dtype, view) in &borrowed {
                    let room = snapshot.tensor(stem, name, *dtype, &view.shape);
                    stream_copy(room, view.bytes(), COPY_THREADS);
                }
                snapshot.set_meta(meta);
                let waited = snapshot.waited().as_secs_f64();
                writer.submit(snapshot)?;
                writer.release(step)?;
                Ok(waited)
            })
        });
        // The producers' deleters run here, with the GIL held.
        drop(borrowed);
        waited
    }

    /// Checkpoints committed since the last call; does not block.
    fn committed(&self, py: Python<'_>) -> PyResult<Vec<Py<PyDict>>> {
        let committed = self.with(|writer| writer.committed())?;
        committed_dicts(py, committed)
    }

    /// Waits until every saved step is committed; returns those not reported yet.
    fn wait(&self, py: Python<'_>) -> PyResult<Vec<Py<PyDict>>> {
        let committed = py.detach(|| self.with(|writer| writer.finish()))?;
        committed_dicts(py, committed)
    }

    /// Waits for every saved step, then stops the writer thread.
    fn close(&self, py: Python<'_>) -> PyResult<Vec<Py<PyDict>>> {
        let committed = py.detach(|| self.with(|writer| writer.finish()))?;
        self.writer.lock().expect("never poisoned").take();
        committed_dicts(py, committed)
    }
}

/// Reads and verifies a checkpoint: `path` is a `step-<n>` folder, or a folder of them (the step
/// given, else the newest committed one). Returns `(step, meta_json, {stem: [(name, buffer)]})`.
#[pyfunction]
#[pyo3(signature = (path, step=None))]
pub fn load(py: Python<'_>, path: String, step: Option<u64>) -> PyResult<(u64, String, Py<PyDict>)> {
    let path = PathBuf::from(path);
    let loaded: Loaded = py.detach(|| {
        if step.is_none() && path.join(MANIFEST).is_file() {
            return load_dir(&path).map_err(errors::ckpt);
        }
        let store = CheckpointStore::new(&path);
        let step = match step {
            Some(step) => step,
            None => store.latest().map_err(errors::ckpt)?.ok_or_else(|| {
                errors::CheckpointError::new_err(format!("no committed checkpoint in {}", path.display()))
            })?,
        };
        store.load(step).map_err(errors::ckpt)
    })?;
    let meta = serde_json::to_string(&loaded.manifest.meta).expect("JSON serializes");
    let files = PyDict::new(py);
    for (stem, records) in loaded.files {
        let tensors: Vec<(String, Exported)> = records
            .into_iter()
            .map(|record| {
                let shape = record.shape.iter().map(|&d| d as i64).collect();
                (record.name, Exported::from_vec(record.data, elem_type(record.dtype), shape))
            })
            .collect();
        files.set_item(stem, tensors)?;
    }
    Ok((loaded.manifest.step, meta, files.unbind()))
}

/// Committed steps in a checkpoint folder, oldest first.
#[pyfunction]
pub fn steps(path: String) -> PyResult<Vec<u64>> {
    CheckpointStore::new(PathBuf::from(path)).list().map_err(errors::ckpt)
}
