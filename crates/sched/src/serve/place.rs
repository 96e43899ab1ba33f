//! Placing the allocations: each job's numbered slots, its allocation file (the cores its
//! launcher may use), the start-up profile's phases, and starting a launcher (the `stoke` binary's
//! `launch` subcommand, in its own process group, tagged with its job).

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

use super::estimate::segments;
use super::layout::{last_step, launch_events, unix_now};
use super::process::{proc_stat, shell_quote, write_alloc, JOB_TAG_VAR};
use super::server::{Live, Profile, Server};
use crate::model::Scaling;
use crate::observe;
use crate::policy::Policy;
use crate::store::{JobRow, JobState};
use crate::SchedError;

impl Server<'_> {
    /// Gives the allocations their slots, then tells the launchers. A running job keeps its slots
    /// in order: a shrink releases the last ones only once its launcher runs on no more than the
    /// allocation (the workers there have stopped), a grow adds free slots as they are released; a
    /// queued job with an allocation starts once that many slots are free. Each job's slots are
    /// committed before its allocation file (the cores of its first `alloc` slots, fewer during
    /// its profile) is rewritten.
    pub(super) fn place(&mut self) -> Result<(), SchedError> {
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
    pub(super) fn profile(&mut self) -> Result<(), SchedError> {
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
            let n = self.settings.profile_steps as usize;
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
                let p = match Scaling::fit(&[(1, t1), (2, t2)]) {
                    Ok(Scaling::Amdahl { p, .. }) => p,
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

    fn launch(&mut self, job: &JobRow, slots: &[usize]) -> Result<(), SchedError> {
        let run_dir = self.layout.run_dir(job);
        let resume = stoke_ckpt::CheckpointStore::new(run_dir.join("checkpoints")).latest().ok().flatten();
        // A fresh start on two slots or more under the goodput policy profiles first.
        let profile = if resume.is_none()
            && self.config.policy == Policy::Goodput
            && self.settings.profile_steps > 0
            && job.job.min_workers == 1
            && job.alloc >= 2
        {
            let detail = format!(
                "profile: {n} measured steps on 1 worker, then {n} on 2, holding its {} slots",
                job.alloc,
                n = self.settings.profile_steps
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
        let mut cmd = Command::new(&self.settings.launcher.exe);
        cmd.arg("launch")
            .args(["--nproc", &format!("{}:{}", job.job.min_workers, job.job.max_workers)])
            .args(["--max-restarts", &self.settings.max_restarts.to_string()])
            .args(["--slot-check", &check, "--slot-poll-s", "1", "--slot-wait-s", "300"]);
        if self.settings.slurm {
            // Heartbeats go through the server's folder, which every node sees (the run folders
            // are there too).
            let state_dir = self.layout.dir.join("launch");
            std::fs::create_dir_all(&state_dir).map_err(|source| SchedError::File {
                path: state_dir.clone(),
                what: "create",
                source,
            })?;
            cmd.args(["--slurm", "--job-name", &job.job.name]).arg("--state-dir").arg(&state_dir);
        } else {
            cmd.arg("--cpus-file").arg(&alloc_file);
        }
        cmd.args(["--", "train", "--quiet"]);
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
        let log_dir = log_path.parent().expect("logs sit in a folder");
        std::fs::create_dir_all(log_dir).map_err(|source| SchedError::File {
            path: log_dir.to_path_buf(),
            what: "create",
            source,
        })?;
        let log_error = |what: &'static str| {
            let path = log_path.clone();
            move |source| SchedError::File { path, what, source }
        };
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path).map_err(log_error("open"))?;
        cmd.env(JOB_TAG_VAR, self.layout.tag(job.id))
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(log_error("open"))?)
            .stderr(log)
            // Its own process group: a signal to the server's group (Ctrl-C) leaves the jobs.
            .process_group(0);
        let child = cmd.spawn().map_err(|source| SchedError::Launch { job: job.job.name.clone(), source })?;
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
}
