//! `stoke launch --nproc N -- train ARGS`: starts N workers on this machine with torchrun's
//! variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), prefixes
//! every line a worker prints with its rank, and when one worker fails stops the others and exits
//! with the first failure's code (128 + signal for a worker killed by a signal).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use super::UsageError;

#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Worker processes to start on this machine.
    #[arg(long, default_value_t = 1)]
    pub nproc: usize,
    /// Port of the rendezvous store on 127.0.0.1 (default: a free port).
    #[arg(long)]
    pub master_port: Option<u16>,
    /// Run this program instead of this `stoke` binary (for scripts that start their own
    /// workers, like torchrun's `--no-python`).
    #[arg(long)]
    pub program: Option<std::path::PathBuf>,
    /// Seconds the other workers get to exit after one failed before they are killed.
    #[arg(long, default_value_t = 10.0)]
    pub grace_s: f64,
    /// The command each worker runs, after `--` (for example `-- train --config run.toml`).
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

pub fn run(args: LaunchArgs) -> anyhow::Result<ExitCode> {
    if args.nproc == 0 {
        return Err(UsageError("--nproc must be at least 1".into()).into());
    }
    let program = match &args.program {
        Some(program) => program.clone(),
        None => std::env::current_exe().context("cannot locate the stoke binary to start workers")?,
    };
    let port = match args.master_port {
        Some(port) => port,
        None => free_port()?,
    };
    let mut children: Vec<Option<Child>> = Vec::with_capacity(args.nproc);
    let mut pumps = Vec::new();
    for rank in 0..args.nproc {
        let mut cmd = Command::new(&program);
        cmd.args(&args.command)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", args.nproc.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", args.nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = match cmd.spawn() {
            Ok(child) => child,
            Err(err) => {
                stop_all(&mut children, Duration::ZERO);
                return Err(err).with_context(|| format!("cannot start worker {rank}: {}", program.display()));
            }
        };
        let out = child.stdout.take().expect("stdout is piped");
        let err = child.stderr.take().expect("stderr is piped");
        pumps.push(std::thread::spawn(move || pump(out, rank, false)));
        pumps.push(std::thread::spawn(move || pump(err, rank, true)));
        children.push(Some(child));
    }
    let code = supervise(&mut children, Duration::from_secs_f64(args.grace_s.max(0.0)));
    for pump in pumps {
        let _ = pump.join();
    }
    Ok(ExitCode::from(code))
}

/// Waits for all workers; after the first failure, stops the rest. Returns the exit code.
fn supervise(children: &mut [Option<Child>], grace: Duration) -> u8 {
    let mut first_failure: Option<(usize, u8)> = None;
    loop {
        let mut running = 0;
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(Some(status)) => {
                    *slot = None;
                    let code = exit_code(status);
                    if code != 0 && first_failure.is_none() {
                        eprintln!("[launch] worker {rank} failed ({status}); stopping the others");
                        first_failure = Some((rank, code));
                    }
                }
                Ok(None) => running += 1,
                Err(err) => {
                    eprintln!("[launch] cannot wait for worker {rank}: {err}");
                    first_failure.get_or_insert((rank, 1));
                    *slot = None;
                }
            }
        }
        if running == 0 {
            return first_failure.map_or(0, |(_, code)| code);
        }
        if first_failure.is_some() {
            stop_all(children, grace);
            return first_failure.map_or(0, |(_, code)| code);
        }
        std::thread::sleep(Duration::from_millis(50));
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
