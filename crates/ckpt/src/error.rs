use std::path::PathBuf;

/// What can go wrong writing or reading a checkpoint. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum CkptError {
    #[error("cannot {action} {path}: {source}")]
    Io { action: &'static str, path: PathBuf, source: std::io::Error },
    #[error("checkpoint manifest {path} is malformed: {message}")]
    BadManifest { path: PathBuf, message: String },
    #[error("checkpoint file {path} is corrupt: {message}")]
    Corrupt { path: PathBuf, message: String },
    #[error("no checkpoint at step {step} in {dir}")]
    Missing { dir: PathBuf, step: u64 },
    #[error("tensor {name:?}: {message}")]
    BadTensor { name: String, message: String },
}

pub(crate) fn io<'a>(action: &'static str, path: &'a std::path::Path) -> impl FnOnce(std::io::Error) -> CkptError + 'a {
    move |source| CkptError::Io { action, path: path.to_path_buf(), source }
}
