//! `stoke sched serve`: the real executor. Runs each job as a `stoke launch` process group on this
//! machine's slots and resizes it through the launcher's elastic path: the launcher's
//! `--slot-check` reads the job's allocation (a file the server rewrites after each committed
//! decision), so a smaller or larger allocation stops the workers through the preemption path
//! (every rank stops after the same step with a checkpoint) and starts them again on the new size
//! from that checkpoint.
//!
//! The state (jobs, allocations, decisions with reasons, history, measured throughput) is the
//! SQLite database of `stoke_sched::store`, written before acting. A server killed at any moment
//! and started again on the same folder re-adopts the launchers that still run (pid and start
//! time recorded, so a reused pid is not mistaken for one), learns how the others ended from
//! their run's `events.jsonl`, and starts the lost ones again from their latest checkpoint.
//!
//! Slots are cores: slot k is the k-th CPU of `--cpus` (default: the CPUs this server may run
//! on). A job holds numbered slots (committed with the job), and its launcher pins worker RANK to
//! the core of its RANK-th slot (`stoke launch --cpus-file`: the allocation file lists the
//! cores), so two jobs never share a core. Under the goodput policy a job that starts on two
//! slots or more first runs `--profile-steps` measured steps on one worker, then on two (through
//! the same checkpoint-restart resize), so its speedup is measured before the policy relies on
//! it; the profile's cost is recorded in its history.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use stoke_sched::observe::{self, Segment};
use stoke_sched::{Change, HistoryEntry, JobRow, JobSpec, JobState, JobView, Policy, PolicyConfig, Store};

use super::UsageError;
use crate::signals::EXIT_PREEMPTED;

/// The environment variable that tags a launcher with its job (`<database>#<id>`), so a server
/// that died between starting a launcher and recording its pid finds it again.
const JOB_TAG_VAR: &str = "STOKE_SCHED_JOB";

/// Seconds a resize is assumed to cost before one has been measured.
pub const DEFAULT_RESIZE_S: f64 = 5.0;

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// State folder: `sched.db`, the jobs' run folders (`runs/`), logs (`logs/`) and allocations
    /// (`alloc/`).
    #[arg(long)]
    pub dir: PathBuf,
    /// Slots to share (cores here; one worker per slot).
    #[arg(long)]
    pub slots: usize,
    /// goodput, fair or fifo.
    #[arg(long, default_value = "goodput")]
    pub policy: String,
    /// Serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: a free port, written to the
    /// database's meta table as `prometheus_addr`).
    #[arg(long)]
    pub prometheus_port: Option<u16>,
    /// Seconds between two looks at the jobs.
    #[arg(long, default_value_t = 0.5)]
    pub poll_s: f64,
    /// Seconds between the goodput policy's reallocations (it also reallocates at arrivals and
    /// completions).
    #[arg(long, default_value_t = 10.0)]
    pub tick_s: f64,
    /// The least seconds between two resizes of one job (goodput policy).
    #[arg(long, default_value_t = 30.0)]
    pub min_resize_interval_s: f64,
    /// `--max-restarts` of each job's launcher (failed workers brought back from the checkpoint).
    #[arg(long, default_value_t = 2)]
    pub max_restarts: u32,
    /// Launchers lost (killed, or gone without saying how they ended) before a job counts failed.
    #[arg(long, default_value_t = 3)]
    pub max_lost: u64,
    /// The cores of the slots, in slot order (`0,1`; `0-3` ranges too). Default: the first
    /// `--slots` CPUs this process may run on.
    #[arg(long)]
    pub cpus: Option<String>,
    /// Goodput policy: steps measured on one worker, then on two, when a job first starts on two
    /// slots or more (after `observe::WARMUP_STEPS` per start); 0 skips the profile.
    #[arg(long, default_value_t = 10)]
    pub profile_steps: u64,
    /// Exit once jobs were submitted and none is queued or running (scripts and tests); without it the server runs until
    /// killed. Killing it leaves the jobs running; the next `serve` on the folder re-adopts them.
    #[arg(long)]
    pub exit_when_idle: bool,
}

pub fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Where a job's run folder, log and allocation file live.
pub struct Layout {
    pub dir: PathBuf,
}

impl Layout {
    pub fn runs(&self) -> PathBuf {
        self.dir.join("runs")
    }
    pub fn run_dir(&self, job: &JobRow) -> PathBuf {
        self.runs().join(&job.job.name)
    }
    pub fn log(&self, job: &JobRow) -> PathBuf {
        self.dir.join("logs").join(format!("{}.log", job.job.name))
    }
    pub fn alloc_file(&self, id: i64) -> PathBuf {
        self.dir.join("alloc").join(id.to_string())
    }
    fn tag(&self, id: i64) -> String {
        format!("{}#{id}", self.dir.join(stoke_sched::store::DB_FILE).display())
    }
}

/// The highest step in a run's `metrics.jsonl` (0 before any).
pub fn last_step(run_dir: &Path) -> u64 {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap_or_default();
    observe::parse_step_times(&text).last().map_or(0, |&(s, _)| s)
}

fn launch_events(run_dir: &Path) -> Vec<observe::LaunchEvent> {
    observe::parse_events(&std::fs::read_to_string(run_dir.join("events.jsonl")).unwrap_or_default())
}

