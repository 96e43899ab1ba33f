use super::*;

#[test]
fn the_fused_cross_entropy_runs_from_a_large_vocabulary_unless_told() {
    assert!(!FusedCrossEntropy::Auto.enabled(256));
    assert!(FusedCrossEntropy::Auto.enabled(50304));
    assert!(FusedCrossEntropy::On.enabled(256));
    assert!(!FusedCrossEntropy::Off.enabled(50304));
}

#[test]
fn a_global_batch_sets_the_accumulation_for_the_world_size() {
    let train = TrainConfig { micro_batch: 4, global_batch: 16, ..TrainConfig::default() };
    assert_eq!(train.for_world(1).unwrap().grad_accum, 4);
    assert_eq!(train.for_world(2).unwrap().grad_accum, 2);
    assert_eq!(train.for_world(4).unwrap().grad_accum, 1);
    train.for_world(2).unwrap().validate().unwrap();
    let err = train.for_world(3).unwrap_err().to_string();
    assert!(err.contains("train.global_batch") && err.contains("3 rank(s)"), "{err}");
    let both = TrainConfig { grad_accum: 2, ..train };
    assert!(both.validate().unwrap_err().to_string().contains("train.grad_accum must stay 1"));
    assert_eq!(TrainConfig::default().for_world(3).unwrap(), TrainConfig::default());
}

#[test]
fn lr_schedule_warms_up_then_decays() {
    let cfg = TrainConfig { steps: 100, warmup_steps: 10, lr: 1.0, min_lr: 0.1, ..TrainConfig::default() };
    assert!((cfg.lr_at(0) - 0.1).abs() < 1e-12);
    assert!((cfg.lr_at(9) - 1.0).abs() < 1e-12);
    assert!((cfg.lr_at(10) - 1.0).abs() < 1e-12);
    assert!((cfg.lr_at(55) - 0.55).abs() < 1e-12);
    assert!((cfg.lr_at(100) - 0.1).abs() < 1e-12);
    assert!(cfg.lr_at(30) > cfg.lr_at(40));
}

#[test]
fn lr_horizon_keeps_the_schedule_when_steps_grow() {
    let base = TrainConfig { steps: 100, warmup_steps: 10, lr: 1.0, min_lr: 0.1, ..TrainConfig::default() };
    let extended = TrainConfig { steps: 150, lr_horizon: 100, ..base.clone() };
    for step in 0..100 {
        assert_eq!(base.lr_at(step).to_bits(), extended.lr_at(step).to_bits(), "step {step}");
    }
    assert_eq!(extended.lr_at(120), 0.1, "past the horizon the rate stays at min_lr");
    let stretched = TrainConfig { steps: 150, ..base.clone() };
    assert!(stretched.lr_at(60) > base.lr_at(60));
}

#[test]
fn lr_shapes_follow_their_definitions() {
    let base = TrainConfig { steps: 110, warmup_steps: 10, lr: 1.0, min_lr: 0.1, ..TrainConfig::default() };
    let linear = TrainConfig { lr_shape: LrShape::Linear, ..base.clone() };
    assert!((linear.lr_at(60) - 0.55).abs() < 1e-12);
    assert!((linear.lr_at(110) - 0.1).abs() < 1e-12);
    let constant = TrainConfig { lr_shape: LrShape::Constant, ..base.clone() };
    assert_eq!(constant.lr_at(5), 0.6);
    assert_eq!(constant.lr_at(100), 1.0);
    let wsd = TrainConfig { lr_shape: LrShape::Wsd, lr_decay_fraction: 0.2, ..base.clone() };
    assert_eq!(wsd.lr_at(80), 1.0, "stable until 80% of the decay span");
    assert_eq!(wsd.lr_at(90), 1.0);
    assert!((wsd.lr_at(100) - 0.55).abs() < 1e-12, "half way down the last 20%");
    assert!((wsd.lr_at(110) - 0.1).abs() < 1e-12);
    for shape in [LrShape::Cosine, LrShape::Linear, LrShape::Wsd] {
        let cfg = TrainConfig { lr_shape: shape, ..base.clone() };
        for step in 10..110 {
            assert!(cfg.lr_at(step + 1) <= cfg.lr_at(step), "{shape:?} never rises after warmup");
        }
    }
}

#[test]
fn batch_scaling_rules_scale_rate_and_warmup() {
    let base = TrainConfig {
        steps: 200,
        warmup_steps: 10,
        lr: 1e-3,
        min_lr: 1e-4,
        micro_batch: 16,
        lr_reference_batch: 16,
        ..TrainConfig::default()
    };
    let none = TrainConfig { grad_accum: 4, ..base.clone() };
    assert_eq!(none.lr_at(50).to_bits(), base.lr_at(50).to_bits(), "none ignores the batch");
    let linear = TrainConfig { grad_accum: 4, lr_scaling: LrScaling::Linear, ..base.clone() };
    assert_eq!(linear.batch_sequences(), 64);
    assert!((linear.lr_at(9) - 4e-3).abs() < 1e-15, "peak x4 after the same 10 warmup steps (4x the tokens)");
    assert!((linear.lr_at(0) - 4e-4).abs() < 1e-15);
    assert!((linear.lr_at(200) - 4e-4).abs() < 1e-15);
    let sqrt = TrainConfig { lr_scaling: LrScaling::Sqrt, world_size: 4, ..base.clone() };
    assert!((sqrt.lr_at(4) - 2e-3).abs() < 1e-15, "sqrt(4) = 2; warmup 10 x 2 / 4 = 5 steps, 2x the tokens");
    assert!(sqrt.lr_at(3) < 2e-3);
    let at_reference = TrainConfig { lr_scaling: LrScaling::Linear, ..base.clone() };
    for step in 0..200 {
        assert_eq!(at_reference.lr_at(step).to_bits(), base.lr_at(step).to_bits(), "factor 1 at the reference");
    }
}
