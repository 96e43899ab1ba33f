//! Calibration from `runs/<name>/report.json` files: parsing the report schema `stoke train`
//! writes (extra fields ignored), fitting on some runs and predicting others.

use std::path::{Path, PathBuf};

use stoke_plan::{calibrate, compare, ClusterConfig, Efficiency, MeasuredRun, PlanError};

/// A report in `stoke train`'s schema, with fields calibration does not read.
fn report_json(
    n_layer: usize,
    d_model: usize,
    micro_batch: usize,
    grad_accum: usize,
    step_ms: f64,
    optimizer_ms: f64,
) -> String {
    serde_json::json!({
        "step_ms": step_ms,
        "tokens_per_s": 1234.5,
        "phases": {
            "data_wait": 0.1, "h2d": 0.1, "forward": step_ms * 0.3, "backward": step_ms * 0.6,
            "recompute": 0.0, "comm_exposed": 0.0, "comm_total": 0.0, "optimizer": optimizer_ms,
            "ckpt_stall": 0.0, "other": 0.0
        },
        "effective_compute_ratio": 0.97,
        "mfu": 0.1,
        "peak_memory_bytes": 123456789u64,
        "findings": [{"rule": "example", "message": "ignored"}],
        "model": {
            "n_layer": n_layer, "n_head": 4, "d_model": d_model, "seq_len": 128, "vocab_size": 256,
            "n_params": 1, "flops_per_token": 1.0
        },
        "train": {"micro_batch": micro_batch, "grad_accum": grad_accum, "precision": "fp32", "world_size": 1},
        "machine": {"peak_flops": 205e9, "device": "cpu", "cores": 2}
    })
    .to_string()
}

fn write_run(root: &Path, name: &str, json: &str) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("report.json");
    std::fs::write(&path, json).unwrap();
    path
}

/// Writes runs whose step times follow `truth`, scaled by `noise` (a deterministic ±3% pattern
/// standing in for measurement noise).
fn synthetic_runs(
    root: &Path,
    truth: &Efficiency,
    shapes: &[(usize, usize, usize, usize)],
    noise: &[f64],
) -> Vec<PathBuf> {
    let cluster = ClusterConfig::preset("cpu", 1).unwrap();
    shapes
        .iter()
        .zip(noise)
        .enumerate()
        .map(|(idx, (&(l, d, b, m), factor))| {
            // Parse once with placeholder times to get the model's prediction for this shape.
            let probe = write_run(root, &format!("probe-{idx}"), &report_json(l, d, b, m, 1.0, 1.0));
            let run = MeasuredRun::from_report_file(&probe, &cluster).unwrap();
            let mut truth_config = run.config.clone();
            truth_config.cluster.efficiency = truth.clone();
            let time = stoke_plan::evaluate(&truth_config, &run.layout).time;
            let json = report_json(l, d, b, m, time.step_s * 1e3 * factor, time.optimizer_s * 1e3 * factor);
            write_run(root, &format!("run-{idx}"), &json)
        })
        .collect()
}

fn load(paths: &[PathBuf]) -> Vec<MeasuredRun> {
    let cluster = ClusterConfig::preset("cpu", 1).unwrap();
    paths.iter().map(|path| MeasuredRun::from_report_file(path, &cluster).unwrap()).collect()
}

#[test]
fn held_out_runs_are_predicted_within_15_percent() {
    let root = tempfile::tempdir().unwrap();
    let truth = Efficiency {
        compute: 0.3,
        memory: 0.15,
        optimizer: 0.08,
        layer_overhead_s: 0.004,
        step_overhead_s: 0.02,
        ..Efficiency::default()
    };
    let fit_shapes = [(2, 256, 16, 1), (4, 256, 8, 1), (4, 256, 4, 2), (6, 384, 8, 1), (2, 512, 8, 1), (8, 128, 16, 1)];
    let held_shapes = [(4, 384, 16, 1), (3, 256, 4, 4), (6, 256, 16, 1)];
    let fit_noise = [1.03, 0.98, 1.01, 0.97, 1.02, 0.99];
    let held_noise = [0.97, 1.03, 1.0];
    let fit_runs = load(&synthetic_runs(&root.path().join("fit"), &truth, &fit_shapes, &fit_noise));
    let held_runs = load(&synthetic_runs(&root.path().join("held"), &truth, &held_shapes, &held_noise));
    let calibration = calibrate(&fit_runs, &Efficiency::default()).unwrap();
    for fit in compare(&held_runs, &calibration.efficiency) {
        assert!(fit.relative_error.abs() < 0.15, "{}: {:+.1}%", fit.name, 100.0 * fit.relative_error);
    }
    // The spread the calibration reports is of the size of the noise.
    assert!(calibration.efficiency.relative_error < 0.06, "{:?}", calibration.efficiency);
}

#[test]
fn run_name_is_the_report_folder() {
    let root = tempfile::tempdir().unwrap();
    let path = write_run(root.path(), "cal-a", &report_json(2, 256, 16, 1, 900.0, 60.0));
    let run = MeasuredRun::from_report_file(&path, &ClusterConfig::default()).unwrap();
    assert_eq!(run.name, "cal-a");
    assert_eq!(run.measured_step_s, 0.9);
    assert_eq!(run.measured_optimizer_s, Some(0.06));
    assert_eq!((run.layout.micro_batch, run.layout.n_micro_batches), (16, 1));
}

fn check_rejected(json: &str, expected: fn(&PlanError) -> bool) {
    let root = tempfile::tempdir().unwrap();
    let path = write_run(root.path(), "bad", json);
    let err = MeasuredRun::from_report_file(&path, &ClusterConfig::default()).unwrap_err();
    assert!(expected(&err), "{err}");
    assert!(err.to_string().contains("report.json"), "error names the file: {err}");
}

#[test]
fn unusable_reports_are_rejected_with_their_path() {
    check_rejected("{not json", |e| matches!(e, PlanError::ParseReport { .. }));
    check_rejected(r#"{"step_ms": 5.0}"#, |e| matches!(e, PlanError::ParseReport { .. }));
    check_rejected(&report_json(2, 256, 16, 1, 0.0, 1.0), |e| matches!(e, PlanError::UnusableReport { .. }));
    check_rejected(&report_json(2, 250, 16, 1, 10.0, 1.0), |e| matches!(e, PlanError::UnusableReport { .. }));
}

#[test]
fn one_run_is_too_few() {
    let root = tempfile::tempdir().unwrap();
    let runs = load(&[write_run(root.path(), "only", &report_json(2, 256, 16, 1, 900.0, 60.0))]);
    assert!(matches!(calibrate(&runs, &Efficiency::default()), Err(PlanError::TooFewRuns { needed: 2, got: 1 })));
}

#[test]
fn reads_a_report_stoke_train_wrote() {
    // runs/plan-cal-a-1/report.json of benches/plan_calibration.sh (2 blocks, d 256, b 16), as
    // written by `stoke train`, with every field it has.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/plan-cal-a-1/report.json");
    let run = MeasuredRun::from_report_file(&path, &ClusterConfig::default()).unwrap();
    assert_eq!(run.name, "plan-cal-a-1");
    assert_eq!(run.layout, stoke_plan::Layout::single(16));
    assert_eq!(run.config.precision, stoke_plan::Precision::Fp32);
    // The planner counts the same parameters as the trainer's model.
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(run.config.model.n_params() as u64, report["model"]["n_params"].as_u64().unwrap());
    assert_eq!(run.config.cluster.peak_flops_fp32, report["machine"]["peak_flops"].as_f64().unwrap());
    assert!(run.measured_optimizer_s.is_some());
}
