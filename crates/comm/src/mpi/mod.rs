//! The `mpi` backend's module swap: `enabled.rs` with the feature, `disabled.rs` without, so the
//! rest of the crate never sees a cfg.

#[cfg(feature = "mpi")]
mod enabled;
#[cfg(feature = "mpi")]
pub(crate) use enabled::connect;

#[cfg(not(feature = "mpi"))]
mod disabled;
#[cfg(not(feature = "mpi"))]
pub(crate) use disabled::connect;

/// Whether this build carries the backend.
pub(crate) const BUILT: bool = cfg!(feature = "mpi");
