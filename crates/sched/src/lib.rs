//! stoke-sched: sharing a cluster among elastic training jobs.
//!
//! Its job (not built yet): a goodput model of each job (throughput as a function of its device
//! count, measured by stoke's profiler), scheduling policies that resize elastic jobs, a simulator to
//! compare policies on recorded traces, and an executor that launches and resizes stoke runs.
//! Nothing here pretends to work until that capability is built.
