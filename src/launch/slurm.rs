//! `stoke launch --slurm`: one start of the job as a Slurm allocation and one job step in it,
//! instead of workers on this machine.
//!
//! Each start (the first, a resize, a restart after a failure) asks Slurm for an allocation of
//! `world` tasks (salloc, holding it with a placeholder command that ends when the launcher closes
//! its stdin or dies, so no allocation outlives its launcher), runs the workers as one step
//! (`srun --jobid --nodes --ntasks`, the node count Slurm gave the allocation) and releases the
//! allocation when the step ends, so a resize is a checkpoint, the end of the step and a new step
//! in a new allocation of another task (and node) count, and Slurm's accounting shows every start
//! as a job with its step.
//!
//! Ranks come from Slurm's variables (SLURM_PROCID, SLURM_NTASKS, read by `DistEnv::from_vars`);
//! they rendezvous over TCP at MASTER_ADDR, the address (`NodeAddr`) of the allocation's first
//! node, where rank 0 runs, and a port free here (a new one each start; one taken on that node
//! fails the step's rendezvous, which counts as a failure and restarts). The shm backend then needs
//! the ranks on one machine (it says so otherwise); across machines `dist.backend` is tcp (grouping ranks by
//! SLURM_NODEID), mpi or nccl. The launcher asks the workers to stop by
//! signalling the step's tasks (`scancel --signal=TERM`), so every rank stops after the same step
//! with a checkpoint and exits 75; it does not signal srun, which would kill the tasks. A task that
//! fails ends the step once the others have gone on for `STEP_WAIT_S` (srun's `--wait`), and a node
//! that stops answering fails the step through Slurm or is caught by the heartbeats; either way the
//! error names the Slurm job and step.
//!
//! Heartbeats and the run folder's name go through the launcher's folder, so with `--slurm` it must
//! be on a file system every node sees (`--state-dir`), as the run folder must.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::spec::Launch;
use super::workers::{supervise, Outcome, Watch};
use crate::run::{heartbeat_path, LAUNCH_DIR_VAR};

/// Seconds the other tasks of a step may run on after the first one ended (srun's `--wait`).
const STEP_WAIT_S: u64 = 60;
/// Seconds a Slurm command (scontrol, scancel) may take before it counts as not answering.
const COMMAND_TIMEOUT_S: f64 = 60.0;

/// A Slurm allocation held for one start of the job; released when dropped.
struct Allocation {
    id: u64,
    nodes: usize,
    node_list: String,
    /// salloc, running the placeholder that holds the allocation until its stdin closes.
    holder: Child,
}

