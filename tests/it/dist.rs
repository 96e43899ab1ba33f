//! Data-parallel training with real processes over loopback: 1, 2 and 3 ranks on the same global
//! batch give the same fp32 losses (started by `stoke launch`, `mpirun` and `srun`), gradient
//! buckets with and without overlap give identical losses, ranks with differing configurations are
//! refused at start, and a killed rank stops the others with an error naming it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::{free_port, losses, run_ok, stoke, FAMILIES};

/// A small fp32 model; the global batch is 6 rows (micro_batch x world size).
pub(crate) const MODEL: &[&str] = &[
    "model.n_layer=2",
    "model.d_model=64",
    "model.n_head=4",
    "model.seq_len=32",
    "train.precision=\"fp32\"",
    // A stable learning rate: at 0.01 this model's loss spikes (to 10 at step 9; a bump at step
    // 13 at 0.003), and a spike amplifies fp32 rounding differences (summation order) past 1e-5.
    "train.lr=0.002",
    "train.warmup_steps=5",
    "train.threads=1",
    "data.builtin_bytes=200000",
    "prof.enabled=false",
];

pub(crate) fn overrides(run_dir: &Path, name: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = MODEL.iter().chain(extra).map(|s| s.to_string()).collect();
    v.push(format!("run.dir={}", run_dir.display()));
    v.push(format!("run.name={name}"));
    v
}

pub(crate) fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Buckets small enough that the model above has several (its gradients are about 0.5 MiB).
pub(crate) const SMALL_BUCKETS: &[&str] = &["dist.first_bucket_mb=0.03", "dist.bucket_mb=0.1"];

/// One process on the global batch of 6 rows for 20 steps: the trajectory every data-parallel
/// run of these tests must follow.
pub(crate) fn reference_losses(dir: &Path) -> Vec<(u64, f64)> {
    family_reference_losses(dir, FAMILIES[0])
}

/// `reference_losses` of the model family `(tag, override)` (one of `FAMILIES`), run as
/// `one-<tag>`.
pub(crate) fn family_reference_losses(dir: &Path, family: (&str, &[&str])) -> Vec<(u64, f64)> {
    reference_losses_over(dir, family, 20)
}

/// `family_reference_losses` over `steps` steps.
pub(crate) fn reference_losses_over(dir: &Path, (tag, family): (&str, &[&str]), steps: usize) -> Vec<(u64, f64)> {
    let name = format!("one-{tag}");
    let mut extra = family.to_vec();
    let steps_set = format!("train.steps={steps}");
    extra.extend([steps_set.as_str(), "train.micro_batch=6"]);
    let one = overrides(dir, &name, &extra);
    run_ok(&mut stoke(&["train", "--quiet"], &refs(&one)));
    let reference = losses(&dir.join(&name));
    assert_eq!(reference.len(), steps, "{reference:?}");
    reference
}

