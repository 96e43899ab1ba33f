//! The `mpi` backend's module swap: `enabled.rs` with the feature, `disabled.rs` without, so the
//! rest of the crate never sees a cfg.

#[cfg(feature = "mpi")]
mod enabled;
#[cfg(feature = "mpi")]
pub(crate) use enabled::{connect, BUILT};

#[cfg(not(feature = "mpi"))]
mod disabled;
#[cfg(not(feature = "mpi"))]
pub(crate) use disabled::{connect, BUILT};
