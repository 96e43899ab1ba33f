//! Instruction data (`data.path` a `.jsonl` of prompts and responses): the loss a run logs is the
//! model's mean cross-entropy over response tokens only, recomputed here from the same init.

use stoke_train::{CkptConfig, ModelConfig, Precision, TrainConfig, Trainer};
use tch::{Device, Kind, Tensor};

use crate::{losses, run_ok, stoke};

#[test]
fn the_loss_counts_response_tokens_only() {
    let dir = tempfile::tempdir().unwrap();
    let examples = [("What is 2+2? ", "4."), ("Name a colour: ", "blue"), ("Say hi", " hello there"), ("x", "y")];
    let lines: Vec<String> = examples
        .iter()
        .map(|(prompt, response)| serde_json::json!({"prompt": prompt, "response": response}).to_string())
        .collect();
    let data = dir.path().join("sft.jsonl");
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    let path = format!("data.path=\"{}\"", data.display());
    let run_dir = format!("run.dir={}", dir.path().display());
    let sets = [
        "model.family=\"llama\"",
        "model.n_layer=2",
        "model.d_model=64",
        "model.n_head=4",
        "model.n_kv_head=2",
        "model.seq_len=24",
        "train.precision=\"fp32\"",
        "train.micro_batch=4",
        "train.steps=2",
        "train.threads=1",
        "prof.enabled=false",
        "run.name=sft",
        &path,
        &run_dir,
    ];
    run_ok(&mut stoke(&["train", "--quiet"], &sets));
    let logged = losses(&dir.path().join("sft"))[0].1;

    // The first step's loss is the init's: every example once (a batch of all four), each row
    // prompt then response then padding, counted from the first response token on.
    let model = ModelConfig {
        family: "llama".into(),
        n_layer: 2,
        d_model: 64,
        n_head: 4,
        n_kv_head: 2,
        seq_len: 24,
        ..ModelConfig::default()
    };
    let train = TrainConfig { precision: Precision::Fp32, threads: 1, ..TrainConfig::default() };
    let trainer = Trainer::new(&model, &train, &CkptConfig::default(), Device::Cpu).unwrap();
    let (mut sum, mut count) = (0.0f64, 0usize);
    let (mut sum_all, mut count_all) = (0.0f64, 0usize);
    for (prompt, response) in examples {
        let tokens: Vec<i64> = format!("{prompt}{response}").bytes().map(i64::from).collect();
        let inputs = Tensor::from_slice(&tokens[..tokens.len() - 1]).view([1, -1]);
        let logits = tch::no_grad(|| trainer.model().forward(&inputs).expect("token logits"))
            .to_kind(Kind::Float)
            .squeeze_dim(0);
        let log_probs = logits.log_softmax(-1, Kind::Float);
        for position in 1..tokens.len() {
            sum_all -= log_probs.double_value(&[position as i64 - 1, tokens[position]]);
            count_all += 1;
        }
        for position in prompt.len().max(1)..tokens.len() {
            sum -= log_probs.double_value(&[position as i64 - 1, tokens[position]]);
            count += 1;
        }
    }
    let expected = sum / count as f64;
    assert!((logged - expected).abs() < 2e-5 * expected, "logged {logged}, the response-only mean is {expected}");
    // Counting the prompts' targets too would move the mean fifty times as far.
    let every_target = sum_all / count_all as f64;
    assert!((every_target - expected).abs() > 1e-3 * expected, "{every_target} against {expected}: no test");
}
