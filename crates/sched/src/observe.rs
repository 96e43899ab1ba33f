//! A job's throughput model fitted from its own reports: the step times in its `metrics.jsonl`,
//! attributed to the world size each step ran on (from the starts in `events.jsonl` and the
//! server's own launches), and fitted with Amdahl's law (`Scaling::fit`).
//!
//! Pure functions of the files' text, so they are tested here without processes.

use crate::model::Scaling;

/// One start of a job's workers: at `time_s` (Unix seconds), from step `from_step` (its latest
/// checkpoint, 0 for a fresh start), on `workers`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Segment {
    pub time_s: f64,
    pub from_step: u64,
    pub workers: usize,
}

/// One line of a launcher's `events.jsonl`.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchEvent {
    pub time_s: f64,
    /// start, finish, preempted, give_up.
    pub event: String,
    pub cause: String,
    pub world_size: usize,
    pub latest_checkpoint: Option<u64>,
}

/// The lines of `events.jsonl` that parse (a line cut short by a crash is skipped).
pub fn parse_events(text: &str) -> Vec<LaunchEvent> {
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|v| {
            Some(LaunchEvent {
                time_s: v["time"].as_f64()?,
                event: v["event"].as_str()?.to_string(),
                cause: v["cause"].as_str().unwrap_or("").to_string(),
                world_size: v["world_size"].as_u64()? as usize,
                latest_checkpoint: v["latest_checkpoint"].as_u64(),
            })
        })
        .collect()
}

/// (step, step_ms) of each line of `metrics.jsonl` that parses.
pub fn parse_step_times(text: &str) -> Vec<(u64, f64)> {
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|v| Some((v["step"].as_u64()?, v["step_ms"].as_f64()?)))
        .filter(|&(_, ms)| ms > 0.0 && ms.is_finite())
        .collect()
}

/// The latest gradient noise scale the run reported (`noise_scale` in `metrics.jsonl`, written
/// while `adaptive.enabled` is on), if any is finite and positive.
pub fn latest_noise_scale(text: &str) -> Option<f64> {
    text.lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|v| v["noise_scale"].as_f64())
        .filter(|n| n.is_finite() && *n > 0.0)
        .last()
}

/// What a profile at 1 then 2 workers cost the job, in seconds: the steps it ran on one worker
/// while two slots were held for it, each slower than on two by `1/t1 - 1/t2` (steps/s), plus the
/// measured resize from one worker to two. Never negative (a second worker that does not help
/// loses nothing by those steps).
pub fn profile_cost(steps_at_1: u64, t1: f64, t2: f64, resize_s: f64) -> f64 {
    let per_step = if t1 > 0.0 && t2 > 0.0 { (1.0 / t1 - 1.0 / t2).max(0.0) } else { 0.0 };
    steps_at_1 as f64 * per_step + resize_s.max(0.0)
}

/// Steps skipped after every start before step times count (start-up: first batches, caches).
pub const WARMUP_STEPS: u64 = 2;

/// Measured throughput per world size: (workers, steps/s as 1000 / median step_ms, steps
/// measured), sorted by workers. A step belongs to the latest start (by time) that began before
/// it; `metrics.jsonl` keeps the surviving lines after every resume, so each step is counted once.
pub fn throughput_points(steps: &[(u64, f64)], segments: &[Segment]) -> Vec<(usize, f64, usize)> {
    let mut ordered: Vec<Segment> = segments.to_vec();
    ordered.sort_by(|a, b| a.time_s.total_cmp(&b.time_s));
    let mut by_world: std::collections::BTreeMap<usize, Vec<f64>> = Default::default();
    for &(step, ms) in steps {
        let Some(seg) = ordered.iter().rev().find(|s| s.from_step < step) else { continue };
        if step > seg.from_step + WARMUP_STEPS {
            by_world.entry(seg.workers).or_default().push(ms);
        }
    }
    by_world.into_iter().map(|(w, ms)| (w, 1000.0 / stoke_stats::median(&ms), ms.len())).collect()
}

