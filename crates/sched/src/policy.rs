//! The policies' allocation: one function that both the simulator (`sim::simulate`) and the real
//! executor (`stoke sched serve`) call, so what the simulator predicts is what the server does.
//!
//! `allocate` takes the active jobs (submitted, not finished) in submission order, each with the
//! workers it holds now and when it was last resized, and returns each one's workers with the
//! reason, in words, for every change.

use crate::model::JobSpec;

/// How slots are shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served, static: a job gets its `max_workers` or waits (the head of the
    /// queue blocks the rest); never resized.
    Fifo,
    /// Every active job gets an equal share (within its min/max), recomputed at arrivals and
    /// completions.
    Fair,
    /// Goodput-maximizing: jobs are admitted at their minimum (shrinking others to their minimum
    /// if needed), and the remaining slots go one by one to the largest weighted gain in speedup;
    /// a running job is resized at most once per `min_resize_interval_s`, and grown only when the
    /// gain over that interval pays for the resize.
    Goodput,
}

impl Policy {
    pub const ALL: &'static [Policy] = &[Policy::Fifo, Policy::Fair, Policy::Goodput];

    /// Whether the policy reallocates on its own clock as well as at arrivals and completions.
    pub fn ticks(self) -> bool {
        matches!(self, Policy::Goodput)
    }

    pub fn name(self) -> &'static str {
        match self {
            Policy::Fifo => "fifo",
            Policy::Fair => "fair",
            Policy::Goodput => "goodput",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = crate::SchedError;
    fn from_str(s: &str) -> Result<Policy, crate::SchedError> {
        match s {
            "fifo" => Ok(Policy::Fifo),
            "fair" => Ok(Policy::Fair),
            "goodput" => Ok(Policy::Goodput),
            other => Err(crate::SchedError::BadPolicy { name: other.into() }),
        }
    }
}

/// What a policy needs to know: the slots, the policy, and the goodput policy's minimum interval
/// between two resizes of one job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyConfig {
    pub slots: usize,
    pub policy: Policy,
    /// Seconds a running job keeps its allocation after a resize or its start (goodput policy),
    /// unless it must shrink to admit a waiting job. Default 300 in the simulator.
    pub min_resize_interval_s: f64,
}

/// One active job as the policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct JobView<'a> {
    pub spec: &'a JobSpec,
    /// Workers it holds now (0: waiting).
    pub workers: usize,
    /// When it last started or was resized (the policy's clock; `-inf` never).
    pub last_resize_s: f64,
}

/// A job's workers after `allocate`, and why they changed (empty when they did not).
#[derive(Debug, Clone, PartialEq)]
pub struct Allocation {
    pub workers: usize,
    pub reason: String,
}

