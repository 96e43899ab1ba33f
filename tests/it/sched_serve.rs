//! `stoke sched serve` with real processes: three small training jobs on two slots under the fair
//! policy. The first job starts on both slots, is shrunk to one when the others arrive (through
//! the launcher's preemption: a checkpoint, then a restart on one worker) and grown back to two
//! when they finish; the scheduler is SIGKILLed mid-run and started again on the same folder,
//! re-adopts the running launchers, and every job completes. The shrunk-and-grown job trains
//! every step exactly once, each restart resumes at least at the last step it had reached, and
//! its losses match those of a job that ran on one worker throughout. A cancelled job stops through
//! the preemption path with a checkpoint; a cancelled queued one never starts.
//!
//! Under the goodput policy: a job starting on both slots first profiles on one worker, then two
//! (its measured points recorded and fitted), is shrunk when a second job arrives, and every
//! worker of the two jobs runs pinned to its own core (read from `/proc/PID/task/TID/status`).

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::{losses, run_ok, stoke};

/// The small job every scheduler test submits (also `benches/sched_real.sh`'s).
pub(crate) const JOB: &str = include_str!("../../benches/sched_job.toml");

/// The scheduler process (`dir` its state folder); killed, with every launcher its database
/// names, if the test fails.
pub(crate) struct Server {
    pub(crate) child: Child,
    pub(crate) dir: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            for job in status(&self.dir)["jobs"].as_array().cloned().unwrap_or_default() {
                if let Some(pid) = job["pid"].as_i64() {
                    // SAFETY: kill(2) of the process group of a launcher this test's server started.
                    unsafe { libc::kill(-(pid as libc::pid_t), libc::SIGKILL) };
                }
            }
        }
    }
}

fn serve(dir: &Path, log: &str) -> Server {
    serve_with(dir, log, &["--policy", "fair"])
}

fn serve_with(dir: &Path, log: &str, extra: &[&str]) -> Server {
    let log = std::fs::File::create(dir.join(log)).unwrap();
    let state = dir.join("state");
    let mut args = vec![
        "sched",
        "serve",
        "--dir",
        state.to_str().unwrap(),
        "--slots",
        "2",
        "--prometheus-port",
        "0",
        "--poll-s",
        "0.2",
    ];
    args.extend_from_slice(extra);
    args.push("--exit-when-idle");
    let child = stoke(&args, &[])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("stoke sched serve starts");
    Server { child, dir: dir.join("state") }
}

pub(crate) fn status(state: &Path) -> serde_json::Value {
    let out = stoke(&["sched", "status", "--dir", state.to_str().unwrap(), "--json"], &[]).output().unwrap();
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

pub(crate) fn job<'a>(status: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    status["jobs"]
        .as_array()
        .and_then(|jobs| jobs.iter().find(|j| j["name"] == name))
        .unwrap_or(&serde_json::Value::Null)
}

pub(crate) fn submit(state: &Path, config: &Path, name: &str, max: &str, steps: u64) {
    run_ok(&mut stoke(
        &["sched", "submit", "--dir", state.to_str().unwrap(), config.to_str().unwrap(), "--name", name, "--max", max],
        &[&format!("train.steps={steps}")],
    ));
}

pub(crate) fn starts(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("events.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["event"] == "start")
        .collect()
}

pub(crate) fn last_step(run: &Path) -> u64 {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["step"].as_u64())
        .max()
        .unwrap_or(0)
}

/// Watches job `a`: for each count of its restarts so far, the highest step seen before the next.
struct Watch {
    run: PathBuf,
    highest_before: Vec<u64>,
}

impl Watch {
    fn look(&mut self) {
        let step = last_step(&self.run);
        let n = starts(&self.run).len();
        if self.highest_before.len() <= n {
            self.highest_before.resize(n + 1, 0);
        }
        // A step seen before restart n+1 was logged by the workers that restart stopped.
        self.highest_before[n] = self.highest_before[n].max(step);
    }
}

