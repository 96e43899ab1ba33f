//! `stoke launch --nproc N -- train ARGS`: starts N workers on this machine with torchrun's
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

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use clap::Args;
use stoke_train::{Observer, ObserverError, TrainEvent};

use super::UsageError;
use crate::signals::EXIT_PREEMPTED;

/// The launcher's folder for a job, handed to every worker: rank 0 writes `run-dir` there (the
/// run folder, so a restart resumes that run) and every rank touches `heartbeat-<rank>`.
pub const LAUNCH_DIR_VAR: &str = "STOKE_LAUNCH_DIR";

#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Worker processes to start on this machine: N, or MIN:MAX for an elastic job that goes on
    /// with fewer workers (down to MIN) when slots are lost and grows back when they return.
    #[arg(long, default_value = "1")]
    pub nproc: String,
    /// Restarts after a failed or hung worker before the job gives up (exit code of the last
    /// failure). Each one resumes from the run's latest committed checkpoint.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: u32,
    /// A shell command that says whether slot STOKE_SLOT (0..MAX) can run a worker: exit 0 for
    /// yes. Checked before every start and, while fewer than MAX workers run, every
    /// `--slot-poll-s`. Without it every slot is available.
    #[arg(long, value_name = "COMMAND")]
    pub slot_check: Option<String>,
    /// Seconds between checks of the missing slots while the job runs short of MAX.
    #[arg(long, default_value_t = 2.0)]
    pub slot_poll_s: f64,
    /// Seconds to wait for MIN slots before a (re)start gives up.
    #[arg(long, default_value_t = 60.0)]
    pub slot_wait_s: f64,
    /// Seconds a worker may go without a heartbeat (one per finished step; the first one counted
    /// from its start) before the job counts it hung.
    #[arg(long, default_value_t = 300.0)]
    pub hang_timeout_s: f64,
    /// A file listing CPUs (`2,3`), read at every (re)start: worker RANK runs pinned to the
    /// RANK-th CPU of the list (`sched_setaffinity` before it starts; ranks past the list's end are
    /// not pinned). `stoke sched serve` writes the cores of the job's slots there.
    #[arg(long, value_name = "FILE")]
    pub cpus_file: Option<PathBuf>,
    /// Port of the rendezvous store on 127.0.0.1 (default: a free port, a new one per start).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Run this program instead of this `stoke` binary (for scripts that start their own
    /// workers, like torchrun's `--no-python`).
    #[arg(long)]
    pub program: Option<PathBuf>,
    /// Seconds the other workers get to exit after one failed before they are killed.
    #[arg(long, default_value_t = 10.0)]
    pub grace_s: f64,
    /// The command each worker runs, after `--` (for example `-- train --config run.toml`).
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// `--nproc`: N or MIN:MAX.
fn parse_nproc(text: &str) -> Result<(usize, usize), UsageError> {
    let bad = || UsageError(format!("--nproc takes N or MIN:MAX with 1 <= MIN <= MAX, got `{text}`"));
    let (min, max) = match text.split_once(':') {
        Some((min, max)) => (min.trim().parse().map_err(|_| bad())?, max.trim().parse().map_err(|_| bad())?),
        None => {
            let n = text.trim().parse().map_err(|_| bad())?;
            (n, n)
        }
    };
    if min == 0 || min > max {
        return Err(bad());
    }
    Ok((min, max))
}

/// How one start of the workers ended.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// Every worker exited 0.
    Finished,
    /// Every worker stopped as preempted (exit 75) after a stop signal to the launcher.
    Preempted,
    /// The launcher stopped the workers (exit 75) to start again on `to` workers: more when slots
    /// came back, fewer when slots were taken away.
    Resize { to: usize },
    /// A worker failed, was killed or hung: the exit code to report and why.
    Failed { code: u8, cause: String },
}

