//! `stoke sched serve --slurm` on real Slurm clusters that `scripts/slurm-local.sh` starts and
//! stops (Debian's slurm-wlm, munge, slurmdbd on a MariaDB of its own for accounting; installed
//! when missing, which needs root).
//!
//! Two nodes, each a slurmd in its own network namespace with its own hostname and address, one CPU
//! each: three jobs under the fair policy. The first starts as one step of two tasks over both
//! nodes, is shrunk to one task on one node when the others arrive (a checkpoint, the end of the
//! step, a new allocation and step), and grown back over both nodes when they have finished; it
//! trains every step once and ends on the losses of a job that ran on one worker throughout, and
//! `sacct` lists every job and step. With 2 CPUs a node, `stoke launch --slurm` runs tensor 2
//! inside each node and data 2 across them as one step of 4 tasks, on one process's losses.
//!
//! One node (slots = its CPUs): a job shares the node with another and finishes, a cancelled job
//! stops with a checkpoint, a killed launcher leaves no allocation or task behind, and a step whose
//! worker is killed ends in an error naming the Slurm job and step. Two nodes again: a node that
//! stops answering (every process on it stopped) ends its step in such an error too, within the
//! heartbeat timeout, not a hang. A launcher that ends before its job has trained 5 steps is started
//! once more, its error printed (a second such end fails).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::sched_serve::{job, last_step, starts, status, submit, Server, JOB};
use crate::{losses, stoke};

/// The Slurm tests run one at a time: each starts its own cluster, and the CPUs are few.
static ONE_CLUSTER: Mutex<()> = Mutex::new(());

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/slurm-local.sh")
}

/// A cluster this test started; stopped (daemons by pid, namespaces, bridge) however it ends.
struct Cluster {
    state: PathBuf,
    port: u16,
}

impl Cluster {
    fn start(mode: &str, port: u16) -> Cluster {
        Cluster::start_with(mode, port, 1)
    }

    /// `start` with `cpus` CPUs a node.
    fn start_with(mode: &str, port: u16, cpus: usize) -> Cluster {
        let state = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("slurm-{mode}-{}", std::process::id()));
        let cluster = Cluster { state, port };
        let out = cluster.script_command(mode).env("STOKE_SLURM_NODE_CPUS", cpus.to_string()).output().unwrap();
        assert!(
            out.status.success(),
            "slurm-local.sh {mode} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        cluster
    }

    fn script_command(&self, arg: &str) -> Command {
        let mut cmd = Command::new(script());
        cmd.arg(arg)
            .env("STOKE_SLURM_STATE", &self.state)
            .env("STOKE_SLURM_PORT", self.port.to_string())
            .env("STOKE_SLURM_ACCOUNTING", "1");
        cmd
    }

    fn conf(&self) -> PathBuf {
        self.state.join("slurm.conf")
    }

    /// `sacct`'s lines for every job (`-P`: fields split by `|`).
    fn sacct(&self) -> Vec<Vec<String>> {
        let out = Command::new("sacct")
            .args(["-a", "-n", "-P", "--format=JobID,JobName,NNodes,NTasks,NodeList,State"])
            .env("SLURM_CONF", self.conf())
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).lines().map(|l| l.split('|').map(str::to_string).collect()).collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.script_command("stop").status();
        // Its database and logs are kept for a failed test only.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.state);
        }
    }
}

/// The root check every Slurm test makes: the daemons and the namespaces need root.
fn can_run() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("SKIPPED: a Slurm cluster of this test's own needs root");
    }
    root
}

fn serve(dir: &Path, cluster: &Cluster) -> Server {
    let state = dir.join("state");
    let log = std::fs::File::create(dir.join("serve.log")).unwrap();
    let args = ["sched", "serve", "--slurm", "--dir", state.to_str().unwrap(), "--policy", "fair", "--poll-s", "0.2"];
    let child = stoke(&args, &[])
        .arg("--exit-when-idle")
        .env("SLURM_CONF", cluster.conf())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("stoke sched serve starts");
    Server { child, dir: state }
}

