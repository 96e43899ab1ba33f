use std::path::PathBuf;

/// What can go wrong writing or reading a checkpoint. Every variant names the file or folder.
#[derive(Debug, thiserror::Error)]
pub enum CkptError {
    #[error("cannot {action} {path}: {source}")]
    Io { action: &'static str, path: PathBuf, source: std::io::Error },
    #[error("checkpoint manifest {path} is malformed: {message}")]
    BadManifest { path: PathBuf, message: String },
    #[error("checkpoint file {path} is corrupt: {message}")]
    Corrupt { path: PathBuf, message: String },
    #[error("no committed checkpoint at step {step} in {dir}")]
    Missing { dir: PathBuf, step: u64 },
    #[error("tensor {name:?}: {message}")]
    BadTensor { name: String, message: String },
    #[error("writer id {id:?} must be 1-32 ASCII letters, digits or '_'")]
    BadWriterId { id: String },
    #[error(
        "cannot replace {path} atomically: this filesystem has no rename exchange ({source}); \
         remove the old checkpoint first or write to another folder"
    )]
    NoAtomicReplace { path: PathBuf, source: std::io::Error },
    #[error("the checkpoint writer thread stopped after an earlier error (reported before)")]
    WriterFailed,
    #[error("checkpoint mirror {url}: cannot {op}: {message}")]
    Mirror { url: String, op: &'static str, message: String },
    #[error("checkpoint writer: {message}")]
    Writer { message: String },
}

pub(crate) fn io<'a>(action: &'static str, path: &'a std::path::Path) -> impl FnOnce(std::io::Error) -> CkptError + 'a {
    move |source| CkptError::Io { action, path: path.to_path_buf(), source }
}
