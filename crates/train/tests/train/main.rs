//! Integration tests of stoke-train: the block executor, precision and the optimizer's state,
//! driven through the crate's public API on small models.

mod executor;
mod precision;

use std::sync::Mutex;

/// Tests that seed libtorch's global generator hold this, so parallel tests do not draw from each
/// other's seeds.
pub static GLOBAL_RNG: Mutex<()> = Mutex::new(());

pub fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
