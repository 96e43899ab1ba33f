//! Fitting the efficiencies of a machine from measured `stoke train` runs.
//!
//! Once the layout is fixed the time model of one device is linear in its unknowns:
//!
//! ```text
//! step = F/(peak·compute) + M/(bandwidth·memory) + P/(bandwidth·optimizer)
//!        + L·m·layer_overhead + step_overhead
//! ```
//!
//! with F the step's FLOPs, M its element-wise and weight bytes, P the optimizer's bytes, L the
//! blocks and m the micro-batches. The optimizer's share comes first, from the runs' measured
//! `optimizer` phase alone (a pure memory-bound pass); the other four are then fitted to whole
//! steps by least squares on relative error (every run counts alike whatever its length), with
//! each share kept at most 1 and each overhead at least 0. Runs should differ in width, depth and
//! micro-batch so that FLOPs, bytes and block count vary independently.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use stoke_stats::median;

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
    /// Ranks one model is cut over (tensor parallelism); 0 or absent is 1.
    #[serde(default = "one")]
    pub tensor: usize,
    /// Pipeline stages of one model copy; 0 or absent is 1.
    #[serde(default = "one")]
    pub pipeline: usize,
    /// Model chunks per stage (the interleaved schedule's); 0 or absent is 1.
    #[serde(default = "one")]
    pub pipeline_chunks: usize,
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
    /// The report's `optimizer` phase, seconds per step, when it has one.
    pub measured_optimizer_s: Option<f64>,
}

impl MeasuredRun {
    /// Reads `path` (a `runs/<name>/report.json`) and places the run on `cluster`, whose peak for
    /// the run's precision becomes the report's.
    pub fn from_report_file(path: &Path, cluster: &ClusterConfig) -> Result<MeasuredRun, PlanError> {
        let text = stoke_fsio::read_to_string_capped(path, stoke_fsio::TABLE_CAP)
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
        if !report.machine.peak_flops.is_finite() || report.machine.peak_flops <= 0.0 {
            return Err(format!("machine.peak_flops must be positive; got {}", report.machine.peak_flops));
        }
        let m = &report.model;
        // stoke's GPT: nanoGPT's shape, attention through scaled_dot_product_attention.
        let model = ModelConfig {
            flash_attention: true,
            ..ModelConfig::gpt(m.n_layer, m.d_model, m.n_head, m.seq_len, m.vocab_size)
        };
        model.validate().map_err(|err| err.to_string())?;
        let train = &report.train;
        if train.micro_batch == 0 || train.grad_accum == 0 || train.world_size == 0 {
            return Err("train.micro_batch, grad_accum and world_size must be positive".into());
        }
        let (tensor, pipeline) = (train.tensor.max(1), train.pipeline.max(1));
        if train.world_size % (tensor * pipeline) != 0 {
            return Err(format!(
                "train.tensor {tensor} x train.pipeline {pipeline} does not divide world_size {}",
                train.world_size
            ));
        }
        let mut cluster = ClusterConfig { n_devices: train.world_size, ..cluster.clone() };
        if report.machine.device == "cpu" {
            // Processes of a CPU run share one machine: their collectives stay inside the node.
            cluster.devices_per_node = cluster.devices_per_node.max(train.world_size);
        }
        match train.precision {
            Precision::Fp32 => cluster.peak_flops_fp32 = report.machine.peak_flops,
            Precision::Bf16 => cluster.peak_flops_bf16 = report.machine.peak_flops,
        }
        // A run that spent time recomputing ran with full recomputation (stoke's only policy).
        let recomputed = report.phases.get("recompute").and_then(|v| v.as_f64()).unwrap_or(0.0) > 0.0;
        let layout = Layout {
            data: train.world_size / (tensor * pipeline),
            tensor,
            pipeline,
            recompute: if recomputed { Recompute::Full } else { Recompute::None },
            n_micro_batches: train.grad_accum,
            virtual_stages: if pipeline > 1 { train.pipeline_chunks.max(1) } else { 1 },
            ..Layout::single(train.micro_batch)
        };
        let config = PlanConfig {
            model,
            cluster,
            precision: train.precision,
            global_batch: layout.global_batch(),
            ..PlanConfig::default()
        };
        let measured_optimizer_s =
            report.phases.get("optimizer").and_then(|v| v.as_f64()).filter(|ms| *ms > 0.0).map(|ms| ms / 1e3);
        Ok(MeasuredRun { name, config, layout, measured_step_s: report.step_ms / 1e3, measured_optimizer_s })
    }