/// Asserts `run`'s losses equal `reference` within 1e-5 relative at every step, and that rank 0
/// alone wrote its metrics (with the step's communication time).
pub(crate) fn assert_same_trajectory(reference: &[(u64, f64)], run: &Path, what: &str, output: &Output) {
    let got = losses(run);
    assert_eq!(
        got.len(),
        reference.len(),
        "{what}: {got:?}\nstdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let mut worst = 0.0f64;
    for (&(step_a, a), &(step_b, b)) in reference.iter().zip(&got) {
        assert_eq!(step_a, step_b);
        let rel = (a - b).abs() / a.abs();
        worst = worst.max(rel);
        assert!(rel <= 1e-5, "{what}, step {step_a}: loss {b} vs one process {a} (relative {rel:e})");
    }
    println!("{what}: largest relative loss difference over {} steps {worst:e}", got.len());
    // Only rank 0 writes the run's files; the other ranks' metrics would be a second writer.
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert!(metrics.lines().all(|l| l.contains("\"comm_total_ms\"")), "{metrics}");
}

/// Each case `(nproc, overrides, key, why)` launched for 2 steps exits before any step with an
/// error naming `key` and `why`; and a vla model with `vla_setting` is refused naming `vla_key`
/// and `vla_why`.
pub(crate) fn assert_refused(
    dir: &Path,
    cases: &[(&str, &[&str], &str, &str)],
    vla_setting: &str,
    (vla_key, vla_why): (&str, &str),
) {
    let vla = ["model.family=\"vla\"", "model.preset=\"vla-tiny\"", "data.builtin_episodes=64", vla_setting];
    let run_dir = format!("run.dir={}", dir.display());
    let args: Vec<&str> = vla.iter().copied().chain([run_dir.as_str(), "train.steps=2"]).collect();
    let out = stoke(&["launch", "--nproc", "2", "--", "train", "--quiet"], &args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "vla ran with {vla_setting}: {stderr}");
    assert!(stderr.contains(vla_key) && stderr.contains(vla_why), "{stderr}");
    for (i, (nproc, extra, key, why)) in cases.iter().enumerate() {
        let mut all = extra.to_vec();
        all.extend(["train.steps=2", "ckpt.every=0", "ckpt.at_end=false"]);
        let args = overrides(dir, &format!("refused-{i}"), &all);
        let out = stoke(&["launch", "--nproc", nproc, "--", "train", "--quiet"], &refs(&args)).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "case {i} ran: {stderr}");
        assert!(stderr.contains(key) && stderr.contains(why), "case {i}: want {key:?} and {why:?} in:\n{stderr}");
    }
}

/// The number of buckets the run's log line reports (`... gradients in N buckets ...`).
fn buckets_reported(stdout: &[u8]) -> usize {
    let text = String::from_utf8_lossy(stdout);
    let line = text.lines().find(|l| l.contains("data parallel: ")).unwrap_or_else(|| panic!("no layout line: {text}"));
    let after = line.split("gradients in ").nth(1).unwrap_or_else(|| panic!("{line}"));
    after.split(' ').next().unwrap().parse().unwrap_or_else(|_| panic!("{line}"))
}

#[test]
fn one_two_and_three_ranks_give_the_same_losses() {
    let dir = tempfile::tempdir().unwrap();
    for &(tag, family) in FAMILIES {
        let reference = family_reference_losses(dir.path(), (tag, family));
        // Two ranks with the default buckets (one bucket for this model), three with several.
        for (nproc, micro_batch, name, buckets) in
            [("2", "train.micro_batch=3", "two", &[][..]), ("3", "train.micro_batch=2", "three", SMALL_BUCKETS)]
        {
            let name = format!("{name}-{tag}");
            let mut extra = family.to_vec();
            extra.extend(["train.steps=20", micro_batch]);
            extra.extend_from_slice(buckets);
            let args = overrides(dir.path(), &name, &extra);
            let out = run_ok(&mut stoke(&["launch", "--nproc", nproc, "--", "train", "--quiet"], &refs(&args)));
            assert_same_trajectory(&reference, &dir.path().join(&name), &format!("{tag}, {nproc} ranks"), &out);
            let n_buckets = buckets_reported(&out.stdout);
            assert_eq!(n_buckets > 1, !buckets.is_empty(), "{tag}, {nproc} ranks: {n_buckets} buckets");
        }
    }
}

#[test]
fn buckets_with_overlap_off_give_identical_losses() {
    let dir = tempfile::tempdir().unwrap();
    let mut runs = Vec::new();
    for (overlap, name) in [("dist.overlap=true", "on"), ("dist.overlap=false", "off")] {
        let mut extra = vec!["train.steps=10", "train.micro_batch=3", overlap];
        extra.extend_from_slice(SMALL_BUCKETS);
        let args = overrides(dir.path(), name, &extra);
        let out = run_ok(&mut stoke(&["launch", "--nproc", "2", "--", "train", "--quiet"], &refs(&args)));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(&format!("overlap {name}")), "{text}");
        assert!(buckets_reported(&out.stdout) > 1, "{text}");
        runs.push(losses(&dir.path().join(name)));
    }
    assert_eq!(runs[0].len(), 10);
    // The same buckets reduced in the same order: the same bits, whenever they are sent.
    assert_eq!(runs[0], runs[1], "overlap on vs off");
}