impl Allocation {
    /// salloc for `tasks` tasks, waiting up to `wait_s` for the resources. Its command is a
    /// placeholder (`cat`, its output discarded) reading a pipe from this process: when the pipe closes (the
    /// allocation dropped, or this process gone, even killed) the placeholder ends and salloc
    /// releases the allocation, so none outlives its launcher.
    fn request(tasks: usize, name: &str, wait_s: f64) -> anyhow::Result<Allocation> {
        let wait = wait_s.max(1.0).ceil() as u64;
        let mut holder = Command::new("salloc")
            .args([&format!("--immediate={wait}"), &format!("--ntasks={tasks}"), "--job-name", name])
            .arg("cat")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run salloc for {name} (is Slurm installed here?)"))?;
        // salloc's messages, line by line; the thread drains them to the end so salloc never
        // blocks on a full pipe.
        let (lines_tx, lines) = mpsc::channel::<String>();
        let stderr = holder.stderr.take().expect("piped");
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = lines_tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs_f64(wait as f64 + COMMAND_TIMEOUT_S);
        let mut said = Vec::new();
        let id_after =
            |line: &str, marker: &str| line.split_once(marker).and_then(|(_, rest)| rest.trim().parse::<u64>().ok());
        let id = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match lines.recv_timeout(left) {
                Ok(line) => {
                    if let Some(id) = id_after(&line, "Granted job allocation") {
                        break id;
                    }
                    said.push(line);
                }
                Err(RecvTimeoutError::Timeout) => {
                    // A request left pending is withdrawn, so it never starts holding resources.
                    let _ = holder.kill();
                    let _ = holder.wait();
                    if let Some(pending) = said.iter().find_map(|l| id_after(l, "Pending job allocation")) {
                        let _ = scancel(pending, None);
                    }
                    bail!(
                        "salloc did not answer within {} s for {name}: {}",
                        wait as f64 + COMMAND_TIMEOUT_S,
                        said.join("; ")
                    );
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = holder.wait()?;
                    bail!(
                        "Slurm gave no allocation of {tasks} tasks for {name} within {wait} s ({status}): {}",
                        said.join("; ")
                    );
                }
            }
        };
        let mut alloc = Allocation { id, nodes: 0, node_list: String::new(), holder };
        let show = scontrol(&["show", "job", "-o", &id.to_string()])
            .with_context(|| format!("Slurm job {id} (allocation for {name})"))?;
        alloc.nodes = field(&show, "NumNodes").and_then(|n| n.parse().ok()).unwrap_or(0);
        alloc.node_list = field(&show, "NodeList").unwrap_or_default().to_string();
        if alloc.nodes == 0 || alloc.node_list.is_empty() || alloc.node_list == "(null)" {
            bail!("Slurm job {id} (allocation for {name}) names no nodes: {}", show.trim());
        }
        Ok(alloc)
    }

    /// The address of the allocation's first node: rank 0 runs there and serves the rendezvous.
    fn first_address(&self) -> anyhow::Result<String> {
        let hosts = scontrol(&["show", "hostnames", &self.node_list])?;
        let first = hosts.split_whitespace().next().context("an empty node list")?.to_string();
        let node = scontrol(&["show", "node", "-o", &first])?;
        Ok(field(&node, "NodeAddr").unwrap_or(&first).to_string())
    }
}