/// The policy's allocation for `jobs` (active, in submission order) at time `now`. A running job
/// never drops below its minimum; the sum never exceeds `config.slots`.
pub fn allocate(jobs: &[JobView<'_>], config: &PolicyConfig, now: f64) -> Vec<Allocation> {
    let current: Vec<usize> = jobs.iter().map(|j| j.workers).collect();
    let (out, notes) = match config.policy {
        Policy::Fifo => fifo(jobs, config),
        Policy::Fair => fair(jobs, config),
        Policy::Goodput => goodput(jobs, config, now),
    };
    debug_assert!(out.iter().sum::<usize>() <= config.slots);
    out.into_iter()
        .zip(notes)
        .zip(&current)
        .map(|((workers, note), &was)| Allocation {
            workers,
            reason: if workers == was && note.is_empty() { String::new() } else { note },
        })
        .collect()
}

type Plan = (Vec<usize>, Vec<String>);

fn fifo(jobs: &[JobView<'_>], config: &PolicyConfig) -> Plan {
    let mut out: Vec<usize> = jobs.iter().map(|j| j.workers).collect();
    let mut notes = vec![String::new(); jobs.len()];
    let mut free = config.slots - out.iter().sum::<usize>();
    for (i, job) in jobs.iter().enumerate() {
        if out[i] > 0 {
            continue;
        }
        let want = job.spec.max_workers.min(config.slots);
        if want > free {
            break; // the head of the queue blocks the rest
        }
        out[i] = want;
        free -= want;
        notes[i] = format!("fifo: started with the {want} workers it asks for ({free} slots left free)");
    }
    (out, notes)
}

fn fair(jobs: &[JobView<'_>], config: &PolicyConfig) -> Plan {
    // Minimums in order (running jobs first keep theirs), then round-robin to max.
    let n = jobs.len();
    let mut out = vec![0; n];
    let mut free = config.slots;
    let running_first = (0..n).filter(|&i| jobs[i].workers > 0).chain((0..n).filter(|&i| jobs[i].workers == 0));
    for i in running_first {
        let min = jobs[i].spec.min_workers;
        if min <= free {
            out[i] = min;
            free -= min;
        }
    }
    loop {
        let mut gave = false;
        for i in 0..n {
            if free > 0 && out[i] > 0 && out[i] < jobs[i].spec.max_workers {
                out[i] += 1;
                free -= 1;
                gave = true;
            }
        }
        if !gave {
            break;
        }
    }
    let sharing = out.iter().filter(|&&w| w > 0).count();
    let notes = (0..n)
        .map(|i| match (jobs[i].workers, out[i]) {
            (was, now) if was == now => String::new(),
            (_, 0) => format!("fair: waits, its minimum {} is more than the slots left", jobs[i].spec.min_workers),
            (0, now) => format!("fair: started on {now}, its share of {} slots among {sharing} jobs", config.slots),
            (was, now) if now < was => {
                format!("fair: shrunk from {was} to {now}, its share of {} slots among {sharing} jobs", config.slots)
            }
            (was, now) => {
                format!("fair: grown from {was} to {now}, its share of {} slots among {sharing} jobs", config.slots)
            }
        })
        .collect();
    (out, notes)
}

fn goodput(jobs: &[JobView<'_>], config: &PolicyConfig, now: f64) -> Plan {
    let n = jobs.len();
    let current: Vec<usize> = jobs.iter().map(|j| j.workers).collect();
    let mut notes = vec![String::new(); n];
    // Running jobs resized less than min_resize_interval_s ago keep their allocation, unless it
    // must shrink to admit a waiting job (to the job's minimum, no lower).
    let pinned: Vec<bool> =
        (0..n).map(|i| current[i] > 0 && now - jobs[i].last_resize_s < config.min_resize_interval_s).collect();
    let mut out: Vec<usize> = (0..n).map(|i| if current[i] > 0 { jobs[i].spec.min_workers } else { 0 }).collect();
    let mut free = config.slots - out.iter().sum::<usize>();
    let mut admitted = Vec::new();
    for i in 0..n {
        if current[i] == 0 && jobs[i].spec.min_workers <= free {
            out[i] = jobs[i].spec.min_workers;
            free -= out[i];
            admitted.push(jobs[i].spec.name.as_str());
            notes[i] = format!("goodput: admitted at its minimum {}", out[i]);
        } else if current[i] == 0 {
            notes[i] =
                format!("goodput: waits, its minimum {} is more than the {free} slots left", jobs[i].spec.min_workers);
        }
    }
    // Pinned jobs get back what they hold, as far as the admissions leave room.
    for i in 0..n {
        if pinned[i] {
            let extra = (current[i] - out[i]).min(free);
            out[i] += extra;
            free -= extra;
            if out[i] < current[i] {
                notes[i] = format!(
                    "goodput: shrunk from {} to {} to admit {} (resized {:.0} s ago, within the minimum interval)",
                    current[i],
                    out[i],
                    admitted.join(", "),
                    now - jobs[i].last_resize_s
                );
            }
        }
    }
    let gain = |i: usize, w: usize| {
        let job = jobs[i].spec;
        job.priority * (job.speedup(w + 1) - job.speedup(w))
    };
    while free > 0 {
        let best = (0..n)
            .filter(|&i| out[i] > 0 && !pinned[i] && out[i] < jobs[i].spec.max_workers.min(config.slots))
            .map(|i| (i, gain(i, out[i])))
            .filter(|&(_, g)| g > 1e-12)
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let Some((i, _)) = best else { break };
        out[i] += 1;
        free -= 1;
    }
    // A running job grows only when the gain over the interval pays for the resize; it keeps
    // what it has when the plan would shrink it for nothing (slots left free).
    for i in 0..n {
        let job = jobs[i].spec;
        if current[i] > 0 && out[i] != current[i] && !pinned[i] {
            let horizon = config.min_resize_interval_s.max(job.resize_s);
            let (new, old) = (job.goodput(out[i]) * (horizon - job.resize_s), job.goodput(current[i]) * horizon);
            if out[i] > current[i] && new <= old {
                free += out[i] - current[i];
                out[i] = current[i];
            } else if out[i] < current[i] && free >= current[i] - out[i] {
                free -= current[i] - out[i];
                out[i] = current[i];
            } else if out[i] > current[i] {
                notes[i] = format!(
                    "goodput: grown from {} to {}: over {horizon:.0} s it trains {new:.1} units against {old:.1}, \
                     the resize's {:.1} s paid",
                    current[i], out[i], job.resize_s
                );
            } else {
                notes[i] =
                    format!("goodput: shrunk from {} to {} to admit {}", current[i], out[i], admitted.join(", "));
            }
        }
    }
    // Newly admitted jobs grown past their minimum say so.
    for i in 0..n {
        if current[i] == 0 && out[i] > jobs[i].spec.min_workers {
            notes[i] = format!(
                "goodput: admitted on {} (minimum {}, the rest by the largest gain in speedup)",
                out[i], jobs[i].spec.min_workers
            );
        }
    }
    (out, notes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Efficiency, Scaling};

    fn spec(name: &str, max: usize, p: f64) -> JobSpec {
        JobSpec {
            name: name.into(),
            submit_s: 0.0,
            work: 100.0,
            min_workers: 1,
            max_workers: max,
            scaling: Scaling::Amdahl { t1: 1.0, p },
            efficiency: Efficiency::FIXED_BATCH,
            resize_s: 5.0,
            start_s: 0.0,
            priority: 1.0,
        }
    }

    fn check(policy: Policy, jobs: &[(JobSpec, usize, f64)], now: f64, expected: &[usize]) -> Vec<Allocation> {
        let views: Vec<JobView<'_>> = jobs
            .iter()
            .map(|(spec, workers, last)| JobView { spec, workers: *workers, last_resize_s: *last })
            .collect();
        let config = PolicyConfig { slots: 2, policy, min_resize_interval_s: 30.0 };
        let got = allocate(&views, &config, now);
        assert_eq!(got.iter().map(|a| a.workers).collect::<Vec<_>>(), expected, "{policy:?}: {got:?}");
        for (a, (_, was, _)) in got.iter().zip(jobs) {
            assert_eq!(a.reason.is_empty(), a.workers == *was, "a reason exactly for each change: {got:?}");
        }
        got
    }

    #[test]
    fn an_arrival_shrinks_a_running_job_and_a_completion_grows_it_back() {
        let (a, b) = (spec("a", 2, 0.95), spec("b", 1, 1.0));
        for policy in [Policy::Fair, Policy::Goodput] {
            check(policy, &[(a.clone(), 0, f64::NEG_INFINITY)], 0.0, &[2]);
            let shrunk = check(policy, &[(a.clone(), 2, 0.0), (b.clone(), 0, f64::NEG_INFINITY)], 10.0, &[1, 1]);
            assert!(shrunk[0].reason.contains("shrunk from 2 to 1"), "{shrunk:?}");
            // b done: a grows back (the goodput policy once the interval has passed).
            check(policy, &[(a.clone(), 1, 10.0)], 100.0, &[2]);
        }
        // Within the interval the goodput policy keeps a's size; fair does not look at time.
        check(Policy::Goodput, &[(a.clone(), 1, 10.0)], 20.0, &[1]);
        check(Policy::Fair, &[(a.clone(), 1, 10.0)], 20.0, &[2]);
        // FIFO never resizes: b waits behind a.
        let waits = check(Policy::Fifo, &[(a.clone(), 2, 0.0), (b, 0, f64::NEG_INFINITY)], 10.0, &[2, 0]);
        assert!(waits[1].reason.is_empty());
    }

    #[test]
    fn growth_that_does_not_pay_for_the_resize_is_refused() {
        // Two workers at p = 0.05 are 2.5% faster: 30 s at that rate do not pay a 5 s resize.
        check(Policy::Goodput, &[(spec("a", 2, 0.05), 1, 0.0)], 100.0, &[1]);
    }
}
