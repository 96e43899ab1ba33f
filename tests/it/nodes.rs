//! Two "nodes" on this machine: two network namespaces that the test makes, joined by a veth
//! pair, each with its own address, hostname and a private /dev/shm (its own mount namespace), so
//! shared memory cannot cross from one to the other and everything between them goes over real
//! TCP. Each node runs its own `stoke launch --nnodes 2 --node-rank R --master-addr
//! NODE0:PORT --nproc 2`.
//!
//! Tensor 2 inside each node and data 2 across them follows one process's fp32 losses within
//! 1e-5 over 20 steps (node 1 started first: the rendezvous takes nodes in any order); a node that
//! never arrives is named by the other's error within `dist.timeout_s`; a node killed mid-run
//! (every process in its namespace) is named by the survivors, whose launcher starts them again
//! from the latest checkpoint, and the job ends on one process's losses once the node is back.
//! Needs root (namespaces); without it the tests say SKIPPED.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::dist::{assert_same_trajectory, family_reference_losses, overrides, reference_losses_over};

/// One pair of namespaces at a time: the tests share the address plan and the 2 cores.
static ONE_NETWORK: Mutex<()> = Mutex::new(());

const RMS: (&str, &[&str]) = ("gpt-rms", &["model.family=\"gpt-rms\""]);
const PORT: u16 = 29517;

/// Two namespaces and the veth pair between them; deleted (with whatever still runs in them)
/// however the test ends.
struct Network {
    namespaces: [String; 2],
    addresses: [String; 2],
}

impl Network {
    fn make() -> Network {
        let id = std::process::id();
        let namespaces = [format!("stoke-n0-{id}"), format!("stoke-n1-{id}")];
        // A subnet of this test's own, between its own two namespaces.
        let subnet = format!("10.234.{}", id % 250);
        let addresses = [format!("{subnet}.1"), format!("{subnet}.2")];
        let network = Network { namespaces, addresses };
        let (a, b) = (&network.namespaces[0], &network.namespaces[1]);
        let (va, vb) = (format!("stkn{id}a"), format!("stkn{id}b"));
        let steps: Vec<Vec<String>> = vec![
            vec!["netns".into(), "add".into(), a.clone()],
            vec!["netns".into(), "add".into(), b.clone()],
            ["link", "add", &va, "netns", a, "type", "veth", "peer", "name", &vb, "netns", b]
                .map(String::from)
                .to_vec(),
            ["-n", a, "addr", "add", &format!("{}/24", network.addresses[0]), "dev", &va].map(String::from).to_vec(),
            ["-n", b, "addr", "add", &format!("{}/24", network.addresses[1]), "dev", &vb].map(String::from).to_vec(),
            ["-n", a, "link", "set", &va, "up"].map(String::from).to_vec(),
            ["-n", b, "link", "set", &vb, "up"].map(String::from).to_vec(),
            ["-n", a, "link", "set", "lo", "up"].map(String::from).to_vec(),
            ["-n", b, "link", "set", "lo", "up"].map(String::from).to_vec(),
        ];
        for step in steps {
            let out = Command::new("ip").args(&step).output().expect("ip runs");
            assert!(out.status.success(), "ip {}: {}", step.join(" "), String::from_utf8_lossy(&out.stderr));
        }
        network
    }

    fn master(&self) -> String {
        format!("{}:{PORT}", self.addresses[0])
    }

    /// `stoke launch` as node `rank` (see `in_node`).
    fn launch(&self, rank: usize, log: &Path, args: &[String]) -> Launched {
        self.launch_with(rank, log, &[], &[], args)
    }