    /// Predicted step time under `efficiency`.
    pub fn predict_s(&self, efficiency: &Efficiency) -> f64 {
        let mut config = self.config.clone();
        config.cluster.efficiency = efficiency.clone();
        evaluate(&config, &self.layout).time.step_s
    }

    /// Predicted optimizer time at an optimizer share of 1.
    fn optimizer_s_at_full_share(&self) -> f64 {
        let mut config = self.config.clone();
        config.cluster.efficiency.optimizer = 1.0;
        evaluate(&config, &self.layout).time.optimizer_s
    }

    /// The step's time as a linear function of the fitted unknowns: the coefficients of
    /// 1/compute, 1/memory, layer_overhead_s, step_overhead_s and 1/comm (the links' share of
    /// their bandwidth), and the constant rest (the optimizer at its share, the links' latency).
    /// Each coefficient is read off the time model itself, as the step's change when its unknown
    /// moves by one, so the fit and the prediction count alike what scales with it: a pipeline's
    /// bubble repeats the slowest stage's compute, memory traffic, per-block cost and transfers.
    fn features(&self, optimizer_share: f64) -> ([f64; UNKNOWNS], f64) {
        let step_s = |x: [f64; UNKNOWNS]| {
            let mut config = self.config.clone();
            config.cluster.efficiency = Efficiency {
                compute: 1.0 / x[0],
                memory: 1.0 / x[1],
                optimizer: optimizer_share,
                layer_overhead_s: x[2],
                step_overhead_s: x[3],
                comm: 1.0 / x[4],
                ..self.config.cluster.efficiency.clone()
            };
            evaluate(&config, &self.layout).time.step_s
        };
        let unit = [1.0, 1.0, 0.0, 0.0, 1.0];
        let base = step_s(unit);
        let coefficients: [f64; UNKNOWNS] = std::array::from_fn(|i| {
            let mut moved = unit;
            moved[i] += 1.0;
            step_s(moved) - base
        });
        let at_unit: f64 = coefficients.iter().zip(unit).map(|(c, x)| c * x).sum();
        (coefficients, base - at_unit)
    }
}

