//! stoke-sched: sharing a machine or cluster among elastic training jobs.
//!
//! Built so far: the job model (`model`: throughput as a function of workers, measured points or
//! Amdahl's law, fitted from measurements; statistical efficiency of the global batch; goodput),
//! three policies (`sim::Policy`: static FIFO, fair share, goodput-maximizing reallocation with a
//! minimum interval and the resize cost charged), an event-driven simulator over job lists
//! (`workload`: a documented CSV format and a seeded generator), and its report (`report`: the
//! figures and an HTML timeline of which job held which slots). Behind `stoke sched simulate`.
//! Not built yet: the real executor (`stoke sched serve`, running jobs through `stoke launch`
//! with state in SQLite).

pub mod model;
pub mod report;
pub mod sim;
pub mod workload;

pub use model::{Efficiency, JobSpec, Scaling};
pub use sim::{simulate, JobResult, Policy, SimConfig, SimResult};
pub use workload::{generate, parse_csv, to_csv, WorkloadSpec};

/// What can be wrong with a scheduler's input. Every variant names what and where.
#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    #[error("scaling `{text}`: {why}")]
    BadScaling { text: String, why: String },
    #[error("jobs CSV, line {line}: {why}")]
    BadCsv { line: usize, why: String },
    #[error("job {name}: {why}")]
    BadJob { name: String, why: String },
    #[error("unknown policy `{name}`; policies: fifo, fair, goodput")]
    BadPolicy { name: String },
}