#[test]
fn ranks_keeping_the_guard_on_the_device_follow_one_process_and_stop_together_on_a_nan() {
    // The tensor-op optimizer keeps the gradient norm on each rank's device (`guard_every`), under
    // plain data parallelism: two ranks still follow one process, and a step poisoned on both
    // stops both on the step it happened, read later by the interval, with no checkpoint after.
    let dir = tempfile::tempdir().unwrap();
    let device = ["train.fused_optimizer=false", "train.guard_every=4"];
    let one = {
        let mut extra = device.to_vec();
        extra.extend(["train.steps=20", "train.micro_batch=6"]);
        overrides(dir.path(), "one-device", &extra)
    };
    run_ok(&mut stoke(&["train", "--quiet"], &refs(&one)));
    let reference = losses(&dir.path().join("one-device"));
    assert_eq!(reference.len(), 20);
    let mut extra = device.to_vec();
    extra.extend(["train.steps=20", "train.micro_batch=3"]);
    let args = overrides(dir.path(), "two-device", &extra);
    let out = run_ok(&mut stoke(&["launch", "--nproc", "2", "--", "train", "--quiet"], &refs(&args)));
    assert_same_trajectory(&reference, &dir.path().join("two-device"), "2 ranks, guard on the device", &out);

    extra.extend(["train.log_every=5", "ckpt.every=5", "train.debug_poison_step=6"]);
    let args = overrides(dir.path(), "poisoned", &extra);
    let out = stoke(&["launch", "--nproc", "2", "--", "train", "--quiet"], &refs(&args)).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("at step 6") && stderr.contains("read at step 8"), "{stderr}");
    let dump: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("poisoned/nan-dump.json")).unwrap()).unwrap();
    assert_eq!((dump["step"].as_u64(), dump["detected_at_step"].as_u64()), (Some(6), Some(8)), "{dump}");
    assert_eq!(dump["latest_checkpoint"], 5, "{dump}");
}

