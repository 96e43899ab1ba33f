//! The launcher's loop: start the job on the slots available, watch it, and start it again
//! (resuming its run) after a failure or a change of slots, logging each start and end to the
//! run's `events.jsonl`.

use std::io::Write;
use std::net::TcpListener;
use std::path::Path;
use std::process::ExitCode;
use std::time::SystemTime;

use anyhow::Context;

use super::slots::wait_for_slots;
use super::slurm::run_step;
use super::spec::Launch;
use super::workers::{run_workers, Outcome};
use crate::exit::{UsageError, EXIT_PREEMPTED};
use crate::run::{latest_checkpoint, read_run_dir, restart_command};

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

/// Runs the job to its end: the exit code of `stoke launch`.
pub fn launch(args: &Launch) -> anyhow::Result<ExitCode> {
    let (min, max) = parse_nproc(&args.nproc)?;
    let program = match &args.program {
        Some(program) => program.clone(),
        None => std::env::current_exe().context("cannot locate the stoke binary to start workers")?,
    };
    let stop = crate::signals::install();
    let launch_dir = match &args.state_dir {
        Some(dir) => dir.join(format!("stoke-launch-{}", std::process::id())),
        None => std::env::temp_dir().join(format!("stoke-launch-{}", std::process::id())),
    };
    std::fs::create_dir_all(&launch_dir).with_context(|| format!("cannot create {}", launch_dir.display()))?;
    let result = (|| {
        let mut restarts = 0u32;
        let mut command = args.command.clone();
        let mut cause = "start".to_string();
        loop {
            let slots = wait_for_slots(args, min, max, stop)?;
            let world = slots.len();
            let port = match args.nodes.master.as_ref().map(|(_, port)| *port).or(args.master_port) {
                Some(port) => port,
                None => free_port()?,
            };
            let run_dir = read_run_dir(&launch_dir);
            if let Some(run_dir) = &run_dir {
                event(run_dir, "start", &cause, world, restarts);
            }
            let outcome = if args.slurm {
                run_step(args, &program, &command, world, port, &launch_dir, (min, max), stop)?
            } else {
                run_workers(args, &program, &command, &slots, port, &launch_dir, (min, max), stop)?
            };
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

/// One line of the run's `events.jsonl`.
fn event(run_dir: &Path, kind: &str, cause: &str, world_size: usize, restarts: u32) {
    let time = SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    let latest = latest_checkpoint(run_dir);
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
}
