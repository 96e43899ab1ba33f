//! What `stoke launch` is asked to run: the job's settings, as plain data.

use std::path::PathBuf;

/// One job to launch (`stoke launch`'s arguments).
#[derive(Debug, Clone)]
pub struct Launch {
    /// Worker processes: N, or MIN:MAX for an elastic job.
    pub nproc: String,
    /// Restarts after a failed or hung worker before the job gives up.
    pub max_restarts: u32,
    /// A shell command that says whether slot STOKE_SLOT can run a worker (exit 0 for yes).
    pub slot_check: Option<String>,
    /// Seconds between checks of the missing slots while the job runs short of MAX.
    pub slot_poll_s: f64,
    /// Seconds to wait for MIN slots before a (re)start gives up.
    pub slot_wait_s: f64,
    /// Seconds a worker may go without a heartbeat before the job counts it hung.
    pub hang_timeout_s: f64,
    /// A file listing CPUs: worker RANK runs pinned to the RANK-th.
    pub cpus_file: Option<PathBuf>,
    /// Port of the rendezvous store on 127.0.0.1 (default: a free port, a new one per start).
    pub master_port: Option<u16>,
    /// Run this program instead of this `stoke` binary.
    pub program: Option<PathBuf>,
    /// Seconds the other workers get to exit after one failed before they are killed.
    pub grace_s: f64,
    /// Run each start as a Slurm job step (salloc, then `srun`) instead of workers
    /// on this machine.
    pub slurm: bool,
    /// The Slurm job name of the allocations (default `stoke`).
    pub job_name: String,
    /// The launcher's folder for heartbeats and the run folder's name (default a new folder under
    /// the temporary directory, removed at the end); under Slurm, one every node sees.
    pub state_dir: Option<PathBuf>,
    /// The command each worker runs.
    pub command: Vec<String>,
}