/// Merges runs of the same shape (model, layout, precision, peak) into one whose times are the
/// medians of theirs: on a machine shared with other work a repeat taken in a busy spell is an
/// outlier, and the median of three or more rounds discards it. The merged run is named after
/// the first, its trailing `-<round>` replaced by `x<count>`; order follows first appearance.
pub fn merge_repeats(runs: Vec<MeasuredRun>) -> Vec<MeasuredRun> {
    let mut groups: Vec<Vec<MeasuredRun>> = Vec::new();
    for run in runs {
        match groups.iter_mut().find(|group| group[0].config == run.config && group[0].layout == run.layout) {
            Some(group) => group.push(run),
            None => groups.push(vec![run]),
        }
    }
    groups
        .into_iter()
        .map(|group| {
            if group.len() == 1 {
                return group.into_iter().next().expect("one run");
            }
            let stem = match group[0].name.rsplit_once('-') {
                Some((stem, round)) if !round.is_empty() && round.chars().all(|c| c.is_ascii_digit()) => stem,
                _ => group[0].name.as_str(),
            };
            let name = format!("{stem}x{}", group.len());
            let step = median(&group.iter().map(|run| run.measured_step_s).collect::<Vec<_>>());
            let optimizer: Option<Vec<f64>> = group.iter().map(|run| run.measured_optimizer_s).collect();
            MeasuredRun {
                name,
                config: group[0].config.clone(),
                layout: group[0].layout,
                measured_step_s: step,
                measured_optimizer_s: optimizer.map(|values| median(&values)),
            }
        })
        .collect()
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

/// Fits the compute and memory shares, the per-block and per-step overheads and (when some run
/// communicates) the links' share to `runs`, and the optimizer's share to their optimizer phases;
/// `prior` gives the rest (the overlap share). The relative error recorded is the
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
    let optimizer = fit_optimizer_share(runs).unwrap_or(prior.optimizer);
    // Rows scaled by 1/measured: least squares on relative error.
    let rows: Vec<([f64; UNKNOWNS], f64)> = runs
        .iter()
        .map(|run| {
            let (features, constant) = run.features(optimizer);
            let scale = 1.0 / run.measured_step_s;
            (features.map(|f| f * scale), (run.measured_step_s - constant) * scale)
        })
        .collect();
    // Without runs that communicate the links' column is zero: their share stays the prior's.
    let communicates = rows.iter().any(|(a, _)| a[4] > 0.0);
    let x = bounded_least_squares(&rows);
    Efficiency {
        compute: 1.0 / x[0],
        memory: 1.0 / x[1],
        optimizer,
        layer_overhead_s: x[2],
        step_overhead_s: x[3],
        comm: if communicates { 1.0 / x[4] } else { prior.comm },
        ..prior.clone()
    }
}

/// The optimizer's share of memory bandwidth from the runs' measured optimizer phases: the x
/// minimising Σ ((x·B_i - t_i)/t_i)², B_i the time at full share, then 1/x capped at 1. None when
/// a run lacks the phase.
fn fit_optimizer_share(runs: &[MeasuredRun]) -> Option<f64> {
    let mut numerator = 0.0;
    let mut denominator = 0.0;
    for run in runs {
        let measured = run.measured_optimizer_s?;
        let ideal = run.optimizer_s_at_full_share() / measured;
        numerator += ideal;
        denominator += ideal * ideal;
    }
    if denominator <= 0.0 {
        return None;
    }
    let coefficient = numerator / denominator;
    Some((1.0 / coefficient).min(1.0))
}

/// The fitted unknowns: 1/compute, 1/memory, layer_overhead_s, step_overhead_s, 1/comm.
const UNKNOWNS: usize = 5;

/// Lower bounds of the coefficients: 1/compute, 1/memory and 1/comm at least 1 (a share of at
/// most the peak), the overheads at least 0.
const FLOORS: [f64; UNKNOWNS] = [1.0, 1.0, 0.0, 0.0, 1.0];

/// Minimises Σ (a_i·x - y_i)² subject to x >= FLOORS. At the optimum each coefficient is either
/// free or at its floor, so trying all 2^UNKNOWNS such patterns and keeping the best feasible
/// solution is exact.
fn bounded_least_squares(rows: &[([f64; UNKNOWNS], f64)]) -> [f64; UNKNOWNS] {
    let residual = |x: &[f64; UNKNOWNS]| -> f64 {
        rows.iter().map(|(a, y)| (0..UNKNOWNS).map(|i| a[i] * x[i]).sum::<f64>() - y).map(|r| r * r).sum()
    };
    let mut best = FLOORS;
    let mut best_residual = residual(&best);
    for mask in 0u32..(1 << UNKNOWNS) {
        let free: Vec<usize> = (0..UNKNOWNS).filter(|i| mask & (1 << i) != 0).collect();
        let reduced: Vec<(Vec<f64>, f64)> = rows
            .iter()
            .map(|(a, y)| {
                let at_floor: f64 = (0..UNKNOWNS).filter(|i| !free.contains(i)).map(|i| a[i] * FLOORS[i]).sum();
                (free.iter().map(|&i| a[i]).collect(), y - at_floor)
            })
            .collect();
        let Some(solution) = least_squares(&reduced, free.len()) else { continue };
        let mut x = FLOORS;
        for (k, &i) in free.iter().enumerate() {
            x[i] = solution[k];
        }
        // Invariant: a candidate is kept only if it respects every bound.
        let feasible = x.iter().zip(FLOORS).all(|(v, floor)| *v >= floor - 1e-12);
        let r = residual(&x);
        if feasible && r < best_residual {
            best_residual = r;
            best = x;
        }
    }
    debug_assert!(best.iter().zip(FLOORS).all(|(v, floor)| *v >= floor - 1e-12));
    best
}

