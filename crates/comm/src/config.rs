//! Plain-data configuration and the process's place in the job ([`DistEnv`]).

use std::collections::HashMap;
use std::path::PathBuf;

use crate::error::{CommError, Result};

/// Which library moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Shared memory between processes of one machine (no system dependency).
    Shm,
    /// Open MPI (feature `mpi`).
    Mpi,
    /// NCCL on GPUs (feature `nccl`, libraries loaded at run time).
    Nccl,
    /// TCP between machines and shared memory inside one (no system dependency): a group whose
    /// members share a node runs over shared memory, a group that spans nodes over TCP.
    Tcp,
}

impl Backend {
    /// Parses `shm`, `mpi`, `nccl` or `tcp`.
    pub fn parse(name: &str) -> Result<Backend> {
        match name {
            "shm" => Ok(Backend::Shm),
            "mpi" => Ok(Backend::Mpi),
            "nccl" => Ok(Backend::Nccl),
            "tcp" => Ok(Backend::Tcp),
            other => Err(CommError::Environment(format!("unknown backend `{other}` (shm, mpi, nccl, tcp)"))),
        }
    }

    /// Whether this build carries the backend (`mpi` and `nccl` are features; `shm` and `tcp`
    /// always are).
    pub fn is_built(self) -> bool {
        match self {
            Backend::Shm | Backend::Tcp => true,
            Backend::Mpi => crate::mpi::BUILT,
            Backend::Nccl => crate::nccl::BUILT,
        }
    }
}

/// How a communicator is built. Plain data; every field documents its default.
#[derive(Debug, Clone, PartialEq)]
pub struct CommConfig {
    /// The backend. Default: `Shm`.
    pub backend: Backend,
    /// Seconds any single wait for a peer may take before the call fails naming that peer
    /// (`dist.timeout_s`). Default: 300.
    pub timeout_s: f64,
    /// Folder for shared-memory segments (should be a tmpfs). Default: `/dev/shm`.
    pub shm_dir: PathBuf,
    /// Bytes of one message slot in the shared-memory channels; the ring moves buffers in chunks
    /// of this size. Must be a positive multiple of 64. Default: 512 KiB (measured on a 2-core
    /// machine: 256 KiB chunks cost a third of the 1-4 MiB bandwidth in wake-ups).
    pub slot_bytes: usize,
    /// Slots per channel: how many chunks a sender may run ahead of its receiver. Default: 4.
    pub slots: usize,
    /// All-reduces up to this many bytes use the direct algorithm (every rank reads every other
    /// rank's whole buffer, one round trip); larger ones the ring. Capped at `slot_bytes`.
    /// Default: 64 KiB.
    pub direct_max_bytes: usize,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            backend: Backend::Shm,
            timeout_s: 300.0,
            shm_dir: PathBuf::from("/dev/shm"),
            slot_bytes: 512 << 10,
            slots: 4,
            direct_max_bytes: 64 << 10,
        }
    }
}

impl CommConfig {
    /// Checks the values; returns what is wrong, naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: String| Err(CommError::Environment(what));
        if !(self.timeout_s > 0.0 && self.timeout_s.is_finite()) {
            return bad(format!("timeout_s must be a positive number of seconds, got {}", self.timeout_s));
        }
        if self.slot_bytes == 0 || !self.slot_bytes.is_multiple_of(64) || self.slot_bytes > (1 << 30) {
            return bad(format!("slot_bytes must be a positive multiple of 64 up to 1 GiB, got {}", self.slot_bytes));
        }
        if self.slots == 0 || self.slots > 1024 {
            return bad(format!("slots must be in 1..=1024, got {}", self.slots));
        }
        Ok(())
    }
}

/// Where the rank and world came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvSource {
    /// torchrun's (and `stoke launch`'s) RANK, WORLD_SIZE, ...
    Torchrun,
    /// Open MPI's OMPI_COMM_WORLD_*.
    OpenMpi,
    /// Slurm's SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID.
    Slurm,
    /// None of them: a single process.
    Single,
}

