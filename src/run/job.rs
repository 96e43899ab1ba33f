//! The job a process belongs to: one process, or one rank of a data-parallel job described by
//! the launcher's variables (torchrun's, Open MPI's, Slurm's). Joining it checks that every rank
//! runs the same configuration and agrees on the run's name.

use std::path::PathBuf;

use anyhow::Context;
use stoke_comm::{Backend, CommConfig, CommunicatorExt, DistEnv};
use stoke_train::DataParallel;

use super::folder::locate_run;
use super::source::ConfigSource;
use crate::config::StokeConfig;
use crate::exit::UsageError;

/// This process's place in its job.
pub struct Job {
    env: DistEnv,
    dist: Option<DataParallel>,
}

impl Job {
    /// Reads the launcher's variables (the only place that does; none is one process, as before)
    /// and, in a job of more than one rank, connects to the others, checks that all run the same
    /// configuration and adds the run name they agreed on (`run.name`, rank 0's) to `source`.
    pub fn join(source: &mut ConfigSource, resume: bool) -> anyhow::Result<Job> {
        let vars: std::collections::HashMap<String, String> = std::env::vars().collect();
        let env = DistEnv::from_vars(&vars).context("reading the launcher's rank and world variables")?;
        let dist = if env.world_size > 1 {
            let config = source.load()?;
            let mut dist = connect(&config, &env)?;
            check_agreement(&dist, &config)?;
            // Every rank must train in the same run folder: rank 0 names it.
            let name = agree_run_name(&mut dist, source, resume)?;
            source.push(format!("run.name={}", toml::Value::String(name)));
            Some(dist)
        } else {
            None
        };
        Ok(Job { env, dist })
    }

    /// Whether this process writes the run folder: rank 0, or the only process.
    pub fn is_writer(&self) -> bool {
        self.dist.as_ref().is_none_or(|d| d.rank() == 0)
    }

    /// This process's rank among those on its machine.
    pub fn local_rank(&self) -> usize {
        self.env.local_rank
    }

    /// Ranks of this job in all, and on this machine.
    pub fn world_sizes(&self) -> (usize, usize) {
        (self.env.world_size.max(1), self.env.local_world_size.max(1))
    }

    /// The data-parallel group, in a job of more than one rank.
    pub fn dist_mut(&mut self) -> Option<&mut DataParallel> {
        self.dist.as_mut()
    }
}

/// Joins the data-parallel job described by `env` with the `[dist]` settings of `config`, and
/// gives this rank's libtorch `threads_per_worker` threads unless `train.threads` is set.
fn connect(config: &StokeConfig, env: &DistEnv) -> anyhow::Result<DataParallel> {
    let dist = &config.dist;
    let comm_config = CommConfig {
        backend: Backend::parse(&dist.backend).map_err(crate::exit::comm_backend_error)?,
        timeout_s: dist.timeout_s,
        shm_dir: PathBuf::from(&dist.shm_dir),
        ..CommConfig::default()
    };
    if config.train.threads == 0 {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        tch::set_num_threads(stoke_comm::threads_per_worker(cores, env.local_world_size) as i32);
    }
    let comm = stoke_comm::connect(&comm_config, env)
        .with_context(|| format!("rank {} of {} cannot join the {} job", env.rank, env.world_size, dist.backend))?;
    let mut data_parallel = DataParallel::new(comm, dist.data_parallel());
    data_parallel.split_groups(dist.tensor, dist.pipeline).map_err(crate::exit::train_error)?;
    Ok(data_parallel)
}

/// The start-up check: every rank must run the same model and configuration (but for per-rank
/// keys); a mismatch fails every rank with exit code 2, naming the ranks and keys that differ.
fn check_agreement(dist: &DataParallel, config: &StokeConfig) -> anyhow::Result<()> {
    dist.check_agreement(&config.agreement_entries()).map_err(crate::exit::train_error)
}

/// The port of this process's `/metrics`: `prof.prometheus_port` + its local rank, so that the
/// ranks on one machine serve side by side (0 stays 0: each picks a free port).
pub fn metrics_port(base: u16, local_rank: usize) -> anyhow::Result<u16> {
    if base == 0 {
        return Ok(0);
    }
    u16::try_from(base as usize + local_rank).map_err(|_| {
        anyhow::Error::new(UsageError(format!(
            "prof.prometheus_port {base} + local rank {local_rank} is past the last port (65535); choose a lower prof.prometheus_port"
        )))
    })
}

/// The run name all ranks use: rank 0's (made up there when run.name is empty), broadcast.
fn agree_run_name(dist: &mut DataParallel, source: &ConfigSource, resume: bool) -> anyhow::Result<String> {
    const MAX: usize = 1024;
    let mut buf = vec![0u8; MAX + 2];
    if dist.rank() == 0 {
        let mut config = source.load()?;
        if config.run.name.is_empty() {
            locate_run(&mut config, resume)?;
        }
        let name = config.run.name.as_bytes();
        anyhow::ensure!(name.len() <= MAX, "run.name is longer than {MAX} bytes");
        buf[..2].copy_from_slice(&(name.len() as u16).to_le_bytes());
        buf[2..2 + name.len()].copy_from_slice(name);
    }
    dist.communicator()
        .broadcast(&mut buf, 0)
        .with_context(|| format!("rank {}: broadcast of run.name", dist.rank()))?;
    let len = (u16::from_le_bytes([buf[0], buf[1]]) as usize).min(MAX);
    Ok(String::from_utf8_lossy(&buf[2..2 + len]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::metrics_port;

    #[test]
    fn each_local_rank_serves_metrics_on_the_next_port() {
        for (base, local_rank, expected) in
            [(9477, 0, Some(9477)), (9477, 3, Some(9480)), (0, 2, Some(0)), (65535, 0, Some(65535)), (65535, 1, None)]
        {
            let got = metrics_port(base, local_rank);
            assert_eq!(got.as_ref().ok().copied(), expected, "{base} + {local_rank}: {got:?}");
        }
        let err = metrics_port(65000, 600).unwrap_err().to_string();
        assert!(err.contains("prof.prometheus_port 65000") && err.contains("local rank 600"), "{err}");
    }
}
