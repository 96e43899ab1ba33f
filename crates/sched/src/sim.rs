//! The simulator: jobs arrive, policies allocate slots, progress accrues at each job's goodput,
//! and every resize costs the job its `resize_s` without progress (its first start, its `start_s`).
//!
//! Event-driven: time jumps to the next arrival, completion, end of a resize, or policy tick
//! (`SimConfig::tick_s`, for the goodput policy's periodic reallocation). Allocations change only
//! at those events; a running job never drops below its minimum, and only a job's first start is
//! free.

use crate::limits::{HORIZON_S, MAX_WORKERS, MIN_TICK_S};
use crate::model::JobSpec;
use crate::nodes::Nodes;
use crate::policy::{allocate, JobView, Policy, PolicyConfig};
use crate::view::DEFAULT_FAIRNESS_P;
use crate::SchedError;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimConfig {
    pub slots: usize,
    pub policy: Policy,
    /// Seconds between the goodput policy's reallocations (it also reallocates at arrivals and
    /// completions).
    pub tick_s: f64,
    pub min_resize_interval_s: f64,
    /// Allocate only on ticks (every `tick_s`), as Pollux's simulator does, instead of also at
    /// every arrival and completion.
    pub on_ticks_only: bool,
    /// Slots per node (`None`: one node holds them all). With nodes, a job's workers are placed
    /// (`nodes::Nodes`) and a step table's spread measurements price a spread placement.
    pub slots_per_node: Option<usize>,
    /// The goodput policy's fairness p (`PolicyConfig::fairness_p`).
    pub fairness_p: f64,
    /// The most events (arrivals, completions, resizes' ends, ticks) a simulation may take before
    /// it stops with an error instead of running on (a tick far shorter than the jobs).
    pub max_events: u64,
}

impl SimConfig {
    pub fn new(slots: usize, policy: Policy) -> SimConfig {
        SimConfig {
            slots,
            policy,
            tick_s: 60.0,
            min_resize_interval_s: 300.0,
            fairness_p: DEFAULT_FAIRNESS_P,
            on_ticks_only: false,
            slots_per_node: None,
            max_events: 20_000_000,
        }
    }

    /// Refuses settings under which a simulation could not move forward, naming the flag and its
    /// allowed range.
    pub fn check(&self) -> Result<(), SchedError> {
        let flag = |flag: &'static str, value: String, range: String| Err(SchedError::BadFlag { flag, value, range });
        if !(1..=MAX_WORKERS).contains(&self.slots) {
            return flag("--slots", self.slots.to_string(), format!("1 <= slots <= {MAX_WORKERS}"));
        }
        if !(MIN_TICK_S..=HORIZON_S).contains(&self.tick_s) {
            return flag("--tick-s", self.tick_s.to_string(), format!("{MIN_TICK_S} <= tick_s <= {HORIZON_S:e}"));
        }
        if !(0.0..=HORIZON_S).contains(&self.min_resize_interval_s) {
            return flag(
                "--min-resize-interval-s",
                self.min_resize_interval_s.to_string(),
                format!("0 <= min_resize_interval_s <= {HORIZON_S:e}"),
            );
        }
        if !(-10.0..=1.0).contains(&self.fairness_p) {
            return flag("--fairness-p", self.fairness_p.to_string(), "-10 <= p <= 1".into());
        }
        if let Some(per_node) = self.slots_per_node.filter(|&p| !(1..=self.slots).contains(&p)) {
            return flag("--slots-per-node", per_node.to_string(), format!("1 <= slots_per_node <= {}", self.slots));
        }
        if self.max_events == 0 {
            return flag("max_events", "0".into(), "at least 1".into());
        }
        Ok(())
    }

    pub fn policy_config(&self) -> PolicyConfig {
        PolicyConfig {
            slots: self.slots,
            policy: self.policy,
            min_resize_interval_s: self.min_resize_interval_s,
            fairness_p: self.fairness_p,
            slots_per_node: self.slots_per_node,
        }
    }
}

/// One job's course.
#[derive(Debug, Clone, PartialEq)]
pub struct JobResult {
    pub name: String,
    pub submit_s: f64,
    pub start_s: f64,
    pub finish_s: f64,
    pub resizes: usize,
    /// Every change of its workers: (time, workers), from its start to its finish (0 workers).
    pub allocations: Vec<(f64, usize)>,
}

impl JobResult {
    pub fn completion_s(&self) -> f64 {
        self.finish_s - self.submit_s
    }
}

