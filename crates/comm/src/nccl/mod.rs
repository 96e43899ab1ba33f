//! The `nccl` backend's module swap: `enabled.rs` with the feature, `disabled.rs` without, so the
//! rest of the crate never sees a cfg.

#[cfg(feature = "nccl")]
mod enabled;
#[cfg(feature = "nccl")]
pub(crate) use enabled::connect;

#[cfg(not(feature = "nccl"))]
mod disabled;
#[cfg(not(feature = "nccl"))]
pub(crate) use disabled::connect;

/// Whether this build carries the backend.
pub(crate) const BUILT: bool = cfg!(feature = "nccl");
