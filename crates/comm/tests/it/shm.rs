//! The shared-memory backend with 1 to 4 processes, a killed peer and a stopped peer.

use std::time::Instant;

use crate::harness::{assert_all_passed, assert_stopped_victim_times_out, finish_all, spawn_torchrun, HANG_LIMIT};

#[test]
fn every_op_dtype_and_odd_size_with_one_to_four_processes() {
    for n in 1..=4 {
        let outcomes = finish_all(spawn_torchrun(n, &["check", "--timeout", "60"]));
        assert_all_passed(&outcomes, &format!("shm with {n} processes"));
    }
}

#[test]
fn small_slots_force_many_ring_chunks() {
    // 4 KiB slots: every size above 1 KiB of f32 crosses several chunks, odd remainders included.
    let outcomes = finish_all(spawn_torchrun(3, &["check", "--timeout", "60", "--slot-bytes", "4096"]));
    assert_all_passed(&outcomes, "shm with 4 KiB slots");
}

#[test]
fn path_rendezvous_under_a_job_key() {
    // Without MASTER_ADDR/PORT, Slurm's job and step ids name a segment path.
    let job = format!("{}", std::process::id());
    let workers = (0..2)
        .map(|rank| {
            let mut cmd = std::process::Command::new(crate::harness::WORKER);
            cmd.args(["check", "--timeout", "60"])
                .env_remove("MASTER_ADDR")
                .env_remove("MASTER_PORT")
                .env_remove("RANK")
                .env("SLURM_PROCID", rank.to_string())
                .env("SLURM_NTASKS", "2")
                .env("SLURM_LOCALID", rank.to_string())
                .env("SLURM_JOB_ID", format!("test{job}"))
                .env("SLURM_STEP_ID", "0");
            crate::harness::Worker::spawn(cmd, rank)
        })
        .collect();
    let outcomes = finish_all(workers);
    assert_all_passed(&outcomes, "shm with a path rendezvous");
    let leftover = std::path::Path::new("/dev/shm").join(format!("stoke-comm-slurm-test{job}-0"));
    assert!(!leftover.exists(), "the segment file {} was left behind", leftover.display());
}

#[test]
fn a_killed_worker_is_named_by_the_others() {
    // A long timeout: the others must notice the death itself, not time out.
    let victim = 1;
    let mut workers = spawn_torchrun(3, &["victim", "--victim", "1", "--timeout", "120"]);
    let deadline = Instant::now() + HANG_LIMIT;
    for w in &mut workers {
        let line = format!("ready {}", w.rank);
        w.wait_line(&line, deadline);
    }
    // SAFETY: kill with the pid of a child we started and have not reaped.
    unsafe { libc::kill(workers[victim].child.id() as i32, libc::SIGKILL) };
    let outcomes = finish_all(workers);
    for (rank, outcome) in outcomes.iter().enumerate() {
        if rank == victim {
            assert_eq!(outcome.code, None, "the victim was killed by a signal");
            continue;
        }
        assert_eq!(outcome.code, Some(3), "rank {rank} should fail with a comm error: {}", outcome.stderr);
        assert!(
            outcome.stderr.contains("rank 1 was lost"),
            "rank {rank} should name the lost rank 1, said: {}",
            outcome.stderr
        );
    }
}

#[test]
fn a_killed_worker_is_named_in_an_all_to_all() {
    let victim = 2;
    let mut workers = spawn_torchrun(3, &["victim", "--victim", "2", "--op", "all_to_all", "--timeout", "120"]);
    let deadline = Instant::now() + HANG_LIMIT;
    for w in &mut workers {
        let line = format!("ready {}", w.rank);
        w.wait_line(&line, deadline);
    }
    // SAFETY: kill with the pid of a child we started and have not reaped.
    unsafe { libc::kill(workers[victim].child.id() as i32, libc::SIGKILL) };
    let outcomes = finish_all(workers);
    for (rank, outcome) in outcomes.iter().enumerate().filter(|(rank, _)| *rank != victim) {
        assert_eq!(outcome.code, Some(3), "rank {rank} should fail with a comm error: {}", outcome.stderr);
        assert!(
            outcome.stderr.contains("rank 2 was lost") && outcome.stderr.contains("all_to_all"),
            "rank {rank} should name the lost rank 2 and the operation, said: {}",
            outcome.stderr
        );
    }
}

#[test]
fn a_rank_that_sent_and_left_is_not_taken_for_lost() {
    // Rank 0 waits for rank 1 while ranks 2 and 3 have sent their messages and exited: a
    // liveness check that counted every member would fail this wait with "rank 2 was lost".
    let outcomes = finish_all(spawn_torchrun(4, &["leave", "--timeout", "60"]));
    assert_all_passed(&outcomes, "ranks leaving after their last send");
}

#[test]
fn a_stopped_worker_times_out_with_its_rank_named() {
    stopped_worker_times_out(&[]);
}

#[test]
fn a_stopped_worker_times_out_in_an_all_to_all() {
    stopped_worker_times_out(&["--op", "all_to_all"]);
}

fn stopped_worker_times_out(op: &[&str]) {
    let mut args = vec!["victim", "--victim", "1", "--timeout", "2"];
    args.extend_from_slice(op);
    let op_name = if op.is_empty() { "all_reduce" } else { "all_to_all" };
    assert_stopped_victim_times_out(spawn_torchrun(2, &args), op_name);
}

#[test]
fn bad_arguments_are_refused_before_anything_is_queued() {
    use stoke_comm::{connect, CommConfig, CommError, CommunicatorExt, DistEnv, ReduceOp};
    let comm = connect(&CommConfig::default(), &DistEnv::single()).unwrap();
    let mut bytes = [1u8, 2, 3];
    let err = comm.all_reduce(&mut bytes, ReduceOp::Avg).unwrap_err();
    assert!(matches!(err, CommError::InvalidArgument { op: "all_reduce", .. }), "{err}");
    let err = comm.broadcast(&mut bytes, 1).unwrap_err();
    assert!(err.to_string().contains("root 1"), "{err}");
    let err = comm.send(&bytes, 0).unwrap_err();
    assert!(matches!(err, CommError::InvalidArgument { op: "send", .. }), "{err}");
    assert!(comm.new_group(&[0, 0]).is_err());
    // None of that poisoned the communicator: a valid call still works, on any element type.
    let mut floats = [1.5f32, -2.0];
    comm.all_reduce(&mut floats, ReduceOp::Avg).unwrap();
    assert_eq!(floats, [1.5, -2.0]);
    comm.barrier().unwrap();
    // All-to-all on one rank is a copy; unlike lengths are refused.
    let mut out = [0u8; 3];
    comm.all_to_all(&bytes, &mut out).unwrap();
    assert_eq!(out, bytes);
    let err = comm.all_to_all(&bytes, &mut out[..2]).unwrap_err();
    assert!(matches!(err, CommError::InvalidArgument { op: "all_to_all", .. }), "{err}");
    let config = CommConfig { timeout_s: 0.0, ..CommConfig::default() };
    assert!(connect(&config, &DistEnv::single()).is_err(), "timeout_s 0 is refused");
}
