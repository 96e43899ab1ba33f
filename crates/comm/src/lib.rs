//! stoke-comm: collective communication for data-parallel training.
//!
//! Its job (not built yet): a `Communicator` trait with backends (shared memory on one node; MPI and
//! NCCL behind the `mpi` and `nccl` features), gradient bucketing that overlaps all-reduce with
//! backward, reduce-scatter for ZeRO-style sharding, and gradient compression. Nothing here pretends
//! to work until that capability is built; today every stoke run is a single process.
