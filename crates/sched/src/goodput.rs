//! The goodput policy (`Policy::Goodput`): Pollux's objective, searched so that it can jump past
//! a dip in a throughput curve and never leaves a slot free that would speed a job up.
//!
//! Each job's value on `w` workers is its speed-up `S(w)`: goodput at the best global batch for
//! `w` and its current noise scale, over the same on its minimum. A change of workers costs the
//! job its `resize_s`; over its expected remaining time `R / g(w)` that is a goodput of
//! `R / (resize_s + R / g(w))`, so a resize is worth it exactly when it finishes the job sooner.
//! The policy maximises `sum priority * u(S)`, `u(S) = S^p / p` (`ln S` at p = 0).
//!
//! Search: running jobs start at their minimum and waiting ones are admitted at theirs in
//! submission order while slots last; jobs resized within the minimum interval get back what they
//! hold where room is left; then, while slots are free, every job's every jump `w -> w'` (not
//! only `w + 1`) is scored by its gain per slot, and the best jump is taken. Greedy on whole jumps
//! is greedy on each job's upper concave envelope, so a curve that dips at 5 and climbs again at
//! 8 is climbed.

use crate::model::BatchChoice;
use crate::view::{JobView, Plan, PolicyConfig};

pub(crate) fn goodput(jobs: &[JobView<'_>], config: &PolicyConfig, now: f64) -> Plan {
    let n = jobs.len();
    let current: Vec<usize> = jobs.iter().map(|j| j.workers).collect();
    let mut notes = vec![String::new(); n];
    let values: Vec<Vec<f64>> = jobs.iter().map(|job| values(job, config)).collect();
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
        } else if current[i] == 0 {
            notes[i] =
                format!("goodput: waits, its minimum {} is more than the {free} slots left", jobs[i].spec.min_workers);
        }
    }
    for i in 0..n {
        if pinned[i] {
            let extra = (current[i] - out[i]).min(free);
            out[i] += extra;
            free -= extra;
        }
    }
    // Jumps by gain per slot, on each job's envelope; a pinned job only grows.
    while free > 0 {
        let mut best: Option<(usize, usize, f64)> = None;
        for i in (0..n).filter(|&i| out[i] > 0) {
            let top = (values[i].len() - 1).min(out[i] + free);
            for w in out[i] + 1..=top {
                let gain = (values[i][w] - values[i][out[i]]) / (w - out[i]) as f64;
                if gain > 1e-12 && best.is_none_or(|b| gain > b.2) {
                    best = Some((i, w, gain));
                }
            }
        }
        let Some((i, w, _)) = best else { break };
        free -= w - out[i];
        out[i] = w;
    }
    for i in 0..n {
        let spec = jobs[i].spec;
        notes[i] = match (current[i], out[i]) {
            (was, now) if was == now => std::mem::take(&mut notes[i]),
            (_, 0) => std::mem::take(&mut notes[i]),
            (0, now) => {
                format!("goodput: admitted on {now} (minimum {}){}", spec.min_workers, best_batch(&jobs[i], now))
            }
            (was, now) if now < was => format!(
                "goodput: shrunk from {was} to {now}{}{}",
                if admitted.is_empty() { String::new() } else { format!(" to admit {}", admitted.join(", ")) },
                best_batch(&jobs[i], now)
            ),
            (was, now) => format!(
                "goodput: grown from {was} to {now}: goodput {:.3} -> {:.3}{}, the {:.0} s resize paid over its \
                 remaining time",
                spec.goodput_at(was, jobs[i].done, BatchChoice::Best),
                spec.goodput_at(now, jobs[i].done, BatchChoice::Best),
                best_batch(&jobs[i], now),
                spec.resize_s
            ),
        };
    }
    (out, notes)
}

/// ", batch B" where the policy chose the job's batch, else nothing.
fn best_batch(job: &JobView<'_>, workers: usize) -> String {
    let spec = job.spec;
    spec.batch.as_ref().map_or(String::new(), |m| format!(", batch {:.0}", m.best(workers, job.done / spec.work).1))
}

/// `priority * u(S(w))` for w in 0..=the most useful workers (index 0 unused): the speed-up at
/// the best batch, a change from the job's current workers charged its resize over its remaining
/// time.
fn values(job: &JobView<'_>, config: &PolicyConfig) -> Vec<f64> {
    let spec = job.spec;
    let top = spec.max_useful_workers(BatchChoice::Best).min(config.slots);
    let rate = |w: usize| spec.goodput_at(w, job.done, BatchChoice::Best);
    let base = rate(spec.min_workers).max(f64::MIN_POSITIVE);
    let remaining = (spec.work - job.done).max(0.0);
    let p = config.fairness_p;
    let mut out = vec![f64::NEG_INFINITY; top + 1];
    for (w, value) in out.iter_mut().enumerate().skip(spec.min_workers) {
        let whole = config.slots_per_node.is_none_or(|per| w <= per || w % per == 0);
        if !whole && w != job.workers {
            continue;
        }
        let g = rate(w);
        let effective = if job.workers > 0 && w != job.workers && g > 0.0 {
            remaining / (spec.resize_s + remaining / g)
        } else {
            g
        };
        let s = (effective / base).max(1e-12);
        *value = spec.priority * if p.abs() < 1e-9 { s.ln() } else { s.powf(p) / p };
    }
    out
}
