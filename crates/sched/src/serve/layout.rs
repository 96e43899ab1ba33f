//! Where a job's files live under the server's folder, and what the server reads back from a
//! job's run folder (`metrics.jsonl`, `events.jsonl`).

use std::path::{Path, PathBuf};

use crate::observe;
use crate::store::{JobRow, DB_FILE};

/// Seconds since the Unix epoch (the clock of the database and of the runs' events).
pub fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Where a job's run folder, log and allocation file live.
pub struct Layout {
    pub dir: PathBuf,
}

impl Layout {
    pub fn runs(&self) -> PathBuf {
        self.dir.join("runs")
    }
    pub fn run_dir(&self, job: &JobRow) -> PathBuf {
        self.runs().join(&job.job.name)
    }
    pub fn log(&self, job: &JobRow) -> PathBuf {
        self.dir.join("logs").join(format!("{}.log", job.job.name))
    }
    pub fn alloc_file(&self, id: i64) -> PathBuf {
        self.dir.join("alloc").join(id.to_string())
    }
    /// The value of a launcher's job tag (`<database>#<id>`).
    pub fn tag(&self, id: i64) -> String {
        format!("{}#{id}", self.dir.join(DB_FILE).display())
    }
}

/// The highest step in a run's `metrics.jsonl` (0 before any).
pub fn last_step(run_dir: &Path) -> u64 {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap_or_default();
    observe::parse_step_times(&text).last().map_or(0, |&(s, _)| s)
}

pub fn launch_events(run_dir: &Path) -> Vec<observe::LaunchEvent> {
    observe::parse_events(&std::fs::read_to_string(run_dir.join("events.jsonl")).unwrap_or_default())
}

/// The noise scale in a job's `metrics.jsonl`, if its run reported one.
pub fn noise_scale(run_dir: &Path) -> Option<f64> {
    observe::latest_noise_scale(&std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap_or_default())
}
