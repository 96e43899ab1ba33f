//! The `mpi` backend under a real `mpirun -np 2` (Open MPI; `cargo xtask test` installs it).

use std::process::Command;

use crate::harness::WORKER;

#[test]
fn every_op_under_mpirun() {
    // A temporary directory of its own: Open MPI's default one is created racily when two MPI
    // jobs start at once ("mkdir /tmp/ompi.<host>.<uid>: File exists").
    let session = tempfile::tempdir().unwrap();
    let mut cmd = Command::new("timeout");
    cmd.env("OMPI_MCA_orte_tmpdir_base", session.path());
    cmd.args(["300", "mpirun", "-np", "2", "--oversubscribe"]);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    let out = cmd.args([WORKER, "check", "--backend", "mpi"]).output().expect("mpirun runs (install openmpi-bin)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "mpirun failed: {stdout}{}", String::from_utf8_lossy(&out.stderr));
    for rank in 0..2 {
        assert!(stdout.contains(&format!("rank {rank} of 2: all checks passed")), "{stdout}");
    }
}

#[test]
fn mpi_backend_outside_mpirun_is_a_clear_error() {
    // `stoke launch`-style variables without mpirun: MPI starts as a singleton of size 1.
    let session = tempfile::tempdir().unwrap();
    let out = Command::new(WORKER)
        .args(["check", "--backend", "mpi"])
        .env("OMPI_MCA_orte_tmpdir_base", session.path())
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("MPI says rank 0 of 1"), "{stderr}");
}
