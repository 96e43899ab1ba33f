//! The job model: throughput as a function of workers, statistical efficiency, goodput.

use crate::batch::BatchModel;
use crate::limits::{MAX_PRIORITY, MAX_RATE, MAX_RESIZE_S, MAX_SUBMIT_S, MAX_WORK, MAX_WORKERS, MIN_RATE};
use crate::SchedError;

/// Samples per second on `w` workers.
#[derive(Debug, Clone, PartialEq)]
pub enum Scaling {
    /// Measured points (workers, samples/s), sorted by workers: linear between them, flat past
    /// the last one (more workers than ever measured buy nothing the model can promise), and
    /// proportional below the first.
    Points(Vec<(usize, f64)>),
    /// Amdahl's law from one worker's throughput and the parallel fraction `p`:
    /// `t1 / ((1 - p) + p / w)`.
    Amdahl { t1: f64, p: f64 },
}

impl Scaling {
    /// Parses `amdahl:T1:P`, `linear:T1` (Amdahl with p = 1) or `points:W=T;W=T;...`.
    pub fn parse(text: &str) -> Result<Scaling, SchedError> {
        let bad = |why: &str| SchedError::BadScaling { text: text.into(), why: why.into() };
        let number = |s: &str| s.trim().parse::<f64>().map_err(|_| bad("not a number"));
        let mut parts = text.split(':');
        let scaling = match parts.next().unwrap_or("") {
            "amdahl" => {
                let t1 = number(parts.next().ok_or_else(|| bad("amdahl:T1:P"))?)?;
                let p = number(parts.next().ok_or_else(|| bad("amdahl:T1:P"))?)?;
                Scaling::Amdahl { t1, p }
            }
            "linear" => Scaling::Amdahl { t1: number(parts.next().ok_or_else(|| bad("linear:T1"))?)?, p: 1.0 },
            "points" => {
                let mut points = Vec::new();
                for point in parts.next().ok_or_else(|| bad("points:W=T;W=T"))?.split(';') {
                    let (w, t) = point.split_once('=').ok_or_else(|| bad("points:W=T;W=T"))?;
                    let w = w.trim().parse::<usize>().map_err(|_| bad("workers must be whole numbers"))?;
                    points.push((w, number(t)?));
                }
                points.sort_by_key(|&(w, _)| w);
                Scaling::Points(points)
            }
            _ => return Err(bad("expected amdahl:T1:P, linear:T1 or points:W=T;W=T")),
        };
        scaling.check().map_err(|why| bad(&why))?;
        Ok(scaling)
    }

    pub fn check(&self) -> Result<(), String> {
        match self {
            Scaling::Amdahl { t1, p } if !((MIN_RATE..=MAX_RATE).contains(t1) && (0.0..=1.0).contains(p)) => {
                Err(format!("needs {MIN_RATE:e} <= T1 <= {MAX_RATE:e} and 0 <= P <= 1"))
            }
            Scaling::Points(points)
                if points.is_empty()
                    || points.iter().any(|&(w, t)| !(1..=MAX_WORKERS).contains(&w) || !(MIN_RATE..=MAX_RATE).contains(&t)) =>
            {
                Err(format!(
                    "needs at least one point, each with 1 <= workers <= {MAX_WORKERS} and {MIN_RATE:e} <= throughput <= {MAX_RATE:e}"
                ))
            }
            Scaling::Points(points) if points.windows(2).any(|p| p[0].0 == p[1].0) => {
                Err("one point per worker count".into())
            }
            _ => Ok(()),
        }
    }

    /// Samples per second on `workers` (0 for none).
    pub fn throughput(&self, workers: usize) -> f64 {
        if workers == 0 {
            return 0.0;
        }
        let w = workers as f64;
        match self {
            Scaling::Amdahl { t1, p } => t1 / ((1.0 - p) + p / w),
            Scaling::Points(points) => {
                let (w0, t0) = points[0];
                if workers <= w0 {
                    return t0 * w / w0 as f64;
                }
                for pair in points.windows(2) {
                    let ((wa, ta), (wb, tb)) = (pair[0], pair[1]);
                    if workers <= wb {
                        return ta + (tb - ta) * (w - wa as f64) / (wb - wa) as f64;
                    }
                }
                points[points.len() - 1].1
            }
        }
    }

