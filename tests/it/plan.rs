//! `stoke plan --zero-table`: the model-state formula the trainer's report uses, for the units the
//! trainer really lays out, printed per rank and stage; and Figure 1 of the ZeRO paper.

use serde_json::Value;
use stoke_plan::{model_units, zero_rank_bytes, ModelConfig, Slices, ZeroInFlight, ZeroStage};
use stoke_train::{AttentionPrecision, Gpt, GptShape, Precision};
use tch::Device;

use crate::{run_ok, stoke};

#[test]
fn the_planners_units_are_the_trainers() {
    for (n_layer, d_model, n_head, seq_len, vocab_size) in
        [(4, 256, 4, 128, 256), (2, 64, 2, 32, 300), (3, 48, 3, 17, 61)]
    {
        let shape = GptShape { n_layer, n_head, d_model, seq_len, vocab_size };
        let model = Gpt::new(shape, Precision::Fp32, AttentionPrecision::Fp32, Device::Cpu);
        let trainer: Vec<u64> = model.params().units().iter().map(|u| (u.range.end - u.range.start) as u64).collect();
        let planner = model_units(&ModelConfig::gpt(n_layer, d_model, n_head, seq_len, vocab_size));
        assert_eq!(trainer, planner, "{shape:?}");
    }
}

#[test]
fn zero_table_prints_the_formula_for_every_rank_and_stage() {
    let args = ["plan", "--zero-table", "--json", "--devices", "3", "--layers", "2", "--hidden", "64", "--heads", "2"];
    let out = run_ok(&mut stoke(&args, &[]));
    let table: Value = serde_json::from_slice(&out.stdout).expect("--json prints JSON");
    let units =
        model_units(&ModelConfig { n_layer: 2, d_model: 64, n_head: 2, ..ModelConfig::preset("tiny").unwrap() });
    let in_flight = ZeroInFlight { gradient_units: 2, gathered_units: 2 };
    let stages = table["stages"].as_array().expect("stages");
    assert_eq!(stages.len(), 4);
    for (stage, entry) in ZeroStage::ALL.into_iter().zip(stages) {
        let ranks = entry["ranks"].as_array().expect("ranks");
        assert_eq!(ranks.len(), 3);
        for (rank, printed) in ranks.iter().enumerate() {
            let expected = zero_rank_bytes(&units, 3, rank, stage, 2, Slices::Mapped, in_flight).unwrap();
            let between = zero_rank_bytes(&units, 3, rank, stage, 2, Slices::Mapped, ZeroInFlight::NONE).unwrap();
            assert_eq!(printed["total"].as_u64(), Some(expected.total()), "stage {stage:?} rank {rank}");
            assert_eq!(printed["optimizer"].as_u64(), Some(expected.optimizer), "stage {stage:?} rank {rank}");
            assert_eq!(printed["between_steps_total"].as_u64(), Some(between.total()), "stage {stage:?} rank {rank}");
        }
    }
    let bars = table["zero_figure_1"].as_array().expect("zero_figure_1");
    assert_eq!(bars.len(), 4);
    assert!(bars.iter().all(|bar| bar["agrees"] == Value::Bool(true)), "{bars:?}");

    let text = run_ok(&mut stoke(&["plan", "--zero-table", "--devices", "2"], &[]));
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("Figure 1") && text.contains("31.4 GB") && !text.contains("disagrees"), "{text}");

    let bad = stoke(&["plan", "--zero-table", "--optimizer", "adagrad"], &[]).output().expect("stoke runs");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--optimizer"), "{}", String::from_utf8_lossy(&bad.stderr));
}

#[test]
fn the_zero_table_of_a_family_is_the_family_as_built() {
    // gpt-rms has no biases and scale-only norms: the table holds its own units, not the GPT's.
    let args = ["plan", "--zero-table", "--json", "--devices", "2", "--layers", "2", "--hidden", "64", "--heads", "2"];
    let mut with_family = args.to_vec();
    with_family.extend(["--family", "gpt-rms"]);
    let out = run_ok(&mut stoke(&with_family, &[]));
    let table: Value = serde_json::from_slice(&out.stdout).expect("--json prints JSON");
    let config = stoke_train::ModelConfig {
        family: "gpt-rms".into(),
        n_layer: 2,
        d_model: 64,
        n_head: 2,
        ..stoke_train::ModelConfig::default()
    };
    let units = model_units(&stoke_train::plan_model(&config).unwrap());
    let expected = zero_rank_bytes(&units, 2, 0, ZeroStage::ALL[0], 2, Slices::Mapped, ZeroInFlight::NONE).unwrap();
    let printed = &table["stages"][0]["ranks"][0];
    assert_eq!(printed["between_steps_total"].as_u64(), Some(expected.total()), "{printed}");
    let gpt: Value = serde_json::from_slice(&run_ok(&mut stoke(&args, &[])).stdout).unwrap();
    assert!(
        gpt["stages"][0]["ranks"][0]["between_steps_total"].as_u64() > printed["between_steps_total"].as_u64(),
        "the GPT's biases and norm shifts count"
    );

    let bad = stoke(&["plan", "--model", "llama-7b", "--family", "gpt-rms"], &[]).output().expect("stoke runs");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--family"), "{}", String::from_utf8_lossy(&bad.stderr));
    let unknown = stoke(&["plan", "--family", "nosuch"], &[]).output().expect("stoke runs");
    assert_eq!(unknown.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("model.family"));
}

