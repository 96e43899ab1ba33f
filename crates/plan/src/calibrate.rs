//! Fitting the efficiencies of a machine from measured `stoke train` runs.
//!
//! The time model of one device is linear in four unknowns once the layout is fixed:
//! `step = F/(peak·compute) + M/(bandwidth·memory) + L·m·layer_overhead + step_overhead`, with F the
//! FLOPs and M the bytes of the step, L the blocks and m the micro-batches. Calibration keeps the
//! memory share at the cluster's prior (on this machine the element-wise bytes are a near-constant
//! fraction of the FLOPs, so the two cannot be told apart) and fits the other three by
//! non-negative least squares on relative error, so every run counts alike whatever its length.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cluster::{ClusterConfig, Efficiency, Precision};
use crate::layout::{Layout, Recompute};
use crate::model::ModelConfig;
use crate::search::{evaluate, PlanConfig};
use crate::PlanError;

/// The part of a run's `report.json` calibration reads; other fields are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// Mean wall time of a step, milliseconds.
    pub step_ms: f64,
    /// Milliseconds per step by phase (forward, backward, recompute, ...); may be absent.
    #[serde(default)]
    pub phases: BTreeMap<String, serde_json::Value>,
    pub model: ReportModel,
    pub train: ReportTrain,
    pub machine: ReportMachine,
}

/// `report.json`'s `model` object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportModel {
    pub n_layer: usize,
    pub n_head: usize,
    pub d_model: usize,
    pub seq_len: usize,
    pub vocab_size: usize,
}

/// `report.json`'s `train` object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportTrain {
    pub micro_batch: usize,
    #[serde(default = "one")]
    pub grad_accum: usize,
    pub precision: Precision,
    #[serde(default = "one")]
    pub world_size: usize,
}

/// `report.json`'s `machine` object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportMachine {
    /// Peak FLOP/s of the run's precision.
    pub peak_flops: f64,
    #[serde(default)]
    pub device: String,
}

fn one() -> usize {
    1
}

/// A measured run ready for fitting: its name, its plan and its measured step time.
#[derive(Debug, Clone, PartialEq)]
pub struct MeasuredRun {
    /// The run directory's name (or the file's path when it has none).
    pub name: String,
    pub config: PlanConfig,
    pub layout: Layout,
    pub measured_step_s: f64,
}

impl MeasuredRun {
    /// Reads `path` (a `runs/<name>/report.json`) and places the run on `cluster`, whose peak for
    /// the run's precision becomes the report's.
    pub fn from_report_file(path: &Path, cluster: &ClusterConfig) -> Result<MeasuredRun, PlanError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| PlanError::ReadReport { path: path.to_path_buf(), source })?;
        let report: RunReport = serde_json::from_str(&text)
            .map_err(|source| PlanError::ParseReport { path: path.to_path_buf(), source })?;
        let name = path
            .parent()
            .and_then(|dir| dir.file_name())
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string());
        MeasuredRun::from_report(name, &report, cluster)
            .map_err(|message| PlanError::UnusableReport { path: PathBuf::from(path), message })
    }

    /// Places a parsed report on `cluster`.
    pub fn from_report(name: String, report: &RunReport, cluster: &ClusterConfig) -> Result<MeasuredRun, String> {
        if !(report.step_ms > 0.0 && report.step_ms.is_finite()) {
            return Err(format!("step_ms must be positive; got {}", report.step_ms));
        }
        if !(report.machine.peak_flops > 0.0) {
            return Err(format!("machine.peak_flops must be positive; got {}", report.machine.peak_flops));
        }
        let m = &report.model;
        let model = ModelConfig::gpt(m.n_layer, m.d_model, m.n_head, m.seq_len, m.vocab_size);
        model.validate().map_err(|err| err.to_string())?;
        let train = &report.train;
        if train.micro_batch == 0 || train.grad_accum == 0 || train.world_size == 0 {
            return Err("train.micro_batch, grad_accum and world_size must be positive".into());
        }
        let mut cluster = ClusterConfig { n_devices: train.world_size, ..cluster.clone() };
        match train.precision {
            Precision::Fp32 => cluster.peak_flops_fp32 = report.machine.peak_flops,
            Precision::Bf16 => cluster.peak_flops_bf16 = report.machine.peak_flops,
        }
        // A run that spent time recomputing ran with full recomputation (stoke's only policy).
        let recomputed = report.phases.get("recompute").and_then(|v| v.as_f64()).unwrap_or(0.0) > 0.0;
        let layout = Layout {
            data: train.world_size,
            recompute: if recomputed { Recompute::Full } else { Recompute::None },
            n_micro_batches: train.grad_accum,
            ..Layout::single(train.micro_batch)
        };
        let config = PlanConfig {
            model,
            cluster,
            precision: train.precision,
            global_batch: layout.global_batch(),
            ..PlanConfig::default()
        };
        Ok(MeasuredRun { name, config, layout, measured_step_s: report.step_ms / 1e3 })
    }

    /// Predicted step time under `efficiency`.
    pub fn predict_s(&self, efficiency: &Efficiency) -> f64 {
        let mut config = self.config.clone();
        config.cluster.efficiency = efficiency.clone();
        evaluate(&config, &self.layout).time.step_s
    }

    /// The step's time as a linear function of the fitted unknowns: the constant part (memory at
    /// the prior share, communication) and the coefficients of 1/compute, layer_overhead_s and
    /// step_overhead_s.
    fn features(&self, memory_share: f64) -> ([f64; 3], f64) {
        let unit = Efficiency {
            compute: 1.0,
            memory: memory_share,
            layer_overhead_s: 0.0,
            step_overhead_s: 0.0,
            ..self.config.cluster.efficiency.clone()
        };
        let mut config = self.config.clone();
        config.cluster.efficiency = unit;
        let time = evaluate(&config, &self.layout).time;
        let layer_passes = (self.config.model.n_layer / self.layout.pipeline * self.layout.n_micro_batches) as f64;
        ([time.compute_s, layer_passes, 1.0], time.step_s - time.compute_s)
    }
}