    /// Fits Amdahl's law to measured points (least squares on the step time per sample, which is
    /// linear in 1/w: `1/T(w) = a + b/w`). One point gives p = 1 at that throughput.
    pub fn fit(points: &[(usize, f64)]) -> Result<Scaling, SchedError> {
        let valid: Vec<(f64, f64)> =
            points.iter().filter(|&&(w, t)| w > 0 && t > 0.0).map(|&(w, t)| (1.0 / w as f64, 1.0 / t)).collect();
        let bad = |why: &str| SchedError::BadScaling { text: format!("{points:?}"), why: why.into() };
        match valid.len() {
            0 => Err(bad("no point with workers >= 1 and throughput > 0")),
            1 => {
                let (x, y) = valid[0];
                Ok(Scaling::Amdahl { t1: 1.0 / (y / x), p: 1.0 })
            }
            n => {
                let (mx, my) = (
                    valid.iter().map(|v| v.0).sum::<f64>() / n as f64,
                    valid.iter().map(|v| v.1).sum::<f64>() / n as f64,
                );
                let sxx: f64 = valid.iter().map(|v| (v.0 - mx).powi(2)).sum();
                if sxx == 0.0 {
                    return Scaling::fit(&points[..1]);
                }
                let b = (valid.iter().map(|v| (v.0 - mx) * (v.1 - my)).sum::<f64>() / sxx).max(0.0);
                let a = (my - b * mx).max(0.0);
                // 1/T(w) = (1/t1)((1-p) + p/w): a = (1-p)/t1, b = p/t1.
                let t1 = 1.0 / (a + b);
                Ok(Scaling::Amdahl { t1, p: b * t1 })
            }
        }
    }
}

/// Statistical efficiency of a global batch (McCandlish et al. 2018, as Pollux uses it): with
/// gradient noise scale `noise`, training on batch `b` makes `(noise + b0) / (noise + b)` of the
/// progress per sample that batch `b0` makes. A job that keeps its global batch (stoke's
/// `train.global_batch`) has efficiency 1 on every size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Efficiency {
    /// Global batch on one worker, and how it grows: `b0 * w` when `batch_grows`, else `b0`.
    pub b0: f64,
    pub batch_grows: bool,
    pub noise: f64,
}

impl Efficiency {
    pub const FIXED_BATCH: Efficiency = Efficiency { b0: 1.0, batch_grows: false, noise: 0.0 };

    /// Refuses an efficiency that is not a fraction: a batch below 1 or a negative noise scale.
    pub fn check(&self) -> Result<(), String> {
        if self.batch_grows && !(self.b0.is_finite() && self.b0 >= 1.0 && self.noise.is_finite() && self.noise >= 0.0) {
            return Err(format!(
                "noise_scale {} batch_per_worker {}: needs noise_scale >= 0 and batch_per_worker >= 1",
                self.noise, self.b0
            ));
        }
        Ok(())
    }

    pub fn at(&self, workers: usize) -> f64 {
        if !self.batch_grows || workers <= 1 {
            return 1.0;
        }
        let b = self.b0 * workers as f64;
        (self.noise + self.b0) / (self.noise + b)
    }
}

