use std::path::PathBuf;

/// Everything that can go wrong while reading or preparing training data. Errors about a file name
/// the file and, where one exists, the byte offset of the bad part.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read data file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("cannot write data file {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("data file {path} holds {n_tokens} tokens, fewer than one sequence of {needed}")]
    TooShort { path: PathBuf, n_tokens: usize, needed: usize },
    #[error("in-memory data holds {n_tokens} tokens, fewer than one sequence of {needed}")]
    TooShortInMemory { n_tokens: usize, needed: usize },
    #[error("{path}: bad magic at offset {offset}: expected {expected}")]
    BadMagic { path: PathBuf, offset: u64, expected: &'static str },
    #[error("{path} is truncated: {what} needs {needed} bytes at offset {offset}, the file has {len}")]
    Truncated { path: PathBuf, what: &'static str, offset: u64, needed: u64, len: u64 },
    #[error("{path}: corrupt {what} at offset {offset}: {detail}")]
    Corrupt { path: PathBuf, what: &'static str, offset: u64, detail: String },
    #[error("{path}: dtype mismatch at offset {offset}: expected {expected}, found {found}")]
    DtypeMismatch { path: PathBuf, offset: u64, expected: String, found: String },
    #[error("{path}: checksum mismatch: expected crc32 {expected:08x}, computed {actual:08x}")]
    ChecksumMismatch { path: PathBuf, expected: u32, actual: u32 },
    #[error("{path}: bad manifest: {source}")]
    Manifest { path: PathBuf, source: serde_json::Error },
    #[error("{path}: cannot load tokenizer: {detail}")]
    Tokenizer { path: PathBuf, detail: String },
    #[error("{path}: cannot tokenize: {detail}")]
    Tokenize { path: PathBuf, detail: String },
    #[error("{path}:{line}: {message}")]
    Episode { path: PathBuf, line: u64, message: String },
    #[error("{path}: cannot decode image: {detail}")]
    Image { path: PathBuf, detail: String },
    #[error("{path}: cannot read Parquet table: {detail}")]
    Table { path: PathBuf, detail: String },
    #[error("{path}: cannot decode video: {detail}")]
    Video { path: PathBuf, detail: String },
    #[error(
        "{path}: not a dataset stoke can read (expected a prepared directory, Megatron .bin/.idx, or a raw token file)"
    )]
    UnknownFormat { path: PathBuf },
    #[error("{path}, line {line}: {detail}")]
    Instruction { path: PathBuf, line: usize, detail: String },
    #[error("invalid data config: {field}: {reason}")]
    Config { field: &'static str, reason: String },
    #[error("remote shard {url}: {detail}")]
    Remote { url: String, detail: String },
    #[error("cache {path}: {detail}")]
    Cache { path: PathBuf, detail: String },
    #[error("a loader worker stopped unexpectedly")]
    WorkerGone,
}

impl DataError {
    pub(crate) fn read(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
        move |source| DataError::Read { path: path.to_path_buf(), source }
    }

    pub(crate) fn write(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
        move |source| DataError::Write { path: path.to_path_buf(), source }
    }
}