/// This process's place in a job, read from the launcher's environment variables.
#[derive(Debug, Clone, PartialEq)]
pub struct DistEnv {
    pub rank: usize,
    pub world_size: usize,
    pub local_rank: usize,
    pub local_world_size: usize,
    /// MASTER_ADDR, when set: the TCP store's host.
    pub master_addr: Option<String>,
    /// MASTER_PORT, when set: the TCP store's port.
    pub master_port: Option<u16>,
    /// A name unique to this job step (Open MPI's job id, Slurm's job and step ids), used for a
    /// path rendezvous when there is no MASTER_ADDR/MASTER_PORT.
    pub job_key: Option<String>,
    /// Which node (machine) this process runs on, `0..n_nodes`: torchrun's GROUP_RANK, Slurm's
    /// SLURM_NODEID; `None` under Open MPI and for a single process. The `tcp` backend groups
    /// ranks by it, and by hostname and boot id when it is `None`.
    pub node_rank: Option<usize>,
    pub source: EnvSource,
}

impl DistEnv {
    /// A single process: rank 0 of 1.
    pub fn single() -> DistEnv {
        DistEnv {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: None,
            master_port: None,
            job_key: None,
            node_rank: None,
            source: EnvSource::Single,
        }
    }

    /// Reads torchrun's variables, then Open MPI's, then Slurm's (the first family whose rank
    /// variable is set wins); none gives [`DistEnv::single`]. The caller passes the environment
    /// (only the binary reads it).
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<DistEnv> {
        let get = |key: &str| vars.get(key).map(|v| v.trim()).filter(|v| !v.is_empty());
        let num = |key: &str| -> Result<Option<usize>> {
            match get(key) {
                None => Ok(None),
                Some(v) => v
                    .parse::<usize>()
                    .map(Some)
                    .map_err(|_| CommError::Environment(format!("{key}={v} is not a non-negative integer"))),
            }
        };
        let need = |key: &str, family: &str| -> Result<usize> {
            num(key)?.ok_or_else(|| CommError::Environment(format!("{family} variables are set but {key} is missing")))
        };
        let master_addr = get("MASTER_ADDR").map(str::to_string);
        let master_port = match get("MASTER_PORT") {
            None => None,
            Some(v) => Some(
                v.parse::<u16>()
                    .map_err(|_| CommError::Environment(format!("MASTER_PORT={v} is not a port number")))?,
            ),
        };
        let mut env = if get("RANK").is_some() {
            let world_size = need("WORLD_SIZE", "torchrun")?;
            DistEnv {
                rank: need("RANK", "torchrun")?,
                world_size,
                local_rank: num("LOCAL_RANK")?.unwrap_or(0),
                local_world_size: num("LOCAL_WORLD_SIZE")?.unwrap_or(world_size),
                master_addr,
                master_port,
                job_key: None,
                node_rank: num("GROUP_RANK")?,
                source: EnvSource::Torchrun,
            }
        } else if get("OMPI_COMM_WORLD_RANK").is_some() {
            let world_size = need("OMPI_COMM_WORLD_SIZE", "Open MPI")?;
            DistEnv {
                rank: need("OMPI_COMM_WORLD_RANK", "Open MPI")?,
                world_size,
                local_rank: num("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0),
                local_world_size: num("OMPI_COMM_WORLD_LOCAL_SIZE")?.unwrap_or(world_size),
                master_addr,
                master_port,
                job_key: get("OMPI_MCA_orte_ess_jobid").or(get("PMIX_NAMESPACE")).map(|id| format!("ompi-{id}")),
                node_rank: None,
                source: EnvSource::OpenMpi,
            }
        } else if get("SLURM_PROCID").is_some() {
            let world_size = need("SLURM_NTASKS", "Slurm")?;
            // SLURM_STEP_TASKS_PER_NODE looks like "2" or "2(x3)" or "3,2": this node's count is
            // only certain when the first entry covers every node, so take it as an estimate.
            let local_world_size = get("SLURM_STEP_TASKS_PER_NODE")
                .or(get("SLURM_TASKS_PER_NODE"))
                .and_then(|v| v.split(|c: char| !c.is_ascii_digit()).next().and_then(|n| n.parse().ok()))
                .unwrap_or(world_size);
            DistEnv {
                rank: need("SLURM_PROCID", "Slurm")?,
                world_size,
                local_rank: num("SLURM_LOCALID")?.unwrap_or(0),
                local_world_size,
                master_addr,
                master_port,
                job_key: get("SLURM_JOB_ID").map(|job| format!("slurm-{job}-{}", get("SLURM_STEP_ID").unwrap_or("0"))),
                node_rank: num("SLURM_NODEID")?,
                source: EnvSource::Slurm,
            }
        } else {
            return Ok(DistEnv::single());
        };
        if env.world_size == 0 || env.rank >= env.world_size {
            return Err(CommError::Environment(format!(
                "rank {} is not below world size {} ({:?} variables)",
                env.rank, env.world_size, env.source
            )));
        }
        if env.local_world_size == 0 || env.local_rank >= env.local_world_size {
            env.local_world_size = env.local_world_size.max(env.local_rank + 1);
        }
        Ok(env)
    }
}

/// Threads each worker should use by default: the machine's cores shared evenly by the workers
/// on this machine, at least one.
pub fn threads_per_worker(cores: usize, local_world_size: usize) -> usize {
    (cores / local_world_size.max(1)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(vars: &[(&str, &str)], expected: Option<(usize, usize, usize, usize, EnvSource)>) {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let got = DistEnv::from_vars(&map);
        match expected {
            Some((rank, world, local_rank, local_world, source)) => {
                let env = got.unwrap();
                assert_eq!(
                    (env.rank, env.world_size, env.local_rank, env.local_world_size, env.source),
                    (rank, world, local_rank, local_world, source)
                );
            }
            None => assert!(got.is_err(), "{vars:?} should be rejected, got {got:?}"),
        }
    }

    #[test]
    fn reads_torchrun_then_open_mpi_then_slurm() {
        check(&[], Some((0, 1, 0, 1, EnvSource::Single)));
        check(
            &[
                ("RANK", "1"),
                ("WORLD_SIZE", "4"),
                ("LOCAL_RANK", "1"),
                ("LOCAL_WORLD_SIZE", "2"),
                ("SLURM_PROCID", "3"),
            ],
            Some((1, 4, 1, 2, EnvSource::Torchrun)),
        );
        check(
            &[
                ("OMPI_COMM_WORLD_RANK", "2"),
                ("OMPI_COMM_WORLD_SIZE", "3"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "2"),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "3"),
                ("SLURM_PROCID", "0"),
            ],
            Some((2, 3, 2, 3, EnvSource::OpenMpi)),
        );
        check(
            &[
                ("SLURM_PROCID", "1"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_LOCALID", "1"),
                ("SLURM_STEP_TASKS_PER_NODE", "2(x1)"),
            ],
            Some((1, 2, 1, 2, EnvSource::Slurm)),
        );
        check(&[("RANK", "2"), ("WORLD_SIZE", "2")], None);
        check(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("GROUP_RANK", "x")], None);
        check(&[("RANK", "0")], None);
        check(&[("RANK", "x"), ("WORLD_SIZE", "2")], None);
    }

    #[test]
    fn node_rank_comes_from_group_rank_or_slurm_nodeid() {
        let node = |vars: &[(&str, &str)]| {
            let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            DistEnv::from_vars(&map).unwrap().node_rank
        };
        assert_eq!(node(&[("RANK", "3"), ("WORLD_SIZE", "4"), ("GROUP_RANK", "1")]), Some(1));
        assert_eq!(node(&[("RANK", "3"), ("WORLD_SIZE", "4")]), None);
        assert_eq!(node(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"), ("SLURM_NODEID", "1")]), Some(1));
        assert_eq!(node(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")]), None);
        assert_eq!(Backend::parse("tcp").unwrap(), Backend::Tcp);
        assert!(Backend::Tcp.is_built());
        assert!(Backend::parse("gloo").unwrap_err().to_string().contains("tcp"));
    }

    #[test]
    fn threads_share_the_cores() {
        assert_eq!(threads_per_worker(16, 4), 4);
        assert_eq!(threads_per_worker(2, 3), 1);
        assert_eq!(threads_per_worker(2, 0), 2);
    }
}