/// The job's starts: the server's own launches (history) and the launcher's restarts (events).
pub fn segments(history: &[HistoryEntry], job: i64, events: &[observe::LaunchEvent]) -> Vec<Segment> {
    let mut segments: Vec<Segment> = history
        .iter()
        .filter(|h| h.job == job && h.event == "launched")
        .map(|h| Segment { time_s: h.time_s, from_step: h.step, workers: h.workers })
        .collect();
    segments.extend(events.iter().filter(|e| e.event == "start").map(|e| Segment {
        time_s: e.time_s,
        from_step: e.latest_checkpoint.unwrap_or(0),
        workers: e.world_size,
    }));
    segments.sort_by(|a, b| a.time_s.total_cmp(&b.time_s));
    segments
}

/// The measured resize costs in the history (seconds from the decision to the first step on the
/// new size), median; `DEFAULT_RESIZE_S` before any.
pub fn resize_cost(history: &[HistoryEntry]) -> f64 {
    let mut costs: Vec<f64> =
        history.iter().filter(|h| h.event == "resized").filter_map(|h| h.detail.parse::<f64>().ok()).collect();
    costs.sort_by(f64::total_cmp);
    costs.get(costs.len() / 2).copied().unwrap_or(DEFAULT_RESIZE_S)
}

/// Seconds from a job's first launch to its first step (`first_step` in the history); another
/// job's median before its own is measured; 0 before any.
pub fn startup_cost(history: &[HistoryEntry], job: i64) -> f64 {
    let measured = |h: &&HistoryEntry| h.event == "first_step";
    if let Some(own) = history.iter().filter(measured).find(|h| h.job == job).and_then(|h| h.detail.parse().ok()) {
        return own;
    }
    let mut all: Vec<f64> = history.iter().filter(measured).filter_map(|h| h.detail.parse().ok()).collect();
    all.sort_by(f64::total_cmp);
    all.get(all.len() / 2).copied().unwrap_or(0.0)
}

/// The job's statistical efficiency: from the gradient noise scale its run reported, when its
/// global batch grows with its workers (`train.global_batch` unset); 1 on every size otherwise (a
/// fixed global batch, or no noise scale reported).
pub fn efficiency(job: &JobRow, noise_scale: Option<f64>) -> stoke_sched::Efficiency {
    match noise_scale {
        Some(noise) if job.job.batch_grows && job.job.batch_per_worker > 0 => {
            stoke_sched::Efficiency { b0: job.job.batch_per_worker as f64, batch_grows: true, noise }
        }
        _ => stoke_sched::Efficiency::FIXED_BATCH,
    }
}

/// The noise scale in a job's `metrics.jsonl`, if its run reported one.
pub fn noise_scale(run_dir: &Path) -> Option<f64> {
    observe::latest_noise_scale(&std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap_or_default())
}

/// The model of a job the policies and the simulator use: work in steps, throughput in steps/s
/// (fitted from its own reports, the start-up profile's included; before any, 1 step/s on one
/// worker with the prior parallel fraction), its statistical efficiency (`efficiency`), the
/// measured resize and start-up costs.
pub fn job_spec(
    job: &JobRow,
    points: &[(usize, f64, usize)],
    noise_scale: Option<f64>,
    resize_s: f64,
    start_s: f64,
    t0: f64,
) -> JobSpec {
    let scaling = observe::fit_scaling(points)
        .unwrap_or(stoke_sched::Scaling::Amdahl { t1: 1.0, p: observe::PRIOR_PARALLEL_FRACTION });
    JobSpec {
        name: job.job.name.clone(),
        submit_s: job.submit_s - t0,
        work: job.job.steps as f64,
        min_workers: job.job.min_workers,
        max_workers: job.job.max_workers,
        scaling,
        efficiency: efficiency(job, noise_scale),
        resize_s,
        start_s,
        priority: job.job.priority,
    }
}

/// What the server knows of a live launcher beyond the database.
#[derive(Default)]
struct Live {
    /// The launcher, when this server started it (else it was adopted: no exit status).
    child: Option<Child>,
    /// SIGTERM sent for a cancel.
    stopping: bool,
    /// The last step seen and when it was first seen.
    last_step: u64,
    last_step_s: f64,
    /// Starts in events.jsonl seen so far, and a resize waiting for its first step: (since, from
    /// step).
    starts_seen: usize,
    resizing: Option<(f64, u64)>,
    /// This server's launch waiting for its first step: (when, from step).
    launched: Option<(f64, u64)>,
    /// The world size it runs on now.
    world: usize,
    /// Where its start-up profile stands.
    profile: Profile,
}

/// A job's start-up profile (goodput policy): `One` while it runs its measured steps on one worker
/// (two slots or more held), `Two` while on two; `Off` before, after, or without one. Kept in the
/// history (`profile_1`, `profile_2`, then `profiled` or `profile_cut`), so a restarted server
/// carries it on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Profile {
    #[default]
    Off,
    One,
    Two,
}

impl Profile {
    /// The most workers the job's allocation file lets it run on.
    fn cap(self) -> usize {
        match self {
            Profile::Off => usize::MAX,
            Profile::One => 1,
            Profile::Two => 2,
        }
    }

    /// The phase the history leaves a job in.
    fn from_history(history: &[HistoryEntry], job: i64) -> Profile {
        let last = history.iter().rev().filter(|h| h.job == job).find(|h| h.event.starts_with("profile"));
        match last.map(|h| h.event.as_str()) {
            Some("profile_1") => Profile::One,
            Some("profile_2") => Profile::Two,
            _ => Profile::Off,
        }
    }
}

enum ProcessState {
    Alive,
    Exited(i32),
    Gone,
}

/// (state, start time) of a pid from `/proc/PID/stat`; None when there is no such process.
fn proc_stat(pid: i32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); start time is field 22.
    Some((fields.first()?.chars().next()?, fields.get(19)?.parse().ok()?))
}

