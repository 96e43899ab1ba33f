//! The published baselines beside stoke's own policies: Tiresias (two-queue least attained
//! service) and Optimus-style marginal-gain allocation. Neither chooses batches: their jobs run
//! the batch they ask for.

use crate::model::BatchChoice;
use crate::view::{JobView, Plan, PolicyConfig, LAS_THRESHOLD_SLOT_S};

/// Tiresias: the first queue (under `LAS_THRESHOLD_SLOT_S` slot-seconds of service) before the
/// second, submission order within each; a job runs on all the workers it asks for
/// (`JobSpec::asked`) or none.
pub(crate) fn tiresias(jobs: &[JobView<'_>], config: &PolicyConfig) -> Plan {
    let n = jobs.len();
    let mut out = vec![0; n];
    let mut notes = vec![String::new(); n];
    let mut free = config.slots;
    let first = |i: &usize| jobs[*i].attained_slot_s < LAS_THRESHOLD_SLOT_S;
    let order: Vec<usize> = (0..n).filter(first).chain((0..n).filter(|i| !first(i))).collect();
    for i in order {
        let want = jobs[i].spec.asked().min(jobs[i].spec.max_useful_workers(BatchChoice::Asked)).min(config.slots);
        let queue = if first(&i) { 1 } else { 2 };
        if want <= free {
            out[i] = want;
            free -= want;
            if jobs[i].workers != want {
                notes[i] =
                    format!("tiresias: runs on {want} (queue {queue}, {:.0} slot-s served)", jobs[i].attained_slot_s);
            }
        } else if jobs[i].workers > 0 {
            notes[i] = format!(
                "tiresias: preempted (queue {queue}, {:.0} slot-s served): jobs ahead of it hold the slots",
                jobs[i].attained_slot_s
            );
        }
    }
    (out, notes)
}

/// Optimus: every job at its minimum while slots last (fewest first), then slot by slot to the
/// job whose expected remaining time falls most, at its asked batch.
pub(crate) fn optimus(jobs: &[JobView<'_>], config: &PolicyConfig) -> Plan {
    let n = jobs.len();
    let mut out = vec![0; n];
    let mut free = config.slots;
    let mut by_min: Vec<usize> = (0..n).collect();
    by_min.sort_by_key(|&i| jobs[i].spec.min_workers);
    for i in by_min {
        if jobs[i].spec.min_workers <= free {
            out[i] = jobs[i].spec.min_workers;
            free -= out[i];
        }
    }
    let remaining_s = |i: usize, w: usize| {
        let job = &jobs[i];
        (job.spec.work - job.done).max(0.0)
            / job.spec.goodput_at(w, job.done, BatchChoice::Asked).max(f64::MIN_POSITIVE)
    };
    while free > 0 {
        let best = (0..n)
            .filter(|&i| out[i] > 0 && out[i] < jobs[i].spec.max_useful_workers(BatchChoice::Asked))
            .map(|i| (i, remaining_s(i, out[i]) - remaining_s(i, out[i] + 1)))
            .filter(|&(_, saved)| saved > 1e-9)
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let Some((i, _)) = best else { break };
        out[i] += 1;
        free -= 1;
    }
    let notes = (0..n)
        .map(|i| match (jobs[i].workers, out[i]) {
            (was, now) if was == now => String::new(),
            (_, 0) => "optimus: waits, no slot for its minimum".into(),
            (was, now) => format!(
                "optimus: {was} -> {now}, the most expected remaining time saved per slot ({:.0} s left)",
                remaining_s(i, now)
            ),
        })
        .collect();
    (out, notes)
}