/// Polls until `ready`; fails if the server exits first or `limit` passes (a bound on a hang, not
/// a timing assertion).
fn wait_until(server: &mut Server, what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !ready() {
        if let Some(code) = server.child.try_wait().unwrap() {
            assert!(ready(), "the scheduler exited ({code}) before {what}");
            return;
        }
        assert!(Instant::now() < deadline, "no {what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits for the server to end with every job finished.
fn all_finish(server: &mut Server, names: &[&str]) -> serde_json::Value {
    let state = server.dir.clone();
    wait_until(server, "the end of every job", Duration::from_secs(600), || server_done(&state));
    let code = server.child.wait().unwrap();
    assert!(code.success(), "{code}");
    let end = status(&server.dir);
    for name in names {
        assert_eq!(job(&end, name)["state"], "finished", "{name}: {end}");
    }
    end
}

fn server_done(state: &Path) -> bool {
    status(state)["jobs"].as_array().is_some_and(|jobs| {
        !jobs.is_empty()
            && jobs.iter().all(|j| j["state"] != "queued" && j["state"] != "running" && j["state"] != "starting")
    })
}

/// The Slurm steps a job's launcher ran, from its log: (Slurm job id, tasks, nodes).
fn slurm_steps(state: &Path, name: &str) -> Vec<(String, usize, usize)> {
    let log = std::fs::read_to_string(state.join("logs").join(format!("{name}.log"))).unwrap_or_default();
    log.lines()
        .filter_map(|l| l.strip_prefix("[launch] Slurm job "))
        .filter_map(|rest| {
            let words: Vec<&str> = rest.split_whitespace().collect();
            // `J (name): step J.0 on T tasks over N node(s) ...`
            let tasks = words.iter().position(|w| *w == "tasks")?;
            Some((words[0].to_string(), words[tasks - 1].parse().ok()?, words[tasks + 2].parse().ok()?))
        })
        .collect()
}

#[test]
fn three_jobs_on_two_slurm_nodes_one_resized_across_nodes_keeps_its_losses_and_sacct_lists_every_step() {
    if !can_run() {
        return;
    }
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = Cluster::start("start-two", 16857);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("job.toml");
    std::fs::write(&config, JOB).unwrap();
    let mut server = serve(dir.path(), &cluster);
    let state = server.dir.clone();
    let (run_a, run_b) = (state.join("runs/a"), state.join("runs/b"));
    submit(&state, &config, "a", "2", 600);
    wait_until(&mut server, "20 steps of a over both nodes", Duration::from_secs(300), || last_step(&run_a) >= 20);
    submit(&state, &config, "b", "1", 100);
    submit(&state, &config, "c", "1", 100);
    let end = all_finish(&mut server, &["a", "b", "c"]);
    // a: two tasks over both nodes, one task on one node, then both nodes again; each start its own
    // allocation and step.
    let a_steps = slurm_steps(&state, "a");
    let shapes: Vec<(usize, usize)> = a_steps.iter().map(|s| (s.1, s.2)).collect();
    assert_eq!(shapes, [(2, 2), (1, 1), (2, 2)], "a's steps (tasks, nodes): {a_steps:?}\n{end}");
    let worlds: Vec<u64> = starts(&run_a).iter().map(|e| e["world_size"].as_u64().unwrap()).collect();
    assert_eq!(worlds, [1, 2], "{:?}", starts(&run_a));
    // Every step trained once, and a's losses (two workers on two nodes, one, two again, over
    // the same global batch) equal b's (one worker throughout) within fp32 rounding.
    let a = losses(&run_a);
    assert_eq!(a.iter().map(|l| l.0).collect::<Vec<_>>(), (1..=600).collect::<Vec<_>>());
    let b = losses(&run_b);
    assert_eq!(b.len(), 100);
    let worst = a.iter().zip(&b).map(|(x, y)| (x.1 - y.1).abs() / y.1.abs()).fold(0.0, f64::max);
    assert!(worst <= 1e-5, "a and b differ by {worst:e} over their first 100 steps");
    println!("a (resized across nodes) against b over 100 steps: largest relative loss difference {worst:e}");
    // Slurm's accounting lists every job and step (slurmctld sends its records to slurmdbd a
    // moment after a job ends: bounded wait).
    let mut expected: Vec<(String, String)> = Vec::new();
    for name in ["a", "b", "c"] {
        let steps = slurm_steps(&state, name);
        assert!(!steps.is_empty(), "{name} ran no Slurm step");
        expected.extend(steps.into_iter().map(|s| (s.0, name.to_string())));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let rows = loop {
        let rows = cluster.sacct();
        let listed = |id: &str, name: &str| {
            [id.to_string(), format!("{id}.0")].iter().all(|want| rows.iter().any(|r| r[0] == *want && r[1] == name))
        };
        if expected.iter().all(|(id, name)| listed(id, name)) {
            break rows;
        }
        assert!(Instant::now() < deadline, "sacct does not list every job and step of {expected:?}: {rows:?}");
        std::thread::sleep(Duration::from_millis(500));
    };
    let a_step_nodes: Vec<&str> =
        rows.iter().filter(|r| r[1] == "a" && r[0].ends_with(".0")).map(|r| r[2].as_str()).collect();
    assert_eq!(a_step_nodes, ["2", "1", "2"], "{rows:?}");
    for row in &rows {
        println!("sacct: {}", row.join(" | "));
    }
}

/// `stoke launch --slurm` over the two nodes with 2 CPUs each: one step of 4 tasks, 2 a node, the
/// ranks placed by Slurm's variables (SLURM_NODEID their node); tensor 2 inside each node over
/// shared memory, data 2 across over TCP, one process's losses.
#[test]
fn launch_slurm_cuts_inside_each_node_and_follows_one_process() {
    if !can_run() {
        return;
    }
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = Cluster::start_with("start-two", 16877, 2);
    let dir = tempfile::tempdir().unwrap();
    let rms: (&str, &[&str]) = ("gpt-rms", &["model.family=\"gpt-rms\""]);
    let reference = crate::dist::family_reference_losses(dir.path(), rms);
    let settings = [
        "model.family=\"gpt-rms\"",
        "train.steps=20",
        "ckpt.every=0",
        "ckpt.at_end=false",
        "dist.tensor=2",
        "train.micro_batch=3",
        "dist.backend=\"tcp\"",
    ];
    let args = crate::dist::overrides(dir.path(), "slurm-t2d2", &settings);
    let state = dir.path().join("launcher");
    let out = stoke(&["launch", "--slurm", "--nproc", "4", "--state-dir", state.to_str().unwrap()], &[])
        .args(["--", "train", "--quiet"])
        .args(args.iter().flat_map(|a| ["--set", a.as_str()]))
        .env("SLURM_CONF", cluster.conf())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{log}");
    assert!(log.contains("over 2 node(s)"), "one step over both nodes: {log}");
    assert!(log.contains("the model cut over 2 ranks, 2 copies of it (tensor over shm, data over tcp)"), "{log}");
    crate::dist::assert_same_trajectory(
        &reference,
        &dir.path().join("slurm-t2d2"),
        "tensor 2 x data 2 over two Slurm nodes",
        &out,
    );
}

#[test]
fn jobs_share_a_single_node_slurm_cluster_and_a_failed_step_names_its_slurm_job() {
    if !can_run() {
        return;
    }
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = Cluster::start("start", 16847);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("job.toml");
    std::fs::write(&config, JOB).unwrap();
    // Slots: the node's CPUs, as sinfo counts them.
    let mut server = serve(dir.path(), &cluster);
    let state = server.dir.clone();
    let run_a = state.join("runs/a");
    submit(&state, &config, "a", "2", 200);
    wait_until(&mut server, "10 steps of a", Duration::from_secs(300), || last_step(&run_a) >= 10);
    submit(&state, &config, "b", "1", 40);
    all_finish(&mut server, &["a", "b"]);
    let slots: usize = status(&state)["slots"].as_u64().map_or(0, |s| s as usize);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(slots, cpus, "slots are the node's CPUs");
    assert_eq!(losses(&run_a).len(), 200);
    assert!(!slurm_steps(&state, "b").is_empty());

    // A cancelled job stops through the preemption path: its step's tasks get SIGTERM from
    // scancel, write a checkpoint and exit 75. (Submitted before the server starts, which exits
    // once nothing is queued or running.)
    submit(&state, &config, "long", "2", 100_000);
    let mut server = serve(dir.path(), &cluster);
    let run_long = state.join("runs/long");
    wait_until(&mut server, "5 steps of long", Duration::from_secs(300), || last_step(&run_long) >= 5);
    crate::run_ok(&mut stoke(&["sched", "cancel", "--dir", state.to_str().unwrap(), "long"], &[]));
    wait_until(&mut server, "the end of long", Duration::from_secs(300), || server_done(&state));
    assert!(server.child.wait().unwrap().success());
    let end = status(&state);
    assert_eq!(job(&end, "long")["state"], "cancelled", "{end}");
    assert_eq!(job(&end, "long")["exit_code"], 75, "stopped through the preemption path: {end}");
    let events = std::fs::read_to_string(run_long.join("events.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(events.lines().last().unwrap()).unwrap();
    assert_eq!(last["event"], "preempted", "{events}");
    assert_eq!(last["latest_checkpoint"].as_u64(), Some(last_step(&run_long)), "{events}");

    // A launcher killed outright takes its allocation and step with it: salloc's placeholder reads
    // a pipe from the launcher, which the kill closes.
    let (mut launcher, _run) = running_launcher(dir.path(), &config, &cluster, "orphan", &[]);
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let queue = Command::new("squeue").args(["-h", "-n", "orphan"]).env("SLURM_CONF", cluster.conf()).output();
        let queued = String::from_utf8_lossy(&queue.unwrap().stdout).trim().to_string();
        if queued.is_empty() && slurm_task("orphan", 0).is_none() && slurm_task("orphan", 1).is_none() {
            break;
        }
        assert!(Instant::now() < deadline, "the killed launcher's allocation or tasks live on: {queued}");
        std::thread::sleep(Duration::from_millis(200));
    }

    // A worker killed mid-step: the step fails and the launcher's error names the job and step.
    let (launcher, run) = running_launcher(dir.path(), &config, &cluster, "doomed", &[]);
    let worker = slurm_task("doomed", 1).expect("task 1 of the doomed step runs");
    // SAFETY: kill(2) of a worker of the step this test started, found by its Slurm variables.
    assert_eq!(unsafe { libc::kill(worker, libc::SIGKILL) }, 0);
    let err = ends_naming_its_step(launcher, &run);
    assert!(err.contains("failed"), "{err}");
}

#[test]
fn a_node_that_stops_answering_fails_its_step_with_an_error_naming_the_slurm_job() {
    if !can_run() {
        return;
    }
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|e| e.into_inner());
    let cluster = Cluster::start("start-two", 16867);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("job.toml");
    std::fs::write(&config, JOB).unwrap();
    let (launcher, run) = running_launcher(dir.path(), &config, &cluster, "frozen", &["--hang-timeout-s", "20"]);
    // The second node stops answering: every process in its namespace (its slurmd, the step's
    // slurmstepd and task) is stopped; continued when the test ends, before the cluster stops.
    let frozen = Frozen(namespace_pids(&format!("stoke-n2-{}", cluster.port)));
    assert!(frozen.0.len() >= 3, "slurmd, slurmstepd and a task in the namespace: {:?}", frozen.0);
    for &pid in &frozen.0 {
        // SAFETY: kill(2) of a process of this test's cluster, listed by its network namespace.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
    }
    let err = ends_naming_its_step(launcher, &run);
    assert!(err.contains("sent no heartbeat") || err.contains("failed"), "{err}");
    drop(frozen);
}

/// Processes stopped by the test: continued however it ends.
struct Frozen(Vec<i32>);

impl Drop for Frozen {
    fn drop(&mut self) {
        for &pid in &self.0 {
            // SAFETY: kill(2) of a process this test stopped.
            unsafe { libc::kill(pid, libc::SIGCONT) };
        }
    }
}

fn namespace_pids(ns: &str) -> Vec<i32> {
    let out = Command::new("ip").args(["netns", "pids", ns]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|p| p.parse().ok()).collect()
}

/// `stoke launch --slurm --nproc 2` of a long training job named `name`, and its run folder.
fn launch_slurm(dir: &Path, config: &Path, cluster: &Cluster, name: &str, extra: &[&str]) -> (Child, PathBuf) {
    let runs = dir.join("runs");
    let child = stoke(&["launch", "--slurm", "--nproc", "2", "--job-name", name, "--state-dir"], &[])
        .arg(dir)
        .args(extra)
        .args(["--", "train", "--quiet", "--config", config.to_str().unwrap()])
        .args(["--set", "train.steps=100000", "--set", &format!("run.dir=\"{}\"", runs.display())])
        .args(["--set", &format!("run.name=\"{name}\"")])
        .env("SLURM_CONF", cluster.conf())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    (child, runs.join(name))
}

/// `launch_slurm` of `name`, once its run has trained 5 steps. A launcher that ends before then
/// (on a loaded machine a step can fail to start: srun or the rendezvous) is started once more,
/// its first error printed; a second such end fails the test.
fn running_launcher(dir: &Path, config: &Path, cluster: &Cluster, name: &str, extra: &[&str]) -> (Child, PathBuf) {
    let mut first_error = None;
    loop {
        let (mut launcher, run) = launch_slurm(dir, config, cluster, name, extra);
        let deadline = Instant::now() + Duration::from_secs(300);
        let ended = loop {
            if last_step(&run) >= 5 {
                break None;
            }
            if let Some(code) = launcher.try_wait().unwrap() {
                let mut err = String::new();
                if let Some(mut pipe) = launcher.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut pipe, &mut err);
                }
                break Some(format!("the launcher of {name} ended ({code}) before 5 steps:\n{err}"));
            }
            assert!(Instant::now() < deadline, "no 5 steps in {}", run.display());
            std::thread::sleep(Duration::from_millis(50));
        };
        match (ended, &first_error) {
            (None, _) => return (launcher, run),
            (Some(err), None) => {
                eprintln!("{err}\n(started once more)");
                let _ = std::fs::remove_dir_all(&run);
                first_error = Some(err);
            }
            (Some(err), Some(first)) => panic!("{first}\nand again:\n{err}"),
        }
    }
}

/// Waits for a launcher that is to fail, bounded (one still running 300 s on is a hang); returns
/// its error output with the run's last event, which names the Slurm job and step.
fn ends_naming_its_step(mut launcher: Child, run: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(300);
    while launcher.try_wait().unwrap().is_none() {
        if Instant::now() >= deadline {
            let _ = launcher.kill();
            panic!("the launcher still runs 300 s after its step went wrong");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = launcher.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{err}");
    let id = err
        .lines()
        .find_map(|l| l.strip_prefix("[launch] Slurm job ").and_then(|r| r.split_whitespace().next()))
        .unwrap_or_else(|| panic!("no Slurm job named: {err}"))
        .to_string();
    let name = run.file_name().unwrap().to_string_lossy();
    let events = std::fs::read_to_string(run.join("events.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(events.lines().last().unwrap()).unwrap();
    assert_eq!(last["event"], "give_up", "{events}");
    let cause = last["cause"].as_str().unwrap();
    assert!(cause.starts_with(&format!("Slurm job {id} ({name}), step {id}.0: ")), "{cause}");
    println!("{name}: {cause}");
    err + cause
}

/// The pid of task `rank` of the step named `name`, from the processes' Slurm variables.
fn slurm_task(name: &str, rank: usize) -> Option<i32> {
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else { continue };
        let vars: Vec<String> = environ.split(|&b| b == 0).map(|v| String::from_utf8_lossy(v).into_owned()).collect();
        let has = |kv: String| vars.iter().any(|v| *v == kv);
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if comm.trim() == "stoke" && has(format!("SLURM_JOB_NAME={name}")) && has(format!("SLURM_PROCID={rank}")) {
            return Some(pid);
        }
    }
    None
}
