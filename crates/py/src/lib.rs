//! stoke-py: the `stoke` Python package's native module, `stoke._native`. It puts stoke's data
//! loader, trace analyzer, checkpoint writer and offline preparation in front of a PyTorch
//! training loop, with no libtorch of its own: batches and checkpoint tensors cross the boundary
//! as DLPack buffers (`dlpack.rs`), so `torch.from_dlpack` wraps them without a copy, and a
//! `state_dict`'s tensors are read through their own `__dlpack__`.
//!
//! Every call that does real work (filling batches, analyzing traces, copying or loading a
//! checkpoint, preparing data) releases the GIL. Errors arrive as `stoke.StokeError` subclasses
//! carrying the Rust message, which names the file.
//!
//! The Python side (`python/stoke/`) wraps these in `stoke.data`, `stoke.trace`, `stoke.ckpt` and
//! `stoke.prep`; a use from Python:
//!
//! ```python
//! import stoke.data, torch
//! loader = stoke.data.TokenLoader("data/prepared", seq_len=256, batch_size=16, seed=0)
//! for step, batch in zip(range(100), loader):      # batch: int64 [16, 257], zero-copy
//!     x, y = batch[:, :-1], batch[:, 1:]
//! state = loader.state_dict()                       # exact resume, also at another world size
//! ```

mod ckpt;
mod data;
mod dlpack;
mod errors;
mod prep;
mod trace;

use pyo3::prelude::*;

pub use ckpt::Writer;
pub use data::{EpisodeBatches, TokenLoader};
pub use dlpack::Exported;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("StokeError", py.get_type::<errors::StokeError>())?;
    m.add("DataError", py.get_type::<errors::DataError>())?;
    m.add("TraceError", py.get_type::<errors::TraceError>())?;
    m.add("CheckpointError", py.get_type::<errors::CheckpointError>())?;
    m.add_class::<Exported>()?;
    m.add_class::<TokenLoader>()?;
    m.add_class::<EpisodeBatches>()?;
    m.add_class::<Writer>()?;
    m.add_function(wrap_pyfunction!(trace::analyze, m)?)?;
    m.add_function(wrap_pyfunction!(trace::compare, m)?)?;
    m.add_function(wrap_pyfunction!(ckpt::load, m)?)?;
    m.add_function(wrap_pyfunction!(ckpt::steps, m)?)?;
    m.add_function(wrap_pyfunction!(prep::text, m)?)?;
    m.add_function(wrap_pyfunction!(prep::episodes, m)?)?;
    m.add_function(wrap_pyfunction!(prep::verify, m)?)?;
    m.add_function(wrap_pyfunction!(prep::synthetic_episodes, m)?)?;
    Ok(())
}