/// Ordinary least squares through the normal equations (a few unknowns); None when singular.
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
        let pivot_row = matrix[col].clone();
        for (row_idx, row) in matrix.iter_mut().enumerate() {
            if row_idx != col {
                let factor = row[col] / pivot_row[col];
                for (value, pivot_value) in row.iter_mut().zip(&pivot_row).skip(col) {
                    *value -= factor * pivot_value;
                }
            }
        }
    }
    Some((0..n).map(|i| matrix[i][n] / matrix[i][i]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(n_layer: usize, d_model: usize, micro_batch: usize, grad_accum: usize) -> MeasuredRun {
        let report = RunReport {
            step_ms: 1.0,
            phases: BTreeMap::new(),
            model: ReportModel { n_layer, n_head: 4, d_model, seq_len: 128, vocab_size: 256 },
            train: ReportTrain {
                micro_batch,
                grad_accum,
                precision: Precision::Fp32,
                world_size: 1,
                tensor: 1,
                pipeline: 1,
                pipeline_chunks: 1,
            },
            machine: ReportMachine { peak_flops: 205e9, device: "cpu".into() },
        };
        MeasuredRun::from_report("synthetic".into(), &report, &ClusterConfig::default()).unwrap()
    }

    #[test]
    fn a_cut_run_is_placed_as_its_tensor_by_data_layout() {
        let report = |world_size, tensor| RunReport {
            step_ms: 1.0,
            phases: BTreeMap::new(),
            model: ReportModel { n_layer: 2, n_head: 4, d_model: 128, seq_len: 64, vocab_size: 256 },
            train: ReportTrain {
                micro_batch: 4,
                grad_accum: 1,
                precision: Precision::Fp32,
                world_size,
                tensor,
                pipeline: 1,
                pipeline_chunks: 1,
            },
            machine: ReportMachine { peak_flops: 205e9, device: "cpu".into() },
        };
        let cluster = ClusterConfig::default();
        let cut = MeasuredRun::from_report("t2d2".into(), &report(4, 2), &cluster).unwrap();
        assert_eq!((cut.layout.tensor, cut.layout.data), (2, 2));
        assert_eq!(cut.config.global_batch, 8, "2 copies of 4 rows");
        let plain = MeasuredRun::from_report("d4".into(), &report(4, 0), &cluster).unwrap();
        assert_eq!((plain.layout.tensor, plain.layout.data), (1, 4), "an older report without tensor");
        let err = MeasuredRun::from_report("bad".into(), &report(4, 3), &cluster).unwrap_err();
        assert!(err.contains("does not divide"), "{err}");
    }

    fn synthetic(truth: &Efficiency) -> Vec<MeasuredRun> {
        let shapes = [(2, 256, 8, 1), (4, 256, 16, 1), (4, 128, 8, 2), (6, 384, 4, 1), (8, 256, 16, 2), (3, 512, 2, 4)];
        shapes
            .iter()
            .map(|&(l, d, b, m)| {
                let mut r = run(l, d, b, m);
                r.measured_step_s = r.predict_s(truth);
                r.measured_optimizer_s = Some(r.optimizer_s_at_full_share() / truth.optimizer);
                r
            })
            .collect()
    }

    #[test]
    fn recovers_the_efficiency_that_generated_the_runs() {
        let truth = Efficiency {
            compute: 0.45,
            memory: 0.2,
            optimizer: 0.1,
            layer_overhead_s: 0.002,
            step_overhead_s: 0.01,
            ..Efficiency::default()
        };
        let calibration = calibrate(&synthetic(&truth), &Efficiency::default()).unwrap();
        let got = &calibration.efficiency;
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1e-3);
        assert!(close(got.compute, 0.45) && close(got.memory, 0.2) && close(got.optimizer, 0.1), "{got:?}");
        assert!(close(got.layer_overhead_s, 0.002) && close(got.step_overhead_s, 0.01), "{got:?}");
        assert!(got.relative_error < 1e-6);
    }

    #[test]
    fn pipeline_runs_are_fitted_with_their_bubble() {
        // Runs in 2 stages (1F1B and 2 chunks a stage) beside single-process ones: the per-block
        // cost enters a pipeline's step once per micro-batch and once per bubble slot, so a fit
        // that counted the micro-batches alone would not recover what generated the runs.
        let truth = Efficiency {
            compute: 0.6,
            memory: 0.3,
            optimizer: 0.5,
            layer_overhead_s: 0.004,
            step_overhead_s: 0.02,
            ..Efficiency::default()
        };
        let mut runs = synthetic(&truth);
        for (l, d, b, m, chunks) in [(4, 256, 2, 4, 1), (8, 128, 4, 4, 1), (4, 256, 2, 4, 2), (8, 128, 1, 8, 2)] {
            let mut r = run(l, d, b, m);
            r.layout = Layout { pipeline: 2, virtual_stages: chunks, data: 1, ..r.layout };
            r.config.cluster.n_devices = 2;
            r.config.cluster.devices_per_node = r.config.cluster.devices_per_node.max(2);
            r.measured_step_s = r.predict_s(&truth);
            r.measured_optimizer_s = Some(r.optimizer_s_at_full_share() / truth.optimizer);
            runs.push(r);
        }
        let got = calibrate(&runs, &Efficiency::default()).unwrap().efficiency;
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1e-3);
        assert!(close(got.compute, 0.6) && close(got.memory, 0.3), "{got:?}");
        assert!(close(got.layer_overhead_s, 0.004) && close(got.step_overhead_s, 0.02), "{got:?}");
        assert!(close(got.comm, Efficiency::default().comm), "the stages' transfers give the links' share: {got:?}");
        assert!(got.relative_error < 1e-6, "{got:?}");
    }

    #[test]
    fn repeats_merge_into_their_median() {
        let mut runs = Vec::new();
        for (round, step_s) in [(1, 0.30), (2, 0.50), (3, 0.32)] {
            let mut r = run(2, 256, 16, 1);
            r.name = format!("cal-a-{round}");
            r.measured_step_s = step_s;
            r.measured_optimizer_s = Some(step_s / 10.0);
            runs.push(r);
        }
        let mut other = run(4, 256, 8, 1);
        other.name = "cal-b-1".into();
        runs.insert(1, other);
        let merged = merge_repeats(runs);
        assert_eq!(merged.len(), 2);
        assert_eq!(merged[0].name, "cal-ax3");
        assert_eq!(merged[0].measured_step_s, 0.32);
        assert_eq!(merged[0].measured_optimizer_s, Some(0.032));
        assert_eq!(merged[1].name, "cal-b-1");
    }

    #[test]
    fn shares_stay_at_most_one_and_overheads_at_least_zero() {
        // Runs faster than the peak allows: the fit must stop at the bounds.
        let truth = Efficiency { compute: 1.0, memory: 1.0, optimizer: 1.0, ..Efficiency::default() };
        let mut runs = synthetic(&truth);
        for run in &mut runs {
            run.measured_step_s *= 0.5;
        }
        let got = calibrate(&runs, &Efficiency::default()).unwrap().efficiency;
        assert!(got.compute <= 1.0 && got.memory <= 1.0 && got.optimizer <= 1.0, "{got:?}");
        assert!(got.layer_overhead_s >= 0.0 && got.step_overhead_s >= 0.0, "{got:?}");
        got.validate().unwrap();
    }
}
