//! The cost estimators: each job's model for the policies and the simulator (throughput fitted
//! from its own steps, statistical efficiency, resize and start-up costs measured in the history).

use crate::model::{Efficiency, JobSpec, Scaling};
use crate::observe::{self, Segment};
use crate::store::{Decision, HistoryEntry, JobRow};

/// Seconds a resize is assumed to cost before one has been measured.
pub const DEFAULT_RESIZE_S: f64 = 5.0;

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

/// Slot-seconds the policy has given `job` up to `now` (Tiresias's attained service): each
/// decision's workers from its time to the job's next decision.
pub fn attained_slot_s(decisions: &[Decision], job: i64, now: f64) -> f64 {
    let own: Vec<&Decision> = decisions.iter().filter(|d| d.job == job).collect();
    own.iter()
        .enumerate()
        .map(|(i, d)| {
            let until = own.get(i + 1).map_or(now, |next| next.time_s);
            d.to_workers as f64 * (until - d.time_s).max(0.0)
        })
        .sum()
}

/// The job's statistical efficiency: from the gradient noise scale its run reported, when its
/// global batch grows with its workers (`train.global_batch` unset); 1 on every size otherwise (a
/// fixed global batch, or no noise scale reported).
pub fn efficiency(job: &JobRow, noise_scale: Option<f64>) -> Efficiency {
    match noise_scale {
        Some(noise) if job.job.batch_grows && job.job.batch_per_worker > 0 => {
            Efficiency { b0: job.job.batch_per_worker as f64, batch_grows: true, noise }
        }
        _ => Efficiency::FIXED_BATCH,
    }
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
    let scaling =
        observe::fit_scaling(points).unwrap_or(Scaling::Amdahl { t1: 1.0, p: observe::PRIOR_PARALLEL_FRACTION });
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
        batch: None,
        asked_workers: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attained_service_sums_each_allocation_over_its_time() {
        let d = |time_s: f64, job: i64, to_workers: usize| Decision {
            time_s,
            job,
            policy: "tiresias".into(),
            from_workers: 0,
            to_workers,
            reason: String::new(),
        };
        let decisions = [d(0.0, 1, 2), d(5.0, 2, 1), d(10.0, 1, 1), d(20.0, 1, 0)];
        assert_eq!(attained_slot_s(&decisions, 1, 100.0), 2.0 * 10.0 + 10.0);
        assert_eq!(attained_slot_s(&decisions, 2, 100.0), 95.0);
    }
}