impl Drop for Allocation {
    /// Closes the placeholder's stdin, so salloc releases the allocation (the job ends COMPLETED);
    /// a salloc that has not ended within `COMMAND_TIMEOUT_S` is killed and the job cancelled.
    fn drop(&mut self) {
        drop(self.holder.stdin.take());
        let deadline = Instant::now() + Duration::from_secs_f64(COMMAND_TIMEOUT_S);
        while let Ok(None) = self.holder.try_wait() {
            if Instant::now() >= deadline {
                let _ = self.holder.kill();
                let _ = self.holder.wait();
                if let Err(e) = scancel(self.id, None) {
                    eprintln!("[launch] cannot release Slurm job {}: {e:#}", self.id);
                }
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Runs one start of the job as a Slurm step on `world` tasks and supervises it until it ends.
#[allow(clippy::too_many_arguments)] // one start of the job: its settings, and where it runs
pub fn run_step(
    args: &Launch,
    program: &Path,
    command: &[String],
    world: usize,
    port: u16,
    launch_dir: &Path,
    (min, max): (usize, usize),
    stop: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<Outcome> {
    let name = args.job_name.as_str();
    let alloc = Allocation::request(world, name, args.slot_wait_s)?;
    let step = format!("{}.0", alloc.id);
    let master = alloc.first_address().with_context(|| format!("Slurm job {} ({name})", alloc.id))?;
    for rank in 0..world {
        let _ = std::fs::remove_file(heartbeat_path(launch_dir, rank));
    }
    eprintln!(
        "[launch] Slurm job {} ({name}): step {step} on {world} tasks over {} node(s) {}, rendezvous {master}:{port}",
        alloc.id, alloc.nodes, alloc.node_list
    );
    let mut cmd = Command::new("srun");
    cmd.arg(format!("--jobid={}", alloc.id))
        .arg(format!("--nodes={}", alloc.nodes))
        .arg(format!("--ntasks={world}"))
        .arg(format!("--wait={STEP_WAIT_S}"))
        .args(["--label", "--job-name", name])
        .arg(program)
        .args(command)
        .env("MASTER_ADDR", &master)
        .env("MASTER_PORT", port.to_string())
        .env(LAUNCH_DIR_VAR, launch_dir)
        .stdin(Stdio::null());
    // The ranks are Slurm's: no launcher's variables may shadow them.
    for var in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"] {
        cmd.env_remove(var);
    }
    let child = cmd.spawn().with_context(|| format!("cannot start srun for Slurm step {step} ({name})"))?;
    let id = alloc.id;
    let signal = move |_: &[Option<std::process::Child>]| {
        if let Err(e) = scancel(id, Some("TERM")) {
            eprintln!("[launch] cannot signal Slurm step {id}.0: {e:#}");
        }
    };
    let watch = Watch {
        grace: Duration::from_secs(STEP_WAIT_S + 30),
        hang_timeout: Duration::from_secs_f64(args.hang_timeout_s.max(0.0)),
        slot_poll: Duration::from_secs_f64(args.slot_poll_s.max(0.1)),
        launch_dir,
        stop,
        resize: args.slot_check.is_some().then_some((args, min, max)),
        world,
        first_rank: 0,
        ask_to_stop: &signal,
        child_name: &|_| format!("srun of Slurm step {step}"),
    };
    let mut children = [Some(child)];
    let outcome = supervise(&mut children, &watch);
    drop(alloc);
    Ok(match outcome {
        Outcome::Failed { code, cause } => {
            Outcome::Failed { code, cause: format!("Slurm job {id} ({name}), step {id}.0: {cause}") }
        }
        other => other,
    })
}

/// `KEY=value` of scontrol's one-line output.
fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.split_whitespace().find_map(|kv| kv.strip_prefix(key).and_then(|rest| rest.strip_prefix('=')))
}

fn scontrol(args: &[&str]) -> anyhow::Result<String> {
    let mut cmd = Command::new("scontrol");
    cmd.args(args);
    let out = output_within(cmd, COMMAND_TIMEOUT_S)?;
    if !out.status.success() {
        bail!("scontrol {} failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `scancel` of a Slurm job: with a signal, to its steps' tasks only; without, the whole job.
fn scancel(id: u64, signal: Option<&str>) -> anyhow::Result<()> {
    let mut cmd = Command::new("scancel");
    if let Some(signal) = signal {
        cmd.arg(format!("--signal={signal}"));
    }
    cmd.arg(id.to_string());
    let out = output_within(cmd, COMMAND_TIMEOUT_S)?;
    if !out.status.success() {
        bail!("scancel {id} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Runs `cmd` to its end, killing it after `timeout_s` (a controller that does not answer is an
/// error, not a hang).
fn output_within(mut cmd: Command, timeout_s: f64) -> anyhow::Result<Output> {
    let program = format!("{:?}", cmd.get_program());
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {program} (is Slurm installed here?)"))?;
    // Small outputs: read them on threads so a full pipe never blocks the wait.
    let mut out_pipe = child.stdout.take().expect("piped");
    let mut err_pipe = child.stderr.take().expect("piped");
    let out_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = std::io::Read::read_to_end(&mut out_pipe, &mut buf);
        buf
    });
    let err_reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = std::io::Read::read_to_end(&mut err_pipe, &mut buf);
        buf
    });
    let deadline = Instant::now() + Duration::from_secs_f64(timeout_s);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{program} did not answer within {timeout_s} s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    Ok(Output { status, stdout, stderr })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_of_scontrol_lines() {
        let line = "JobId=7 JobName=a NumNodes=2 NumCPUs=2 NumTasks=2 NodeList=stoke-n[1-2] BatchHost=stoke-n1";
        assert_eq!(field(line, "NumNodes"), Some("2"));
        assert_eq!(field(line, "NodeList"), Some("stoke-n[1-2]"));
        assert_eq!(field(line, "Num"), None);
        assert_eq!(field(line, "NodeAddr"), None);
    }
}