/// A job: its work, its limits, its scaling and efficiency, its priority and what a resize costs.
#[derive(Debug, Clone, PartialEq)]
pub struct JobSpec {
    pub name: String,
    /// Seconds after the start of the trace.
    pub submit_s: f64,
    /// Samples (at the efficiency of one worker's batch) to train.
    pub work: f64,
    pub min_workers: usize,
    pub max_workers: usize,
    pub scaling: Scaling,
    pub efficiency: Efficiency,
    /// Seconds without progress per resize (checkpoint, stop, restart, reload).
    pub resize_s: f64,
    /// Seconds from its first start to its first step (process start-up, building the model and
    /// the data). 0 in the jobs CSV and the generator (a first start is free there); the server
    /// measures it.
    pub start_s: f64,
    /// Weight in the goodput policy's sum (1 = normal).
    pub priority: f64,
    /// A batch the scheduler may choose: then the step table, not `scaling` and `efficiency`,
    /// gives its goodput.
    pub batch: Option<BatchModel>,
    /// The workers it asks for, which FIFO and Tiresias run it on (`None`: `max_workers`).
    pub asked_workers: Option<usize>,
}

/// Which global batch a job runs: the one it asks for, or the best one it accepts for its
/// workers and progress (the goodput policy's choice, as Pollux makes it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchChoice {
    Asked,
    Best,
}

impl JobSpec {
    /// Refuses a job no simulation could finish, or whose figures are out of their ranges (the
    /// jobs CSV checks the same per field, naming the line).
    pub fn check(&self, slots: usize) -> Result<(), String> {
        let within = |v: f64, lo: f64, hi: f64| v.is_finite() && (lo..=hi).contains(&v);
        if self.name.is_empty() {
            return Err("needs a name".into());
        }
        if !(1 <= self.min_workers && self.min_workers <= self.max_workers && self.max_workers <= MAX_WORKERS) {
            return Err(format!(
                "min_workers {} max_workers {}: needs 1 <= min_workers <= max_workers <= {MAX_WORKERS}",
                self.min_workers, self.max_workers
            ));
        }
        if self.min_workers > slots {
            return Err(format!("min_workers {} is more than the {slots} slots", self.min_workers));
        }
        if !(within(self.work, 0.0, MAX_WORK) && self.work > 0.0) {
            return Err(format!("work {}: needs 0 < work <= {MAX_WORK:e}", self.work));
        }
        if !within(self.submit_s, 0.0, MAX_SUBMIT_S) {
            return Err(format!("submit_s {}: needs 0 <= submit_s <= {MAX_SUBMIT_S:e}", self.submit_s));
        }
        if !within(self.resize_s, 0.0, MAX_RESIZE_S) || !within(self.start_s, 0.0, MAX_RESIZE_S) {
            return Err(format!(
                "resize_s {} start_s {}: needs 0 <= each <= {MAX_RESIZE_S:e}",
                self.resize_s, self.start_s
            ));
        }
        if !(within(self.priority, 0.0, MAX_PRIORITY) && self.priority > 0.0) {
            return Err(format!("priority {}: needs 0 < priority <= {MAX_PRIORITY:e}", self.priority));
        }
        self.scaling.check()?;
        self.efficiency.check()?;
        if let Some(model) = &self.batch {
            model.check()?;
        }
        for w in [self.min_workers, self.max_workers.min(slots)] {
            let rate = self.goodput(w);
            if !(rate.is_finite() && rate >= MIN_RATE * 1e-6) {
                return Err(format!("goodput {rate} on {w} workers; needs a positive, finite rate"));
            }
        }
        Ok(())
    }

    /// Useful samples per second on `workers` at the start: throughput x statistical efficiency.
    pub fn goodput(&self, workers: usize) -> f64 {
        self.goodput_at(workers, 0.0, BatchChoice::Asked)
    }

    /// Useful samples per second on `workers` with `done` of the work done, at the batch `choice`
    /// gives.
    pub fn goodput_at(&self, workers: usize, done: f64, choice: BatchChoice) -> f64 {
        self.goodput_placed(workers, done, choice, None)
    }