/// Starts two ranks whose command lines differ by `rank1_extra` on rank 1, and checks both fail
/// with exit code 2 naming rank 1, the section and the key.
fn check_refused(rank1_extra: &str, section: &str, key: &str) {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let base = overrides(dir.path(), "refused", &["train.steps=5", "train.micro_batch=3", "dist.timeout_s=60"]);
    let mut rank1 = base.clone();
    rank1.push(rank1_extra.to_string());
    let mut workers = [worker(0, 2, port, &base), worker(1, 2, port, &rank1)];
    let deadline = Instant::now() + Duration::from_secs(120);
    for (rank, w) in workers.iter_mut().enumerate() {
        let status = wait_until(w, deadline, rank);
        let mut err = String::new();
        std::io::Read::read_to_string(w.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert_eq!(status.code(), Some(2), "rank {rank} with rank 1 given {rank1_extra}: {err}");
        for needle in ["rank 1 differs from rank 0", &format!("[{section}]"), key] {
            assert!(err.contains(needle), "rank {rank}'s error lacks `{needle}`: {err}");
        }
    }
    assert!(!dir.path().join("refused").join("metrics.jsonl").exists(), "a refused job trained");
}

#[test]
fn ranks_with_another_model_or_config_are_refused_at_start() {
    check_refused("model.d_model=128", "model", "model.d_model = 128 (rank 0: 64)");
    check_refused("train.lr=0.003", "train", "train.lr = 0.003 (rank 0: 0.002)");
}

fn wait_until(w: &mut Child, deadline: Instant, rank: usize) -> std::process::ExitStatus {
    loop {
        if let Some(status) = w.try_wait().unwrap() {
            return status;
        }
        if Instant::now() > deadline {
            let _ = w.kill();
            panic!("rank {rank} hangs");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Adds `mpirun`'s flags for this machine: more ranks than cores, root in CI containers, and a
/// temporary directory of its own under `session` (Open MPI's default, ompi.<host>.<uid> in the temp folder, is
/// created racily when two MPI jobs start at once: "mkdir ... File exists").
/// `stoke train --quiet` with `args` under `mpirun -np np` (None, said, when this build lacks MPI).
pub(crate) fn mpirun_train(np: &str, args: &[String]) -> Option<Output> {
    if !stoke_comm::Backend::Mpi.is_built() {
        eprintln!("SKIPPED: this build lacks stoke-comm/mpi (cargo xtask test builds it)");
        return None;
    }
    let session = tempfile::tempdir().unwrap();
    let mut cmd = mpirun(np, session.path());
    cmd.arg(env!("CARGO_BIN_EXE_stoke")).args(["train", "--quiet"]);
    for o in args {
        cmd.arg("--set").arg(o);
    }
    Some(run_ok(&mut cmd))
}

pub(crate) fn mpirun(np: &str, session: &Path) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.env("OMPI_MCA_orte_tmpdir_base", session);
    cmd.args(["300", "mpirun", "-np", np, "--oversubscribe"]);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    cmd
}

#[test]
fn mpirun_two_ranks_follow_one_process() {
    if !stoke_comm::Backend::Mpi.is_built() {
        // `cargo xtask test` builds with it (and installs Open MPI); a plain `cargo test` does not.
        eprintln!("SKIPPED: this build lacks stoke-comm/mpi (cargo xtask test builds it)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let reference = reference_losses(dir.path());
    let args = overrides(dir.path(), "mpi", &["train.steps=20", "train.micro_batch=3", "dist.backend=\"mpi\""]);
    let session = tempfile::tempdir().unwrap();
    let mut cmd = mpirun("2", session.path());
    cmd.arg(env!("CARGO_BIN_EXE_stoke")).args(["train", "--quiet"]);
    for o in &args {
        cmd.arg("--set").arg(o);
    }
    let out = run_ok(&mut cmd);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("2 ranks over mpi"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_same_trajectory(&reference, &dir.path().join("mpi"), "mpirun -np 2 (mpi)", &out);
}

/// A single-node Slurm cluster from `scripts/slurm-local.sh`, stopped however the test ends.
struct SlurmCluster {
    state: PathBuf,
}

impl SlurmCluster {
    fn script() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/slurm-local.sh")
    }

    fn start(state: PathBuf) -> SlurmCluster {
        let cluster = SlurmCluster { state };
        // Its own ports, apart from stoke-comm's Slurm test (16817).
        let out = Command::new(Self::script())
            .arg("start")
            .env("STOKE_SLURM_STATE", &cluster.state)
            .env("STOKE_SLURM_PORT", "16837")
            .output()
            .unwrap();
        assert!(out.status.success(), "slurm-local.sh start failed: {}", String::from_utf8_lossy(&out.stderr));
        cluster
    }
}

impl Drop for SlurmCluster {
    fn drop(&mut self) {
        let _ = Command::new(Self::script()).arg("stop").env("STOKE_SLURM_STATE", &self.state).status();
    }
}

#[test]
fn srun_two_ranks_follow_one_process() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 && Command::new("slurmctld").arg("-V").output().is_err() {
        eprintln!("SKIPPED: Slurm is not installed and installing it needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let reference = reference_losses(dir.path());
    let state = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("slurm-dist-{}", std::process::id()));
    let cluster = SlurmCluster::start(state.clone());
    let args = overrides(dir.path(), "srun", &["train.steps=20", "train.micro_batch=3", "dist.timeout_s=120"]);
    let mut cmd = Command::new("timeout");
    cmd.args(["300", "srun", "-n", "2", env!("CARGO_BIN_EXE_stoke"), "train", "--quiet"]);
    for o in &args {
        cmd.arg("--set").arg(o);
    }
    let out = run_ok(cmd.env("SLURM_CONF", state.join("slurm.conf")));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("2 ranks over shm"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_same_trajectory(&reference, &dir.path().join("srun"), "srun -n 2 (shm)", &out);
    drop(cluster);
    for name in ["slurmctld", "slurmd", "munged"] {
        assert!(!state.join(format!("{name}.started-pid")).exists(), "{name} was not stopped");
    }
}

fn worker(rank: usize, world: usize, port: u16, args: &[String]) -> Child {
    let mut cmd = stoke(&["train", "--quiet"], &refs(args));
    cmd.env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd.spawn().expect("a worker starts")
}

#[test]
fn a_killed_rank_stops_the_others_naming_it_and_the_checkpoints_verify() {
    kill_one_rank(3, 2, &["train.micro_batch=2"]);
}

/// `world` workers train far more steps than the test waits for, a checkpoint every 2 steps;
/// once a checkpoint is committed and a few steps are logged, `victim` is SIGKILLed. Every other
/// rank must stop on its own with an error naming the victim, and the committed checkpoints
/// verify.
pub(crate) fn kill_one_rank(world: usize, victim: usize, extra: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("killed");
    let mut all = vec!["train.steps=100000", "ckpt.every=2", "ckpt.keep=2", "dist.timeout_s=30"];
    all.extend_from_slice(extra);
    let args = overrides(dir.path(), "killed", &all);
    let port = free_port();
    let mut workers: Vec<Child> = (0..world).map(|rank| worker(rank, world, port, &args)).collect();
    let deadline = Instant::now() + Duration::from_secs(240);
    let committed = |run: &Path| {
        std::fs::read_dir(run.join("checkpoints"))
            .map(|rd| rd.flatten().any(|e| e.file_name().to_string_lossy().starts_with("step-")))
            .unwrap_or(false)
    };
    while !(committed(&run) && losses_logged(&run) >= 5) {
        for (rank, w) in workers.iter_mut().enumerate() {
            if let Some(status) = w.try_wait().unwrap() {
                let mut err = String::new();
                std::io::Read::read_to_string(w.stderr.as_mut().unwrap(), &mut err).unwrap();
                panic!("rank {rank} exited early with {status}: {err}");
            }
        }
        assert!(Instant::now() < deadline, "the run did not reach a checkpoint");
        std::thread::sleep(Duration::from_millis(50));
    }
    workers[victim].kill().unwrap();
    workers[victim].wait().unwrap();
    // The others must stop on their own: bounded here (well above dist.timeout_s) so a hang fails
    // the test instead of blocking it.
    let deadline = Instant::now() + Duration::from_secs(180);
    for (rank, w) in workers.iter_mut().enumerate().filter(|(rank, _)| *rank != victim) {
        let status = loop {
            if let Some(status) = w.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = w.kill();
                panic!("rank {rank} hangs after rank {victim} was killed");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(w.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(!status.success(), "rank {rank} succeeded after losing rank {victim}: {err}");
        assert!(
            err.contains(&format!("rank {victim}")),
            "rank {rank}'s error does not name the lost rank {victim}: {err}"
        );
    }
    let verify = Command::new(env!("CARGO_BIN_EXE_stoke")).args(["ckpt", "verify"]).arg(&run).output().unwrap();
    assert!(
        verify.status.success(),
        "the committed checkpoints do not verify:\n{}{}",
        String::from_utf8_lossy(&verify.stdout),
        String::from_utf8_lossy(&verify.stderr)
    );
}

fn losses_logged(run: &Path) -> usize {
    std::fs::read_to_string(run.join("metrics.jsonl")).map(|t| t.lines().count()).unwrap_or(0)
}