    /// A command that runs in node `rank`: its network namespace, a mount namespace of its own
    /// whose /dev/shm is a fresh tmpfs, and its own hostname; the program and its arguments follow.
    fn in_node(&self, rank: usize) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", self.namespaces[rank]))
            .args(["unshare", "--mount", "--uts", "sh", "-c"])
            .arg(format!("{} && exec \"$@\"", Self::node_setup(rank)))
            .arg("node");
        cmd
    }

    fn node_setup(rank: usize) -> String {
        format!("mount -t tmpfs -o size=1g stoke-shm /dev/shm && hostname stoke-node{rank}")
    }

    /// Open MPI's launch agent (`plm_rsh_agent`, called as ssh would be: options, the host, then
    /// one command line for a shell) that enters the node whose address is the host.
    fn launch_agent(&self) -> String {
        let mut script = String::from(
            "#!/bin/sh\nwhile [ \"${1#-}\" != \"$1\" ]; do shift; done\nhost=$1\nshift\ncase \"$host\" in\n",
        );
        for rank in 0..2 {
            script.push_str(&format!(
                "  {}) exec nsenter --net=/run/netns/{} unshare --mount --uts sh -c \"{} && $*\" ;;\n",
                self.addresses[rank],
                self.namespaces[rank],
                Self::node_setup(rank)
            ));
        }
        script.push_str("  *) echo \"no node at $host\" >&2; exit 1 ;;\nesac\n");
        script
    }

    /// `launch` with flags for the launcher and for `train`.
    fn launch_with(&self, rank: usize, log: &Path, launcher: &[&str], train: &[&str], args: &[String]) -> Launched {
        let mut cmd = self.in_node(rank);
        cmd.arg(env!("CARGO_BIN_EXE_stoke"))
            .args(["launch", "--nnodes", "2", "--node-rank", &rank.to_string(), "--master-addr", &self.master()])
            .args(["--nproc", "2"])
            .args(launcher)
            .args(["--", "train", "--quiet"])
            .args(train);
        for a in args {
            cmd.arg("--set").arg(a);
        }
        let file = std::fs::File::create(log).unwrap();
        cmd.stdin(Stdio::null()).stdout(file.try_clone().unwrap()).stderr(file);
        Launched { child: Some(cmd.spawn().expect("nsenter runs")), log: log.to_path_buf() }
    }

    /// SIGKILL to every process in node `rank`'s namespace.
    fn kill_node(&self, rank: usize) -> usize {
        let out = Command::new("ip").args(["netns", "pids", &self.namespaces[rank]]).output().unwrap();
        let pids: Vec<i32> =
            String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|p| p.parse().ok()).collect();
        for &pid in &pids {
            // SAFETY: kill(2) of a process in a namespace this test made.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        pids.len()
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for rank in 0..2 {
            self.kill_node(rank);
        }
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// A node's launcher; killed if the test ends before it does.
struct Launched {
    child: Option<Child>,
    log: PathBuf,
}

impl Launched {
    /// Waits at most `limit` for the launcher to end: its exit status and everything it printed.
    fn finish(mut self, limit: Duration) -> (std::process::ExitStatus, String) {
        let mut child = self.child.take().unwrap();
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "a node's launcher ran past {limit:?}:\n{}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        (status, std::fs::read_to_string(&self.log).unwrap_or_default())
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn can_run() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: two network namespaces need root");
        return false;
    }
    let have = |tool: &str| Command::new(tool).arg("-V").output().is_ok_and(|o| o.status.success());
    if !have("ip") {
        // iproute2 makes the namespaces; nsenter and unshare are util-linux, always there.
        let installed = Command::new("sh")
            .args(["-c", "apt-get update -q && apt-get install -y -q --no-install-recommends iproute2"])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdin(Stdio::null())
            .status();
        assert!(installed.is_ok_and(|s| s.success()) && have("ip"), "iproute2 is missing and would not install");
    }
    assert!(have("nsenter") && have("unshare"), "nsenter and unshare (util-linux) are missing");
    true
}

/// One test at a time on the network, with a folder of its own; None (skipped) without root.
fn two_nodes() -> Option<(std::sync::MutexGuard<'static, ()>, tempfile::TempDir)> {
    if !can_run() {
        return None;
    }
    let one = ONE_NETWORK.lock().unwrap_or_else(|e| e.into_inner());
    Some((one, tempfile::tempdir().unwrap()))
}

/// Tensor 2 x data 2 for 20 steps (later `--set`s of the same key win).
fn run_args(dir: &Path, name: &str, extra: &[&str]) -> Vec<String> {
    let mut all: Vec<&str> = RMS.1.to_vec();
    all.extend(["train.steps=20", "ckpt.every=0", "ckpt.at_end=false", "dist.tensor=2", "train.micro_batch=3"]);
    all.extend_from_slice(extra);
    overrides(dir, name, &all)
}

fn as_output(status: std::process::ExitStatus, log: String) -> Output {
    Output { status, stdout: log.into_bytes(), stderr: Vec::new() }
}

#[test]
fn tensor_two_inside_each_node_and_data_two_across_follow_one_process() {
    let Some((_one, dir)) = two_nodes() else { return };
    let reference = family_reference_losses(dir.path(), RMS);
    let network = Network::make();
    let args = run_args(dir.path(), "nodes", &[]);
    // Node 1 first: its ranks wait for node 0's store.
    let one = network.launch(1, &dir.path().join("node1.log"), &args);
    std::thread::sleep(Duration::from_millis(500));
    let zero = network.launch(0, &dir.path().join("node0.log"), &args);
    let (status0, log0) = zero.finish(Duration::from_secs(300));
    let (status1, log1) = one.finish(Duration::from_secs(60));
    assert!(status0.success() && status1.success(), "node 0 {status0}:\n{log0}\nnode 1 {status1}:\n{log1}");
    // Each node's tensor group over its own shared memory, the copies across nodes over TCP.
    assert!(log0.contains("the model cut over 2 ranks, 2 copies of it (tensor over shm, data over tcp)"), "{log0}");
    assert_same_trajectory(
        &reference,
        &dir.path().join("nodes"),
        "tensor 2 x data 2 over two nodes",
        &as_output(status0, log0),
    );
}

/// Open MPI over the same two nodes: `mpirun` in node 0 starts two ranks there and, through a
/// launch agent standing in for ssh (it enters node 1's namespaces and runs the command Open MPI
/// gives it), its daemon and two ranks in node 1. The ranks take their places from Open MPI's
/// variables: with the tcp backend they group by hostname (tensor 2 inside each node over shared
/// memory, data 2 across over TCP), with the mpi backend Open MPI carries both; one process's
/// losses either way.
#[test]
fn mpirun_across_two_nodes_cuts_inside_each_and_follows_one_process() {
    if !stoke_comm::Backend::Mpi.is_built() {
        // `cargo xtask test` installs Open MPI and builds with it; a plain `cargo test` has neither.
        eprintln!("SKIPPED: this build lacks stoke-comm/mpi (cargo xtask test builds it and installs Open MPI)");
        return;
    }
    let Some((_one, dir)) = two_nodes() else { return };
    let reference = family_reference_losses(dir.path(), RMS);
    let network = Network::make();
    let agent = dir.path().join("node-agent.sh");
    std::fs::write(&agent, network.launch_agent()).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&agent, std::fs::Permissions::from_mode(0o755)).unwrap();
    let session = dir.path().join("ompi");
    std::fs::create_dir(&session).unwrap();
    let subnet = network.addresses[0].rsplit_once('.').unwrap().0.to_string() + ".0/24";
    let hosts = format!("{}:2,{}:2", network.addresses[0], network.addresses[1]);
    // stoke's own collectives (shared memory inside a node, TCP between), then Open MPI's.
    for (backend, groups) in [("tcp", "(tensor over shm, data over tcp)"), ("mpi", "(tensor over mpi, data over mpi)")]
    {
        let mut cmd = network.in_node(0);
        cmd.args(["timeout", "300", "mpirun", "--allow-run-as-root", "-np", "4", "--host", &hosts])
            .args(["--mca", "plm_rsh_agent"])
            .arg(&agent)
            .args(["--mca", "oob_tcp_if_include", &subnet, "--mca", "btl_tcp_if_include", &subnet])
            .args(["--mca", "orte_tmpdir_base"])
            .arg(&session)
            .args(["-x", &format!("MASTER_ADDR={}", network.addresses[0]), "-x", &format!("MASTER_PORT={}", PORT + 1)])
            .arg(env!("CARGO_BIN_EXE_stoke"))
            .args(["train", "--quiet"]);
        let name = format!("mpirun-{backend}");
        for a in run_args(dir.path(), &name, &[&format!("dist.backend=\"{backend}\"")]) {
            cmd.arg("--set").arg(a);
        }
        let log = dir.path().join(format!("{name}.log"));
        let file = std::fs::File::create(&log).unwrap();
        cmd.stdin(Stdio::null()).stdout(file.try_clone().unwrap()).stderr(file);
        let (status, text) =
            Launched { child: Some(cmd.spawn().expect("nsenter runs")), log }.finish(Duration::from_secs(320));
        assert!(status.success(), "mpirun over two nodes ({backend}) {status}:\n{text}");
        assert!(text.contains(&format!("the model cut over 2 ranks, 2 copies of it {groups}")), "{text}");
        assert_same_trajectory(
            &reference,
            &dir.path().join(&name),
            &format!("tensor 2 x data 2 over two nodes under mpirun ({backend})"),
            &as_output(status, text),
        );
    }
}