/// An interval with constant allocations: (job index, workers) for each job holding slots.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    pub start_s: f64,
    pub end_s: f64,
    pub held: Vec<(usize, usize)>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct SimResult {
    pub jobs: Vec<JobResult>,
    pub timeline: Vec<Segment>,
    pub slots: usize,
}

impl SimResult {
    pub fn mean_completion_s(&self) -> f64 {
        self.jobs.iter().map(JobResult::completion_s).sum::<f64>() / self.jobs.len().max(1) as f64
    }

    /// Nearest-rank percentile of completion times.
    pub fn completion_percentile_s(&self, q: f64) -> f64 {
        let times: Vec<f64> = self.jobs.iter().map(JobResult::completion_s).collect();
        if times.is_empty() {
            return 0.0;
        }
        stoke_stats::percentile(&times, 100.0 * q)
    }

    pub fn makespan_s(&self) -> f64 {
        let first = self.jobs.iter().map(|j| j.submit_s).fold(f64::INFINITY, f64::min);
        let last = self.jobs.iter().map(|j| j.finish_s).fold(0.0, f64::max);
        (last - first).max(0.0)
    }

    /// Slot-seconds held over slot-seconds available during the makespan.
    pub fn utilization(&self) -> f64 {
        let held: f64 = self
            .timeline
            .iter()
            .map(|s| (s.end_s - s.start_s) * s.held.iter().map(|h| h.1).sum::<usize>() as f64)
            .sum();
        held / (self.slots as f64 * self.makespan_s()).max(1e-12)
    }

    pub fn resizes(&self) -> usize {
        self.jobs.iter().map(|j| j.resizes).sum()
    }
}

#[derive(Debug, Clone)]
struct State {
    progress: f64,
    workers: usize,
    /// No progress before this time (a resize in progress).
    paused_until: f64,
    last_resize: f64,
    start: Option<f64>,
    finish: Option<f64>,
    resizes: usize,
    /// Slot-seconds held so far (Tiresias's attained service).
    attained_slot_s: f64,
}

