//! What `stoke sched report` shows of a folder: the simulator's completion times for the jobs the
//! server finished (their measured throughput, submission times, resize and start-up costs, under
//! the server's policy and settings) against the measured ones.

use std::path::Path;

use super::estimate::{job_spec, resize_cost, startup_cost};
use super::layout::{noise_scale, Layout};
use crate::policy::Policy;
use crate::sim::{simulate, SimConfig};
use crate::store::{JobRow, JobState, Store};
use crate::SchedError;

/// Predicted against measured, per finished job and on average.
#[derive(Debug, Clone)]
pub struct Prediction {
    pub policy: Policy,
    pub slots: usize,
    /// The resize cost the simulator charged (the measured median).
    pub resize_s: f64,
    /// Per job: `job`, `submit_s`, `steps`, `scaling`, `start_s`, `profile_s`, `measured_s`,
    /// `predicted_s`, `error` (relative), `measured_resizes`, `predicted_resizes`.
    pub rows: Vec<serde_json::Value>,
    pub mean_measured_s: f64,
    pub mean_predicted_s: f64,
    /// The mean over jobs of |error|.
    pub mean_abs_error: f64,
}

impl Prediction {
    /// The whole comparison as JSON (`stoke sched report --json`).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "policy": self.policy.name(), "slots": self.slots, "resize_s": self.resize_s, "jobs": self.rows,
            "mean_measured_s": self.mean_measured_s, "mean_predicted_s": self.mean_predicted_s,
            "mean_abs_error": self.mean_abs_error,
        })
    }
}

/// Simulates the finished jobs of the server's folder `dir` (database `store`) and compares.
pub fn predict(store: &Store, dir: &Path) -> Result<Prediction, SchedError> {
    let jobs: Vec<JobRow> = store.jobs()?.into_iter().filter(|j| j.state == JobState::Finished).collect();
    if jobs.is_empty() {
        return Err(SchedError::NothingFinished { dir: dir.to_path_buf() });
    }
    let layout = Layout {
        dir: std::fs::canonicalize(dir).map_err(|source| SchedError::File {
            path: dir.to_path_buf(),
            what: "resolve",
            source,
        })?,
    };
    let meta = |key: &str, default: f64| -> Result<f64, SchedError> {
        Ok(store.meta(key)?.and_then(|v| v.parse().ok()).unwrap_or(default))
    };
    let slots = meta("slots", 1.0)? as usize;
    let policy: Policy = store.meta("policy")?.unwrap_or_else(|| "goodput".into()).parse()?;
    let history = store.history()?;
    let resize_s = resize_cost(&history);
    let t0 = jobs.iter().map(|j| j.submit_s).fold(f64::INFINITY, f64::min);
    let mut specs = Vec::new();
    let mut profile_costs = Vec::new();
    for job in &jobs {
        // A start-up profile's cost (the slower steps on one worker while two slots were held, and
        // its resize) is charged to the job's start.
        let profile_s = history
            .iter()
            .filter(|h| h.job == job.id && h.event == "profiled")
            .filter_map(|h| serde_json::from_str::<serde_json::Value>(&h.detail).ok()?["cost_s"].as_f64())
            .fold(0.0, |sum, cost| sum + cost);
        profile_costs.push(profile_s);
        let start_s = startup_cost(&history, job.id) + profile_s;
        let noise = noise_scale(&layout.run_dir(job));
        specs.push(job_spec(job, &store.throughput(job.id)?, noise, resize_s, start_s, t0));
    }
    let config = SimConfig {
        tick_s: meta("tick_s", 10.0)?,
        min_resize_interval_s: meta("min_resize_interval_s", 30.0)?,
        ..SimConfig::new(slots, policy)
    };
    let sim = simulate(&specs, &config)?;
    let mut rows = Vec::new();
    for (((job, spec), predicted), profile_s) in jobs.iter().zip(&specs).zip(&sim.jobs).zip(&profile_costs) {
        let measured = job.finish_s.unwrap_or(f64::NAN) - job.submit_s;
        let predicted_s = predicted.completion_s();
        rows.push(serde_json::json!({
            "job": job.job.name,
            "submit_s": job.submit_s - t0,
            "steps": job.job.steps,
            "scaling": format!("{:?}", spec.scaling),
            "start_s": spec.start_s,
            "profile_s": profile_s,
            "measured_s": measured,
            "predicted_s": predicted_s,
            "error": (predicted_s - measured) / measured,
            "measured_resizes": job.resizes,
            "predicted_resizes": predicted.resizes,
        }));
    }
    let mean = |key: &str| rows.iter().map(|r| r[key].as_f64().unwrap_or(f64::NAN)).sum::<f64>() / rows.len() as f64;
    let (measured_mean, predicted_mean) = (mean("measured_s"), mean("predicted_s"));
    let mean_abs_error =
        rows.iter().map(|r| r["error"].as_f64().unwrap_or(f64::NAN).abs()).sum::<f64>() / rows.len() as f64;
    Ok(Prediction {
        policy,
        slots,
        resize_s,
        rows,
        mean_measured_s: measured_mean,
        mean_predicted_s: predicted_mean,
        mean_abs_error,
    })
}