pub fn run(args: LaunchArgs) -> anyhow::Result<ExitCode> {
    let (min, max) = parse_nproc(&args.nproc)?;
    let program = match &args.program {
        Some(program) => program.clone(),
        None => std::env::current_exe().context("cannot locate the stoke binary to start workers")?,
    };
    let stop = crate::signals::install();
    let launch_dir = std::env::temp_dir().join(format!("stoke-launch-{}", std::process::id()));
    std::fs::create_dir_all(&launch_dir).with_context(|| format!("cannot create {}", launch_dir.display()))?;
    let result = (|| {
        let mut restarts = 0u32;
        let mut command = args.command.clone();
        let mut cause = "start".to_string();
        loop {
            let slots = wait_for_slots(&args, min, max, stop)?;
            let world = slots.len();
            let port = match args.master_port {
                Some(port) => port,
                None => free_port()?,
            };
            let run_dir = read_run_dir(&launch_dir);
            if let Some(run_dir) = &run_dir {
                event(run_dir, "start", &cause, world, restarts);
            }
            let outcome = run_workers(&args, &program, &command, &slots, port, &launch_dir, (min, max), stop)?;
            // Rank 0 names the run folder once it has one; a restart resumes that run.
            let run_dir = read_run_dir(&launch_dir);
            let log = |kind: &str, cause: &str| {
                if let Some(run_dir) = &run_dir {
                    event(run_dir, kind, cause, world, restarts);
                }
            };
            cause = match outcome {
                Outcome::Finished => {
                    log("finish", "every worker finished");
                    return Ok(0);
                }
                Outcome::Preempted => {
                    log("preempted", "the launcher was asked to stop; the run stopped with a checkpoint");
                    return Ok(EXIT_PREEMPTED);
                }
                Outcome::Resize { to } => {
                    let cause = if to > world {
                        format!("slots are back: growing from {world} to {to} workers")
                    } else {
                        format!("slots were taken: shrinking from {world} to {to} workers")
                    };
                    eprintln!("[launch] {cause}");
                    cause
                }
                Outcome::Failed { code, cause } => {
                    if restarts >= args.max_restarts {
                        log("give_up", &format!("{cause}; {restarts} of {} restarts used", args.max_restarts));
                        return Ok(code);
                    }
                    restarts += 1;
                    eprintln!(
                        "[launch] {cause}; restarting from the latest checkpoint (restart {restarts} of {})",
                        args.max_restarts
                    );
                    cause
                }
            };
            command = restart_command(&args.command, run_dir.as_deref());
        }
    })();
    let _ = std::fs::remove_dir_all(&launch_dir);
    result.map(ExitCode::from)
}

/// The worker command of a restart: the original one resuming its run (by folder), when rank 0
/// named it; a job that failed before that starts afresh.
fn restart_command(original: &[String], run_dir: Option<&Path>) -> Vec<String> {
    let mut command = original.to_vec();
    let Some(run_dir) = run_dir else { return command };
    if command.first().map(String::as_str) != Some("train") {
        return command;
    }
    let has_checkpoint =
        stoke_ckpt::CheckpointStore::new(run_dir.join("checkpoints")).latest().ok().flatten().is_some();
    let name = run_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let dir = run_dir.parent().map(|p| p.display().to_string()).unwrap_or_default();
    if has_checkpoint && !command.iter().any(|a| a == "--resume") {
        command.insert(1, "--resume".into());
    }
    for (key, value) in [("run.dir", dir), ("run.name", name)] {
        command.push("--set".into());
        command.push(format!("{key}={}", toml::Value::String(value)));
    }
    command
}

