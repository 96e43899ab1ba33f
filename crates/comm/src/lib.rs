//! stoke-comm: collective communication between the processes of a data-parallel job.
//!
//! A [`Communicator`] all-reduces (sum, avg), reduce-scatters, all-gathers, broadcasts and
//! exchanges all-to-all plain buffers of f32, bf16, f16 or u8, sends and receives between two
//! ranks, waits at barriers, and splits into sub-groups. Operations run on one communication thread per process in submission
//! order; the `*_async` forms work in place on caller-owned memory and return a [`Work`] at once,
//! so a trainer can reduce one bucket of its flat gradient buffer while backward fills the next.
//! Every wait for a peer is bounded by `timeout_s`, and a peer whose process died is named in the
//! error ([`CommError::PeerLost`]) instead of hanging the job.
//!
//! Backends ([`Backend`]): `shm`, shared memory between processes of one machine (the default, no
//! system dependency); `tcp`, for jobs on several machines without MPI: TCP between nodes and
//! shared memory inside one (a group whose members share a node runs on shared memory, an
//! all-reduce across nodes reduces inside each node first; nodes come from
//! [`DistEnv::node_rank`], else hostname and boot id); `mpi`, Open MPI (feature `mpi`); `nccl`,
//! NCCL on GPUs (feature `nccl`, the libraries are loaded at run time and their absence is an
//! error, not a crash).
//!
//! [`DistEnv::from_vars`] reads a process's rank and world from the variables of torchrun (and
//! `stoke launch`), Open MPI or Slurm; the binary passes the environment in.
//!
//! ```
//! use std::collections::HashMap;
//! use stoke_comm::{connect, CommConfig, CommunicatorExt, DistEnv, ReduceOp};
//!
//! // Without launcher variables this is a single process: world size 1.
//! let env = DistEnv::from_vars(&HashMap::new()).unwrap();
//! let comm = connect(&CommConfig::default(), &env).unwrap();
//! let mut grads = vec![1.0f32, 2.0, 3.0];
//! comm.all_reduce(&mut grads, ReduceOp::Avg).unwrap();
//! assert_eq!(grads, [1.0, 2.0, 3.0]);
//! ```
//!
//! The crate has no libtorch and no tensors.

mod api;
mod config;
mod dtype;
mod error;
mod mpi;
mod nccl;
mod shm;
mod store;
mod tcp;
mod work;

pub use api::{shard_range, Communicator, CommunicatorExt};
pub use config::{threads_per_worker, Backend, CommConfig, DistEnv, EnvSource};
pub use dtype::{DType, Element, ReduceOp};
pub use error::{CommError, Result};
pub use half::{bf16, f16};
pub use work::{P2p, Region, Work};

use std::time::{Duration, Instant};

/// Builds the communicator of this process for `env`'s job with `config`'s backend. Collective:
/// every rank of the job calls it; it returns once all have joined (or fails after `timeout_s`).
pub fn connect(config: &CommConfig, env: &DistEnv) -> Result<Box<dyn Communicator>> {
    config.validate()?;
    match config.backend {
        Backend::Shm => connect_shm(config, env),
        Backend::Mpi => mpi::connect(config, env),
        Backend::Nccl => nccl::connect(config, env),
        Backend::Tcp => tcp::connect(config, env),
    }
}

fn connect_shm(config: &CommConfig, env: &DistEnv) -> Result<Box<dyn Communicator>> {
    let config = config.clone();
    let env = env.clone();
    let (rank, size) = (env.rank, env.world_size);
    let worker = work::Worker::spawn(rank, "shm", move || {
        let deadline = Instant::now() + Duration::from_secs_f64(config.timeout_s);
        let rendezvous = if env.world_size == 1 {
            shm::Rendezvous::Path(config.shm_dir.join("stoke-comm-single"))
        } else {
            shm::rendezvous_for(&config, &env, deadline)?
        };
        let engine = shm::ShmEngine::new(config, env.rank, env.world_size, rendezvous)?;
        Ok(Box::new(engine) as Box<dyn work::Engine>)
    })?;
    Ok(Box::new(api::ProcessGroup { worker, group: 0, rank, size, backend: "shm" }))
}