fn alive(pid: i32, start: u64) -> bool {
    matches!(proc_stat(pid), Some((state, s)) if s == start && state != 'Z' && state != 'X')
}

/// A process group leader tagged with `tag` (a launcher this folder's server started).
fn find_tagged(tag: &str) -> Option<(i32, u64)> {
    let wanted = format!("{JOB_TAG_VAR}={tag}");
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        // SAFETY: getpgid(2) on any pid only reads; an exited one returns -1.
        if unsafe { libc::getpgid(pid) } != pid {
            continue;
        }
        let Ok(env) = std::fs::read(entry.path().join("environ")) else { continue };
        if env.split(|&b| b == 0).any(|var| var == wanted.as_bytes()) {
            if let Some((_, start)) = proc_stat(pid).filter(|(s, _)| *s != 'Z') {
                return Some((pid, start));
            }
        }
    }
    None
}

/// One server per folder: an exclusive `flock` on `D/serve.lock`, held while the process lives (the
/// kernel drops it when the process dies, SIGKILL included). The file names the holder's pid.
fn lock_folder(dir: &Path) -> anyhow::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let path = dir.join("serve.lock");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    // SAFETY: flock(2) on a descriptor this function owns (the file lives as long as the lock).
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        return Err(UsageError(format!(
            "another `stoke sched serve` runs on {} (pid {}); one server per folder",
            dir.display(),
            holder.trim()
        ))
        .into());
    }
    file.set_len(0)?;
    file.write_all(std::process::id().to_string().as_bytes())?;
    Ok(file)
}

/// Writes a job's allocation file, the cores its workers may run on (`2,3`), when it says
/// something else (write + rename: the launcher never reads half a list).
fn write_alloc(layout: &Layout, id: i64, cores: &[usize]) -> anyhow::Result<()> {
    let path = layout.alloc_file(id);
    let text = cores.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    if std::fs::read_to_string(&path).is_ok_and(|old| old == text) {
        return Ok(());
    }
    let dir = path.parent().expect("alloc files sit in a folder");
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let tmp = dir.join(format!(".{id}.tmp"));
    std::fs::write(&tmp, &text).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))
}

/// `0,2,5-7` to [0, 2, 5, 6, 7].
fn parse_cpu_list(text: &str) -> Result<Vec<usize>, UsageError> {
    let bad = || UsageError(format!("--cpus `{text}`: expected CPU numbers and ranges like 0,2,4-7"));
    let mut cpus = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                if a > b {
                    return Err(bad());
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().map_err(|_| bad())?),
        }
    }
    Ok(cpus)
}

/// The CPUs this process may run on, in order.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: sched_getaffinity(2) fills a cpu_set_t of the size given; zeroed is a valid empty set.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        set
    };
    // SAFETY: CPU_ISSET reads the set filled above, for indices below its size.
    (0..libc::CPU_SETSIZE as usize).filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) }).collect()
}

/// The cores of the slots: `--cpus`, else the first `slots` CPUs this process may run on. Fewer
/// CPUs than slots: slots share cores round-robin (said once).
fn slot_cores(args: &ServeArgs) -> anyhow::Result<Vec<usize>> {
    let cpus = match &args.cpus {
        Some(text) => parse_cpu_list(text)?,
        None => allowed_cpus(),
    };
    if cpus.is_empty() {
        return Err(
            UsageError("no CPU to pin the slots to (--cpus, or this process's affinity, is empty)".into()).into()
        );
    }
    if cpus.len() < args.slots {
        eprintln!(
            "[sched] warning: {} slots on {} CPUs ({:?}): slots share cores, jobs are not kept apart",
            args.slots,
            cpus.len(),
            cpus
        );
    }
    Ok((0..args.slots).map(|k| cpus[k % cpus.len()]).collect())
}

/// A shell word holding `text` as is.
fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}

pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let policy: Policy =
        args.policy.parse().map_err(|e: stoke_sched::SchedError| anyhow::Error::new(UsageError(e.to_string())))?;
    if args.slots == 0 {
        return Err(UsageError("--slots must be at least 1".into()).into());
    }
    std::fs::create_dir_all(&args.dir).with_context(|| format!("cannot create {}", args.dir.display()))?;
    let dir = std::fs::canonicalize(&args.dir).with_context(|| format!("cannot resolve {}", args.dir.display()))?;
    let layout = Layout { dir };
    let _lock = lock_folder(&layout.dir)?;
    let mut store = Store::open(&layout.dir)?;
    store.set_meta("slots", &args.slots.to_string())?;
    store.set_meta("policy", policy.name())?;
    store.set_meta("tick_s", &args.tick_s.to_string())?;
    store.set_meta("min_resize_interval_s", &args.min_resize_interval_s.to_string())?;
    store.set_meta("server_pid", &std::process::id().to_string())?;
    let metrics = Arc::new(Mutex::new(String::new()));
    if let Some(port) = args.prometheus_port {
        let addr = serve_metrics(port, Arc::clone(&metrics))?;
        store.set_meta("prometheus_addr", &addr.to_string())?;
        eprintln!("[sched] metrics: http://{addr}/metrics");
    }
    let cores = slot_cores(&args)?;
    store.set_meta("cores", &cores.iter().map(usize::to_string).collect::<Vec<_>>().join(","))?;
    let config = PolicyConfig { slots: args.slots, policy, min_resize_interval_s: args.min_resize_interval_s };
    let mut server = Server { args: &args, layout, store, config, cores, live: HashMap::new() };
    server.recover()?;
    let mut known_active: Vec<i64> = Vec::new();
    let mut next_tick = 0.0;
    let mut next_fit = 0.0;
    loop {
        let now = unix_now();
        server.cancels()?;
        server.reap(now)?;
        server.watch_progress(now)?;
        if now >= next_fit {
            server.fit()?;
            next_fit = now + 2.0;
        }
        let jobs = server.store.jobs()?;
        let active: Vec<i64> = jobs.iter().filter(|j| j.state.is_active()).map(|j| j.id).collect();
        // The policy runs at arrivals and completions, and on the goodput policy's ticks.
        if active != known_active || (policy == Policy::Goodput && now >= next_tick) {
            server.plan(now)?;
            known_active = active.clone();
            next_tick = now + args.tick_s;
        }
        server.profile()?;
        server.place()?;
        *metrics.lock().expect("metrics lock") = server.prometheus()?;
        if args.exit_when_idle && active.is_empty() && !jobs.is_empty() {
            eprintln!("[sched] no job queued or running; exiting");
            return Ok(ExitCode::SUCCESS);
        }
        std::thread::sleep(Duration::from_secs_f64(args.poll_s.max(0.05)));
    }
}