/// The slots that may run a worker now, at most `max` of them; waits up to `--slot-wait-s` for
/// `min`.
fn wait_for_slots(
    args: &LaunchArgs,
    min: usize,
    max: usize,
    stop: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<Vec<usize>> {
    let deadline = Instant::now() + Duration::from_secs_f64(args.slot_wait_s.max(0.0));
    loop {
        let slots = available_slots(args, max);
        if slots.len() >= min {
            return Ok(slots);
        }
        if Instant::now() >= deadline || stop.load(std::sync::atomic::Ordering::Relaxed) {
            anyhow::bail!(
                "only {} of the {max} slots are available ({:?}; --slot-check `{}`), fewer than the {min} the job needs, \
                 after waiting {} s",
                slots.len(),
                slots,
                args.slot_check.as_deref().unwrap_or(""),
                args.slot_wait_s
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn available_slots(args: &LaunchArgs, max: usize) -> Vec<usize> {
    let Some(check) = &args.slot_check else { return (0..max).collect() };
    (0..max)
        .filter(|slot| {
            Command::new("sh")
                .args(["-c", check])
                .env("STOKE_SLOT", slot.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .collect()
}

/// Starts one worker per slot and supervises them until they all end (see `Outcome`).
#[allow(clippy::too_many_arguments)] // one start of the job: its settings, and where it runs
fn run_workers(
    args: &LaunchArgs,
    program: &Path,
    command: &[String],
    slots: &[usize],
    port: u16,
    launch_dir: &Path,
    (min, max): (usize, usize),
    stop: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<Outcome> {
    let world = slots.len();
    let mut children: Vec<Option<Child>> = Vec::with_capacity(world);
    let mut pumps = Vec::new();
    for rank in 0..world {
        let _ = std::fs::remove_file(heartbeat_path(launch_dir, rank));
    }
    let cpus = match &args.cpus_file {
        Some(path) => read_cpus(path)?,
        None => Vec::new(),
    };
    for (rank, slot) in slots.iter().enumerate() {
        let mut cmd = Command::new(program);
        if let Some(&cpu) = cpus.get(rank) {
            pin_to(&mut cmd, cpu);
        }
        cmd.args(command)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("STOKE_SLOT", slot.to_string())
            .env(LAUNCH_DIR_VAR, launch_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(err) => {
                stop_all(&mut children, Duration::ZERO);
                let pinned = cpus.get(rank).map_or(String::new(), |cpu| format!(" pinned to CPU {cpu}"));
                return Err(err).with_context(|| format!("cannot start worker {rank}{pinned}: {}", program.display()));
            }
        };
        let out = child.stdout.take().expect("stdout is piped");
        let err = child.stderr.take().expect("stderr is piped");
        pumps.push(std::thread::spawn(move || pump(out, rank, false)));
        pumps.push(std::thread::spawn(move || pump(err, rank, true)));
        children.push(Some(child));
    }
    let watch = Watch {
        grace: Duration::from_secs_f64(args.grace_s.max(0.0)),
        hang_timeout: Duration::from_secs_f64(args.hang_timeout_s.max(0.0)),
        slot_poll: Duration::from_secs_f64(args.slot_poll_s.max(0.1)),
        launch_dir,
        stop,
        resize: args.slot_check.is_some().then_some((args, min, max)),
    };
    let outcome = supervise(&mut children, &watch);
    for pump in pumps {
        let _ = pump.join();
    }
    Ok(outcome)
}

/// The CPUs listed in `path` (numbers separated by commas, spaces or lines).
fn read_cpus(path: &Path) -> anyhow::Result<Vec<usize>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read --cpus-file {}", path.display()))?;
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .ok()
                .filter(|&cpu| cpu < libc::CPU_SETSIZE as usize)
                .with_context(|| format!("--cpus-file {}: `{s}` is not a CPU number", path.display()))
        })
        .collect()
}

/// Makes the worker `cmd` starts run on `cpu` only, from before its first instruction (so every
/// thread it creates inherits the mask).
fn pin_to(cmd: &mut Command, cpu: usize) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and only calls sched_setaffinity(2),
    // which is async-signal-safe, on a mask built on its own stack; no allocation, no lock.
    unsafe {
        cmd.pre_exec(move || {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// What `supervise` watches besides exit codes.
struct Watch<'a> {
    grace: Duration,
    hang_timeout: Duration,
    slot_poll: Duration,
    launch_dir: &'a Path,
    stop: &'a std::sync::atomic::AtomicBool,
    /// With `--slot-check`: the settings to check the slots with, MIN and MAX.
    resize: Option<(&'a LaunchArgs, usize, usize)>,
}

/// Waits for all workers. The first failure (a non-zero exit that the launcher did not ask for,
/// or a worker without a heartbeat for `hang_timeout`) stops the rest. A stop signal to the
/// launcher, or slots coming back, stops the workers through their preemption path (SIGTERM:
/// every rank stops after the same step with a checkpoint and exits 75).
fn supervise(children: &mut [Option<Child>], watch: &Watch<'_>) -> Outcome {
    let started = Instant::now();
    let mut failure: Option<Outcome> = None;
    // Why the launcher asked the workers to stop, once it has.
    let mut asked: Option<Outcome> = None;
    let mut preempted = 0;
    let mut next_slot_check = Instant::now() + watch.slot_poll;
    loop {
        let mut running = 0;
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(Some(status)) => {
                    *slot = None;
                    let code = exit_code(status);
                    if asked.is_some() && code == EXIT_PREEMPTED {
                        preempted += 1;
                    } else if code != 0 && failure.is_none() {
                        eprintln!("[launch] worker {rank} failed ({status}); stopping the others");
                        let cause = format!("worker {rank} failed ({status})");
                        failure = Some(Outcome::Failed { code, cause });
                    }
                }
                Ok(None) => running += 1,
                Err(err) => {
                    eprintln!("[launch] cannot wait for worker {rank}: {err}");
                    failure.get_or_insert(Outcome::Failed {
                        code: 1,
                        cause: format!("cannot wait for worker {rank}: {err}"),
                    });
                    *slot = None;
                }
            }
        }
        if failure.is_none() && running > 0 {
            if let Some(rank) = hung_worker(children, watch.launch_dir, started, watch.hang_timeout) {
                let cause =
                    format!("worker {rank} sent no heartbeat for {:.0} s (hung)", watch.hang_timeout.as_secs_f64());
                eprintln!("[launch] {cause}; stopping all workers");
                failure = Some(Outcome::Failed { code: 1, cause });
            }
        }
        if let Some(failure) = failure {
            stop_all(children, watch.grace);
            return failure;
        }
        if running == 0 {
            return match asked {
                Some(reason) if preempted == children.len() => reason,
                Some(reason) if preempted > 0 => reason,
                _ => Outcome::Finished,
            };
        }
        if asked.is_none() {
            if watch.stop.load(std::sync::atomic::Ordering::Relaxed) {
                asked = Some(Outcome::Preempted);
            } else if let Some((args, min, max)) = watch.resize.filter(|_| Instant::now() >= next_slot_check) {
                next_slot_check = Instant::now() + watch.slot_poll;
                // More slots: grow. Fewer, but still MIN: shrink before the workers on the taken
                // slots are lost. Fewer than MIN: keep going; a failure restarts as usual.
                let available = available_slots(args, max).len();
                if available != children.len() && available >= min {
                    asked = Some(Outcome::Resize { to: available });
                }
            }
            if asked.is_some() {
                for child in children.iter().flatten() {
                    // SAFETY: the pid of a child we started and have not reaped yet.
                    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A running worker whose last heartbeat (or, before its first, its start) is older than
/// `timeout`.
fn hung_worker(children: &[Option<Child>], launch_dir: &Path, started: Instant, timeout: Duration) -> Option<usize> {
    if timeout.is_zero() {
        return None;
    }
    let now = SystemTime::now();
    let started_ago = started.elapsed();
    children.iter().enumerate().filter(|(_, c)| c.is_some()).find_map(|(rank, _)| {
        let quiet = std::fs::metadata(heartbeat_path(launch_dir, rank))
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| now.duration_since(t).ok())
            .map_or(started_ago, |ago| ago.min(started_ago));
        (quiet > timeout).then_some(rank)
    })
}

fn heartbeat_path(launch_dir: &Path, rank: usize) -> PathBuf {
    launch_dir.join(format!("heartbeat-{rank}"))
}

/// The run folder rank 0 wrote into the launcher's folder, if it did.
fn read_run_dir(launch_dir: &Path) -> Option<PathBuf> {
    let text = std::fs::read_to_string(launch_dir.join("run-dir")).ok()?;
    let path = PathBuf::from(text.trim());
    path.is_dir().then_some(path)
}

/// One line of the run's `events.jsonl`.
fn event(run_dir: &Path, kind: &str, cause: &str, world_size: usize, restarts: u32) {
    let time = SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    let latest = stoke_ckpt::CheckpointStore::new(run_dir.join("checkpoints")).latest().ok().flatten();
    let line = serde_json::json!({
        "time": time,
        "event": kind,
        "cause": cause,
        "world_size": world_size,
        "restarts": restarts,
        "latest_checkpoint": latest,
    });
    let path = run_dir.join("events.jsonl");
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
    if let Err(e) = written {
        eprintln!("[launch] cannot append to {}: {e}", path.display());
    }
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

/// SIGTERM to every live worker, SIGKILL to those still alive after `grace`; reaps them all.
fn stop_all(children: &mut [Option<Child>], grace: Duration) {
    for child in children.iter().flatten() {
        // SAFETY: the pid of a child we started and have not reaped yet.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    }
    let deadline = Instant::now() + grace;
    for slot in children.iter_mut() {
        let Some(child) = slot else { continue };
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        *slot = None;
    }
}

fn exit_code(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code).unwrap_or(1),
        (None, Some(signal)) => 128u8.saturating_add(signal as u8),
        (None, None) => 1,
    }
}

/// Copies a worker's output to ours line by line, each line prefixed with `[rank R] `.
fn pump(stream: impl std::io::Read, rank: usize, to_stderr: bool) {
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                if !line.ends_with(b"\n") {
                    line.push(b'\n');
                }
                let mut text = format!("[rank {rank}] ").into_bytes();
                text.extend_from_slice(&line);
                // One write per line, so lines of different workers never interleave mid-line.
                let _ = if to_stderr {
                    std::io::stderr().lock().write_all(&text)
                } else {
                    std::io::stdout().lock().write_all(&text)
                };
            }
        }
    }
}

fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("cannot find a free port for MASTER_PORT")?;
    Ok(listener.local_addr()?.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nproc_takes_a_count_or_a_range() {
        assert_eq!(parse_nproc("3").unwrap(), (3, 3));
        assert_eq!(parse_nproc("1:4").unwrap(), (1, 4));
        for bad in ["0", "3:2", "0:2", "a", "1:", ""] {
            assert!(parse_nproc(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_restart_resumes_the_named_run_once() {
        let dir = std::env::temp_dir().join(format!("stoke-launch-test-{}", std::process::id()));
        let run = dir.join("runs").join("job");
        std::fs::create_dir_all(&run).unwrap();
        let original: Vec<String> = ["train", "--quiet", "--set", "train.steps=9"].map(String::from).to_vec();
        // No checkpoint yet: a fresh start of the same run folder.
        let fresh = restart_command(&original, Some(&run));
        assert!(!fresh.contains(&"--resume".to_string()), "{fresh:?}");
        assert!(fresh.ends_with(&["--set".into(), "run.name=\"job\"".into()]), "{fresh:?}");
        // Not a train command: as it was.
        let other: Vec<String> = vec!["config".into()];
        assert_eq!(restart_command(&other, Some(&run)), other);
        assert_eq!(restart_command(&original, None), original);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