#[test]
fn report_json_memory_is_the_formula_at_every_stage() {
    let dir = tempfile::tempdir().unwrap();
    // SMALL's shape: 2 blocks of width 64, 32 tokens, the tiny preset's 256-token vocabulary.
    let units = model_units(&ModelConfig::gpt(2, 64, 2, 32, 256));
    for (nproc, stage) in
        [(2, ZeroStage::None), (2, ZeroStage::Optimizer), (3, ZeroStage::Gradients), (3, ZeroStage::Parameters)]
    {
        let name = format!("zero{}-{nproc}", stage.number());
        let mut overrides: Vec<String> = crate::SMALL.iter().map(|s| s.to_string()).collect();
        overrides.extend([
            format!("run.dir={}", dir.path().display()),
            format!("run.name={name}"),
            "train.steps=3".into(),
            "prof.prometheus=false".into(),
            "ckpt.at_end=false".into(),
            format!("dist.zero={}", stage.number()),
        ]);
        let refs: Vec<&str> = overrides.iter().map(String::as_str).collect();
        run_ok(&mut stoke(&["launch", "--nproc", &nproc.to_string(), "--", "train", "--quiet"], &refs));
        let text = std::fs::read_to_string(dir.path().join(&name).join("report.json")).expect("report.json");
        let report: Value = serde_json::from_str(&text).expect("report.json is JSON");
        let memory = report["ranks"]["memory"].as_array().unwrap_or_else(|| panic!("{name}: no ranks.memory"));
        assert_eq!(memory.len(), nproc, "{name}: {memory:?}");
        for entry in memory {
            let rank = entry["rank"].as_u64().expect("rank") as usize;
            let got = [
                entry["parameters"].as_u64(),
                entry["gradients"].as_u64(),
                entry["optimizer"].as_u64(),
                entry["comm_buffers"].as_u64(),
            ];
            // The fused CPU optimizer (the default) maps the optimizer's slices onto the model's buffers.
            let b = zero_rank_bytes(&units, nproc, rank, stage, 2, Slices::Mapped, ZeroInFlight::NONE).unwrap();
            let formula = [b.parameters, b.gradients, b.optimizer, b.comm_buffers].map(Some);
            assert_eq!(got, formula, "{name} rank {rank}: report.json against zero_rank_bytes");
            assert_eq!(entry["zero"].as_u64(), Some(stage.number() as u64), "{name} rank {rank}");
            let (start, peak) = (entry["rss_start_bytes"].as_u64(), entry["peak_rss_bytes"].as_u64());
            assert!(peak.is_some() && peak >= start, "{name} rank {rank}: measured peak {peak:?} from {start:?}");
        }
    }
}

#[test]
fn lora_plans_hold_gradients_and_optimizer_state_for_the_adapters_alone() {
    let plan = |extra: &[&str]| -> Value {
        let mut args =
            vec!["plan", "--json", "--model", "llama-7b", "--cluster", "h100", "--devices", "8", "--top", "1"];
        args.extend_from_slice(extra);
        let out = run_ok(&mut stoke(&args, &[]));
        serde_json::from_slice::<Value>(&out.stdout).expect("--json prints JSON")["plans"][0].clone()
    };
    let full = plan(&["--zero", "1", "--micro-batch", "1"]);
    let lora = plan(&["--zero", "1", "--micro-batch", "1", "--lora-rank", "16"]);
    let adapters = 8_388_608.0; // r 16 on q_proj and v_proj of Llama 7B, PEFT's count
    assert_eq!(lora["memory"]["gradients"].as_f64().unwrap(), 2.0 * adapters, "{lora}");
    assert_eq!(lora["memory"]["optimizer"].as_f64().unwrap(), 12.0 * adapters / 8.0, "{lora}");
    assert!(lora["time"]["compute_s"].as_f64().unwrap() < 0.75 * full["time"]["compute_s"].as_f64().unwrap());
    let out =
        stoke(&["plan", "--model", "llama-7b", "--lora-rank", "16", "--lora-targets", "w_q"], &[]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("w_q"));
}

/// `stoke plan --model vla-small` plans the vla model as `stoke train` builds it on the built-in
/// robot set: its whole sequence (196 patches, 32 instruction tokens, the state, 16 actions), its
/// own units (the vision tower and the projector counted), the trainer's parameter count.
#[test]
fn a_vla_preset_is_planned_as_the_trainer_builds_it() {
    let out = run_ok(&mut stoke(&["plan", "--model", "vla-small", "--zero-table", "--json", "--devices", "2"], &[]));
    let table: Value = serde_json::from_slice(&out.stdout).expect("--json prints JSON");
    let config = stoke_train::ModelConfig {
        family: "vla".into(),
        preset: "vla-small".into(),
        frames: 1,
        state_dim: 2,
        action_dim: 2,
        ..stoke_train::ModelConfig::default()
    };
    let shape = config.vla_shape().unwrap();
    let model = stoke_train::Vla::new(shape, Precision::Fp32, stoke_train::ActionLoss::Flow, Device::Cpu);
    let trainer: Vec<u64> =
        stoke_train::Model::params(&model).units().iter().map(|u| (u.range.end - u.range.start) as u64).collect();
    let units = model_units(&stoke_train::plan_model(&config).unwrap());
    assert_eq!(trainer, units, "the planner's units are the built model's");
    let expected = zero_rank_bytes(&units, 2, 0, ZeroStage::ALL[0], 2, Slices::Mapped, ZeroInFlight::NONE).unwrap();
    assert_eq!(table["stages"][0]["ranks"][0]["between_steps_total"].as_u64(), Some(expected.total()));
    let text = run_ok(&mut stoke(&["plan", "--model", "vla-small"], &[]));
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("10 layers, d 384, 6 heads, seq 245"), "{text}");
    let bad = stoke(&["plan", "--model", "vla-tiny", "--family", "gpt"], &[]).output().expect("stoke runs");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("vla"), "{}", String::from_utf8_lossy(&bad.stderr));
}
