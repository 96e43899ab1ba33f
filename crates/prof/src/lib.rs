//! stoke-prof: where the milliseconds of a training step go.
//!
//! Not built yet: step phases, the step report, diagnosis rules, Chrome-trace and Prometheus output,
//! and analysis of PyTorch profiler (Kineto) traces.
