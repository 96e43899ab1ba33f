//! `stoke sched serve`: the real executor. Runs each job as a `stoke launch` process group on this
//! machine's slots and resizes it through the launcher's elastic path: the launcher's
//! `--slot-check` reads the job's allocation (a file the server rewrites after each committed
//! decision), so a smaller or larger allocation stops the workers through the preemption path
//! (every rank stops after the same step with a checkpoint) and starts them again on the new size
//! from that checkpoint.
//!
//! The state (jobs, allocations, decisions with reasons, history, measured throughput) is the
//! SQLite database of `store`, written before acting. A server killed at any moment and started
//! again on the same folder re-adopts the launchers that still run (pid and start time recorded,
//! so a reused pid is not mistaken for one), learns how the others ended from their run's
//! `events.jsonl`, and starts the lost ones again from their latest checkpoint.
//!
//! Slots are cores: slot k is the k-th CPU of `cpus` (default: the CPUs this server may run on). A
//! job holds numbered slots (committed with the job), and its launcher pins worker RANK to the
//! core of its RANK-th slot (`stoke launch --cpus-file`: the allocation file lists the cores), so
//! two jobs never share a core. Under the goodput policy a job that starts on two slots or more
//! first runs `profile_steps` measured steps on one worker, then on two (through the same
//! checkpoint-restart resize), so its speedup is measured before the policy relies on it; the
//! profile's cost is recorded in its history.
//!
//! With `slurm` set (`stoke sched serve --slurm`) the same loop and policy drive Slurm instead of
//! this machine's cores: each launcher runs `stoke launch --slurm`, so every start of a job is a
//! Slurm allocation of as many tasks as its workers with the workers as one `srun` step, and a
//! resize is the same checkpoint-restart, ending the step and starting a new one of the new size in
//! a new allocation; slots are Slurm CPUs and nothing is pinned here.
//!
//! This crate links no libtorch: the jobs run in processes of the `stoke` binary (`Launcher`).
//!
//! Files: `config` (the settings), `server` (the loop, recovery, progress, the plan), `place`
//! (slots, allocation files, starting launchers), `metrics` (the Prometheus text), `endpoint` (serving it),
//! `estimate` (the cost estimators), `layout` (the folder and what is read from run folders),
//! `process` (liveness, tags, the folder lock), `cpus` (the slots' cores), `status` and `predict`
//! (what `status` and `report` show of a folder).

mod config;
mod cpus;
mod endpoint;
mod estimate;
mod layout;
mod metrics;
mod place;
mod predict;
mod process;
mod server;
mod status;

pub use config::{Launcher, ServeConfig};
pub use cpus::parse_cpu_list;
pub use estimate::{efficiency, job_spec, resize_cost, segments, startup_cost, DEFAULT_RESIZE_S};
pub use layout::{last_step, launch_events, noise_scale, unix_now, Layout};
pub use predict::{predict, Prediction};
pub use server::serve;
pub use status::{job_json, status_json};
