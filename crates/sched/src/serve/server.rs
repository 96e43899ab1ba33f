//! The server's loop and its view of the jobs: what it knows of each live launcher beyond the
//! database, recovery after a restart, how a launcher ended, cancels, progress (the world each job
//! runs on, measured resize and start-up costs), the throughput refits and the policy's plan.
//! Placing the allocations on slots and starting launchers is in `place.rs`; the metrics text in
//! `metrics.rs`.

use std::collections::HashMap;
use std::process::Child;
use std::time::Duration;

use super::config::ServeConfig;
use super::cpus::slot_cores;
use super::endpoint::MetricsEndpoint;
use super::estimate::{attained_slot_s, job_spec, resize_cost, segments, startup_cost};
use super::layout::{last_step, launch_events, noise_scale, unix_now, Layout};
use super::process::{alive, find_tagged, lock_folder, ProcessState};
use crate::observe;
use crate::policy::{allocate, JobView, Policy, PolicyConfig};
use crate::store::{Change, HistoryEntry, JobRow, JobState, Store};
use crate::SchedError;

/// What the server knows of a live launcher beyond the database.
#[derive(Default)]
pub(super) struct Live {
    /// The launcher, when this server started it (else it was adopted: no exit status).
    pub(super) child: Option<Child>,
    /// SIGTERM sent for a cancel.
    pub(super) stopping: bool,
    /// The last step seen and when it was first seen.
    pub(super) last_step: u64,
    pub(super) last_step_s: f64,
    /// Starts in events.jsonl seen so far, and a resize waiting for its first step: (since, from
    /// step).
    pub(super) starts_seen: usize,
    pub(super) resizing: Option<(f64, u64)>,
    /// This server's launch waiting for its first step: (when, from step).
    pub(super) launched: Option<(f64, u64)>,
    /// The world size it runs on now.
    pub(super) world: usize,
    /// Where its start-up profile stands.
    pub(super) profile: Profile,
}

/// A job's start-up profile (goodput policy): `One` while it runs its measured steps on one worker
/// (two slots or more held), `Two` while on two; `Off` before, after, or without one. Kept in the
/// history (`profile_1`, `profile_2`, then `profiled` or `profile_cut`), so a restarted server
/// carries it on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) enum Profile {
    #[default]
    Off,
    One,
    Two,
}

impl Profile {
    /// The most workers the job's allocation file lets it run on.
    pub(super) fn cap(self) -> usize {
        match self {
            Profile::Off => usize::MAX,
            Profile::One => 1,
            Profile::Two => 2,
        }
    }

    /// The phase the history leaves a job in.
    pub(super) fn from_history(history: &[HistoryEntry], job: i64) -> Profile {
        let last = history.iter().rev().filter(|h| h.job == job).find(|h| h.event.starts_with("profile"));
        match last.map(|h| h.event.as_str()) {
            Some("profile_1") => Profile::One,
            Some("profile_2") => Profile::Two,
            _ => Profile::Off,
        }
    }
}

