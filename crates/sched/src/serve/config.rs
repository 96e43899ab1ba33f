//! The server's settings, plain data (the binary fills them from `stoke sched serve`'s flags).

use std::path::PathBuf;

use crate::policy::Policy;

/// Everything `serve` needs to know; the defaults are the command line's.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// State folder: `sched.db`, the jobs' run folders (`runs/`), logs (`logs/`) and allocations
    /// (`alloc/`). No default.
    pub dir: PathBuf,
    /// Slots to share (cores here; one worker per slot). No default; at least 1.
    pub slots: usize,
    /// The allocation policy. Default goodput.
    pub policy: Policy,
    /// Serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: a free port, written to the
    /// database's meta table as `prometheus_addr`). Default none.
    pub prometheus_port: Option<u16>,
    /// Seconds between two looks at the jobs. Default 0.5.
    pub poll_s: f64,
    /// Seconds between the goodput policy's reallocations (it also reallocates at arrivals and
    /// completions). Default 10.
    pub tick_s: f64,
    /// The least seconds between two resizes of one job (goodput policy). Default 30.
    pub min_resize_interval_s: f64,
    /// `--max-restarts` of each job's launcher (failed workers brought back from the checkpoint).
    /// Default 2.
    pub max_restarts: u32,
    /// Launchers lost (killed, or gone without saying how they ended) before a job counts failed.
    /// Default 3.
    pub max_lost: u64,
    /// The cores of the slots, in slot order (`0,1`; `0-3` ranges too). Default: the first
    /// `slots` CPUs this process may run on.
    pub cpus: Option<String>,
    /// Goodput policy: steps measured on one worker, then on two, when a job first starts on two
    /// slots or more (after `observe::WARMUP_STEPS` per start); 0 skips the profile. Default 10.
    pub profile_steps: u64,
    /// Return once jobs were submitted and none is queued or running; else run until killed
    /// (the jobs keep running; the next server on the folder re-adopts them). Default false.
    pub exit_when_idle: bool,
    /// Run the jobs through Slurm (`stoke launch --slurm`): each start of a job is a Slurm
    /// allocation of as many tasks as its workers and one `srun` step in it; slots are the Slurm
    /// CPUs the jobs share, not cores here (no pinning). Default false.
    pub slurm: bool,
    /// The program each job runs under.
    pub launcher: Launcher,
}

/// The `stoke` binary that runs the jobs: started as `EXE launch ... -- train ...`, one process
/// group per job.
#[derive(Debug, Clone)]
pub struct Launcher {
    /// Its path.
    pub exe: PathBuf,
    /// The exit code with which it says it was preempted with a checkpoint written (resumable).
    pub preempted_exit_code: i32,
}