/// Runs `jobs` (any order) under `config` to completion.
pub fn simulate(jobs: &[JobSpec], config: &SimConfig) -> Result<SimResult, SchedError> {
    config.check()?;
    let mut names = std::collections::HashSet::new();
    for job in jobs {
        job.check(config.slots).map_err(|why| SchedError::BadJob { name: job.name.clone(), why })?;
        if !names.insert(job.name.as_str()) {
            return Err(SchedError::BadJob { name: job.name.clone(), why: "two jobs have this name".into() });
        }
    }
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by(|&a, &b| jobs[a].submit_s.total_cmp(&jobs[b].submit_s).then(a.cmp(&b)));
    let mut state: Vec<State> = jobs
        .iter()
        .map(|_| State {
            progress: 0.0,
            workers: 0,
            paused_until: 0.0,
            last_resize: f64::NEG_INFINITY,
            start: None,
            finish: None,
            resizes: 0,
            attained_slot_s: 0.0,
        })
        .collect();
    let mut timeline: Vec<Segment> = Vec::new();
    let mut allocations: Vec<Vec<(f64, usize)>> = vec![Vec::new(); jobs.len()];
    let mut t = 0.0f64;
    let mut next_tick = config.tick_s;
    let mut events = 0u64;
    let mut still = 0usize;
    let choice = config.policy.batch_choice();
    let mut at_tick = true;
    let mut nodes = config.slots_per_node.map(|per_node| Nodes::new(config.slots, per_node, jobs.len()));
    let spread = |nodes: &Option<Nodes>, j: usize| nodes.as_ref().and_then(|n| n.spread(j));
    loop {
        let active: Vec<usize> =
            order.iter().copied().filter(|&j| jobs[j].submit_s <= t && state[j].finish.is_none()).collect();
        if active.is_empty() && order.iter().all(|&j| state[j].finish.is_some()) {
            break;
        }
        events += 1;
        if events > config.max_events {
            return Err(SchedError::Stalled {
                at_s: t,
                why: format!(
                    "{} events without finishing (tick {} s); a longer --tick-s takes fewer",
                    config.max_events, config.tick_s
                ),
            });
        }
        // Allocate.
        // On ticks only (as Pollux's simulator runs), arrivals wait for the next tick and slots a
        // finished job frees stay free until then.
        let targets = if config.on_ticks_only && !at_tick {
            active.iter().map(|&j| state[j].workers).collect()
        } else {
            plan(jobs, &state, &active, config, t)
        };
        debug_assert!(targets.iter().sum::<usize>() <= config.slots);
        if let Some(nodes) = &mut nodes {
            // Shrinks first: the slots they free are what the grows take.
            let mut changes: Vec<(usize, usize)> = active.iter().copied().zip(targets.iter().copied()).collect();
            changes.sort_by_key(|&(j, target)| target > state[j].workers);
            for (j, target) in changes {
                nodes.resize(j, target);
            }
        }
        for (&j, &target) in active.iter().zip(&targets) {
            let s = &mut state[j];
            if target == s.workers {
                continue;
            }
            if s.workers > 0 && target > 0 {
                s.resizes += 1;
                s.paused_until = t + jobs[j].resize_s;
                s.last_resize = t;
            } else if s.workers == 0 && target > 0 {
                if s.start.is_none() {
                    s.paused_until = t + jobs[j].start_s;
                } else {
                    // A preempted job restarts from its checkpoint: a resize's cost.
                    s.resizes += 1;
                    s.paused_until = t + jobs[j].resize_s;
                }
                s.start.get_or_insert(t);
                s.last_resize = t;
            }
            s.workers = target;
            allocations[j].push((t, target));
        }
        // The next event: an arrival, a tick, a resize's end or a completion.
        let mut next = order.iter().map(|&j| jobs[j].submit_s).filter(|&s| s > t).fold(f64::INFINITY, f64::min);
        if config.policy.ticks() || config.on_ticks_only {
            next = next.min(next_tick);
        }
        let mut finish_at = vec![f64::INFINITY; jobs.len()];
        for &j in &active {
            let s = &state[j];
            if s.workers == 0 {
                continue;
            }
            let resume = s.paused_until.max(t);
            if resume > t {
                next = next.min(resume);
            }
            let rate = jobs[j].goodput_placed(s.workers, s.progress, choice, spread(&nodes, j));
            finish_at[j] = resume + (jobs[j].work - s.progress).max(0.0) / rate;
            next = next.min(finish_at[j]);
            // Its noise scale's next step changes its rate: an event.
            if let Some(change) = jobs[j].next_change(s.progress) {
                next = next.min(resume + (change - s.progress).max(0.0) / rate);
            }
        }
        if !next.is_finite() {
            // Nothing runs and nothing arrives: a job that can never start.
            let stuck = active.iter().map(|&j| jobs[j].name.clone()).collect::<Vec<_>>().join(", ");
            return Err(SchedError::BadJob {
                name: stuck,
                why: format!("waits with nothing running and nothing left to arrive (policy {})", config.policy.name()),
            });
        }
        if next > HORIZON_S {
            let late = active.iter().copied().min_by(|&a, &b| finish_at[b].total_cmp(&finish_at[a]));
            return Err(SchedError::Stalled {
                at_s: t,
                why: format!(
                    "the next event falls past the simulator's horizon of {HORIZON_S:e} s{}",
                    late.map(|j| format!(" (job {} would finish at {:.3e} s)", jobs[j].name, finish_at[j]))
                        .unwrap_or_default()
                ),
            });
        }
        let held: Vec<(usize, usize)> =
            active.iter().filter(|&&j| state[j].workers > 0).map(|&j| (j, state[j].workers)).collect();
        if next > t && !held.is_empty() {
            timeline.push(Segment { start_s: t, end_s: next, held });
        }
        // Progress to `next`; a job whose completion is the event finishes exactly then, so that
        // rounding in `progress` can never leave it a sliver short for ever.
        let mut finished = 0;
        for &j in &active {
            let s = &mut state[j];
            if s.workers == 0 {
                continue;
            }
            let run = (next - s.paused_until.max(t)).max(0.0);
            s.attained_slot_s += (next - t) * s.workers as f64;
            s.progress += jobs[j].goodput_placed(s.workers, s.progress, choice, spread(&nodes, j)) * run;
            if finish_at[j] <= next || s.progress >= jobs[j].work {
                s.progress = jobs[j].work;
                s.finish = Some(next);
                s.workers = 0;
                if let Some(nodes) = &mut nodes {
                    nodes.resize(j, 0);
                }
                allocations[j].push((next, 0));
                finished += 1;
            }
        }
        // Invariant: time moves, or a job finishes; anything else repeated is a stall.
        if next > t || finished > 0 {
            still = 0;
        } else {
            still += 1;
            if still > 2 * jobs.len() + 8 {
                return Err(SchedError::Stalled { at_s: t, why: "the clock does not move".into() });
            }
        }
        at_tick = next >= next_tick;
        if at_tick {
            next_tick = next + config.tick_s;
        }
        t = next;
    }
    let results = jobs
        .iter()
        .zip(&state)
        .zip(allocations)
        .map(|((job, s), allocations)| JobResult {
            name: job.name.clone(),
            submit_s: job.submit_s,
            start_s: s.start.unwrap_or(job.submit_s),
            finish_s: s.finish.unwrap_or(f64::NAN),
            resizes: s.resizes,
            allocations,
        })
        .collect();
    Ok(SimResult { jobs: results, timeline, slots: config.slots })
}

