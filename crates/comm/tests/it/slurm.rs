//! The shm backend under `srun -n 2` in a single-node Slurm cluster that
//! `scripts/slurm-local.sh` starts and stops (Debian's slurm-wlm with munge; installed when
//! missing, which needs root).

use std::path::PathBuf;
use std::process::Command;

use crate::harness::WORKER;

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/slurm-local.sh")
}

/// Stops the cluster however the test ends.
struct Cluster {
    state: PathBuf,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(script()).arg("stop").env("STOKE_SLURM_STATE", &self.state).status();
    }
}

#[test]
fn all_reduce_under_srun_in_a_local_slurm_cluster() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 && Command::new("slurmctld").arg("-V").output().is_err() {
        eprintln!("SKIPPED: Slurm is not installed and installing it needs root");
        return;
    }
    let state = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("slurm-local-{}", std::process::id()));
    let cluster = Cluster { state: state.clone() };
    let start = Command::new(script()).arg("start").env("STOKE_SLURM_STATE", &state).output().unwrap();
    assert!(start.status.success(), "slurm-local.sh start failed: {}", String::from_utf8_lossy(&start.stderr));
    let out = Command::new("timeout")
        .args(["300", "srun", "-n", "2", WORKER, "check", "--timeout", "120"])
        .env("SLURM_CONF", state.join("slurm.conf"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "srun failed: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    for rank in 0..2 {
        assert!(stdout.contains(&format!("rank {rank} of 2: all checks passed")), "{stdout}");
    }
    drop(cluster);
    for name in ["slurmctld", "slurmd", "munged"] {
        assert!(!state.join(format!("{name}.started-pid")).exists(), "{name} was not stopped");
    }
}
