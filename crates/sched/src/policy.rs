//! The policies' allocation: one function that both the simulator (`sim::simulate`) and the real
//! executor (`stoke sched serve`) call, so what the simulator predicts is what the server does.
//!
//! `allocate` takes the active jobs (submitted, not finished) in submission order, each with the
//! workers it holds now and when it was last resized, and returns each one's workers with the
//! reason, in words, for every change.

use crate::baselines::{optimus, tiresias};
use crate::goodput::goodput;
use crate::model::BatchChoice;
use crate::view::Plan;
pub use crate::view::{Allocation, JobView, Policy, PolicyConfig};

/// The policy's allocation for `jobs` (active, in submission order) at time `now`. A running job
/// never drops below its minimum; the sum never exceeds `config.slots`.
pub fn allocate(jobs: &[JobView<'_>], config: &PolicyConfig, now: f64) -> Vec<Allocation> {
    let current: Vec<usize> = jobs.iter().map(|j| j.workers).collect();
    let (out, notes) = match config.policy {
        Policy::Fifo => fifo(jobs, config),
        Policy::Fair => fair(jobs, config),
        Policy::Goodput => goodput(jobs, config, now),
        Policy::Tiresias => tiresias(jobs, config),
        Policy::Optimus => optimus(jobs, config),
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

fn fifo(jobs: &[JobView<'_>], config: &PolicyConfig) -> Plan {
    let mut out: Vec<usize> = jobs.iter().map(|j| j.workers).collect();
    let mut notes = vec![String::new(); jobs.len()];
    let mut free = config.slots - out.iter().sum::<usize>();
    for (i, job) in jobs.iter().enumerate() {
        if out[i] > 0 {
            continue;
        }
        let want = job.spec.asked().min(config.slots);
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
            if free > 0 && out[i] > 0 && out[i] < jobs[i].spec.max_useful_workers(BatchChoice::Asked) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Efficiency, JobSpec, Scaling};

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
            batch: None,
            asked_workers: None,
        }
    }

    fn check(policy: Policy, jobs: &[(JobSpec, usize, f64)], now: f64, expected: &[usize]) -> Vec<Allocation> {
        let views: Vec<JobView<'_>> = jobs
            .iter()
            .map(|(spec, workers, last)| JobView {
                spec,
                workers: *workers,
                last_resize_s: *last,
                done: 0.0,
                attained_slot_s: 0.0,
            })
            .collect();
        let config = PolicyConfig { min_resize_interval_s: 30.0, ..PolicyConfig::new(2, policy) };
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
        // Within the interval the goodput policy does not shrink a job, but a free slot that
        // speeds it up is offered at once.
        check(Policy::Goodput, &[(a.clone(), 1, 10.0)], 20.0, &[2]);
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