struct Server<'a> {
    args: &'a ServeArgs,
    layout: Layout,
    store: Store,
    config: PolicyConfig,
    /// The core of each slot.
    cores: Vec<usize>,
    live: HashMap<i64, Live>,
}

impl Server<'_> {
    fn entry(&self, job: &JobRow, event: &str, workers: usize, step: u64, detail: String) -> HistoryEntry {
        HistoryEntry { time_s: unix_now(), job: job.id, event: event.into(), workers, step, detail }
    }

    /// After a (re)start of the server: adopt the launchers that still run, settle the others.
    fn recover(&mut self) -> anyhow::Result<()> {
        for job in self.store.jobs()? {
            let found = match (job.state, job.pid) {
                (JobState::Running, Some((pid, start))) if alive(pid, start) => Some((pid, start)),
                // Started but its pid never recorded: look for the launcher by its tag.
                (JobState::Starting, _) => find_tagged(&self.layout.tag(job.id)),
                (JobState::Running, _) => None,
                _ => continue,
            };
            let run_dir = self.layout.run_dir(&job);
            match found {
                Some((pid, start)) => {
                    let step = last_step(&run_dir);
                    let entry = self.entry(&job, "adopted", job.alloc, step, format!("launcher pid {pid}"));
                    self.store.started(job.id, pid, start, &entry)?;
                    eprintln!("[sched] {}: re-adopted its launcher (pid {pid}) at step {step}", job.job.name);
                    let world = segments(&self.store.history()?, job.id, &launch_events(&run_dir))
                        .last()
                        .map_or(job.alloc, |s| s.workers);
                    let live = Live {
                        last_step: step,
                        last_step_s: unix_now(),
                        starts_seen: launch_events(&run_dir).iter().filter(|e| e.event == "start").count(),
                        world,
                        profile: Profile::from_history(&self.store.history()?, job.id),
                        ..Live::default()
                    };
                    self.live.insert(job.id, live);
                }
                None => self.settle(&job, None)?,
            }
        }
        Ok(())
    }

    /// A job whose launcher is gone: how it ended, from its exit code (when this server started
    /// it) or its run's events.
    fn settle(&mut self, job: &JobRow, code: Option<i32>) -> anyhow::Result<()> {
        let run_dir = self.layout.run_dir(job);
        let launched_at = job.last_resize_s.unwrap_or(job.submit_s);
        let last_event =
            launch_events(&run_dir).into_iter().rev().find(|e| e.event != "start" && e.time_s >= launched_at - 1.0);
        let step = last_step(&run_dir);
        let verdict = match (code, last_event.as_ref().map(|e| e.event.as_str())) {
            (Some(0), _) | (None, Some("finish")) => (JobState::Finished, "finished".to_string()),
            (Some(c), _) if c == i32::from(EXIT_PREEMPTED) && job.cancel_requested => {
                (JobState::Cancelled, "cancelled: stopped with a checkpoint".into())
            }
            (None, Some("preempted")) if job.cancel_requested => {
                (JobState::Cancelled, "cancelled: stopped with a checkpoint".into())
            }
            (Some(c), _) if c == i32::from(EXIT_PREEMPTED) => {
                (JobState::Queued, "stopped by a signal from outside; queued to resume".into())
            }
            (None, Some("preempted")) => {
                (JobState::Queued, "stopped by a signal from outside; queued to resume".into())
            }
            (Some(c), _) => {
                (JobState::Failed, format!("the launcher exited with {c}; see {}", self.layout.log(job).display()))
            }
            (None, Some("give_up")) => (
                JobState::Failed,
                format!("{}; see {}", last_event.map(|e| e.cause).unwrap_or_default(), self.layout.log(job).display()),
            ),
            _ if job.cancel_requested => (JobState::Cancelled, "cancelled; its launcher was gone".into()),
            _ if job.launches >= self.args.max_lost => {
                (JobState::Failed, format!("its launcher was lost {} times", job.launches))
            }
            _ => (
                JobState::Queued,
                format!("its launcher was lost at step {step}; queued to resume from the latest checkpoint"),
            ),
        };
        let (state, detail) = verdict;
        eprintln!("[sched] {}: {detail}", job.job.name);
        let event = if state == JobState::Queued { "requeued" } else { state.name() };
        let entry = self.entry(job, event, 0, step, detail);
        self.store.ended(job.id, state, code, &entry)?;
        let _ = std::fs::remove_file(self.layout.alloc_file(job.id));
        self.live.remove(&job.id);
        Ok(())
    }

    fn cancels(&mut self) -> anyhow::Result<()> {
        for job in self.store.jobs()? {
            if !(job.cancel_requested && job.state == JobState::Running) {
                continue;
            }
            let Some(live) = self.live.get_mut(&job.id) else { continue };
            if let (false, Some((pid, start))) = (live.stopping, job.pid) {
                if alive(pid, start) {
                    // The launcher passes it on: every worker stops with a checkpoint (exit 75).
                    // SAFETY: kill(2) of the launcher whose pid and start time were just checked.
                    unsafe { libc::kill(pid, libc::SIGTERM) };
                }
                live.stopping = true;
                eprintln!("[sched] {}: cancelling (SIGTERM to its launcher, pid {pid})", job.job.name);
            }
        }
        Ok(())
    }

    /// Launchers that ended since the last look.
    fn reap(&mut self, _now: f64) -> anyhow::Result<()> {
        for job in self.store.jobs()? {
            if job.state != JobState::Running {
                continue;
            }
            let state = match (self.live.get_mut(&job.id).and_then(|l| l.child.as_mut()), job.pid) {
                (Some(child), _) => match child.try_wait() {
                    Ok(Some(status)) => {
                        use std::os::unix::process::ExitStatusExt;
                        ProcessState::Exited(status.code().unwrap_or(128 + status.signal().unwrap_or(0)))
                    }
                    Ok(None) => ProcessState::Alive,
                    Err(_) => ProcessState::Gone,
                },
                (None, Some((pid, start))) if alive(pid, start) => ProcessState::Alive,
                _ => ProcessState::Gone,
            };
            match state {
                ProcessState::Alive => {}
                ProcessState::Exited(code) => self.settle(&job, Some(code))?,
                ProcessState::Gone => self.settle(&job, None)?,
            }
        }
        Ok(())
    }

    /// Steps and restarts of the running jobs: the world each runs on, and each resize's measured
    /// cost (from the decision to the first step on the new size).
    fn watch_progress(&mut self, now: f64) -> anyhow::Result<()> {
        let jobs = self.store.jobs()?;
        for job in jobs.iter().filter(|j| j.state == JobState::Running) {
            let run_dir = self.layout.run_dir(job);
            let Some(live) = self.live.get_mut(&job.id) else { continue };
            let step = last_step(&run_dir);
            let events = launch_events(&run_dir);
            let starts: Vec<&observe::LaunchEvent> = events.iter().filter(|e| e.event == "start").collect();
            if starts.len() > live.starts_seen {
                let start = starts[starts.len() - 1];
                live.starts_seen = starts.len();
                live.world = start.world_size;
                // A resize (not a restart after a failure): the workers stopped after the last
                // step seen; its cost counts from there to the first step on the new size.
                if start.cause.contains("slots") {
                    live.resizing = Some((live.last_step_s, start.latest_checkpoint.unwrap_or(0)));
                }
            }
            if step != live.last_step {
                live.last_step = step;
                live.last_step_s = now;
                if let Some((since, from)) = live.launched.filter(|&(_, from)| step > from) {
                    live.launched = None;
                    let entry = HistoryEntry {
                        time_s: now,
                        job: job.id,
                        event: "first_step".into(),
                        workers: live.world,
                        step: from,
                        detail: format!("{:.2}", now - since),
                    };
                    self.store.history_entry(&entry)?;
                }
                if let Some((since, from)) = live.resizing {
                    if step > from {
                        live.resizing = None;
                        let cost = now - since;
                        let entry = HistoryEntry {
                            time_s: now,
                            job: job.id,
                            event: "resized".into(),
                            workers: live.world,
                            step: from,
                            detail: format!("{cost:.2}"),
                        };
                        self.store.history_entry(&entry)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Refits each running job's throughput from its metrics.
    fn fit(&mut self) -> anyhow::Result<()> {
        let history = self.store.history()?;
        for job in self.store.jobs()?.iter().filter(|j| j.state == JobState::Running) {
            let run_dir = self.layout.run_dir(job);
            let steps =
                observe::parse_step_times(&std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap_or_default());
            let points = observe::throughput_points(&steps, &segments(&history, job.id, &launch_events(&run_dir)));
            if !points.is_empty() && points != self.store.throughput(job.id)? {
                self.store.set_throughput(job.id, &points)?;
            }
        }
        Ok(())
    }

    /// Runs the policy over the active jobs; commits the changes with their reasons, then tells
    /// the launchers (their allocation files).
    fn plan(&mut self, now: f64) -> anyhow::Result<()> {
        let jobs: Vec<JobRow> = self.store.jobs()?.into_iter().filter(|j| j.state.is_active()).collect();
        let history = self.store.history()?;
        let resize_s = resize_cost(&history);
        let t0 = jobs.iter().map(|j| j.submit_s).fold(now, f64::min);
        let mut specs = Vec::new();
        for job in &jobs {
            let (points, noise) = (self.store.throughput(job.id)?, noise_scale(&self.layout.run_dir(job)));
            specs.push(job_spec(job, &points, noise, resize_s, startup_cost(&history, job.id), t0));
        }
        // Jobs that can never fit wait forever: refuse them once.
        let mut views = Vec::new();
        let mut placed = Vec::new();
        for (job, spec) in jobs.iter().zip(&specs) {
            if job.job.min_workers > self.config.slots {
                let detail = format!(
                    "needs at least {} workers; the server has {} slots",
                    job.job.min_workers, self.config.slots
                );
                let entry = self.entry(job, "failed", 0, 0, detail);
                self.store.ended(job.id, JobState::Failed, None, &entry)?;
                continue;
            }
            // A queued job with an allocation waits for its slots to be freed: it counts as placed.
            views.push(JobView {
                spec,
                workers: job.alloc,
                last_resize_s: job.last_resize_s.map_or(f64::NEG_INFINITY, |t| t - t0),
            });
            placed.push(job);
        }
        let plan = stoke_sched::allocate(&views, &self.config, now - t0);
        let changes: Vec<Change> = placed
            .iter()
            .zip(&views)
            .zip(&plan)
            .filter(|((job, _), a)| a.workers != job.alloc && !job.cancel_requested)
            .map(|((job, view), a)| Change {
                job: job.id,
                from_workers: view.workers,
                to_workers: a.workers,
                reason: a.reason.clone(),
                resize: job.state != JobState::Queued && view.workers > 0 && a.workers > 0,
            })
            .collect();
        if changes.is_empty() {
            return Ok(());
        }
        self.store.commit_allocation(unix_now(), self.config.policy.name(), &changes)?;
        for change in &changes {
            let name = placed.iter().find(|j| j.id == change.job).map_or("", |j| j.job.name.as_str());
            eprintln!("[sched] {name}: {} -> {} workers: {}", change.from_workers, change.to_workers, change.reason);
        }
        // The launchers learn their new sizes when `place` rewrites their allocation files.
        Ok(())
    }

    /// Gives the allocations their slots, then tells the launchers. A running job keeps its slots
    /// in order: a shrink releases the last ones only once its launcher runs on no more than the
    /// allocation (the workers there have stopped), a grow adds free slots as they are released; a
    /// queued job with an allocation starts once that many slots are free. Each job's slots are
    /// committed before its allocation file (the cores of its first `alloc` slots, fewer during
    /// its profile) is rewritten.
    fn place(&mut self) -> anyhow::Result<()> {
        let jobs = self.store.jobs()?;
        let holds = |j: &JobRow| matches!(j.state, JobState::Running | JobState::Starting);
        let mut held: Vec<bool> = vec![false; self.config.slots];
        for slot in jobs.iter().filter(|j| holds(j)).flat_map(|j| j.slots.iter()) {
            if let Some(h) = held.get_mut(*slot) {
                *h = true;
            }
        }
        let take = |held: &mut Vec<bool>, n: usize| -> Vec<usize> {
            let free: Vec<usize> = (0..held.len()).filter(|&s| !held[s]).take(n).collect();
            for &s in &free {
                held[s] = true;
            }
            free
        };
        for job in jobs.iter().filter(|j| holds(j)) {
            let (world, profile) = self.live.get(&job.id).map_or((0, Profile::Off), |l| (l.world, l.profile));
            let mut slots: Vec<usize> = job.slots.iter().copied().filter(|&s| s < self.config.slots).collect();
            if slots.len() > job.alloc && world <= job.alloc {
                for &s in &slots[job.alloc..] {
                    held[s] = false;
                }
                slots.truncate(job.alloc);
            }
            if slots.len() < job.alloc {
                let more = take(&mut held, job.alloc - slots.len());
                slots.extend(more);
            }
            if slots != job.slots {
                self.store.set_slots(job.id, &slots)?;
            }
            let n = job.alloc.min(profile.cap()).min(slots.len());
            write_alloc(&self.layout, job.id, &slots[..n].iter().map(|&s| self.cores[s]).collect::<Vec<_>>())?;
        }
        for job in jobs.iter().filter(|j| j.state == JobState::Queued && j.alloc > 0 && !j.cancel_requested) {
            if held.iter().filter(|h| !**h).count() < job.alloc {
                continue;
            }
            let slots = take(&mut held, job.alloc);
            self.store.set_slots(job.id, &slots)?;
            self.launch(job, &slots)?;
        }
        Ok(())
    }

    /// Moves the start-up profiles on: after `--profile-steps` measured steps on one worker the
    /// job goes on to two; after as many on two the profile is done, its throughput points (in the
    /// `throughput` table, which the fit reads) and its cost recorded. A policy that takes the
    /// job below two workers meanwhile cuts the profile short.
    fn profile(&mut self) -> anyhow::Result<()> {
        let profiling: Vec<(i64, Profile)> =
            self.live.iter().filter(|(_, l)| l.profile != Profile::Off).map(|(&id, l)| (id, l.profile)).collect();
        if profiling.is_empty() {
            return Ok(());
        }
        let history = self.store.history()?;
        for (id, phase) in profiling {
            let Some(job) = self.store.job(&id.to_string())?.filter(|j| j.state == JobState::Running) else { continue };
            let run_dir = self.layout.run_dir(&job);
            let events = launch_events(&run_dir);
            let steps =
                observe::parse_step_times(&std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap_or_default());
            let segs = segments(&history, id, &events);
            let points = observe::throughput_points(&steps, &segs);
            let at = |w: usize| points.iter().find(|p| p.0 == w).copied();
            let n = self.args.profile_steps as usize;
            let (event, detail, next) = if job.alloc < 2 {
                let detail = format!("allocation now {}: the profile stops at {} worker(s)", job.alloc, phase.cap());
                ("profile_cut", detail, Profile::Off)
            } else if let (Profile::One, Some((_, t1, m))) = (phase, at(1).filter(|p| p.2 >= n)) {
                ("profile_2", format!("1 worker: {t1:.3} steps/s over {m} steps; now 2 workers"), Profile::Two)
            } else if let (Profile::Two, Some((_, t2, m)), Some((_, t1, _))) =
                (phase, at(2).filter(|p| p.2 >= n), at(1))
            {
                // The steps run on one worker: up to the start on two.
                let steps_at_1 = segs.iter().find(|s| s.workers >= 2).map_or(0, |s| s.from_step);
                let since =
                    history.iter().rev().find(|h| h.job == id && h.event == "profile_2").map_or(0.0, |h| h.time_s);
                let resize_s = history
                    .iter()
                    .find(|h| h.job == id && h.event == "resized" && h.time_s >= since)
                    .and_then(|h| h.detail.parse::<f64>().ok())
                    .unwrap_or(0.0);
                let cost_s = observe::profile_cost(steps_at_1, t1, t2, resize_s);
                let p = match stoke_sched::Scaling::fit(&[(1, t1), (2, t2)]) {
                    Ok(stoke_sched::Scaling::Amdahl { p, .. }) => p,
                    _ => f64::NAN,
                };
                let detail = serde_json::json!({
                    "steps_per_s_1": t1, "steps_per_s_2": t2, "steps_measured_2": m, "parallel_fraction": p,
                    "steps_at_1": steps_at_1, "resize_s": resize_s, "cost_s": cost_s,
                })
                .to_string();
                ("profiled", detail, Profile::Off)
            } else {
                continue;
            };
            // The points the step rests on, recorded with it (the periodic fit may not have run yet).
            if !points.is_empty() {
                self.store.set_throughput(id, &points)?;
            }
            let step = last_step(&run_dir);
            eprintln!("[sched] {}: {event}: {detail}", job.job.name);
            let entry = self.entry(&job, event, next.cap().min(job.alloc), step, detail);
            self.store.history_entry(&entry)?;
            if let Some(live) = self.live.get_mut(&id) {
                live.profile = next;
            }
        }
        Ok(())
    }

    fn launch(&mut self, job: &JobRow, slots: &[usize]) -> anyhow::Result<()> {
        let run_dir = self.layout.run_dir(job);
        let resume = stoke_ckpt::CheckpointStore::new(run_dir.join("checkpoints")).latest().ok().flatten();
        // A fresh start on two slots or more under the goodput policy profiles first.
        let profile = if resume.is_none()
            && self.config.policy == Policy::Goodput
            && self.args.profile_steps > 0
            && job.job.min_workers == 1
            && job.alloc >= 2
        {
            let detail = format!(
                "profile: {n} measured steps on 1 worker, then {n} on 2, holding its {} slots",
                job.alloc,
                n = self.args.profile_steps
            );
            self.store.history_entry(&self.entry(job, "profile_1", 1, 0, detail))?;
            Profile::One
        } else {
            Profile::Off
        };
        let n = job.alloc.min(profile.cap()).min(slots.len());
        write_alloc(&self.layout, job.id, &slots[..n].iter().map(|&s| self.cores[s]).collect::<Vec<_>>())?;
        // Committed before the process exists: a server killed in between finds it by its tag.
        self.store.starting(job.id, unix_now())?;
        let alloc_file = self.layout.alloc_file(job.id);
        // The file lists the cores: as many slots as cores listed.
        let check = format!(
            "n=$(cat {} 2>/dev/null | tr , ' ' | wc -w); test \"$STOKE_SLOT\" -lt $n",
            shell_quote(&alloc_file.display().to_string())
        );
        let exe = std::env::current_exe().context("cannot locate the stoke binary")?;
        let mut cmd = Command::new(exe);
        cmd.arg("launch")
            .args(["--nproc", &format!("{}:{}", job.job.min_workers, job.job.max_workers)])
            .args(["--max-restarts", &self.args.max_restarts.to_string()])
            .args(["--slot-check", &check, "--slot-poll-s", "1", "--slot-wait-s", "300"])
            .arg("--cpus-file")
            .arg(&alloc_file)
            .args(["--", "train", "--quiet"]);
        if resume.is_some() {
            cmd.arg("--resume");
        }
        if let Some(config) = &job.job.config {
            cmd.arg("--config").arg(config);
        }
        cmd.args(["--set", "prof.prometheus_port=0"]);
        for o in &job.job.overrides {
            cmd.arg("--set").arg(o);
        }
        for (key, value) in [("run.dir", self.layout.runs().display().to_string()), ("run.name", job.job.name.clone())]
        {
            cmd.arg("--set").arg(format!("{key}={}", toml::Value::String(value)));
        }
        let log_path = self.layout.log(job);
        std::fs::create_dir_all(log_path.parent().expect("logs sit in a folder"))?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("cannot open {}", log_path.display()))?;
        cmd.env(JOB_TAG_VAR, self.layout.tag(job.id))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            // Its own process group: a signal to the server's group (Ctrl-C) leaves the jobs.
            .process_group(0);
        let child = cmd.spawn().with_context(|| format!("cannot start the launcher of {}", job.job.name))?;
        let pid = child.id() as i32;
        let start = proc_stat(pid).map_or(0, |(_, s)| s);
        let step = resume.unwrap_or(0);
        let detail = if resume.is_some() { format!("resuming step {step}") } else { "fresh start".into() };
        let world = n.min(job.job.max_workers);
        let entry = self.entry(job, "launched", world, step, detail.clone());
        self.store.started(job.id, pid, start, &entry)?;
        eprintln!("[sched] {}: launched on {world} of its {} workers (pid {pid}, {detail})", job.job.name, job.alloc);
        let live = Live {
            child: Some(child),
            last_step: last_step(&run_dir),
            last_step_s: unix_now(),
            starts_seen: launch_events(&run_dir).iter().filter(|e| e.event == "start").count(),
            world,
            launched: Some((entry.time_s, step)),
            profile,
            ..Live::default()
        };
        self.live.insert(job.id, live);
        Ok(())
    }

    /// Prometheus text: slots, jobs by state, and per job its allocation, the world it runs on,
    /// its modelled throughput and goodput there (steps/s) and its step.
    fn prometheus(&self) -> anyhow::Result<String> {
        let jobs = self.store.jobs()?;
        let mut out = String::new();
        let mut family = |name: &str, kind: &str, help: &str, samples: Vec<(String, f64)>| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for (labels, value) in samples {
                out.push_str(&format!("{name}{labels} {value}\n"));
            }
        };
        let label = |job: &JobRow| format!("{{job=\"{}\"}}", job.job.name.replace('\\', "\\\\").replace('"', "\\\""));
        family(
            "stoke_sched_slots",
            "gauge",
            "Slots the scheduler shares.",
            vec![(String::new(), self.config.slots as f64)],
        );
        let mut by_state: BTreeMap<&str, usize> = BTreeMap::new();
        for state in ["queued", "starting", "running", "finished", "failed", "cancelled"] {
            by_state.insert(state, 0);
        }
        for job in &jobs {
            *by_state.entry(job.state.name()).or_default() += 1;
        }
        family(
            "stoke_sched_jobs",
            "gauge",
            "Jobs by state.",
            by_state.iter().map(|(s, n)| (format!("{{state=\"{s}\"}}"), *n as f64)).collect(),
        );
        let active: Vec<&JobRow> = jobs.iter().filter(|j| j.state.is_active()).collect();
        family(
            "stoke_sched_job_workers",
            "gauge",
            "Workers the policy allocates to the job.",
            active.iter().map(|j| (label(j), j.alloc as f64)).collect(),
        );
        family(
            "stoke_sched_job_running_workers",
            "gauge",
            "Workers the job runs on now.",
            active.iter().map(|j| (label(j), self.live.get(&j.id).map_or(0, |l| l.world) as f64)).collect(),
        );
        let mut throughput = Vec::new();
        let mut goodput = Vec::new();
        for job in &active {
            let noise = noise_scale(&self.layout.run_dir(job));
            let spec = job_spec(job, &self.store.throughput(job.id)?, noise, DEFAULT_RESIZE_S, 0.0, 0.0);
            let world = self.live.get(&job.id).map_or(0, |l| l.world);
            throughput.push((label(job), spec.scaling.throughput(world)));
            goodput.push((label(job), spec.goodput(world)));
        }
        family("stoke_sched_job_throughput_steps_per_second", "gauge", "Modelled steps/s on its workers.", throughput);
        family("stoke_sched_job_goodput_steps_per_second", "gauge", "Throughput x statistical efficiency.", goodput);
        family(
            "stoke_sched_job_step",
            "gauge",
            "The job's last step.",
            active.iter().map(|j| (label(j), self.live.get(&j.id).map_or(0, |l| l.last_step) as f64)).collect(),
        );
        Ok(out)
    }
}

/// Serves `GET /metrics` with the latest text on a background thread.
fn serve_metrics(port: u16, text: Arc<Mutex<String>>) -> anyhow::Result<std::net::SocketAddr> {
    let listener = TcpListener::bind(("127.0.0.1", port))
        .with_context(|| format!("cannot listen on 127.0.0.1:{port} for /metrics"))?;
    let addr = listener.local_addr()?;
    std::thread::Builder::new().name("sched-metrics".into()).spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
                match stream.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            let request = String::from_utf8_lossy(&head);
            let target = request.split_whitespace().nth(1).unwrap_or("");
            let (status, body) = if request.starts_with("GET ") && (target == "/metrics" || target.starts_with("/metrics?")) {
                ("200 OK", text.lock().expect("metrics lock").clone())
            } else {
                ("404 Not Found", "only /metrics is served here\n".to_string())
            };
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    })?;
    Ok(addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_take_numbers_and_ranges() {
        assert_eq!(parse_cpu_list("0,2,5-7").unwrap(), [0, 2, 5, 6, 7]);
        assert_eq!(parse_cpu_list(" 3 ").unwrap(), [3]);
        for bad in ["a", "3-1", "1-", "-"] {
            assert!(parse_cpu_list(bad).is_err(), "{bad}");
        }
        // This process may run somewhere.
        assert!(!allowed_cpus().is_empty());
    }

    #[test]
    fn the_profile_phase_is_the_last_profile_line_of_the_job() {
        let line = |job: i64, event: &str| HistoryEntry {
            time_s: 0.0,
            job,
            event: event.into(),
            workers: 1,
            step: 0,
            detail: String::new(),
        };
        let mut history = vec![line(1, "submitted"), line(1, "profile_1"), line(1, "launched"), line(2, "profile_2")];
        assert_eq!(Profile::from_history(&history, 1), Profile::One);
        assert_eq!(Profile::from_history(&history, 2), Profile::Two);
        history.push(line(1, "profile_2"));
        assert_eq!(Profile::from_history(&history, 1), Profile::Two);
        history.push(line(1, "profiled"));
        assert_eq!(Profile::from_history(&history, 1), Profile::Off);
        assert_eq!(Profile::from_history(&history, 3), Profile::Off);
        assert_eq!((Profile::One.cap(), Profile::Two.cap()), (1, 2));
    }
}
