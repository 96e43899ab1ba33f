//! Hugging Face checkpoints in and out, against transformers itself: `hf_models.py` writes
//! random-init GPT-2 and Llama checkpoints with `save_pretrained` (no download) and their logits on
//! fixed tokens; stoke's forward from `model.from = "hf:DIR"` must give those logits, and a run
//! `stoke export hf` writes must load in transformers with the logits stoke computes.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use stoke_train::{build_model, resolve_from, CkptConfig, ModelConfig, Precision, TrainConfig, Trainer};
use tch::{Device, Kind, Tensor};

use crate::{run_ok, stoke};

/// The project's Python with transformers and peft (`cargo xtask test` installs them).
pub(crate) fn python() -> PathBuf {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".stoke/venv/bin/python");
    let ok = Command::new(&python).args(["-c", "import transformers, peft"]).output();
    assert!(
        ok.is_ok_and(|o| o.status.success()),
        "{} cannot import transformers and peft: run `cargo xtask test` once to install them",
        python.display()
    );
    python
}

pub(crate) fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/it/hf_models.py")
}

/// Writes the three checkpoints of `hf_models.py make` under `dir`.
pub(crate) fn make_checkpoints(dir: &Path) {
    let out = Command::new(python()).arg(script()).arg("make").arg(dir).output().expect("python runs");
    assert!(out.status.success(), "hf_models.py make: {}", String::from_utf8_lossy(&out.stderr));
}

fn fp32() -> TrainConfig {
    TrainConfig { precision: Precision::Fp32, threads: 1, ..TrainConfig::default() }
}

fn tokens_tensor(tokens: &Value) -> Tensor {
    let rows: Vec<Vec<i64>> = serde_json::from_value(tokens.clone()).expect("tokens are rows of integers");
    let flat: Vec<i64> = rows.iter().flatten().copied().collect();
    Tensor::from_slice(&flat).view([rows.len() as i64, -1])
}

fn floats(value: &Value) -> Vec<f32> {
    value.as_array().expect("a list").iter().map(|v| v.as_f64().expect("a number") as f32).collect()
}

/// Asserts `got` equals `want` within `tolerance` (absolute) at every element.
fn assert_close(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (worst, at) =
        got.iter().zip(want).map(|(a, b)| (a - b).abs()).zip(0..).fold(
            (0.0f32, 0),
            |m, (d, i)| {
                if d > m.0 {
                    (d, i)
                } else {
                    m
                }
            },
        );
    assert!(worst <= tolerance, "{what}: logit {at} is {} against {} (difference {worst:e})", got[at], want[at]);
}

/// stoke's fp32 logits of `tokens` for the model `model` describes.
fn stoke_logits(model: &ModelConfig, tokens: &Tensor) -> Vec<f32> {
    let built = build_model(model, &fp32(), 1, Device::Cpu).expect("the checkpoint loads");
    let logits = tch::no_grad(|| built.forward(tokens).expect("token logits"));
    Vec::<f32>::try_from(logits.to_kind(Kind::Float).reshape([-1])).unwrap()
}

#[test]
fn hugging_face_checkpoints_give_transformers_logits() {
    let dir = tempfile::tempdir().unwrap();
    make_checkpoints(dir.path());
    for (name, family) in [("gpt2", "gpt"), ("llama", "llama"), ("llama-tied", "llama")] {
        let folder = dir.path().join(name);
        let asked = ModelConfig { from: format!("hf:{}", folder.display()), ..ModelConfig::default() };
        let model = resolve_from(&asked).unwrap();
        assert_eq!(model.family, family, "{name}");
        let expected: Value =
            serde_json::from_str(&std::fs::read_to_string(folder.join("expected.json")).unwrap()).unwrap();
        let got = stoke_logits(&model, &tokens_tensor(&expected["tokens"]));
        assert_close(&got, &floats(&expected["logits"]), 1e-5, name);
    }
}