/// One run's measured and predicted step time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunFit {
    pub name: String,
    pub measured_step_s: f64,
    pub predicted_step_s: f64,
    /// (predicted - measured) / measured.
    pub relative_error: f64,
}

/// The fitted efficiencies and how well they explain the runs they came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub efficiency: Efficiency,
    /// Each calibration run, predicted with the fitted efficiency.
    pub fits: Vec<RunFit>,
}

/// Compares predictions under `efficiency` with measurements.
pub fn compare(runs: &[MeasuredRun], efficiency: &Efficiency) -> Vec<RunFit> {
    runs.iter()
        .map(|run| {
            let predicted = run.predict_s(efficiency);
            RunFit {
                name: run.name.clone(),
                measured_step_s: run.measured_step_s,
                predicted_step_s: predicted,
                relative_error: (predicted - run.measured_step_s) / run.measured_step_s,
            }
        })
        .collect()
}

/// Fits compute efficiency, per-block overhead and per-step overhead to `runs`, starting from
/// `prior` (whose memory, comm and overlap shares are kept). The relative error recorded is the
/// root mean square of leave-one-out errors when there are at least four runs (each run predicted
/// by a fit to the others), else of the in-sample errors.
pub fn calibrate(runs: &[MeasuredRun], prior: &Efficiency) -> Result<Calibration, PlanError> {
    const NEEDED: usize = 2;
    if runs.len() < NEEDED {
        return Err(PlanError::TooFewRuns { needed: NEEDED, got: runs.len() });
    }
    let efficiency = fit(runs, prior);
    let fits = compare(runs, &efficiency);
    let errors: Vec<f64> = if runs.len() >= 4 {
        (0..runs.len())
            .map(|held_out| {
                let rest: Vec<MeasuredRun> =
                    runs.iter().enumerate().filter(|(i, _)| *i != held_out).map(|(_, r)| r.clone()).collect();
                let efficiency = fit(&rest, prior);
                let run = &runs[held_out];
                (run.predict_s(&efficiency) - run.measured_step_s) / run.measured_step_s
            })
            .collect()
    } else {
        fits.iter().map(|fit| fit.relative_error).collect()
    };
    let rms = (errors.iter().map(|e| e * e).sum::<f64>() / errors.len() as f64).sqrt();
    Ok(Calibration { efficiency: Efficiency { relative_error: rms, ..efficiency }, fits })
}

fn fit(runs: &[MeasuredRun], prior: &Efficiency) -> Efficiency {
    // Rows scaled by 1/measured: least squares on relative error.
    let rows: Vec<([f64; 3], f64)> = runs
        .iter()
        .map(|run| {
            let (features, constant) = run.features(prior.memory);
            let scale = 1.0 / run.measured_step_s;
            (features.map(|f| f * scale), (run.measured_step_s - constant) * scale)
        })
        .collect();
    let coefficients = non_negative_least_squares(&rows);
    // The compute coefficient is 1/efficiency, at least 1 by construction.
    let compute = (1.0 / coefficients[0]).min(1.0);
    Efficiency { compute, layer_overhead_s: coefficients[1], step_overhead_s: coefficients[2], ..prior.clone() }
}