    /// The same, with its workers spread over `spread_over` nodes (more than the fewest they fit
    /// on) where that is given: only a step table with spread measurements tells the difference.
    pub fn goodput_placed(&self, workers: usize, done: f64, choice: BatchChoice, spread_over: Option<usize>) -> f64 {
        match (&self.batch, choice) {
            (None, _) => self.scaling.throughput(workers) * self.efficiency.at(workers),
            (Some(model), BatchChoice::Asked) => {
                let used = model.workers_for_asked(workers);
                model.goodput(used, model.batch, done / self.work, spread_over.filter(|_| used == workers))
            }
            (Some(model), BatchChoice::Best) => model.best_placed(workers, done / self.work, spread_over).0,
        }
    }

    /// The workers it asks for (FIFO's and Tiresias's allocation), within its limits.
    pub fn asked(&self) -> usize {
        self.asked_workers.unwrap_or(self.max_workers).clamp(self.min_workers, self.max_workers)
    }

    /// The most workers that speed it up at all at `choice`'s batch: `max_workers`, less where
    /// its batch cannot be spread over more (the local batch would fall below the micro-batches
    /// measured).
    pub fn max_useful_workers(&self, choice: BatchChoice) -> usize {
        match (&self.batch, choice) {
            (None, _) => self.max_workers,
            (Some(model), BatchChoice::Asked) => model.workers_for_asked(self.max_workers),
            (Some(model), BatchChoice::Best) => {
                let most = (model.batch_max / model.table.micro_min()).floor().max(1.0) as usize;
                self.max_workers.min(most)
            }
        }
        .max(self.min_workers)
    }

    /// The work done (after `done`) at which its goodput changes without a change of workers
    /// (its noise scale's next step), if any.
    /// Steps closer than a billionth of the work count as reached: rounding in the progress then
    /// never schedules an event the clock cannot resolve.
    pub fn next_change(&self, done: f64) -> Option<f64> {
        self.batch.as_ref()?.next_change(done / self.work + 1e-9).map(|f| f * self.work)
    }

    /// Goodput on `workers` over goodput on `min_workers` (what the goodput policy sums).
    pub fn speedup(&self, workers: usize) -> f64 {
        let base = self.goodput(self.min_workers.max(1));
        if base > 0.0 {
            self.goodput(workers) / base
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaling_models_parse_and_evaluate() {
        let amdahl = Scaling::parse("amdahl:100:0.9").unwrap();
        assert!((amdahl.throughput(1) - 100.0).abs() < 1e-9);
        assert!((amdahl.throughput(10) - 100.0 / (0.1 + 0.09)).abs() < 1e-9);
        assert_eq!(Scaling::parse("linear:10").unwrap().throughput(4), 40.0);
        let points = Scaling::parse("points:1=10;4=30;2=18").unwrap();
        assert_eq!(points.throughput(2), 18.0);
        assert_eq!(points.throughput(3), 24.0);
        assert_eq!(points.throughput(8), 30.0);
        assert_eq!(points.throughput(0), 0.0);
        for bad in ["amdahl:1", "amdahl:0:0.5", "amdahl:1:2", "points:", "points:0=1", "points:1=1;1=2", "cubic:1"] {
            assert!(Scaling::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn amdahl_fit_recovers_its_parameters() {
        let truth = Scaling::Amdahl { t1: 50.0, p: 0.8 };
        let points: Vec<(usize, f64)> = [1, 2, 4].iter().map(|&w| (w, truth.throughput(w))).collect();
        let Scaling::Amdahl { t1, p } = Scaling::fit(&points).unwrap() else { panic!() };
        assert!((t1 - 50.0).abs() < 1e-6 && (p - 0.8).abs() < 1e-9, "{t1} {p}");
    }

    #[test]
    fn a_growing_batch_loses_statistical_efficiency() {
        let e = Efficiency { b0: 32.0, batch_grows: true, noise: 96.0 };
        assert_eq!(e.at(1), 1.0);
        assert!((e.at(4) - 128.0 / 224.0).abs() < 1e-12);
        assert_eq!(Efficiency::FIXED_BATCH.at(8), 1.0);
    }
}
