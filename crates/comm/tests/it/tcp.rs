//! The tcp backend over loopback: nodes are simulated with GROUP_RANK, so ranks of one "node"
//! share memory and ranks of different ones talk TCP.

use std::time::{Duration, Instant};

use crate::harness::{assert_all_passed, assert_stopped_victim_times_out, finish_all, spawn_nodes, HANG_LIMIT};

#[test]
fn every_op_dtype_and_odd_size_with_one_to_three_nodes_of_one_rank() {
    for n in 1..=3 {
        // A world of one is on one node, so it counts as shared memory.
        let expect = if n == 1 { "shm" } else { "tcp" };
        let args = ["check", "--backend", "tcp", "--timeout", "60", "--expect-backend", expect];
        let outcomes = finish_all(spawn_nodes(n, 1, &args, &[]));
        assert_all_passed(&outcomes, &format!("tcp with {n} single-rank nodes"));
    }
}

#[test]
fn two_nodes_of_two_ranks_every_op_hierarchically() {
    // The world spans both nodes with two ranks on each: all-reduces go through shm inside a node
    // and a TCP ring between the node leaders; everything else over TCP.
    let args = ["check", "--backend", "tcp", "--timeout", "60", "--expect-backend", "tcp"];
    let outcomes = finish_all(spawn_nodes(4, 2, &args, &[]));
    assert_all_passed(&outcomes, "tcp with two nodes of two ranks");
}

#[test]
fn groups_inside_a_node_take_shm_and_groups_across_nodes_take_tcp() {
    let outcomes = finish_all(spawn_nodes(4, 2, &["nodes", "--backend", "tcp", "--timeout", "60"], &[]));
    assert_all_passed(&outcomes, "tcp sub-groups inside and across nodes");
}

#[test]
fn a_world_on_one_node_runs_on_shared_memory() {
    let args = ["check", "--backend", "tcp", "--timeout", "60", "--expect-backend", "shm"];
    let outcomes = finish_all(spawn_nodes(3, 3, &args, &[]));
    assert_all_passed(&outcomes, "tcp with three ranks on one node");
}

#[test]
fn a_rank_that_sent_and_left_is_not_taken_for_lost() {
    let outcomes = finish_all(spawn_nodes(4, 1, &["leave", "--backend", "tcp", "--timeout", "60"], &[]));
    assert_all_passed(&outcomes, "tcp ranks leaving after their last send");
}

#[test]
fn a_killed_worker_is_named_by_the_others_well_within_the_timeout() {
    for op in [&[][..], &["--op", "all_to_all"][..]] {
        let victim = 1;
        let mut args = vec!["victim", "--victim", "1", "--backend", "tcp", "--timeout", "120"];
        args.extend_from_slice(op);
        let mut workers = spawn_nodes(3, 1, &args, &[]);
        let deadline = Instant::now() + HANG_LIMIT;
        for w in &mut workers {
            let line = format!("ready {}", w.rank);
            w.wait_line(&line, deadline);
        }
        let killed_at = Instant::now();
        // SAFETY: kill with the pid of a child we started and have not reaped.
        unsafe { libc::kill(workers[victim].child.id() as i32, libc::SIGKILL) };
        let outcomes = finish_all(workers);
        assert!(killed_at.elapsed() < Duration::from_secs(60), "the survivors waited for the timeout");
        for (rank, outcome) in outcomes.iter().enumerate().filter(|(rank, _)| *rank != victim) {
            assert_eq!(outcome.code, Some(3), "rank {rank} should fail with a comm error: {}", outcome.stderr);
            assert!(
                outcome.stderr.contains("rank 1 was lost"),
                "rank {rank} should name the lost rank 1 ({op:?}), said: {}",
                outcome.stderr
            );
        }
    }
}

#[test]
fn a_killed_rank_of_another_node_fails_every_survivor_of_the_hierarchical_all_reduce() {
    // Rank 3 shares node 1 with rank 2; rank 1 waits on shared memory for its leader, rank 0, which
    // learns of the loss over TCP and passes the name on through its node's segment. Nobody may
    // return as if the all-reduce had worked, and every survivor names rank 3.
    let victim = 3;
    let mut workers = spawn_nodes(4, 2, &["victim", "--victim", "3", "--backend", "tcp", "--timeout", "120"], &[]);
    let deadline = Instant::now() + HANG_LIMIT;
    for w in &mut workers {
        let line = format!("ready {}", w.rank);
        w.wait_line(&line, deadline);
    }
    let killed_at = Instant::now();
    // SAFETY: kill with the pid of a child we started and have not reaped.
    unsafe { libc::kill(workers[victim].child.id() as i32, libc::SIGKILL) };
    let outcomes = finish_all(workers);
    assert!(killed_at.elapsed() < Duration::from_secs(60), "the survivors waited for the timeout");
    for (rank, outcome) in outcomes.iter().enumerate().filter(|(rank, _)| *rank != victim) {
        assert_eq!(outcome.code, Some(3), "rank {rank} should fail with a comm error: {}", outcome.stderr);
        let named = "rank 3 was lost";
        assert!(outcome.stderr.contains(named), "rank {rank} should say `{named}`, said: {}", outcome.stderr);
    }
}

#[test]
fn a_stopped_worker_times_out_with_its_rank_named() {
    let args = ["victim", "--victim", "1", "--backend", "tcp", "--timeout", "2"];
    assert_stopped_victim_times_out(spawn_nodes(2, 1, &args, &[]), "all_reduce");
}

#[test]
fn a_rank_that_never_arrives_is_named_with_its_node() {
    let started = Instant::now();
    let outcomes = finish_all(spawn_nodes(4, 2, &["check", "--backend", "tcp", "--timeout", "3"], &[3]));
    assert!(started.elapsed() < Duration::from_secs(60), "the rendezvous outlived its timeout");
    for (rank, outcome) in outcomes.iter().enumerate() {
        assert_eq!(outcome.code, Some(3), "rank {rank} should fail to connect: {}", outcome.stderr);
        assert!(
            outcome.stderr.contains("rank 3 (node 1) never joined the rendezvous"),
            "rank {rank} should name the missing rank 3 and its node, said: {}",
            outcome.stderr
        );
    }
}

#[test]
fn tcp_without_master_addr_is_refused_and_one_process_needs_none() {
    use stoke_comm::{connect, Backend, CommConfig, CommError, CommunicatorExt, DistEnv, ReduceOp};
    let config = CommConfig { backend: Backend::Tcp, ..CommConfig::default() };
    let env = DistEnv { rank: 0, world_size: 2, local_world_size: 2, ..DistEnv::single() };
    let err = connect(&config, &env).err().expect("no MASTER_ADDR");
    assert!(matches!(err, CommError::Environment(_)) && err.to_string().contains("MASTER_ADDR"), "{err}");
    let comm = connect(&config, &DistEnv::single()).unwrap();
    let mut buf = [1.5f32, 2.0];
    comm.all_reduce(&mut buf, ReduceOp::Avg).unwrap();
    assert_eq!(buf, [1.5, 2.0]);
    let mut out = [0u8; 2];
    comm.all_to_all(&[7u8, 9], &mut out).unwrap();
    assert_eq!(out, [7, 9]);
    assert!(comm.new_group(&[0]).unwrap().is_some());
}
