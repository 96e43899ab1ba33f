//! One start of the job: its workers, started with torchrun's variables and their output
//! prefixed by rank, watched until they all end (finished, failed, hung, or stopped to resize).

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;

use super::slots::{available_slots, pin_to, read_cpus};
use super::spec::Launch;
use crate::exit::EXIT_PREEMPTED;
use crate::run::{heartbeat_path, LAUNCH_DIR_VAR};

/// How one start of the workers ended.
#[derive(Debug, PartialEq)]
pub enum Outcome {
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

/// Starts one worker per slot and supervises them until they all end (see `Outcome`).
#[allow(clippy::too_many_arguments)] // one start of the job: its settings, and where it runs
pub fn run_workers(
    args: &Launch,
    program: &Path,
    command: &[String],
    slots: &[usize],
    port: u16,
    launch_dir: &Path,
    (min, max): (usize, usize),
    stop: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<Outcome> {
    let world = slots.len();
    // Over several nodes this node's workers are the ranks `first..first + world`.
    let nodes = &args.nodes;
    let first = nodes.rank * world;
    let (master_addr, _) = nodes.master.clone().unwrap_or(("127.0.0.1".into(), port));
    let mut children: Vec<Option<Child>> = Vec::with_capacity(world);
    let mut pumps = Vec::new();
    for local in 0..world {
        let _ = std::fs::remove_file(heartbeat_path(launch_dir, first + local));
    }
    let cpus = match &args.cpus_file {
        Some(path) => read_cpus(path)?,
        None => Vec::new(),
    };
    for (local, slot) in slots.iter().enumerate() {
        let rank = first + local;
        let mut cmd = Command::new(program);
        if let Some(&cpu) = cpus.get(local) {
            pin_to(&mut cmd, cpu);
        }
        cmd.args(command)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", (world * nodes.count).to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", world.to_string())
            .env("GROUP_RANK", nodes.rank.to_string())
            .env("MASTER_ADDR", &master_addr)
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
                let pinned = cpus.get(local).map_or(String::new(), |cpu| format!(" pinned to CPU {cpu}"));
                return Err(err).with_context(|| format!("cannot start worker {rank}{pinned}: {}", program.display()));
            }
        };
        let out = child.stdout.take().expect("stdout is piped");
        let err = child.stderr.take().expect("stderr is piped");
        pumps.push(std::thread::spawn(move || pump(out, rank, false)));
        pumps.push(std::thread::spawn(move || pump(err, rank, true)));
        children.push(Some(child));
    }
    let signal = |children: &[Option<Child>]| {
        for child in children.iter().flatten() {
            // SAFETY: the pid of a child we started and have not reaped yet.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        }
    };
    let watch = Watch {
        grace: Duration::from_secs_f64(args.grace_s.max(0.0)),
        hang_timeout: Duration::from_secs_f64(args.hang_timeout_s.max(0.0)),
        slot_poll: Duration::from_secs_f64(args.slot_poll_s.max(0.1)),
        launch_dir,
        stop,
        resize: args.slot_check.is_some().then_some((args, min, max)),
        world,
        first_rank: first,
        ask_to_stop: &signal,
        child_name: &|local| format!("worker {}", first + local),
    };
    let outcome = supervise(&mut children, &watch);
    for pump in pumps {
        let _ = pump.join();
    }
    Ok(outcome)
}

/// What `supervise` watches besides exit codes.
pub struct Watch<'a> {
    pub grace: Duration,
    pub hang_timeout: Duration,
    pub slot_poll: Duration,
    pub launch_dir: &'a Path,
    pub stop: &'a std::sync::atomic::AtomicBool,
    /// With `--slot-check`: the settings to check the slots with, MIN and MAX.
    pub resize: Option<(&'a Launch, usize, usize)>,
    /// The ranks the children run (one child per rank here; one srun for them all under Slurm).
    pub world: usize,
    /// The job's rank of the first of them (this node's first rank over several nodes).
    pub first_rank: usize,
    /// Asks the workers to stop through their preemption path (SIGTERM to each one here).
    pub ask_to_stop: &'a dyn Fn(&[Option<Child>]),
    /// How a message names child `k`.
    pub child_name: &'a dyn Fn(usize) -> String,
}

/// Waits for all workers. The first failure (a non-zero exit that the launcher did not ask for,
/// or a worker without a heartbeat for `hang_timeout`) stops the rest. A stop signal to the
/// launcher, or slots coming back, stops the workers through their preemption path (SIGTERM:
/// every rank stops after the same step with a checkpoint and exits 75).
pub fn supervise(children: &mut [Option<Child>], watch: &Watch<'_>) -> Outcome {
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
                        let cause = format!("{} failed ({status})", (watch.child_name)(rank));
                        eprintln!("[launch] {cause}; stopping the others");
                        failure = Some(Outcome::Failed { code, cause });
                    }
                }
                Ok(None) => running += 1,
                Err(err) => {
                    let cause = format!("cannot wait for {}: {err}", (watch.child_name)(rank));
                    eprintln!("[launch] {cause}");
                    failure.get_or_insert(Outcome::Failed { code: 1, cause });
                    *slot = None;
                }
            }
        }
        if failure.is_none() && running > 0 {
            // One child per rank: the ranks still running; one child for all: every rank.
            let ranks: Vec<usize> = if children.len() == watch.world {
                (0..children.len()).filter(|&r| children[r].is_some()).collect()
            } else {
                (0..watch.world).collect()
            };
            let ranks: Vec<usize> = ranks.iter().map(|r| watch.first_rank + r).collect();
            if let Some(rank) = hung_worker(&ranks, watch.launch_dir, started, watch.hang_timeout) {
                let cause =
                    format!("rank {rank} sent no heartbeat for {:.0} s (hung)", watch.hang_timeout.as_secs_f64());
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
                if available != watch.world && available >= min {
                    asked = Some(Outcome::Resize { to: available });
                }
            }
            if asked.is_some() {
                (watch.ask_to_stop)(children);
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A running worker whose last heartbeat (or, before its first, its start) is older than
/// `timeout`.
fn hung_worker(ranks: &[usize], launch_dir: &Path, started: Instant, timeout: Duration) -> Option<usize> {
    if timeout.is_zero() {
        return None;
    }
    let now = SystemTime::now();
    let started_ago = started.elapsed();
    ranks.iter().copied().find_map(|rank| {
        let quiet = std::fs::metadata(heartbeat_path(launch_dir, rank))
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| now.duration_since(t).ok())
            .map_or(started_ago, |ago| ago.min(started_ago));
        (quiet > timeout).then_some(rank)
    })
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