/// Minimises Σ (a_i·x - y_i)² over x >= 0 by trying every subset of free overhead coefficients
/// and keeping the best feasible solution. The compute coefficient is held at >= 1 (an efficiency
/// of at most 1) by also trying it fixed at 1.
fn non_negative_least_squares(rows: &[([f64; 3], f64)]) -> [f64; 3] {
    let residual =
        |x: &[f64; 3]| -> f64 { rows.iter().map(|(a, y)| (a[0] * x[0] + a[1] * x[1] + a[2] * x[2] - y).powi(2)).sum() };
    let mut best = [1.0, 0.0, 0.0];
    let mut best_residual = f64::INFINITY;
    // The compute coefficient is always free (or fixed at 1); the overheads may drop out.
    for mask in [1u8, 3, 5, 7] {
        let free: Vec<usize> = (0..3).filter(|i| mask & (1 << i) != 0).collect();
        for fix_compute_at_one in [false, true] {
            if fix_compute_at_one && !free.contains(&0) {
                continue;
            }
            let solved: Vec<usize> = free.iter().copied().filter(|&i| !(fix_compute_at_one && i == 0)).collect();
            let fixed_compute = if fix_compute_at_one { 1.0 } else { 0.0 };
            let reduced: Vec<(Vec<f64>, f64)> =
                rows.iter().map(|(a, y)| (solved.iter().map(|&i| a[i]).collect(), y - fixed_compute * a[0])).collect();
            let Some(solution) = least_squares(&reduced, solved.len()) else { continue };
            let mut x = [0.0; 3];
            x[0] = fixed_compute;
            for (k, &i) in solved.iter().enumerate() {
                x[i] = solution[k];
            }
            let feasible = x.iter().all(|v| *v >= 0.0) && x[0] >= 1.0 - 1e-12;
            let r = residual(&x);
            if feasible && r < best_residual {
                best_residual = r;
                best = x;
            }
        }
    }
    best
}

/// Ordinary least squares through the normal equations (n <= 3 unknowns); None when singular.
fn least_squares(rows: &[(Vec<f64>, f64)], n: usize) -> Option<Vec<f64>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let mut matrix = vec![vec![0.0; n + 1]; n];
    for (a, y) in rows {
        for i in 0..n {
            for j in 0..n {
                matrix[i][j] += a[i] * a[j];
            }
            matrix[i][n] += a[i] * y;
        }
    }
    // Gaussian elimination with partial pivoting.
    for col in 0..n {
        let pivot = (col..n).max_by(|&a, &b| matrix[a][col].abs().total_cmp(&matrix[b][col].abs()))?;
        let scale = matrix.iter().map(|row| row[col].abs()).fold(0.0, f64::max);
        if matrix[pivot][col].abs() <= 1e-12 * scale.max(f64::MIN_POSITIVE) {
            return None;
        }
        matrix.swap(col, pivot);
        for row in 0..n {
            if row != col {
                let factor = matrix[row][col] / matrix[col][col];
                for k in col..=n {
                    matrix[row][k] -= factor * matrix[col][k];
                }
            }
        }
    }
    Some((0..n).map(|i| matrix[i][n] / matrix[i][i]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(name: &str, n_layer: usize, micro_batch: usize, grad_accum: usize, step_ms: f64) -> MeasuredRun {
        let report = RunReport {
            step_ms,
            phases: BTreeMap::new(),
            model: ReportModel { n_layer, n_head: 4, d_model: 256, seq_len: 128, vocab_size: 256 },
            train: ReportTrain { micro_batch, grad_accum, precision: Precision::Fp32, world_size: 1 },
            machine: ReportMachine { peak_flops: 205e9, device: "cpu".into() },
        };
        MeasuredRun::from_report(name.into(), &report, &ClusterConfig::default()).unwrap()
    }

    #[test]
    fn recovers_the_efficiency_that_generated_the_runs() {
        let truth =
            Efficiency { compute: 0.45, layer_overhead_s: 0.002, step_overhead_s: 0.01, ..Efficiency::default() };
        let shapes = [(2, 8, 1), (4, 16, 1), (4, 8, 2), (6, 4, 1), (8, 16, 2)];
        let runs: Vec<MeasuredRun> = shapes
            .iter()
            .map(|&(l, b, m)| {
                let mut r = run("synthetic", l, b, m, 1.0);
                r.measured_step_s = r.predict_s(&truth);
                r
            })
            .collect();
        let calibration = calibrate(&runs, &Efficiency::default()).unwrap();
        let got = &calibration.efficiency;
        assert!((got.compute - 0.45).abs() < 1e-6, "{got:?}");
        assert!((got.layer_overhead_s - 0.002).abs() < 1e-8, "{got:?}");
        assert!((got.step_overhead_s - 0.01).abs() < 1e-8, "{got:?}");
        assert!(got.relative_error < 1e-6);
    }

    #[test]
    fn least_squares_keeps_coefficients_non_negative() {
        // y = 2·a0 exactly; a1 would like a negative weight on noisy data.
        let rows = vec![([1.0, 1.0, 1.0], 2.0), ([2.0, 0.5, 1.0], 4.0), ([3.0, 2.0, 1.0], 5.9)];
        let x = non_negative_least_squares(&rows);
        assert!(x.iter().all(|v| *v >= 0.0), "{x:?}");
    }
}