#[test]
fn a_checkpoint_that_does_not_fit_names_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    make_checkpoints(dir.path());
    let folder = dir.path().join("llama");
    let model =
        resolve_from(&ModelConfig { from: format!("hf:{}", folder.display()), ..ModelConfig::default() }).unwrap();
    // The MLP one wider than the file's: the first tensor that disagrees is named with its file.
    let wider = ModelConfig { ffn_hidden: 97, ..model.clone() };
    let err = build_model(&wider, &fp32(), 1, Device::Cpu).err().expect("a shape mismatch is refused").to_string();
    assert!(err.contains("model.layers.0.mlp.gate_proj.weight") && err.contains("model.safetensors"), "{err}");
    assert!(err.contains("[96, 64]") && err.contains("[97, 64]"), "{err}");
    // A size the run sets that the checkpoint's config.json contradicts is a config error.
    let asked = ModelConfig { n_layer: 3, from: format!("hf:{}", folder.display()), ..ModelConfig::default() };
    let err = resolve_from(&asked).unwrap_err().to_string();
    assert!(err.contains("model.n_layer is 3") && err.contains("config.json"), "{err}");
}

#[test]
fn an_exported_run_loads_in_transformers_with_stokes_logits() {
    let dir = tempfile::tempdir().unwrap();
    make_checkpoints(dir.path());
    for name in ["gpt2", "llama"] {
        let from = format!("model.from=\"hf:{}\"", dir.path().join(name).display());
        let run_dir = format!("run.dir={}", dir.path().display());
        let run_name = format!("run.name=tuned-{name}");
        let sets = [
            from.as_str(),
            &run_dir,
            &run_name,
            "train.steps=3",
            "train.micro_batch=2",
            "train.precision=\"fp32\"",
            "train.threads=1",
            "data.builtin_bytes=100000",
            "prof.enabled=false",
        ];
        run_ok(&mut stoke(&["train", "--quiet"], &sets));
        let run = dir.path().join(format!("tuned-{name}"));
        let out = dir.path().join(format!("exported-{name}"));
        run_ok(&mut stoke(&["export", "hf", run.to_str().unwrap(), "--out", out.to_str().unwrap()], &[]));

        // stoke's own forward of the checkpoint the export read.
        let model = resolve_from(&ModelConfig {
            from: format!("hf:{}", dir.path().join(name).display()),
            ..ModelConfig::default()
        })
        .unwrap();
        let mut trainer = Trainer::new(&model, &fp32(), &CkptConfig::default(), Device::Cpu).unwrap();
        let store = stoke_ckpt::CheckpointStore::new(run.join("checkpoints"));
        trainer.restore(&store, store.latest().unwrap().expect("the run checkpointed")).unwrap();
        let tokens = "[[1, 2, 3, 90, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 95]]";
        let tokens_json: Value = serde_json::from_str(tokens).unwrap();
        let ours = tch::no_grad(|| trainer.model().forward(&tokens_tensor(&tokens_json)).expect("token logits"));
        let ours = Vec::<f32>::try_from(ours.reshape([-1])).unwrap();

        let theirs = Command::new(python()).arg(script()).arg("logits").arg(&out).arg(tokens).output().unwrap();
        assert!(
            theirs.status.success(),
            "{name}: transformers cannot load the export: {}",
            String::from_utf8_lossy(&theirs.stderr)
        );
        let theirs: Value = serde_json::from_slice(&theirs.stdout).expect("the script prints JSON");
        assert_close(&ours, &floats(&theirs), 1e-5, &format!("exported {name}"));
    }
}

/// Trains `run_name` from the checkpoint `from` with `extra` settings (fp32, a few steps at a rate
/// that moves the weights) and returns the run folder.
fn fine_tune(dir: &Path, from: &Path, run_name: &str, extra: &[&str]) -> PathBuf {
    let from = format!("model.from=\"hf:{}\"", from.display());
    let run_dir = format!("run.dir={}", dir.display());
    let name = format!("run.name={run_name}");
    let mut sets = vec![
        from.as_str(),
        &run_dir,
        &name,
        "train.steps=5",
        "train.micro_batch=2",
        "train.lr=0.01",
        "train.warmup_steps=1",
        "train.precision=\"fp32\"",
        "train.threads=1",
        "data.builtin_bytes=100000",
    ];
    sets.extend_from_slice(extra);
    run_ok(&mut stoke(&["train", "--quiet"], &sets));
    dir.join(run_name)
}

