//! Training dynamics end to end: the NaN guard stops a poisoned run with its dump and an intact
//! checkpoint, early stopping ends a plateaued run, `stoke compare` flags a sabotaged learning
//! rate and passes an identical rerun, and the monitors and evaluation reach metrics.jsonl and
//! the report.

use std::path::Path;

use crate::{run_ok, stoke, SMALL};

fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    SMALL.iter().copied().chain(extra.iter().copied()).collect()
}

fn lines(run_dir: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("metrics.jsonl exists");
    text.lines().map(|l| serde_json::from_str(l).expect("JSON line")).collect()
}

#[test]
fn a_poisoned_step_stops_with_a_dump_and_an_intact_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let out = stoke(
        &["train", "--quiet"],
        &with(&[&run_dir, "run.name=poisoned", "train.steps=20", "ckpt.every=4", "train.debug_poison_step=10"]),
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "a clean runtime failure, not a crash:\n{stderr}");
    assert!(stderr.contains("nan-dump.json") && stderr.contains("step 10"), "{stderr}");
    let run = dir.path().join("poisoned");
    let dump: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("nan-dump.json")).expect("the dump exists")).unwrap();
    assert_eq!(dump["step"], 10);
    assert_eq!(dump["detected_at"], "loss");
    assert_eq!(dump["poisoned_on_purpose"], true);
    assert!(dump["last_finite_loss"].as_f64().unwrap().is_finite());
    assert!(dump["data_position_after"].as_u64() > dump["data_position_before"].as_u64());
    let offending = dump["offending"].as_array().unwrap();
    assert!(
        offending.iter().any(|t| t["name"] == "transformer.h.0.ln_1.weight" && t["kind"] == "parameter"),
        "the poisoned tensor is named: {offending:?}"
    );
    assert_eq!(dump["latest_checkpoint"], 8, "{dump}");
    // Nothing of step 10 reached the metrics or a checkpoint, and step 8's checkpoint verifies.
    let steps: Vec<u64> = lines(&run).iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps.last(), Some(&9));
    let checkpoints: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert!(checkpoints.iter().all(|n| n != "step-10" && n != "step-12"), "{checkpoints:?}");
    let ckpt = run.join("checkpoints/step-8");
    run_ok(&mut stoke(&["ckpt", "verify", &ckpt.display().to_string()], &[]));
    // The run resumes from that checkpoint (without the poison, it trains on).
    run_ok(&mut stoke(
        &["train", "--quiet", "--resume"],
        &[&run_dir, "run.name=poisoned", "train.debug_poison_step=0"],
    ));
    assert_eq!(lines(&run).last().unwrap()["step"], 20);
}

#[test]
fn the_guard_kept_on_the_device_names_the_first_bad_step_when_read_later() {
    // The tensor-op optimizer keeps the gradient norm on the device; the guard is read every 4
    // steps, on logged steps (every 7) and at checkpoints (every 6). Step 15 is poisoned and
    // read at step 16 by the interval alone: the dump names step 15, no checkpoint after step 12
    // is written, and step 12's verifies.
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let out = stoke(
        &["train", "--quiet"],
        &with(&[
            &run_dir,
            "run.name=late",
            "train.steps=20",
            "train.fused_optimizer=false",
            "train.guard_every=4",
            "train.log_every=7",
            "ckpt.every=6",
            "train.debug_poison_step=15",
        ]),
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "a clean runtime failure, not a crash:\n{stderr}");
    assert!(stderr.contains("at step 15") && stderr.contains("read at step 16"), "{stderr}");
    let run = dir.path().join("late");
    let dump: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("nan-dump.json")).expect("the dump exists")).unwrap();
    assert_eq!((dump["step"].as_u64(), dump["detected_at_step"].as_u64()), (Some(15), Some(16)), "{dump}");
    assert_eq!(dump["detected_at"], "loss");
    assert!(dump["last_finite_loss"].as_f64().unwrap().is_finite(), "step 14's loss, kept on the device: {dump}");
    assert!(dump["data_position_after"].as_u64() > dump["data_position_before"].as_u64());
    assert_eq!(dump["latest_checkpoint"], 12, "{dump}");
    let steps: Vec<u64> = lines(&run).iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [7, 14], "only logged steps before the bad one reach the metrics");
    let checkpoints: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert!(checkpoints.iter().all(|n| n != "step-18"), "{checkpoints:?}");
    run_ok(&mut stoke(&["ckpt", "verify", &run.join("checkpoints/step-12").display().to_string()], &[]));

    // Without the poison, reading the guard every step or every 5 changes no logged loss.
    let losses = |name: &str, guard_every: &str| {
        let name_arg = format!("run.name={name}");
        let guard = format!("train.guard_every={guard_every}");
        run_ok(&mut stoke(
            &["train", "--quiet"],
            &with(&[&run_dir, &name_arg, "train.steps=15", "train.fused_optimizer=false", "train.log_every=5", &guard]),
        ));
        lines(&dir.path().join(name))
            .iter()
            .map(|l| (l["step"].as_u64().unwrap(), l["loss"].as_f64().unwrap()))
            .collect::<Vec<_>>()
    };
    let (every_step, every_five) = (losses("every-step", "1"), losses("every-five", "0"));
    assert_eq!(every_step.len(), 3);
    assert_eq!(every_step, every_five);
}

