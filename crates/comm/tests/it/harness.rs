//! Starting worker processes and collecting what they say.

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

pub const WORKER: &str = env!("CARGO_BIN_EXE_stoke-comm-worker");

/// How long a test lets its workers run before it kills them and fails: a safety net far above
/// what they need, so a hang fails the test instead of the suite.
pub const HANG_LIMIT: Duration = Duration::from_secs(180);

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub struct Outcome {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// One running worker with its output lines arriving on channels.
pub struct Worker {
    pub rank: usize,
    pub child: Child,
    lines: mpsc::Receiver<(bool, String)>,
    stdout: String,
    stderr: String,
}

impl Worker {
    pub fn spawn(mut cmd: Command, rank: usize) -> Worker {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).stdin(Stdio::null());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        let tx2 = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((true, line));
            }
        });
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx2.send((false, line));
            }
        });
        Worker { rank, child, lines, stdout: String::new(), stderr: String::new() }
    }

    /// Waits for a stdout line equal to `line`.
    pub fn wait_line(&mut self, line: &str, deadline: Instant) {
        while Instant::now() < deadline {
            match self.lines.recv_timeout(Duration::from_millis(100)) {
                Ok((is_out, text)) => {
                    let done = is_out && text == line;
                    self.record(is_out, text);
                    if done {
                        return;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        let _ = self.child.kill();
        panic!("rank {} never printed `{line}`; stdout: {} stderr: {}", self.rank, self.stdout, self.stderr);
    }

    fn record(&mut self, is_out: bool, text: String) {
        let target = if is_out { &mut self.stdout } else { &mut self.stderr };
        target.push_str(&text);
        target.push('\n');
    }

    /// Waits for the process to exit (killing it at `deadline`) and returns all its output.
    pub fn finish(mut self, deadline: Instant) -> Outcome {
        let code = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status.code();
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("rank {} hung; stdout: {} stderr: {}", self.rank, self.stdout, self.stderr);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // The pipes close at exit; drain what is left.
        while let Ok((is_out, text)) = self.lines.recv_timeout(Duration::from_millis(500)) {
            self.record(is_out, text);
        }
        Outcome { code, stdout: self.stdout, stderr: self.stderr }
    }
}

/// Starts `n` workers with torchrun's variables on a fresh loopback port, all on one node.
pub fn spawn_torchrun(n: usize, args: &[&str]) -> Vec<Worker> {
    spawn_nodes(n, n, args, &[])
}

/// Starts `n` workers with torchrun's variables, `per_node` ranks to a node (GROUP_RANK is
/// `rank / per_node`), on a fresh loopback port; `skip` ranks are left out (they never arrive).
pub fn spawn_nodes(n: usize, per_node: usize, args: &[&str], skip: &[usize]) -> Vec<Worker> {
    let port = free_port();
    (0..n)
        .filter(|rank| !skip.contains(rank))
        .map(|rank| {
            let mut cmd = Command::new(WORKER);
            cmd.args(args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", (rank % per_node).to_string())
                .env("LOCAL_WORLD_SIZE", per_node.to_string())
                .env("GROUP_RANK", (rank / per_node).to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string());
            Worker::spawn(cmd, rank)
        })
        .collect()
}

pub fn finish_all(workers: Vec<Worker>) -> Vec<Outcome> {
    let deadline = Instant::now() + HANG_LIMIT;
    workers.into_iter().map(|w| w.finish(deadline)).collect()
}

/// Asserts every worker exited 0 and said its checks passed.
pub fn assert_all_passed(outcomes: &[Outcome], what: &str) {
    for (rank, outcome) in outcomes.iter().enumerate() {
        assert_eq!(
            outcome.code,
            Some(0),
            "{what}: rank {rank} failed\nstdout:\n{}\nstderr:\n{}",
            outcome.stdout,
            outcome.stderr
        );
        assert!(outcome.stdout.contains("all checks passed"), "{what}: rank {rank} said: {}", outcome.stdout);
    }
}

/// Stops rank 1 of `workers` (SIGSTOP) once every rank is ready; rank 0 must fail naming rank 1,
/// `op` and `timeout_s`. The victim is killed after.
pub fn assert_stopped_victim_times_out(mut workers: Vec<Worker>, op: &str) {
    let deadline = Instant::now() + HANG_LIMIT;
    for w in &mut workers {
        let line = format!("ready {}", w.rank);
        w.wait_line(&line, deadline);
    }
    let victim_pid = workers[1].child.id() as i32;
    // SAFETY: signals to a child we started and have not reaped.
    unsafe { libc::kill(victim_pid, libc::SIGSTOP) };
    let mut workers = workers.into_iter();
    let rank0 = workers.next().unwrap().finish(Instant::now() + HANG_LIMIT);
    let mut victim = workers.next().unwrap();
    // SAFETY: as above.
    unsafe { libc::kill(victim_pid, libc::SIGKILL) };
    let _ = victim.child.wait();
    assert_eq!(rank0.code, Some(3), "rank 0 should fail: {}", rank0.stderr);
    assert!(
        rank0.stderr.contains("for rank 1") && rank0.stderr.contains("timeout_s") && rank0.stderr.contains(op),
        "rank 0 should name rank 1, `{op}` and the timeout, said: {}",
        rank0.stderr
    );
}