/// Polls every 50 ms until `ready`; fails if the server exits first or `limit` passes (a bound on
/// a hang, not a timing assertion).
fn wait_until(server: &mut Server, watch: &mut Watch, what: &str, limit: Duration, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    loop {
        watch.look();
        if ready() {
            return;
        }
        if let Some(status) = server.child.try_wait().unwrap() {
            // It may have reached `ready` and exited (--exit-when-idle) since the look above.
            watch.look();
            if ready() {
                return;
            }
            panic!("the scheduler exited ({status}) before {what}");
        }
        assert!(Instant::now() < deadline, "no {what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A test's folder: the scheduler's state folder, the job config written there, and the run
/// folder the job `first` will train in.
fn setup(first: &str) -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let config = dir.path().join("job.toml");
    std::fs::write(&config, JOB).unwrap();
    let run = state.join("runs").join(first);
    (dir, state, config, run)
}

#[test]
fn three_jobs_share_two_slots_survive_a_killed_scheduler_and_the_resized_one_keeps_its_trajectory() {
    let (dir, state, config, run_a) = setup("a");
    let mut watch = Watch { run: run_a.clone(), highest_before: vec![0] };
    let mut server = serve(dir.path(), "serve-1.log");
    submit(&state, &config, "a", "2", 600);
    wait_until(&mut server, &mut watch, "20 steps of a on two workers", Duration::from_secs(300), || {
        last_step(&run_a) >= 20
    });
    assert_eq!(job(&status(&state), "a")["workers"], 2);
    // Two jobs arrive: a is shrunk to one worker to make room for b; c waits.
    submit(&state, &config, "b", "1", 100);
    submit(&state, &config, "c", "1", 100);
    let run_b = state.join("runs").join("b");
    wait_until(&mut server, &mut watch, "a restarted on one worker and b running", Duration::from_secs(300), || {
        starts(&run_a).iter().any(|e| e["world_size"] == 1) && last_step(&run_b) >= 10
    });
    let before = status(&state);
    assert_eq!(job(&before, "c")["state"], "queued", "{before}");
    let pids: Vec<(String, i64)> =
        ["a", "b"].iter().map(|n| (n.to_string(), job(&before, n)["pid"].as_i64().expect("a launcher pid"))).collect();
    // The scheduler dies mid-run; its jobs go on.
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let mut server = serve(dir.path(), "serve-2.log");
    // Its /metrics, once it has looked at the jobs.
    let addr = loop {
        watch.look();
        let s = status(&state);
        if let Some(addr) = s["prometheus_addr"].as_str().filter(|_| s["history"].to_string().contains("adopted")) {
            break addr.parse::<std::net::SocketAddr>().unwrap();
        }
        assert!(server.child.try_wait().unwrap().is_none(), "the restarted scheduler exited");
        std::thread::sleep(Duration::from_millis(50));
    };
    // A second server on the same folder is refused while this one runs (it holds the lock: it has
    // written its history).
    let second = stoke(&["sched", "serve", "--dir", state.to_str().unwrap(), "--slots", "2"], &[]).output().unwrap();
    assert_eq!(second.status.code(), Some(2), "{}", String::from_utf8_lossy(&second.stderr));
    assert!(String::from_utf8_lossy(&second.stderr).contains("another `stoke sched serve`"));
    std::thread::sleep(Duration::from_millis(500));
    let text = stoke_prof::scrape(addr).unwrap();
    stoke_prof::validate_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    // Job a (600 steps) still runs; b (100) may have finished while the scheduler restarted.
    for series in [
        "stoke_sched_job_workers{job=\"a\"}",
        "stoke_sched_job_throughput_steps_per_second{job=\"a\"}",
        "stoke_sched_job_goodput_steps_per_second{job=\"a\"}",
    ] {
        assert!(text.contains(series), "{series} missing:\n{text}");
    }
    let deadline = Duration::from_secs(600);
    wait_until(&mut server, &mut watch, "the end of every job", deadline, || {
        status(&state)["jobs"].as_array().is_some_and(|jobs| {
            jobs.iter().all(|j| j["state"] != "queued" && j["state"] != "running" && j["state"] != "starting")
        })
    });
    let status_code = server.child.wait().unwrap();
    assert!(status_code.success(), "{status_code}");
    let end = status(&state);
    for name in ["a", "b", "c"] {
        assert_eq!(job(&end, name)["state"], "finished", "{name}: {end}");
    }
    // The launchers that ran at the kill were adopted, not started again.
    let history = end["history"].as_array().unwrap();
    for (name, pid) in &pids {
        let id = job(&end, name)["id"].clone();
        assert!(
            history
                .iter()
                .any(|h| h["job"] == id && h["event"] == "adopted" && h["detail"] == format!("launcher pid {pid}")),
            "{name} not re-adopted: {end}"
        );
        assert_eq!(job(&end, name)["launches"], 1, "{name}: {end}");
    }
    // Every decision carries its reason; a was shrunk when b arrived and grown when c finished.
    let decisions = end["decisions"].as_array().unwrap();
    let a_id = job(&end, "a")["id"].clone();
    let reasons: Vec<&str> =
        decisions.iter().filter(|d| d["job"] == a_id).map(|d| d["reason"].as_str().unwrap()).collect();
    assert!(reasons.iter().any(|r| r.contains("shrunk from 2 to 1")), "{reasons:?}");
    assert!(reasons.iter().any(|r| r.contains("grown from 1 to 2")), "{reasons:?}");
    assert!(decisions.iter().all(|d| !d["reason"].as_str().unwrap().is_empty()), "{decisions:?}");
    let a_starts = starts(&run_a);
    let worlds: Vec<u64> = a_starts.iter().map(|e| e["world_size"].as_u64().unwrap()).collect();
    assert_eq!(worlds, [1, 2], "a restarted on one worker, then on two: {a_starts:?}");
    assert!(a_starts[0]["cause"].as_str().unwrap().contains("shrinking from 2 to 1"), "{a_starts:?}");
    assert!(a_starts[1]["cause"].as_str().unwrap().contains("growing from 1 to 2"), "{a_starts:?}");
    // No step lost beyond the checkpoint: each restart resumed at least from the highest step the
    // workers it replaced had logged, and every step is logged exactly once.
    for (k, start) in a_starts.iter().enumerate() {
        let resumed = start["latest_checkpoint"].as_u64().unwrap();
        assert!(
            resumed >= watch.highest_before[k],
            "restart {k} resumed at {resumed}, after step {} was seen",
            watch.highest_before[k]
        );
    }
    let a = losses(&run_a);
    assert_eq!(a.iter().map(|l| l.0).collect::<Vec<_>>(), (1..=600).collect::<Vec<_>>());
    // b ran on one worker from start to end, with a's schedule (lr_horizon) and data: a's losses
    // (two workers, then one, over the same global batch) equal b's within fp32 rounding.
    let b = losses(&run_b);
    assert_eq!(b.len(), 100);
    let worst = a.iter().zip(&b).map(|(x, y)| (x.1 - y.1).abs() / y.1.abs()).fold(0.0, f64::max);
    assert!(worst <= 1e-5, "a and b differ by {worst:e} over their first 100 steps");
    println!("a's losses against b's over 100 steps: largest relative difference {worst:e}");
    // The simulator's prediction of this run against the measured completion times.
    let out = run_ok(&mut stoke(&["sched", "report", "--dir", state.to_str().unwrap()], &[]));
    let report = String::from_utf8_lossy(&out.stdout);
    println!("{report}");
    for name in ["a", "b", "c"] {
        assert!(report.lines().any(|l| l.starts_with(name) && l.contains('%')), "{report}");
    }
}

#[test]
fn a_cancelled_job_stops_with_a_checkpoint_and_a_queued_one_never_starts() {
    let (dir, state, config, run) = setup("long");
    let mut watch = Watch { run: run.clone(), highest_before: vec![0] };
    let mut server = serve(dir.path(), "serve.log");
    submit(&state, &config, "long", "2", 100_000);
    // It needs both slots: fair share cannot admit it beside the long job's minimum.
    run_ok(&mut stoke(
        &[
            "sched",
            "submit",
            "--dir",
            state.to_str().unwrap(),
            config.to_str().unwrap(),
            "--name",
            "waiting",
            "--min",
            "2",
        ],
        &["train.steps=100"],
    ));
    wait_until(&mut server, &mut watch, "5 steps of the long job", Duration::from_secs(300), || last_step(&run) >= 5);
    // The long job holds a slot the other needs; the other waits, and is cancelled there.
    let out = run_ok(&mut stoke(&["sched", "cancel", "--dir", state.to_str().unwrap(), "waiting"], &[]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("cancelled"));
    let out = run_ok(&mut stoke(&["sched", "cancel", "--dir", state.to_str().unwrap(), "long"], &[]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("cancel requested"));
    wait_until(&mut server, &mut watch, "the end of both jobs", Duration::from_secs(300), || {
        status(&state)["jobs"].as_array().is_some_and(|jobs| jobs.iter().all(|j| j["state"] == "cancelled"))
    });
    assert!(server.child.wait().unwrap().success());
    let end = status(&state);
    let long = job(&end, "long");
    assert_eq!(long["exit_code"], 75, "stopped through the preemption path: {end}");
    assert!(job(&end, "waiting")["launches"] == 0 && !state.join("runs").join("waiting").exists(), "{end}");
    let events = std::fs::read_to_string(run.join("events.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(events.lines().last().unwrap()).unwrap();
    assert_eq!(last["event"], "preempted", "{events}");
    // The checkpoint it stopped with is its last logged step: nothing trained is lost.
    assert_eq!(last["latest_checkpoint"].as_u64(), Some(last_step(&run)), "{events}");
    // The table names both.
    let out = run_ok(&mut stoke(&["sched", "status", "--dir", state.to_str().unwrap()], &[]));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.lines().filter(|l| l.contains("cancelled")).count() == 2, "{table}");
}

/// The workers of a launcher (its child processes) and, for each, the CPUs every one of its
/// threads may run on (`Cpus_allowed_list`), as the kernel reports them.
fn worker_cpus(launcher: i64) -> Vec<(i64, Vec<String>)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i64>() else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<i64>().ok());
        // Its workers are this binary; the slot checks it runs are shells.
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if ppid != Some(launcher) || comm.trim() != "stoke" {
            continue;
        }
        let mut lists = Vec::new();
        for task in std::fs::read_dir(entry.path().join("task")).into_iter().flatten().flatten() {
            let Ok(status) = std::fs::read_to_string(task.path().join("status")) else { continue };
            if let Some(line) = status.lines().find(|l| l.starts_with("Cpus_allowed_list:")) {
                lists.push(line["Cpus_allowed_list:".len()..].trim().to_string());
            }
        }
        if !lists.is_empty() {
            out.push((pid, lists));
        }
    }
    out
}

fn history_has(status: &serde_json::Value, job_id: &serde_json::Value, event: &str) -> bool {
    status["history"].as_array().is_some_and(|h| h.iter().any(|e| &e["job"] == job_id && e["event"] == event))
}

/// This process's CPUs (the server's slots are pinned to the first two of them).
fn own_cpus() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find(|l| l.starts_with("Cpus_allowed_list:"))
        .map(|l| {
            l["Cpus_allowed_list:".len()..]
                .trim()
                .split(',')
                .map(|r| match r.split_once('-') {
                    Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
                    None => 1,
                })
                .sum()
        })
        .unwrap_or(0)
}

#[test]
fn goodput_profiles_a_new_job_on_one_then_two_workers_and_pins_every_worker_to_its_own_core() {
    let (dir, state, config, run_a) = setup("a");
    let mut watch = Watch { run: run_a.clone(), highest_before: vec![0] };
    let mut server = serve_with(
        dir.path(),
        "serve.log",
        &["--policy", "goodput", "--profile-steps", "8", "--tick-s", "1", "--min-resize-interval-s", "5"],
    );
    submit(&state, &config, "a", "2", 300);
    // a starts on both slots' allocation but on one worker: its profile; then on two.
    wait_until(&mut server, &mut watch, "a's profile", Duration::from_secs(300), || {
        let s = status(&state);
        let id = job(&s, "a")["id"].clone();
        history_has(&s, &id, "profiled") || history_has(&s, &id, "profile_cut")
    });
    let s = status(&state);
    let a = job(&s, "a").clone();
    let history: Vec<&serde_json::Value> =
        s["history"].as_array().unwrap().iter().filter(|h| h["job"] == a["id"]).collect();
    let events: Vec<&str> = history.iter().map(|h| h["event"].as_str().unwrap()).collect();
    let pos = |e: &str| events.iter().position(|x| *x == e).unwrap_or_else(|| panic!("no {e}: {events:?}"));
    assert!(
        pos("profile_1") < pos("launched") && pos("launched") < pos("profile_2") && pos("profile_2") < pos("profiled")
    );
    assert_eq!(history[pos("launched")]["workers"], 1, "the profile starts on one worker: {history:?}");
    let profiled: serde_json::Value =
        serde_json::from_str(history[pos("profiled")]["detail"].as_str().unwrap()).unwrap();
    assert!(
        profiled["cost_s"].as_f64().unwrap() >= 0.0 && profiled["steps_at_1"].as_u64().unwrap() >= 8 + 2,
        "{profiled}"
    );
    // Both sizes measured (at least the profile's steps each), and they are what the fit reads.
    let sizes: Vec<(u64, u64)> = a["throughput"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["workers"].as_u64().unwrap(), p["steps"].as_u64().unwrap()))
        .collect();
    assert!(sizes.iter().any(|&(w, n)| w == 1 && n >= 8) && sizes.iter().any(|&(w, n)| w == 2 && n >= 8), "{sizes:?}");
    let worlds: Vec<u64> = starts(&run_a).iter().map(|e| e["world_size"].as_u64().unwrap()).collect();
    assert_eq!(worlds, [2], "the profile's one restart: from one worker to two: {worlds:?}");
    let pinning = own_cpus() >= 2;
    if !pinning {
        println!("skipped the pinning checks: this process may run on fewer than 2 CPUs");
    }
    let cores: Vec<String> = s["cores"].as_str().unwrap().split(',').map(String::from).collect();
    // Two more jobs arrive: the goodput policy admits b at its minimum by shrinking a; c waits.
    submit(&state, &config, "b", "1", 60);
    submit(&state, &config, "c", "1", 60);
    let run_b = state.join("runs").join("b");
    let mut seen = None;
    wait_until(&mut server, &mut watch, "a on one worker beside b, each pinned", Duration::from_secs(300), || {
        if !(starts(&run_a).len() >= 2 && last_step(&run_b) >= 3) {
            return false;
        }
        let s = status(&state);
        let (Some(pa), Some(pb)) = (job(&s, "a")["pid"].as_i64(), job(&s, "b")["pid"].as_i64()) else { return false };
        let (wa, wb) = (worker_cpus(pa), worker_cpus(pb));
        if wa.len() == 1 && wb.len() == 1 {
            seen = Some((wa, wb));
            return true;
        }
        false
    });
    let (wa, wb) = seen.unwrap();
    if pinning {
        for (name, workers) in [("a", &wa), ("b", &wb)] {
            let (_, lists) = &workers[0];
            assert!(
                lists.iter().all(|l| l == &lists[0]) && cores.contains(&lists[0]),
                "{name}'s threads: {lists:?} (cores {cores:?})"
            );
        }
        assert_ne!(wa[0].1[0], wb[0].1[0], "a and b share a core: {wa:?} {wb:?}");
        println!(
            "a's worker on core {}, b's on core {} ({} and {} threads)",
            wa[0].1[0],
            wb[0].1[0],
            wa[0].1.len(),
            wb[0].1.len()
        );
    }
    wait_until(&mut server, &mut watch, "the end of every job", Duration::from_secs(600), || {
        status(&state)["jobs"].as_array().is_some_and(|jobs| {
            jobs.iter().all(|j| j["state"] != "queued" && j["state"] != "running" && j["state"] != "starting")
        })
    });
    assert!(server.child.wait().unwrap().success());
    let end = status(&state);
    for name in ["a", "b", "c"] {
        assert_eq!(job(&end, name)["state"], "finished", "{name}: {end}");
    }
    let a_id = job(&end, "a")["id"].clone();
    let reasons: Vec<&str> = end["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["job"] == a_id)
        .map(|d| d["reason"].as_str().unwrap())
        .collect();
    assert!(reasons.iter().any(|r| r.starts_with("goodput: shrunk from 2 to 1 to admit b")), "{reasons:?}");
    // Every step once, each restart resuming at or after the last step logged before it.
    for (k, start) in starts(&run_a).iter().enumerate() {
        assert!(start["latest_checkpoint"].as_u64().unwrap() >= watch.highest_before[k], "restart {k}: {start}");
    }
    assert_eq!(losses(&run_a).iter().map(|l| l.0).collect::<Vec<_>>(), (1..=300).collect::<Vec<_>>());
    let out = run_ok(&mut stoke(&["sched", "report", "--dir", state.to_str().unwrap()], &[]));
    let report = String::from_utf8_lossy(&out.stdout);
    println!("{report}");
    for name in ["a", "b", "c"] {
        assert!(report.lines().any(|l| l.starts_with(name) && l.contains('%')), "{report}");
    }
}