/// stoke's logits of `tokens` after restoring the newest checkpoint of `run`, built as the run
/// built it (`model`, `train`).
fn restored_logits(run: &Path, model: &ModelConfig, train: &TrainConfig, tokens: &Value) -> Vec<f32> {
    let mut trainer = Trainer::new(model, train, &CkptConfig::default(), Device::Cpu).unwrap();
    let store = stoke_ckpt::CheckpointStore::new(run.join("checkpoints"));
    trainer.restore(&store, store.latest().unwrap().expect("the run checkpointed")).unwrap();
    let logits = tch::no_grad(|| trainer.model().forward(&tokens_tensor(tokens)).expect("token logits"));
    Vec::<f32>::try_from(logits.reshape([-1])).unwrap()
}

fn python_logits(args: &[&std::ffi::OsStr], what: &str) -> Vec<f32> {
    let out = Command::new(python()).arg(script()).args(args).output().unwrap();
    assert!(out.status.success(), "{what}: {}", String::from_utf8_lossy(&out.stderr));
    floats(&serde_json::from_slice(&out.stdout).expect("the script prints JSON"))
}

fn trainable_params(run: &Path) -> u64 {
    let report: Value = serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
    report["model"]["n_trainable_params"].as_u64().expect("report.json counts trainable parameters")
}

#[test]
fn lora_adapters_load_in_peft_and_merge_on_export() {
    let dir = tempfile::tempdir().unwrap();
    make_checkpoints(dir.path());
    let base = dir.path().join("llama");
    let targets = "train.lora.targets=[\"q_proj\", \"v_proj\", \"model.layers.*.mlp.down_proj\"]";
    let run = fine_tune(dir.path(), &base, "lora", &["train.lora.rank=4", "train.lora.alpha=8", targets]);
    // Per block: q [64, 64] gets A [4, 64] and B [64, 4]; v [32, 64] A [4, 64], B [32, 4]; down
    // [64, 96] A [4, 96], B [64, 4]. Nothing else trains.
    assert_eq!(trainable_params(&run), 2 * (512 + 384 + 640));

    let model =
        resolve_from(&ModelConfig { from: format!("hf:{}", base.display()), ..ModelConfig::default() }).unwrap();
    let lora = stoke_train::LoraConfig {
        rank: 4,
        alpha: 8.0,
        targets: vec!["q_proj".into(), "v_proj".into(), "model.layers.*.mlp.down_proj".into()],
        ..stoke_train::LoraConfig::default()
    };
    let train = TrainConfig { lora, ..fp32() };
    let tokens: Value = serde_json::from_str("[[1, 2, 3, 90, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 95]]").unwrap();
    let ours = restored_logits(&run, &model, &train, &tokens);
    let untuned = stoke_logits(&model, &tokens_tensor(&tokens));
    assert!(ours.iter().zip(&untuned).any(|(a, b)| (a - b).abs() > 1e-3), "the adapters did not train");

    let adapter = dir.path().join("adapter");
    run_ok(&mut stoke(&["export", "peft", run.to_str().unwrap(), "--out", adapter.to_str().unwrap()], &[]));
    let tokens_arg = tokens.to_string();
    let peft = python_logits(&["peft".as_ref(), base.as_os_str(), adapter.as_os_str(), tokens_arg.as_ref()], "peft");
    assert_close(&ours, &peft, 1e-5, "peft over the base");

    let merged = dir.path().join("merged");
    run_ok(&mut stoke(&["export", "hf", run.to_str().unwrap(), "--out", merged.to_str().unwrap()], &[]));
    let theirs = python_logits(&["logits".as_ref(), merged.as_os_str(), tokens_arg.as_ref()], "merged export");
    assert_close(&ours, &theirs, 1e-5, "the merged export");
}

/// Reads every tensor of a safetensors file as (name, bytes).
fn tensors_of(path: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    file.tensors().into_iter().map(|(name, view)| (name, view.data().to_vec())).collect()
}