/// The parallel fraction assumed until a job has run on two sizes. Default 0.9.
pub const PRIOR_PARALLEL_FRACTION: f64 = 0.9;

/// The job's scaling from its points: Amdahl fitted on two or more sizes; on one size, Amdahl
/// through that point with `PRIOR_PARALLEL_FRACTION`; `None` before any measurement.
pub fn fit_scaling(points: &[(usize, f64, usize)]) -> Option<Scaling> {
    match points {
        [] => None,
        [(w, t, _)] => {
            let p = PRIOR_PARALLEL_FRACTION;
            let t1 = t * ((1.0 - p) + p / *w as f64);
            Some(Scaling::Amdahl { t1, p })
        }
        _ => Scaling::fit(&points.iter().map(|&(w, t, _)| (w, t)).collect::<Vec<_>>()).ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_attributed_to_the_start_that_ran_them() {
        // 2 workers from step 0 (10 ms), a shrink at step 6 to 1 worker (20 ms), a grow at step 12.
        let mut steps: Vec<(u64, f64)> = (1..=6).map(|s| (s, 10.0)).collect();
        steps.extend((7..=12).map(|s| (s, 20.0)));
        steps.extend((13..=20).map(|s| (s, 11.0)));
        let segments = [
            Segment { time_s: 0.0, from_step: 0, workers: 2 },
            Segment { time_s: 5.0, from_step: 6, workers: 1 },
            Segment { time_s: 9.0, from_step: 12, workers: 2 },
        ];
        let points = throughput_points(&steps, &segments);
        assert_eq!(points.len(), 2);
        assert_eq!(points[0], (1, 50.0, 4));
        assert_eq!(points[1].0, 2);
        assert_eq!(points[1].2, 4 + 6);
        assert!((points[1].1 - 1000.0 / 11.0).abs() < 1e-9, "{points:?}");
        let Some(Scaling::Amdahl { t1, p }) = fit_scaling(&points) else { panic!() };
        assert!((t1 - 50.0).abs() < 1e-6 && p > 0.8 && p < 0.95, "{t1} {p}");
        assert_eq!(fit_scaling(&[]), None);
    }

    #[test]
    fn the_noise_scale_is_the_latest_reported_and_the_profile_cost_counts_the_slow_steps() {
        let metrics = "{\"step\":1,\"step_ms\":5.0}\n{\"step\":2,\"step_ms\":5.0,\"noise_scale\":40.0}\n\
                       {\"step\":3,\"step_ms\":5.0,\"noise_scale\":null}\n{\"step\":4,\"step_ms\":5.0,\"noise_scale\":55.5}\n";
        assert_eq!(latest_noise_scale(metrics), Some(55.5));
        assert_eq!(latest_noise_scale("{\"step\":1,\"step_ms\":5.0}\n"), None);
        // 10 steps at 5 steps/s instead of 8: 10 x (0.2 - 0.125) = 0.75 s, plus a 2 s resize.
        assert!((profile_cost(10, 5.0, 8.0, 2.0) - 2.75).abs() < 1e-12);
        // A second worker that is slower: the steps at one lost nothing.
        assert_eq!(profile_cost(10, 8.0, 5.0, 2.0), 2.0);
    }

    #[test]
    fn torn_lines_are_skipped() {
        let events = "{\"time\":5.0,\"event\":\"start\",\"cause\":\"x\",\"world_size\":1,\"restarts\":0,\"latest_checkpoint\":8}\n{\"time\":6";
        let parsed = parse_events(events);
        assert_eq!(parsed.len(), 1);
        assert_eq!((parsed[0].world_size, parsed[0].latest_checkpoint), (1, Some(8)));
        assert_eq!(parse_step_times("{\"step\":1,\"step_ms\":3.5}\n{\"step\":2,\"st"), vec![(1, 3.5)]);
    }
}
