//! The ranges a job's figures and a simulation's settings must lie in: outside them a
//! simulation's clock overflows, or a step vanishes below its resolution. A leaf: the jobs CSV,
//! the job model and the simulator all check against these.

/// The least and the most samples per second a throughput may be.
pub const MIN_RATE: f64 = 1e-6;
pub const MAX_RATE: f64 = 1e12;
/// The most workers a job or a cluster may have.
pub const MAX_WORKERS: usize = 1_000_000;
/// The latest submission time and the most work a job may have.
pub const MAX_SUBMIT_S: f64 = 1e9;
pub const MAX_WORK: f64 = 1e15;
pub const MAX_RESIZE_S: f64 = 1e7;
pub const MAX_PRIORITY: f64 = 1e6;
pub const MAX_NOISE_SCALE: f64 = 1e12;
/// The simulated clock's end: past it an f64 second no longer resolves a millisecond tick.
pub const HORIZON_S: f64 = 1e12;
/// The shortest tick: with `HORIZON_S`, every tick moves the clock.
pub const MIN_TICK_S: f64 = 1e-3;
