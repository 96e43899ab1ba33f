//! stoke-comm's integration tests: real worker processes (`stoke-comm-worker`) talking over
//! shared memory and loopback (shm, and tcp with simulated nodes), started directly, by `mpirun`, or by `srun`.

mod harness;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
mod shm;
mod slurm;
mod tcp;