#[test]
fn early_stopping_ends_a_plateau_and_keeps_the_best_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    // A learning rate of ~0 after warmup: the evaluation loss stops moving, so after `patience`
    // evaluations without a gain of min_delta the run stops long before train.steps.
    let out = run_ok(&mut stoke(
        &["train", "--quiet"],
        &with(&[
            &run_dir,
            "run.name=plateau",
            "train.steps=400",
            "train.lr=0.000001",
            "train.min_lr=0.000001",
            "train.lr_shape=constant",
            "eval.every=5",
            "eval.batches=2",
            "eval.patience=3",
            "eval.min_delta=0.01",
            "ckpt.every=0",
            "ckpt.keep=1",
        ]),
    ));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let run = dir.path().join("plateau");
    let lines = lines(&run);
    let evals: Vec<&serde_json::Value> = lines.iter().filter(|l| l.get("eval_loss").is_some()).collect();
    let last = lines.last().unwrap();
    assert_eq!(last["event"], "early_stop", "the last line records the stop: {last}");
    let stopped_at = last["step"].as_u64().unwrap();
    assert!(stopped_at < 400 && stopped_at % 5 == 0, "stopped at {stopped_at}");
    assert!(evals.len() >= 4, "patience 3 needs a first evaluation and three more");
    assert!(evals.iter().all(|e| e["eval_ppl"].as_f64().unwrap() > 1.0));
    // Retention (keep = 1) kept the best evaluation's checkpoint besides the final one.
    let best_step = evals
        .iter()
        .min_by(|a, b| a["eval_loss"].as_f64().unwrap().total_cmp(&b["eval_loss"].as_f64().unwrap()))
        .unwrap()["step"]
        .as_u64()
        .unwrap();
    for step in [best_step, stopped_at] {
        assert!(run.join(format!("checkpoints/step-{step}/manifest.json")).is_file(), "step {step} kept");
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["dynamics"]["early_stopped_at"], stopped_at);
    assert!(report["findings"].as_array().unwrap().iter().any(|f| f["id"] == "early_stopped"), "{stdout}");
    let html = std::fs::read_to_string(run.join("report.html")).unwrap();
    assert!(html.contains("evaluation loss") && html.contains("perplexity"));
}

#[test]
fn compare_flags_a_sabotaged_learning_rate_and_passes_a_rerun() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let common = ["train.steps=40", "eval.every=10", "eval.batches=2", "train.monitor_every=5"];
    // The sabotaged run's learning rate is 1/50 of the others'.
    let sabotage: &[&str] = &["train.lr=0.0002", "train.min_lr=0.00002"];
    for (name, extra) in [("a", &[][..]), ("rerun", &[][..]), ("sabotaged", sabotage)] {
        let name = format!("run.name={name}");
        let mut overrides = with(&[&run_dir, &name]);
        overrides.extend(extra);
        overrides.extend(common);
        run_ok(&mut stoke(&["train", "--quiet"], &overrides));
    }
    let runs = dir.path().display().to_string();
    let a = dir.path().join("a").display().to_string();
    let out = run_ok(&mut stoke(&["compare", &a, "rerun", "--runs", &runs], &[]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("+0.00%") && stdout.contains("within tolerance"), "{stdout}");
    let html = std::fs::read_to_string(dir.path().join("rerun/compare-a-vs-rerun.html")).unwrap();
    assert_eq!(html.matches("<svg").count(), 2, "training and evaluation curves");
    let out = stoke(&["compare", &a, "sabotaged", "--runs", &runs], &[]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{stdout}");
    assert!(stdout.contains("WORSE") && stdout.contains("largest eval loss gap"), "{stdout}");
    // The monitors are in metrics.jsonl: per-block figures on every 5th step, named by unit.
    let lines = lines(&dir.path().join("a"));
    let monitored = lines.iter().find(|l| l["step"] == 5).unwrap();
    for key in ["block_grad_norm", "update_ratio"] {
        let per_unit = monitored[key].as_object().unwrap_or_else(|| panic!("{key} in {monitored}"));
        assert!(
            per_unit.contains_key("transformer.h.0") && per_unit.values().all(|v| v.as_f64().unwrap() > 0.0),
            "{monitored}"
        );
    }
    assert!(lines.iter().any(|l| l.get("loss_z").is_some()), "spike z-scores once the window fills");
}

#[test]
fn the_adaptive_batch_grows_on_a_stable_run_within_its_budget() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    run_ok(&mut stoke(
        &["train", "--quiet"],
        &with(&[
            &run_dir,
            "run.name=adaptive",
            "train.steps=80",
            "train.grad_accum=2",
            "train.lr_scaling=sqrt",
            "train.lr_reference_batch=16",
            "adaptive.enabled=true",
            "adaptive.every=10",
            "adaptive.max_batch=48",
            "adaptive.ema=0.8",
        ]),
    ));
    let lines = lines(&dir.path().join("adaptive"));
    let grows: Vec<&serde_json::Value> = lines.iter().filter(|l| l["event"] == "batch_grow").collect();
    assert!(!grows.is_empty(), "the batch grew: {:?}", lines.iter().map(|l| &l["noise_scale"]).collect::<Vec<_>>());
    for grow in &grows {
        let (from, to) = (grow["batch_from"].as_u64().unwrap(), grow["batch_to"].as_u64().unwrap());
        assert!(to > from && to <= 48, "{grow}");
        assert!(grow["noise_scale"].as_f64().unwrap() > from as f64, "grown only below the noise scale: {grow}");
    }
    // Every step's tokens follow the batch (seq_len 32), never past the budget of 48 sequences.
    let mut batch = 16;
    for line in &lines {
        assert_eq!(line["tokens"].as_u64().unwrap(), batch * 32, "{line}");
        if line["event"] == "batch_grow" {
            batch = line["batch_to"].as_u64().unwrap();
        }
        assert!(batch <= 48);
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("adaptive/report.json")).unwrap()).unwrap();
    assert_eq!(report["dynamics"]["batch_changes"].as_array().unwrap().len(), grows.len());
}
