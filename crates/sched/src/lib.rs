//! stoke-sched: sharing a machine or cluster among elastic training jobs.
//!
//! Built so far: the job model (`model`: throughput as a function of workers, measured points or
//! Amdahl's law, fitted from measurements; statistical efficiency of the global batch; goodput;
//! `batch`: Pollux's model, a step table per workers and micro-batch, the batches a job accepts
//! and a noise-scale schedule), five policies (`view::Policy`: static FIFO, fair share, goodput as
//! Pollux defines it with workers and batch chosen together, Tiresias, Optimus), an event-driven
//! simulator over job lists that places jobs on nodes where the cluster has them (`sim`, `nodes`;
//! `workload`: a CSV format checked field by field, and a seeded generator), and its report
//! (`report`: the figures, each job's course as JSON, and an HTML timeline of which job held which
//! slots). Behind `stoke sched simulate`.
//!
//! The real executor (`serve`, behind `stoke sched serve`, which runs jobs through `stoke launch`):
//! the server's loop, its cost estimators and process helpers, and what `status` and `report` show
//! of its folder; the policies' one allocation function (`policy::allocate`, called by the
//! simulator and the server alike), the server's state in SQLite (`store`), and each job's
//! throughput model fitted from its own `metrics.jsonl` and `events.jsonl` (`observe`). It links
//! no libtorch: the jobs run in processes of the `stoke` binary.
//!
//! ```
//! use stoke_sched::{allocate, Efficiency, JobSpec, JobView, Policy, PolicyConfig, Scaling};
//! let job = |name: &str| JobSpec {
//!     name: name.into(), submit_s: 0.0, work: 100.0, min_workers: 1, max_workers: 2,
//!     scaling: Scaling::Amdahl { t1: 1.0, p: 0.9 }, efficiency: Efficiency::FIXED_BATCH,
//!     resize_s: 5.0, start_s: 0.0, priority: 1.0, batch: None, asked_workers: None,
//! };
//! let (a, b) = (job("a"), job("b"));
//! let config = PolicyConfig { min_resize_interval_s: 30.0, ..PolicyConfig::new(2, Policy::Fair) };
//! // a holds both slots; b arrives: a shrinks to admit it.
//! let views = [JobView { spec: &a, workers: 2, last_resize_s: 0.0, done: 0.0, attained_slot_s: 0.0 }, JobView { spec: &b, workers: 0, last_resize_s: f64::NEG_INFINITY, done: 0.0, attained_slot_s: 0.0 }];
//! let plan = allocate(&views, &config, 10.0);
//! assert_eq!((plan[0].workers, plan[1].workers), (1, 1));
//! assert!(plan[0].reason.contains("shrunk from 2 to 1"));
//! ```

mod baselines;
pub mod batch;
mod goodput;
pub mod limits;
pub mod model;
pub mod nodes;
pub mod observe;
pub mod policy;
pub mod report;
pub mod serve;
pub mod sim;
pub mod store;
pub mod view;
pub mod workload;

pub use batch::{BatchModel, StepTable};
pub use model::{BatchChoice, Efficiency, JobSpec, Scaling};
pub use policy::{allocate, Allocation, JobView, Policy, PolicyConfig};
pub use serve::{serve, Launcher, ServeConfig};
pub use sim::{simulate, JobResult, SimConfig, SimResult};
pub use store::{Change, Decision, HistoryEntry, JobRow, JobState, NewJob, Store};
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
    #[error("unknown policy `{name}`; policies: fifo, fair, goodput, tiresias, optimus")]
    BadPolicy { name: String },
    #[error("scheduler database {path}: cannot {what}: {source}")]
    Store { path: std::path::PathBuf, what: &'static str, source: rusqlite::Error },
    #[error("{path}: {source}")]
    Io { path: std::path::PathBuf, source: std::io::Error },
    #[error("cannot {what} {path}: {source}")]
    File { path: std::path::PathBuf, what: &'static str, source: std::io::Error },
    #[error("{flag} {value}: out of range; needs {range}")]
    BadFlag { flag: &'static str, value: String, range: String },
    #[error("the simulation stopped at {at_s:.1} s: {why}")]
    Stalled { at_s: f64, why: String },
    #[error("--slots must be at least 1")]
    NoSlots,
    #[error("--cpus `{text}`: expected CPU numbers and ranges like 0,2,4-7")]
    BadCpuList { text: String },
    #[error("no CPU to pin the slots to (--cpus, or this process's affinity, is empty)")]
    NoCpu,
    #[error("another `stoke sched serve` runs on {} (pid {holder}); one server per folder", dir.display())]
    FolderLocked { dir: std::path::PathBuf, holder: String },
    #[error("cannot start the launcher of {job}: {source}")]
    Launch { job: String, source: std::io::Error },
    #[error("cannot serve /metrics: {source}")]
    Metrics { source: stoke_http::HttpError },
    #[error("{}: no finished job to compare", dir.display())]
    NothingFinished { dir: std::path::PathBuf },
}

impl SchedError {
    /// A mistake in what the server or the report was asked to do (its settings, a folder another
    /// server holds, a folder with nothing to compare), as opposed to a failure while doing it.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            SchedError::NoSlots
                | SchedError::BadFlag { .. }
                | SchedError::BadCpuList { .. }
                | SchedError::NoCpu
                | SchedError::FolderLocked { .. }
                | SchedError::NothingFinished { .. }
        )
    }
}
