//! fp16 loss scaling end to end, 16-bit precision against fp32, and optimizer state layout checks.

use std::sync::atomic::AtomicBool;

use stoke_train::{CkptConfig, ModelConfig, Observer, ObserverError, Precision, TrainConfig, TrainEvent, Trainer};

fn small_model() -> ModelConfig {
    ModelConfig { preset: "tiny".into(), n_layer: 2, d_model: 64, n_head: 4, seq_len: 32, ..ModelConfig::default() }
}

fn train_config(precision: Precision, steps: u64, micro_batch: usize) -> TrainConfig {
    TrainConfig { steps, micro_batch, precision, warmup_steps: 20, lr: 3e-3, min_lr: 3e-4, ..TrainConfig::default() }
}

fn corpus_source(train: &TrainConfig, seq_len: usize) -> stoke_data::RandomWindows {
    let text = stoke_data::builtin_corpus(0, 1 << 17);
    stoke_data::RandomWindows::from_bytes(&text, seq_len, train.micro_batch, train.seed).unwrap()
}

/// Collects each step's (loss scale, skipped, loss).
#[derive(Default)]
struct ScaleLog {
    steps: Vec<(Option<f64>, bool, f64)>,
}

impl Observer for ScaleLog {
    fn on_event(&mut self, event: &TrainEvent<'_>) -> Result<(), ObserverError> {
        if let TrainEvent::Step(record) = event {
            self.steps.push((record.loss_scale, record.skipped, record.loss));
        }
        Ok(())
    }
}

#[test]
fn injected_overflow_skips_backs_off_and_grows_back() {
    let _rng = super::rng_lock();
    let model = small_model();
    let mut train = train_config(Precision::Fp16, 8, 8);
    train.loss_scale_init = 1024.0;
    train.loss_scale_interval = 3;
    let mut trainer = Trainer::new(&model, &train, &CkptConfig::default(), tch::Device::Cpu).unwrap();
    trainer.inject_overflow_at(2);
    let mut source = corpus_source(&train, 32);
    let mut log = ScaleLog::default();
    let summary = trainer.run(&mut source, &mut [&mut log], None, &AtomicBool::new(false)).unwrap();
    let scales: Vec<f64> = log.steps.iter().map(|(s, _, _)| s.unwrap()).collect();
    let skipped: Vec<bool> = log.steps.iter().map(|(_, k, _)| *k).collect();
    assert_eq!(skipped, [false, true, false, false, false, false, false, false]);
    // Step 2 ran at 1024 and overflowed; 3-5 at 512; three clean steps grow it back to 1024.
    assert_eq!(scales, [1024.0, 1024.0, 512.0, 512.0, 512.0, 1024.0, 1024.0, 1024.0]);
    assert_eq!(summary.skipped_steps, 1);
    assert!(summary.final_loss.is_finite());
}

#[test]
fn sixteen_bit_runs_end_within_two_percent_of_fp32() {
    let _rng = super::rng_lock();
    let model = small_model();
    // The final loss is the mean of the last 50 steps' losses: one step's loss on 16 x 32 tokens
    // is too noisy to compare at 2%. (fp16 matrix multiplies are slow on a CPU without fp16
    // units: this run is the longest test of the crate.)
    let final_loss = |precision: Precision, fused_layer_norm: bool| {
        let train = TrainConfig { fused_layer_norm, ..train_config(precision, 300, 16) };
        let mut trainer = Trainer::new(&model, &train, &CkptConfig::default(), tch::Device::Cpu).unwrap();
        let mut source = corpus_source(&train, 32);
        let mut log = ScaleLog::default();
        let summary = trainer.run(&mut source, &mut [&mut log], None, &AtomicBool::new(false)).unwrap();
        let tail: Vec<f64> = log.steps.iter().rev().take(50).map(|(_, _, loss)| *loss).collect();
        (tail.iter().sum::<f64>() / tail.len() as f64, summary.skipped_steps)
    };
    let (fp32, _) = final_loss(Precision::Fp32, false);
    // bf16 also with the fused LayerNorm kernels (`train.fused_layer_norm`), through the trainer.
    for (precision, fused_layer_norm) in [(Precision::Bf16, false), (Precision::Bf16, true), (Precision::Fp16, false)] {
        let (loss, skipped) = final_loss(precision, fused_layer_norm);
        let gap = (loss - fp32) / fp32;
        assert!(
            gap.abs() <= 0.02,
            "{precision:?} (fused LayerNorm {fused_layer_norm}) final loss {loss} vs fp32 {fp32}: {:.2}% ({skipped} steps skipped)",
            100.0 * gap
        );
    }
}