#[test]
fn a_node_that_never_arrives_is_named() {
    let Some((_one, dir)) = two_nodes() else { return };
    let network = Network::make();
    let args = run_args(dir.path(), "alone", &["dist.timeout_s=5"]);
    let (status, log) = network.launch(0, &dir.path().join("node0.log"), &args).finish(Duration::from_secs(120));
    assert!(!status.success(), "{log}");
    assert!(log.contains("ranks 2, 3") && log.contains("node 1"), "the error names the missing node:\n{log}");
    println!("{}", log.lines().find(|l| l.contains("never joined")).unwrap_or_default());
}

/// Node 1 dies (every process in its namespace killed) after a checkpoint: node 0's workers name
/// a lost rank of node 1 and stop; its launcher (`--max-restarts 1`) starts them again from the
/// run's latest checkpoint, and they wait at the rendezvous until node 1 is back (its launcher
/// started again with `train --resume`, as an operator would). The job ends on the losses of one
/// process that ran throughout.
#[test]
fn a_node_killed_mid_run_is_named_and_the_job_resumes_when_it_is_back() {
    let Some((_one, dir)) = two_nodes() else { return };
    let reference = reference_losses_over(dir.path(), RMS, 60);
    let network = Network::make();
    let args = run_args(dir.path(), "restart", &["train.steps=60", "ckpt.every=5", "dist.timeout_s=60"]);
    let zero = network.launch_with(0, &dir.path().join("node0.log"), &["--max-restarts", "1"], &[], &args);
    let one = network.launch(1, &dir.path().join("node1.log"), &args);
    let run = dir.path().join("restart");
    let deadline = Instant::now() + Duration::from_secs(240);
    let trained = || std::fs::read_to_string(run.join("metrics.jsonl")).map_or(0, |t| t.lines().count());
    while trained() < 12 {
        assert!(
            Instant::now() < deadline,
            "no steps trained:\n{}",
            std::fs::read_to_string(&zero.log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(network.kill_node(1) > 0, "node 1's processes are found in its namespace");
    let _ = one.finish(Duration::from_secs(10));
    let restarting = Instant::now() + Duration::from_secs(120);
    while !std::fs::read_to_string(&zero.log).unwrap_or_default().contains("restarting from the latest checkpoint") {
        assert!(
            Instant::now() < restarting,
            "node 0 did not restart:\n{}",
            std::fs::read_to_string(&zero.log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let one = network.launch_with(1, &dir.path().join("node1-again.log"), &[], &["--resume"], &args);
    let (status0, log0) = zero.finish(Duration::from_secs(300));
    let (status1, log1) = one.finish(Duration::from_secs(60));
    assert!(status0.success() && status1.success(), "node 0 {status0}:\n{log0}\nnode 1 {status1}:\n{log1}");
    let named: Vec<&str> =
        log0.lines().filter(|l| l.contains("rank 2 was lost") || l.contains("rank 3 was lost")).collect();
    assert!(!named.is_empty(), "the survivors name a lost rank of node 1:\n{log0}");
    println!("{}", named.join("\n"));
    // Node 0's launcher logged the restart, from a checkpoint, in the run's events.
    let events = std::fs::read_to_string(run.join("events.jsonl")).unwrap_or_default();
    let restart = events
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|e| e["event"] == "start" && e["restarts"] == 1)
        .unwrap_or_else(|| panic!("no restart in the run's events:\n{events}"));
    assert!(restart["latest_checkpoint"].as_u64().is_some_and(|s| s >= 5), "{restart}");
    assert_same_trajectory(
        &reference,
        &run,
        "tensor 2 x data 2 over two nodes, node 1 killed and back",
        &as_output(status0, log0),
    );
}
