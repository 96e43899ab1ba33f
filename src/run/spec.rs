//! `RunSpec`: one run to train, as every subcommand that trains describes it (`train`, `doctor`,
//! `bench gate`), and how its folder and configuration are prepared.

use std::path::PathBuf;

use stoke_train::Observer;

use super::folder::{prepare_run_dir, RunLock};
use super::heartbeat::Heartbeat;
use super::job::{metrics_port, Job};
use super::memory::{check_memory, MemoryCheck};
use super::resume::{prepare_resume, Resume};
use super::source::ConfigSource;
use crate::config::StokeConfig;
use crate::profiler::Overhead;

/// How a run starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// In a new folder, which must hold no checkpoint.
    Fresh,
    /// From the run's newest checkpoint; with `fallback`, from the newest one that passes its
    /// checks when the latest does not.
    Resume { fallback: bool },
}

/// One run to train: its resolved configuration, its folder, the checkpoint it continues from,
/// and who watches it besides the metrics file and the profiler.
pub struct RunSpec<'a> {
    pub config: StokeConfig,
    /// `<run.dir>/<run.name>`, created with the resolved `config.toml` by the rank that writes it.
    pub run_dir: PathBuf,
    /// The checkpoint to continue from, loaded and verified; none for a fresh run.
    pub resume: Option<Resume>,
    /// Draw the progress bar (default: no).
    pub progress: bool,
    /// Also measure the profiler's own cost: it observes alternate blocks of this many steps
    /// (`OverheadProbe`; default: none).
    pub overhead_block: Option<u64>,
    /// One more observer beside the usual ones (default: none).
    pub extra: Option<&'a mut dyn Observer>,
    /// The run folder's lock, held until the run ends (by the process that writes the folder).
    pub lock: Option<RunLock>,
    /// This process's rank among the ranks on its machine, and their number: `run.device = "cuda"`
    /// is `cuda:LOCAL_RANK` (default: 0 of 1).
    pub local: (usize, usize),
}

/// What a run ended with.
pub struct RunOutcome {
    pub summary: stoke_train::Summary,
    /// The step report, on the rank that writes the run folder when the profiler saw a step.
    pub report: Option<stoke_prof::RunReport>,
    /// The profiler's own cost, with `RunSpec::overhead_block`.
    pub overhead: Option<Overhead>,
}

impl RunOutcome {
    /// Prints the step report, when there is one.
    pub fn print_report(&self) {
        if let Some(report) = &self.report {
            println!("\n{}", report.render_text());
        }
    }
}

impl<'a> RunSpec<'a> {
    /// A fresh run of `config` in a new folder: names it (`run.name`, made up when empty), refuses
    /// a folder that holds checkpoints, and writes the resolved config there. A step estimated
    /// beyond this machine's memory is refused first.
    pub fn fresh(mut config: StokeConfig) -> anyhow::Result<RunSpec<'a>> {
        check_memory(&config, 1, 1)?;
        let (run_dir, lock) = prepare_run_dir(&mut config)?;
        Ok(RunSpec::new(config, None, run_dir, Some(lock)))
    }

    /// The command line's run on this process of `job`: fresh or resumed, its folder prepared by
    /// the rank that writes it (and named to the launcher), its `/metrics` port offset by the
    /// local rank. With `MemoryCheck::Enforce`, a step estimated beyond this machine's memory is
    /// refused before the folder is made.
    pub fn for_job(source: &ConfigSource, job: &Job, start: Start, memory: MemoryCheck) -> anyhow::Result<RunSpec<'a>> {
        let writer = job.is_writer();
        let (world_size, local_ranks) = job.world_sizes();
        let (mut config, run_dir, resume, lock) = match start {
            Start::Resume { fallback } => {
                let (config, run_dir, loaded, lock) = prepare_resume(source, fallback, writer)?;
                if memory == MemoryCheck::Enforce {
                    check_memory(&config, world_size, local_ranks)?;
                }
                (config, run_dir, Some(loaded), lock)
            }
            Start::Fresh => {
                let mut config = source.load()?;
                if memory == MemoryCheck::Enforce {
                    check_memory(&config, world_size, local_ranks)?;
                }
                let (run_dir, lock) = if writer {
                    let (run_dir, lock) = prepare_run_dir(&mut config)?;
                    (run_dir, Some(lock))
                } else {
                    (PathBuf::from(&config.run.dir).join(&config.run.name), None)
                };
                (config, run_dir, None, lock)
            }
        };
        if writer {
            Heartbeat::name_run(&run_dir)?;
        }
        config.prof.prometheus_port = metrics_port(config.prof.prometheus_port, job.local_rank())?;
        let mut spec = RunSpec::new(config, resume, run_dir, lock);
        spec.local = (job.local_rank(), local_ranks);
        Ok(spec)
    }

    fn new(config: StokeConfig, resume: Option<Resume>, run_dir: PathBuf, lock: Option<RunLock>) -> RunSpec<'a> {
        RunSpec { config, run_dir, resume, progress: false, overhead_block: None, extra: None, lock, local: (0, 1) }
    }
}
