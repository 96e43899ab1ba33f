//! The worker side of `stoke launch`: rank 0 names the run folder for the launcher, and every
//! rank touches its heartbeat file after each step. Outside `stoke launch` it does nothing.

use std::path::{Path, PathBuf};

use anyhow::Context;
use stoke_train::{Observer, ObserverError, TrainEvent};

/// The launcher's folder for a job, handed to every worker: rank 0 writes `run-dir` there (the
/// run folder, so a restart resumes that run) and every rank touches `heartbeat-<rank>`.
pub const LAUNCH_DIR_VAR: &str = "STOKE_LAUNCH_DIR";

/// The heartbeat file of worker `rank` in the launcher's folder.
pub fn heartbeat_path(launch_dir: &Path, rank: usize) -> PathBuf {
    launch_dir.join(format!("heartbeat-{rank}"))
}

/// The run folder rank 0 wrote into the launcher's folder, if it did.
pub fn read_run_dir(launch_dir: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(launch_dir.join("run-dir")).ok()?;
    let path = PathBuf::from(text.trim());
    path.is_dir().then_some(path)
}

/// Worker side of an elastic job: rank 0 names the run folder for the launcher, and every rank
/// touches its heartbeat file after each step. Does nothing outside `stoke launch`.
pub struct Heartbeat {
    path: Option<PathBuf>,
}

impl Heartbeat {
    pub fn from_env(rank: usize) -> Heartbeat {
        let dir = std::env::var_os(LAUNCH_DIR_VAR).map(PathBuf::from);
        Heartbeat { path: dir.map(|d| heartbeat_path(&d, rank)) }
    }

    /// Rank 0: tells the launcher which run folder a restart resumes.
    pub fn name_run(run_dir: &Path) -> anyhow::Result<()> {
        let Some(dir) = std::env::var_os(LAUNCH_DIR_VAR).map(PathBuf::from) else { return Ok(()) };
        let run_dir = std::fs::canonicalize(run_dir).unwrap_or_else(|_| run_dir.to_path_buf());
        let path = dir.join("run-dir");
        std::fs::write(&path, run_dir.display().to_string()).with_context(|| format!("cannot write {}", path.display()))
    }
}

impl Observer for Heartbeat {
    fn on_event(&mut self, event: &TrainEvent<'_>) -> Result<(), ObserverError> {
        if let (Some(path), TrainEvent::Step(record)) = (&self.path, event) {
            std::fs::write(path, record.step.to_string())?;
        }
        Ok(())
    }
}