/// Runs the server on `settings.dir` until killed, or (with `exit_when_idle`) until jobs were
/// submitted and none is queued or running.
pub fn serve(settings: &ServeConfig) -> Result<(), SchedError> {
    let policy = settings.policy;
    if settings.slots == 0 {
        return Err(SchedError::NoSlots);
    }
    let create = |what: &'static str| move |source| SchedError::File { path: settings.dir.clone(), what, source };
    std::fs::create_dir_all(&settings.dir).map_err(create("create"))?;
    let dir = std::fs::canonicalize(&settings.dir).map_err(create("resolve"))?;
    let layout = Layout { dir };
    let _lock = lock_folder(&layout.dir)?;
    let mut store = Store::open(&layout.dir)?;
    store.set_meta("slots", &settings.slots.to_string())?;
    store.set_meta("policy", policy.name())?;
    store.set_meta("tick_s", &settings.tick_s.to_string())?;
    store.set_meta("min_resize_interval_s", &settings.min_resize_interval_s.to_string())?;
    store.set_meta("server_pid", &std::process::id().to_string())?;
    let metrics = MetricsEndpoint::start(settings.prometheus_port)?;
    if let Some(addr) = metrics.addr() {
        store.set_meta("prometheus_addr", &addr.to_string())?;
        eprintln!("[sched] metrics: http://{addr}/metrics");
    }
    // Under Slurm a slot is a task of Slurm's; the allocation file only counts them.
    let cores = if settings.slurm {
        (0..settings.slots).collect()
    } else {
        slot_cores(settings.cpus.as_deref(), settings.slots)?
    };
    store.set_meta("slurm", if settings.slurm { "yes" } else { "no" })?;
    store.set_meta("cores", &cores.iter().map(usize::to_string).collect::<Vec<_>>().join(","))?;
    let config = PolicyConfig {
        min_resize_interval_s: settings.min_resize_interval_s,
        ..PolicyConfig::new(settings.slots, policy)
    };
    let mut server = Server { settings, layout, store, config, cores, live: HashMap::new() };
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
            next_tick = now + settings.tick_s;
        }
        server.profile()?;
        server.place()?;
        metrics.publish(server.prometheus()?);
        if settings.exit_when_idle && active.is_empty() && !jobs.is_empty() {
            eprintln!("[sched] no job queued or running; exiting");
            return Ok(());
        }
        std::thread::sleep(Duration::from_secs_f64(settings.poll_s.max(0.05)));
    }
}

pub(super) struct Server<'a> {
    pub(super) settings: &'a ServeConfig,
    pub(super) layout: Layout,
    pub(super) store: Store,
    pub(super) config: PolicyConfig,
    /// The core of each slot.
    pub(super) cores: Vec<usize>,
    pub(super) live: HashMap<i64, Live>,
}

impl Server<'_> {
    pub(super) fn entry(&self, job: &JobRow, event: &str, workers: usize, step: u64, detail: String) -> HistoryEntry {
        HistoryEntry { time_s: unix_now(), job: job.id, event: event.into(), workers, step, detail }
    }

    /// After a (re)start of the server: adopt the launchers that still run, settle the others.
    fn recover(&mut self) -> Result<(), SchedError> {
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
    fn settle(&mut self, job: &JobRow, code: Option<i32>) -> Result<(), SchedError> {
        let run_dir = self.layout.run_dir(job);
        let launched_at = job.last_resize_s.unwrap_or(job.submit_s);
        let last_event =
            launch_events(&run_dir).into_iter().rev().find(|e| e.event != "start" && e.time_s >= launched_at - 1.0);
        let step = last_step(&run_dir);
        let verdict = match (code, last_event.as_ref().map(|e| e.event.as_str())) {
            (Some(0), _) | (None, Some("finish")) => (JobState::Finished, "finished".to_string()),
            (Some(c), _) if c == self.settings.launcher.preempted_exit_code && job.cancel_requested => {
                (JobState::Cancelled, "cancelled: stopped with a checkpoint".into())
            }
            (None, Some("preempted")) if job.cancel_requested => {
                (JobState::Cancelled, "cancelled: stopped with a checkpoint".into())
            }
            (Some(c), _) if c == self.settings.launcher.preempted_exit_code => {
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
            _ if job.launches >= self.settings.max_lost => {
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

    fn cancels(&mut self) -> Result<(), SchedError> {
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
    fn reap(&mut self, _now: f64) -> Result<(), SchedError> {
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
    fn watch_progress(&mut self, now: f64) -> Result<(), SchedError> {
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
    fn fit(&mut self) -> Result<(), SchedError> {
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
    fn plan(&mut self, now: f64) -> Result<(), SchedError> {
        let jobs: Vec<JobRow> = self.store.jobs()?.into_iter().filter(|j| j.state.is_active()).collect();
        let history = self.store.history()?;
        let decisions = self.store.decisions()?;
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
                // Work is in steps here: the last step its run reported.
                done: self.live.get(&job.id).map_or(0.0, |l| l.last_step as f64).min(spec.work),
                attained_slot_s: attained_slot_s(&decisions, job.id, now),
            });
            placed.push(job);
        }
        let plan = allocate(&views, &self.config, now - t0);
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
