//! The benchmark gate behind `stoke bench gate`: a regression gate on ratios measured against a reference that moves with
//! the machine.
//!
//! The gate trains a small fixed model in this process, `repeats` times. After every step it times
//! the model's matrix multiplies alone (`GemmReference`: the same shapes, precision and threads,
//! forward and backward), so each step has a reference measured a moment before the next one, on
//! the same cores under the same load. Per run, from the fastest instance of each time over the
//! run's steps (see `run_figures`),
//!
//! - `step_over_gemm`: step time (the sum of its phases' figures) / (forward + backward matrix
//!   multiplies),
//! - `forward_over_gemm`, `backward_over_gemm`: each phase over its own matrix multiplies,
//! - `optimizer_over_gemm`: the optimizer phase over all matrix multiplies,
//!
//! and the shares of the step that are not the model's arithmetic (`data_wait`, `ckpt_stall`,
//! `other`) from the run's report; the gate compares the median of each figure over the runs with
//! `benches/baseline.json`. A time ratio regresses when it exceeds the baseline by more than its
//! relative tolerance, a share when it exceeds the baseline by more than its absolute tolerance.
//!
//! The tolerances are fixed when the baseline is recorded (`--update`, more repeats than a check):
//! four median absolute deviations of the recorded runs, never below a floor (6% for a time ratio,
//! 12% for the optimizer's, which is bound by memory; 2 points for a share) and, for a time ratio
//! bound by arithmetic, never above 8%, below the 10% slowdown the gate must catch. The current
//! run's own spread is printed but never widens them, so a change that makes steps noisier cannot
//! hide inside its own noise. A figure that is missing or not finite on either side is an error, not a pass.
//!
//! `reference` times the model's matrix multiplies beside each step and turns a run into its
//! figures; `baseline` holds the recorded figures, their tolerances and the comparison; `runs`
//! trains the gate's runs and records or checks a baseline.

//!
//! `against` compares code with code instead: another revision's binary and this one, interleaved
//! in one invocation, with tolerances from the spread of their pairs; its self-test injects the five
//! slowdowns the gate must catch.

mod against;
mod baseline;
mod reference;
mod runs;

pub use against::{against, binary_of, jobs_for, self_test};
pub use runs::{gate, gate_settings, GateSpec};
