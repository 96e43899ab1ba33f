//! The launcher behind `stoke launch --nproc N -- train ARGS`: starts N workers on this machine with torchrun's
//! variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), prefixes
//! every line a worker prints with its rank, and when one worker fails stops the others and exits
//! with the first failure's code (128 + signal for a worker killed by a signal).
//!
//! Elastic jobs (`--nproc MIN:MAX`, `--max-restarts R`): the launcher watches its workers' exit
//! status and heartbeats (each worker touches a file in the launcher's folder after every step,
//! `Heartbeat`). When a worker dies, or sends no heartbeat for `--hang-timeout-s`, it stops them
//! all and starts the job again from the run's latest committed checkpoint (`train --resume`), on
//! as many slots as `--slot-check` finds available (at least MIN, at most MAX). While it runs short
//! of MAX it keeps checking the missing slots; when one is back it stops the workers through the
//! preemption path (every rank stops after the same step with a checkpoint and exits 75) and
//! starts them again on the larger world; when slots are taken away (a scheduler giving them to
//! another job), it shrinks the same way, down to MIN. `train.global_batch` keeps the global batch, and so the
//! trajectory, on every world size. Each start, restart and end is a line of the run's
//! `events.jsonl` with its cause. Only failures count against `--max-restarts`. With
//! `--cpus-file`, each start pins worker RANK to the RANK-th CPU the file lists (how
//! `stoke sched serve` keeps jobs on their own cores).
//!
//! Over several machines, one launcher per machine (`--nnodes N --node-rank R --master-addr
//! HOST:PORT`) starts its `--nproc` workers as ranks `R * nproc ..`; rank 0, on node 0, serves the
//! rendezvous at HOST:PORT, and the workers talk over the `tcp` backend (shared memory between
//! the ranks of one node). Each launcher watches and stops its own workers; a worker lost on
//! another node fails the others' collectives, naming the rank, and so this node's start too.
//!
//! With `--slurm` a start is not workers here but one Slurm allocation and one `srun` step in it
//! (`slurm`): the same loop, slot checks, heartbeats and preemption path, so a resize is a
//! checkpoint and a new step with another task and node count.
//!
//! `spec` is what to run; `supervisor` is the loop over starts of the job; `slots` says which
//! slots may run a worker and pins workers to CPUs; `workers` starts one start's workers and
//! watches them until they end; `slurm` does a start as a Slurm step. The worker side (the
//! heartbeat, naming the run folder) is `crate::run`'s.

mod slots;
mod slurm;
mod spec;
mod supervisor;
mod workers;

pub use spec::{across_nodes, apply_layout, Launch, Nodes};
pub use supervisor::launch;
