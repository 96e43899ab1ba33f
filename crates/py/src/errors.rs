//! Python exceptions for the library crates' errors. Each carries the Rust error's message, which
//! names the file (and offset, step or key) it is about.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::PyErr;

create_exception!(_native, StokeError, PyException, "Base of every error stoke raises.");
create_exception!(_native, DataError, StokeError, "A dataset could not be read, prepared or loaded.");
create_exception!(_native, TraceError, StokeError, "A profiler trace could not be read or analyzed.");
create_exception!(_native, CheckpointError, StokeError, "A checkpoint could not be written, found or verified.");

pub fn data(err: stoke_data::DataError) -> PyErr {
    DataError::new_err(err.to_string())
}

pub fn trace(err: stoke_prof::TraceError) -> PyErr {
    TraceError::new_err(err.to_string())
}

pub fn ckpt(err: stoke_ckpt::CkptError) -> PyErr {
    CheckpointError::new_err(err.to_string())
}
