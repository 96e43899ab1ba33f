//! `stoke launch`: torchrun's variables, rank-prefixed output, stop-all on the first failure.

use std::process::Command;
use std::time::Instant;

fn launch(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_stoke")).arg("launch").args(args).output().expect("stoke launch runs")
}

#[test]
fn workers_get_torchrun_variables_and_prefixed_output() {
    let out = launch(&[
        "--nproc",
        "3",
        "--program",
        "sh",
        "--",
        "-c",
        "echo \"vars $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT\"; echo oops >&2",
    ]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let mut port = None;
    for rank in 0..3 {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("[rank {rank}] vars {rank} 3 {rank} 3 127.0.0.1 ")))
            .unwrap_or_else(|| panic!("no vars line for rank {rank} in:\n{stdout}"));
        let this_port: u16 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(port.is_none_or(|p| p == this_port), "all workers share MASTER_PORT");
        port = Some(this_port);
        assert!(stderr.contains(&format!("[rank {rank}] oops")), "stderr is prefixed too: {stderr}");
    }
}

#[test]
fn the_first_failure_stops_the_others_and_sets_the_exit_code() {
    let start = Instant::now();
    // Rank 1 fails with 7; the others would sleep for ten minutes.
    let out = launch(&[
        "--nproc",
        "3",
        "--program",
        "sh",
        "--",
        "-c",
        "if [ \"$RANK\" = 1 ]; then exit 7; fi; echo started; exec sleep 600",
    ]);
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("worker 1 failed"), "{stderr}");
    // Not a timing assertion on stoke's speed: only proof that the sleepers did not run out their
    // ten minutes.
    assert!(start.elapsed().as_secs() < 300, "the other workers were not stopped");
}

#[test]
fn stoke_subcommands_run_as_workers() {
    let out = launch(&["--nproc", "2", "--", "config", "--defaults"]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.lines().any(|l| l.starts_with("[rank 0] ")) && stdout.lines().any(|l| l.starts_with("[rank 1] ")));
}

#[test]
fn a_worker_without_heartbeats_counts_as_hung_and_the_job_stops() {
    let start = Instant::now();
    // `sleep` never finishes a step, so it never touches its heartbeat file.
    let out = launch(&["--nproc", "2", "--hang-timeout-s", "2", "--program", "sh", "--", "-c", "exec sleep 600"]);
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("sent no heartbeat for 2 s (hung)"), "{stderr}");
    // Only proof that the sleepers were stopped instead of running out their ten minutes.
    assert!(start.elapsed().as_secs() < 300, "the hung workers were not stopped");
}
