//! The `stoke` binaries need libtorch on their rpath too: the same script as `crates/train`'s.
include!("crates/train/build.rs");