#[test]
fn frozen_parameters_are_bit_for_bit_unchanged_after_training() {
    let dir = tempfile::tempdir().unwrap();
    make_checkpoints(dir.path());
    let base = dir.path().join("llama");
    let freeze = "train.freeze=[\"model.embed_tokens.*\", \"model.layers.0.*\"]";
    let run = fine_tune(dir.path(), &base, "frozen", &[freeze]);
    let exported = dir.path().join("exported");
    run_ok(&mut stoke(&["export", "hf", run.to_str().unwrap(), "--out", exported.to_str().unwrap()], &[]));

    let before = tensors_of(&base.join("model.safetensors"));
    let after = tensors_of(&exported.join("model.safetensors"));
    assert_eq!(before.keys().collect::<Vec<_>>(), after.keys().collect::<Vec<_>>());
    let frozen = |name: &str| name.starts_with("model.embed_tokens.") || name.starts_with("model.layers.0.");
    let mut frozen_elements = 0;
    for (name, values) in &before {
        if frozen(name) {
            assert!(after[name] == *values, "{name} changed though frozen");
            frozen_elements += values.len() as u64 / 4;
        } else {
            assert!(after[name] != *values, "{name} did not train");
        }
    }
    let total: u64 = before.values().map(|v| v.len() as u64 / 4).sum();
    assert_eq!(trainable_params(&run), total - frozen_elements);
    // The checkpoint holds what trains, not the frozen tensors.
    let step = stoke_ckpt::CheckpointStore::new(run.join("checkpoints")).latest().unwrap().unwrap();
    let checkpoint = tensors_of(&run.join(format!("checkpoints/step-{step}/model.safetensors")));
    assert!(
        checkpoint.keys().all(|name| !frozen(name)) && checkpoint.len() == before.len() - 10,
        "{:?}",
        checkpoint.keys()
    );
}

/// Frozen parameters sit outside the flat buffers, so whole units (the embedding, the head) are
/// empty under LoRA: two ZeRO-3 ranks still follow one process.
#[test]
fn a_lora_run_under_zero_follows_one_process() {
    let dir = tempfile::tempdir().unwrap();
    make_checkpoints(dir.path());
    let from = format!("model.from=\"hf:{}\"", dir.path().join("llama").display());
    let run_dir = format!("run.dir={}", dir.path().display());
    let common = [
        from.as_str(),
        &run_dir,
        "train.lora.rank=4",
        "train.lr=0.01",
        "train.steps=8",
        "train.precision=\"fp32\"",
        "train.threads=1",
        "data.builtin_bytes=100000",
        "prof.enabled=false",
    ];
    let one = [&common[..], &["run.name=one", "train.micro_batch=4"]].concat();
    run_ok(&mut stoke(&["train", "--quiet"], &one));
    let sharded = [&common[..], &["run.name=z3", "train.micro_batch=2", "dist.zero=3"]].concat();
    run_ok(&mut stoke(&["launch", "--nproc", "2", "--", "train", "--quiet"], &sharded));
    let (a, b) = (crate::losses(&dir.path().join("one")), crate::losses(&dir.path().join("z3")));
    assert_eq!(a.len(), 8);
    for ((step, x), (_, y)) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "step {step}: one process {x}, ZeRO-3 on 2 ranks {y}");
    }
}

/// A checkpoint of a LoRA run holds the adapters only; the frozen base comes back from
/// `model.from`, so a resumed run gives the uninterrupted run's losses bit for bit.
#[test]
fn a_lora_run_resumes_bit_identically() {
    let dir = tempfile::tempdir().unwrap();
    make_checkpoints(dir.path());
    let from = format!("model.from=\"hf:{}\"", dir.path().join("llama").display());
    let run_dir = format!("run.dir={}", dir.path().display());
    let common = [
        from.as_str(),
        &run_dir,
        "train.lora.rank=4",
        "train.lr=0.01",
        "train.warmup_steps=2",
        "train.lr_horizon=10",
        "train.micro_batch=2",
        "train.threads=1",
        "data.builtin_bytes=100000",
        "prof.enabled=false",
    ];
    let with = |more: &[&'static str]| [&common[..], more].concat();
    run_ok(&mut stoke(&["train", "--quiet"], &with(&["run.name=straight", "train.steps=10"])));
    run_ok(&mut stoke(&["train", "--quiet"], &with(&["run.name=cut", "train.steps=5"])));
    run_ok(&mut stoke(&["train", "--quiet", "--resume"], &with(&["run.name=cut", "train.steps=10"])));
    let (straight, cut) = (crate::losses(&dir.path().join("straight")), crate::losses(&dir.path().join("cut")));
    assert_eq!(straight.len(), 10);
    assert_eq!(straight, cut, "the resumed LoRA run left the uninterrupted one");
}
