//! The one error type of the trace analyzer.

use std::path::PathBuf;

/// Why a trace could not be read or analyzed. Every variant names the file, and parse errors the
/// byte offset (in the decompressed stream) where reading stopped.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: byte {offset}: {what}")]
    Syntax { path: PathBuf, offset: u64, what: String },
    #[error("{path}: byte {offset}: the file ends inside {inside} (truncated trace?)")]
    Truncated { path: PathBuf, offset: u64, inside: &'static str },
    #[error("{path}: byte {offset}: {field} value {value:?} does not fit in 64-bit nanoseconds")]
    OutOfRange { path: PathBuf, offset: u64, field: &'static str, value: String },
    #[error("{path}: not a Chrome trace: expected an object with \"traceEvents\" or an array of events")]
    NotATrace { path: PathBuf },
    #[error("{path}: no trace files (*.json, *.json.gz) found")]
    NoTraces { path: PathBuf },
    #[error("{side} cannot be measured: {why}")]
    Unmeasurable { side: &'static str, why: String },
    #[error("rank {rank} appears twice: {first} and {second}")]
    DuplicateRank { rank: u32, first: PathBuf, second: PathBuf },
    #[error("{path}: {what}")]
    Write {
        path: PathBuf,
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// Parse errors without a path; the ingest layer adds it.
#[derive(Debug)]
pub(crate) enum ScanError {
    Io(std::io::Error),
    Syntax { offset: u64, what: String },
    Truncated { offset: u64, inside: &'static str },
    OutOfRange { offset: u64, field: &'static str, value: String },
}

impl ScanError {
    pub(crate) fn with_path(self, path: &std::path::Path) -> TraceError {
        let path = path.to_path_buf();
        match self {
            ScanError::Io(source) => TraceError::Io { path, source },
            ScanError::Syntax { offset, what } => TraceError::Syntax { path, offset, what },
            ScanError::Truncated { offset, inside } => TraceError::Truncated { path, offset, inside },
            ScanError::OutOfRange { offset, field, value } => TraceError::OutOfRange { path, offset, field, value },
        }
    }
}
