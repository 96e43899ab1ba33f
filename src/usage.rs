//! A bad command line or configuration, the error that exits with code 2. A leaf of its own, so
//! that `stoke-trace` (which links no libtorch) shares it with `stoke` without `exit`'s mappings.

/// A bad command line or configuration: exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);
