//! What a run is, apart from the command lines that start one: its folder (`<run.dir>/<run.name>/`,
//! named and located by `folder`), the policy of a resume (`resume`, with the keys it may change
//! in `resume_keys`), its data sources (`data`), the job a process belongs to (`job`: the
//! launcher's variables, the ranks' agreement on the config and the run name), the ranks' common
//! clock (`clock`), checkpoint writing (`checkpoints`), the worker side of `stoke launch`
//! (`heartbeat`), the ranks' loops and report gathering (`ranks`, `train`), all behind one
//! `RunSpec`.
//!
//! ```text
//! let mut source = ConfigSource { file: None, overrides: vec!["train.steps=20".into()] };
//! let mut job = Job::join(&mut source, false)?;
//! let mut spec = RunSpec::for_job(&source, &job, Start::Fresh, MemoryCheck::Enforce)?;
//! spec.progress = true;
//! let outcome = spec.train(stop, job.dist_mut())?;
//! outcome.print_report();
//! ```

mod checkpoints;
mod clock;
mod data;
mod episode_dims;
mod episodes;
mod folder;
mod heartbeat;
mod job;
mod memory;
mod ranks;
mod resume;
mod resume_keys;
mod source;
mod spec;
mod train;

pub use episode_dims::{resolve_episode_dims, EpisodeData};
pub use folder::{latest_checkpoint, timestamp};
pub use heartbeat::{heartbeat_path, read_run_dir, LAUNCH_DIR_VAR};
pub use job::Job;
pub use memory::MemoryCheck;
pub use resume::{restart_command, AlreadyDone};
pub use source::ConfigSource;
pub use spec::{RunSpec, Start};
