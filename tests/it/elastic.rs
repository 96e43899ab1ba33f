//! Elastic jobs with real processes: `stoke launch --max-restarts` brings a job whose worker was
//! killed back from its latest checkpoint (also a ZeRO job, whose ranks each write their pieces of
//! every checkpoint), and `--nproc 1:2` shrinks to one worker while a slot is taken and grows back
//! to two when it returns, on the fault-free run's trajectory.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::{losses, run_ok, stoke};

/// fp32, a global batch of 8 sequences kept on every world size by `train.global_batch`, a
/// checkpoint every 4 steps; steps long enough (tens of milliseconds) for the test to act
/// between them.
const JOB: &[&str] = &[
    "model.n_layer=2",
    "model.d_model=128",
    "model.n_head=4",
    "model.seq_len=64",
    "train.precision=\"fp32\"",
    "train.lr=0.002",
    "train.warmup_steps=5",
    "train.micro_batch=4",
    "train.global_batch=8",
    "train.steps=120",
    "train.threads=1",
    "ckpt.every=4",
    "ckpt.keep=2",
    "dist.timeout_s=30",
    "data.builtin_bytes=300000",
    "prof.enabled=false",
];

fn job_args(dir: &Path, name: &str) -> Vec<String> {
    let mut v: Vec<String> = JOB.iter().map(|s| s.to_string()).collect();
    v.push(format!("run.dir={}", dir.display()));
    v.push(format!("run.name={name}"));
    v
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// A launcher child that is killed, with its workers, if the test ends before it does.
struct Launched(Child);

impl Drop for Launched {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            for pid in children_of(self.0.id()) {
                // SAFETY: plain kill(2) of a process this test started (a worker of its launcher).
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Pids whose parent is `parent`.
fn children_of(parent: u32) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // The fields after the command name, which is in parentheses and may hold spaces.
        let Some(rest) = stat.rsplit_once(')').map(|(_, rest)| rest) else { continue };
        if rest.split_whitespace().nth(1).and_then(|p| p.parse::<u32>().ok()) == Some(parent) {
            pids.push(pid);
        }
    }
    pids
}

/// The launcher's worker whose RANK is `rank`.
fn worker_pid(launcher: u32, rank: usize) -> Option<u32> {
    let wanted = format!("RANK={rank}");
    children_of(launcher).into_iter().find(|pid| {
        std::fs::read(format!("/proc/{pid}/environ"))
            .map(|env| env.split(|&b| b == 0).any(|var| var == wanted.as_bytes()))
            .unwrap_or(false)
    })
}

/// The highest step in the run's metrics.jsonl (truncated to the resumed step on every resume).
fn last_step(run: &Path) -> u64 {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .ok()
        .and_then(|t| t.lines().last().and_then(|l| serde_json::from_str::<serde_json::Value>(l).ok()))
        .and_then(|v| v["step"].as_u64())
        .unwrap_or(0)
}

fn events(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("events.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("each event is JSON"))
        .collect()
}

/// Polls `ready` every 20 ms until it holds; fails the test if the launcher exits first or
/// `limit` passes (a bound on a hang, not a timing assertion).
fn wait_until(launcher: &mut Launched, what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ready() {
        if let Some(status) = launcher.0.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(launcher.0.stderr.as_mut().unwrap(), &mut err).unwrap();
            panic!("the launcher exited ({status}) before {what}:\n{err}");
        }
        assert!(Instant::now() < deadline, "no {what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn launch(launch_args: &[&str], train: &[String]) -> Launched {
    let mut cmd = stoke(&["launch"], &[]);
    cmd.args(launch_args).args(["--", "train", "--quiet"]);
    for o in train {
        cmd.arg("--set").arg(o);
    }
    Launched(cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("stoke launch starts"))
}

/// Waits for the launcher; its exit status and its stderr.
fn finish(mut launcher: Launched) -> (std::process::ExitStatus, String) {
    let deadline = Instant::now() + Duration::from_secs(600);
    let status = loop {
        if let Some(status) = launcher.0.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the elastic job did not finish");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(launcher.0.stderr.as_mut().unwrap(), &mut err).unwrap();
    (status, err)
}

/// The fault-free run: two workers from start to end.
fn reference(dir: &Path) -> Vec<(u64, f64)> {
    let args = job_args(dir, "reference");
    run_ok(stoke(&["launch", "--nproc", "2", "--", "train", "--quiet"], &refs(&args)).stdin(Stdio::null()));
    let losses = losses(&dir.join("reference"));
    assert_eq!(losses.len(), 120);
    losses
}

fn assert_same_trajectory(reference: &[(u64, f64)], run: &Path, tolerance: f64) {
    let got = losses(run);
    let steps: Vec<u64> = got.iter().map(|&(s, _)| s).collect();
    assert_eq!(steps, (1..=reference.len() as u64).collect::<Vec<_>>(), "every step logged once, in order");
    let mut worst = 0.0f64;
    for (&(step, a), &(_, b)) in reference.iter().zip(&got) {
        let rel = (a - b).abs() / a.abs();
        worst = worst.max(rel);
        assert!(rel <= tolerance, "step {step}: loss {b}, fault-free {a} (relative {rel:e})");
    }
    println!("{}: largest relative loss difference to the fault-free run {worst:e}", run.display());
}

#[test]
fn a_killed_worker_restarts_from_the_checkpoint_and_finishes_on_the_same_losses() {
    let dir = tempfile::tempdir().unwrap();
    let reference = reference(dir.path());
    let run: PathBuf = dir.path().join("killed");
    let mut launcher = launch(&["--nproc", "2", "--max-restarts", "2"], &job_args(dir.path(), "killed"));
    wait_until(&mut launcher, "a checkpoint and 10 steps", Duration::from_secs(300), || last_step(&run) >= 10);
    let pid = worker_pid(launcher.0.id(), 1).expect("worker 1 runs");
    // SAFETY: kill(2) of the launcher's worker process found above.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
    let (status, err) = finish(launcher);
    assert!(status.success(), "the job did not finish through a restart: {status}\n{err}");
    assert!(err.contains("worker 1 failed"), "{err}");
    let events = events(&run);
    let restart = events
        .iter()
        .find(|e| e["event"] == "start" && e["cause"].as_str().is_some_and(|c| c.contains("worker 1 failed")))
        .unwrap_or_else(|| panic!("no restart event naming worker 1 in {events:?}"));
    assert_eq!(restart["world_size"], 2);
    assert_eq!(restart["restarts"], 1);
    assert!(restart["latest_checkpoint"].as_u64().is_some_and(|s| s >= 4), "{restart}");
    assert_eq!(events.last().unwrap()["event"], "finish", "{events:?}");
    // Same world size, resumed bit-identically from the checkpoint.
    assert_same_trajectory(&reference, &run, 0.0);
}

#[test]
fn a_taken_slot_shrinks_the_job_and_its_return_grows_it_back_on_the_same_trajectory() {
    let dir = tempfile::tempdir().unwrap();
    let reference = reference(dir.path());
    let run: PathBuf = dir.path().join("elastic");
    let down = dir.path().join("down-1");
    let check = format!("test ! -e {}/down-$STOKE_SLOT", dir.path().display());
    let mut launcher = launch(
        &["--nproc", "1:2", "--max-restarts", "1", "--slot-check", &check, "--slot-poll-s", "0.2"],
        &job_args(dir.path(), "elastic"),
    );
    wait_until(&mut launcher, "10 steps on two workers", Duration::from_secs(300), || last_step(&run) >= 10);
    // Slot 1 is taken away (as a scheduler would for another job): the job shrinks to one worker
    // through the preemption path, every rank stopping after the same step with a checkpoint.
    std::fs::write(&down, b"").unwrap();
    let one_worker = || events(&run).iter().any(|e| e["event"] == "start" && e["world_size"] == 1);
    wait_until(&mut launcher, "a restart on one worker", Duration::from_secs(300), one_worker);
    let restarted_at = events(&run).last().unwrap()["latest_checkpoint"].as_u64().unwrap_or(0);
    wait_until(&mut launcher, "6 steps on one worker", Duration::from_secs(300), || {
        last_step(&run) >= restarted_at + 6
    });
    // The slot comes back.
    std::fs::remove_file(&down).unwrap();
    let (status, err) = finish(launcher);
    assert!(status.success(), "the elastic job failed: {status}\n{err}");
    let events = events(&run);
    let starts: Vec<(u64, String)> = events
        .iter()
        .filter(|e| e["event"] == "start")
        .map(|e| (e["world_size"].as_u64().unwrap(), e["cause"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(starts.len(), 2, "a start on one worker, then a start on two: {events:?}");
    assert_eq!(starts[0].0, 1, "{events:?}");
    assert!(starts[0].1.contains("shrinking from 2 to 1"), "{events:?}");
    assert_eq!(starts[1].0, 2, "{events:?}");
    assert!(starts[1].1.contains("growing from 1 to 2"), "{events:?}");
    assert!(events.iter().all(|e| e["restarts"] == 0), "no failure, no restart counted: {events:?}");
    assert_eq!(events.last().unwrap()["event"], "finish", "{events:?}");
    // One worker accumulating two micro-batches sums the rows in another order than two workers
    // averaging theirs: equal within fp32 rounding.
    assert_same_trajectory(&reference, &run, 1e-5);
}

#[test]
fn a_sharded_job_whose_worker_is_killed_while_writing_resumes_from_its_pieces() {
    let dir = tempfile::tempdir().unwrap();
    // ZeRO 2 with a checkpoint every other step: each rank writes its pieces most of the time, so
    // the kill most likely lands in a write; every step's pieces are in no checkpoint until rank 0
    // has them all.
    let job = |name: &str| {
        let mut args = job_args(dir.path(), name);
        args.extend(["train.steps=40", "dist.zero=2", "ckpt.every=2"].map(String::from));
        args
    };
    run_ok(stoke(&["launch", "--nproc", "2", "--", "train", "--quiet"], &refs(&job("reference"))).stdin(Stdio::null()));
    let reference = losses(&dir.path().join("reference"));
    assert_eq!(reference.len(), 40);
    let run: PathBuf = dir.path().join("killed");
    let mut launcher = launch(&["--nproc", "2", "--max-restarts", "2"], &job("killed"));
    wait_until(&mut launcher, "a checkpoint and 9 steps", Duration::from_secs(300), || last_step(&run) >= 9);
    let pid = worker_pid(launcher.0.id(), 1).expect("worker 1 runs");
    // SAFETY: kill(2) of the launcher's worker process found above.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
    let (status, err) = finish(launcher);
    assert!(status.success(), "the job did not finish through a restart: {status}\n{err}");
    assert!(err.contains("worker 1 failed"), "{err}");
    let checkpoints = run.join("checkpoints");
    let latest = stoke_ckpt::CheckpointStore::new(&checkpoints).latest().unwrap().expect("a checkpoint");
    let manifest = stoke_ckpt::CheckpointStore::new(&checkpoints).manifest(latest).unwrap();
    assert_eq!(manifest.shards.as_ref().map(|s| s.world_size), Some(2), "per-rank pieces");
    let report = stoke_ckpt::verify_dir(&checkpoints).unwrap();
    assert_eq!(report.damaged(), 0, "{:?}", report.checkpoints);
    assert_same_trajectory(&reference, &run, 0.0);
}
