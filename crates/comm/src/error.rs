//! The crate's error type.

use std::path::PathBuf;

/// Everything a communicator call can fail with. Every variant names what and where: the rank,
/// the operation, the path or address.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    /// A peer process exited (killed, crashed, or returned) while this rank waited for it.
    #[error("rank {lost_rank} was lost (its process exited) while rank {rank} ran `{op}`")]
    PeerLost { rank: usize, lost_rank: usize, op: &'static str },
    /// A peer did not answer within `timeout_s`.
    #[error("rank {rank} waited {timeout_s} s for rank {peer} in `{op}` and gave up (timeout_s)")]
    Timeout { rank: usize, peer: usize, op: &'static str, timeout_s: f64 },
    /// A call's arguments are wrong (root out of range, avg of u8, a peer equal to self, ...).
    #[error("invalid `{op}` call on rank {rank}: {reason}")]
    InvalidArgument { rank: usize, op: &'static str, reason: String },
    /// Ranks called operations in different orders or with different sizes.
    #[error("rank {rank} got a mismatched message from rank {peer} in `{op}`: {reason}")]
    Mismatch { rank: usize, peer: usize, op: &'static str, reason: String },
    /// An earlier failure left this communicator unusable; the first failure is repeated.
    #[error("communicator is unusable after an earlier failure: {0}")]
    Poisoned(Box<CommError>),
    /// Rendezvous failed: no store, wrong world size, stale or foreign segment.
    #[error("rendezvous failed for rank {rank} at {place}: {reason}")]
    Rendezvous { rank: usize, place: String, reason: String },
    /// A system call on the shared-memory segment failed.
    #[error("{what} on {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::sync::Arc<std::io::Error>,
    },
    /// The rank/world environment variables are inconsistent or unparsable.
    #[error("distributed environment: {0}")]
    Environment(String),
    /// The backend is not available in this build or on this machine (missing feature or library).
    #[error("backend `{backend}` is unavailable: {reason}")]
    Unavailable { backend: &'static str, reason: String },
    /// The backend library itself reported an error.
    #[error("backend `{backend}` failed in `{op}` on rank {rank}: {reason}")]
    Backend { backend: &'static str, op: &'static str, rank: usize, reason: String },
    /// The communication thread is gone (it panicked or the communicator was torn down).
    #[error("the communication thread of rank {rank} is gone")]
    WorkerGone { rank: usize },
}

impl CommError {
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CommError::Io { what, path: path.into(), source: std::sync::Arc::new(source) }
    }
}

/// Result alias for this crate.
pub type Result<T, E = CommError> = std::result::Result<T, E>;