/// The policy's allocation for `active` (submission order), given the current state: the one
/// allocation function the server calls too.
fn plan(jobs: &[JobSpec], state: &[State], active: &[usize], config: &SimConfig, t: f64) -> Vec<usize> {
    let views: Vec<JobView<'_>> = active
        .iter()
        .map(|&j| JobView {
            spec: &jobs[j],
            workers: state[j].workers,
            last_resize_s: state[j].last_resize,
            done: state[j].progress,
            attained_slot_s: state[j].attained_slot_s,
        })
        .collect();
    allocate(&views, &config.policy_config(), t).into_iter().map(|a| a.workers).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Efficiency, Scaling};

    fn job(name: &str, submit_s: f64, work: f64, max: usize, p: f64) -> JobSpec {
        JobSpec {
            name: name.into(),
            submit_s,
            work,
            min_workers: 1,
            max_workers: max,
            scaling: Scaling::Amdahl { t1: 1.0, p },
            efficiency: Efficiency::FIXED_BATCH,
            resize_s: 10.0,
            start_s: 0.0,
            priority: 1.0,
            batch: None,
            asked_workers: None,
        }
    }

    #[test]
    fn one_linear_job_takes_work_over_its_throughput() {
        let jobs = [job("a", 5.0, 400.0, 4, 1.0)];
        for policy in [Policy::Fifo, Policy::Fair, Policy::Goodput] {
            let r = simulate(&jobs, &SimConfig::new(4, policy)).unwrap();
            assert!((r.jobs[0].finish_s - 105.0).abs() < 1e-9, "{policy:?}: {:?}", r.jobs[0]);
            assert!((r.utilization() - 1.0).abs() < 1e-9);
        }
    }

    #[test]
    fn fifo_blocks_behind_the_head_and_goodput_shares() {
        // A big job holds all 4 slots; a small one arriving later waits under FIFO, while the
        // goodput policy shrinks the big one (which scales poorly) to admit it.
        let jobs = [job("big", 0.0, 2000.0, 4, 0.5), job("small", 10.0, 100.0, 1, 1.0)];
        let fifo = simulate(&jobs, &SimConfig::new(4, Policy::Fifo)).unwrap();
        let good = simulate(&jobs, &SimConfig::new(4, Policy::Goodput)).unwrap();
        assert!(fifo.jobs[1].start_s > 1000.0, "{:?}", fifo.jobs);
        assert_eq!(good.jobs[1].start_s, 10.0, "{:?}", good.jobs);
        assert!(good.mean_completion_s() < fifo.mean_completion_s());
        assert!(good.jobs[0].resizes >= 1);
    }

    #[test]
    fn percentiles_and_makespan() {
        let jobs: Vec<JobSpec> = (0..4).map(|i| job(&format!("j{i}"), 0.0, 10.0 * (i + 1) as f64, 1, 1.0)).collect();
        let r = simulate(&jobs, &SimConfig::new(4, Policy::Fifo)).unwrap();
        assert_eq!(r.makespan_s(), 40.0);
        assert_eq!(r.completion_percentile_s(0.99), 40.0);
        assert_eq!(r.completion_percentile_s(0.5), 20.0);
        assert_eq!(r.mean_completion_s(), 25.0);
    }

    #[test]
    fn a_job_larger_than_the_cluster_is_refused() {
        let mut big = job("big", 0.0, 1.0, 8, 1.0);
        big.min_workers = 8;
        let err = simulate(&[big], &SimConfig::new(4, Policy::Fifo)).unwrap_err().to_string();
        assert!(err.contains("big"), "{err}");
    }
}
