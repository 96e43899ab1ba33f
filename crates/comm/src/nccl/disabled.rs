//! Without the `nccl` feature: a clear error.

use crate::config::{CommConfig, DistEnv};
use crate::error::{CommError, Result};
use crate::Communicator;

pub(crate) fn connect(_config: &CommConfig, _env: &DistEnv) -> Result<Box<dyn Communicator>> {
    Err(CommError::Unavailable {
        backend: "nccl",
        reason: "this build lacks the `nccl` feature (build with `--features stoke-comm/nccl`)".into(),
    })
}
