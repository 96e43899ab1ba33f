//! The run folder, `<run.dir>/<run.name>/`: naming a run, finding the most recent one, and the
//! rule that a fresh run must not find checkpoints there while a resume must.

use std::path::{Path, PathBuf};

use anyhow::Context;
use stoke_ckpt::CheckpointStore;

use crate::config::StokeConfig;
use crate::exit::UsageError;

/// Picks a fresh run's name and folder, locks it, and writes the resolved config there.
pub fn prepare_run_dir(config: &mut StokeConfig) -> anyhow::Result<(PathBuf, RunLock)> {
    let run_dir = locate_run(config, false)?;
    std::fs::create_dir_all(&run_dir).with_context(|| format!("cannot create run folder {}", run_dir.display()))?;
    let lock = RunLock::acquire(&run_dir)?;
    // A run that took the lock between our look for checkpoints and the lock may have written one.
    locate_run(config, false)?;
    write_config(config, &run_dir)?;
    Ok((run_dir, lock))
}

/// The file whose lock marks a run folder as in use.
const LOCK_FILE: &str = ".lock";

/// An advisory lock (`flock`) on a run folder, held by the process that writes it for the life of
/// the run: a second `stoke train` of the same `run.name`, or a second `--resume` of a live run,
/// is refused naming the holder's PID. The kernel releases it when the process ends however it
/// ends, so a killed run never leaves its folder locked.
#[derive(Debug)]
pub struct RunLock {
    // Held open: closing it releases the lock.
    _file: std::fs::File,
}

impl RunLock {
    pub fn acquire(run_dir: &Path) -> anyhow::Result<RunLock> {
        use std::io::{Read, Seek, Write};
        use std::os::fd::AsRawFd;
        let path = run_dir.join(LOCK_FILE);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("cannot open the run's lock file {}", path.display()))?;
        // SAFETY: flock on a descriptor this function owns; it neither reads nor writes memory.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(anyhow::Error::new(err).context(format!("cannot lock {}", path.display())));
            }
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let holder = if holder.is_empty() { "another process".to_string() } else { format!("process {holder}") };
            return Err(UsageError(format!(
                "run folder {} is in use by {holder} (a run or resume of it is live); wait for it to end, \
                 stop it, or choose another run.name",
                run_dir.display()
            ))
            .into());
        }
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| writeln!(file, "{}", std::process::id()))
            .with_context(|| format!("cannot write the run's lock file {}", path.display()))?;
        Ok(RunLock { _file: file })
    }
}

/// Writes the resolved config into the run folder as `config.toml`.
pub fn write_config(config: &StokeConfig, run_dir: &Path) -> anyhow::Result<()> {
    let config_path = run_dir.join("config.toml");
    std::fs::write(&config_path, config.to_toml()).with_context(|| format!("cannot write {}", config_path.display()))
}

/// The run's folder: named by run.name (made up for a fresh run, the most recent run with a
/// checkpoint for a resume); a fresh run must not find checkpoints there, a resume must.
pub fn locate_run(config: &mut StokeConfig, resume: bool) -> anyhow::Result<PathBuf> {
    let runs = PathBuf::from(&config.run.dir);
    if config.run.name.is_empty() {
        config.run.name = if resume {
            most_recent_run(&runs)?.ok_or_else(|| {
                UsageError(format!(
                    "--resume: no run with a checkpoint in {}; name one with --set run.name=NAME",
                    runs.display()
                ))
            })?
        } else {
            format!("{}-{}", config.model.preset, timestamp())
        };
    }
    let run_dir = runs.join(&config.run.name);
    let store = CheckpointStore::new(run_dir.join("checkpoints"));
    // Damaged checkpoints count: a resume must name them, a fresh run must not write beside them.
    let latest = store.all_steps()?.last().copied();
    match (resume, latest) {
        (true, None) if config.ckpt.mirror.is_empty() => {
            return Err(UsageError(format!("--resume: run {} has no checkpoint to resume from", run_dir.display())).into())
        }
        (false, Some(step)) => {
            return Err(UsageError(format!(
                "run {} already has checkpoints (latest step {step}); pass --resume to continue it, or choose another run.name",
                run_dir.display()
            ))
            .into())
        }
        _ => {}
    }
    Ok(run_dir)
}

/// Keys a resume may change: they leave the sequence of losses as it was. `train.steps` extends
/// or shortens the run (the schedule's horizon is kept unless `train.lr_horizon` is set too), as
/// early stopping's settings may; `train.debug_poison_step` may be cleared to continue past it;
/// run placement, logging, profiling, checkpointing, loader threads and the cache are not part

fn most_recent_run(runs: &Path) -> anyhow::Result<Option<String>> {
    let Ok(entries) = std::fs::read_dir(runs) else { return Ok(None) };
    let mut best: Option<(std::time::SystemTime, String)> = None;
    for entry in entries.flatten() {
        // Only folders are runs (a stray file is not).
        if !entry.file_type().is_ok_and(|kind| kind.is_dir()) {
            continue;
        }
        let store = CheckpointStore::new(entry.path().join("checkpoints"));
        let Some(&step) = store.all_steps()?.last() else { continue };
        let manifest = store.step_dir(step).join(stoke_ckpt::MANIFEST);
        let modified = std::fs::metadata(&manifest).and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH);
        if best.as_ref().is_none_or(|(t, _)| modified > *t) {
            best = Some((modified, entry.file_name().to_string_lossy().into_owned()));
        }
    }
    Ok(best.map(|(_, name)| name))
}

/// `YYYYmmdd-HHMMSS` in UTC, from the civil-from-days algorithm (Howard Hinnant).
pub fn timestamp() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The step of the newest committed checkpoint in `run_dir`, if any (an unreadable folder counts
/// as none).
pub fn latest_checkpoint(run_dir: &Path) -> Option<u64> {
    CheckpointStore::new(run_dir.join("checkpoints")).latest().ok().flatten()
}
