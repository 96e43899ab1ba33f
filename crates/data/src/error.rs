use std::path::PathBuf;

/// Everything that can go wrong while reading or preparing training data.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read data file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("data file {path} holds {n_tokens} tokens, fewer than one sequence of {needed}")]
    TooShort { path: PathBuf, n_tokens: usize, needed: usize },
    #[error("in-memory data holds {n_tokens} tokens, fewer than one sequence of {needed}")]
    TooShortInMemory { n_tokens: usize, needed: usize },
}
