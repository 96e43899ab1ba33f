//! Each class of configuration error: its message names the key, and the exit code is 2.

use crate::stoke;

fn check(args: &[&str], overrides: &[&str], expected: &str) {
    let out = stoke(args, overrides).output().expect("stoke runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?} {overrides:?}: exit {:?}, stderr: {stderr}", out.status);
    assert!(stderr.contains(expected), "{args:?} {overrides:?}: want {expected:?} in stderr:\n{stderr}");
}

#[test]
fn unknown_key() {
    check(&["train"], &["train.stepz=20"], "unknown config key `train.stepz`; did you mean `train.steps`?");
    check(&["train"], &["optimiser.lr=1"], "unknown config key `optimiser`");
}

#[test]
fn wrong_type() {
    check(&["train"], &["train.steps=twenty"], "config key `train.steps` expects an integer, got a string");
    check(&["train"], &["ckpt.at_end=3"], "config key `ckpt.at_end` expects a boolean, got an integer");
    check(
        &["train"],
        &["train.fused_optimizer=1"],
        "config key `train.fused_optimizer` expects a boolean, got an integer",
    );
}

#[test]
fn out_of_range() {
    check(&["train"], &["train.lr=-0.1"], "config key `train.lr`: must be a finite number > 0; got -0.1");
    check(&["train"], &["train.micro_batch=0"], "config key `train.micro_batch`: must be at least 1");
    check(&["train"], &["train.precision=fp8"], "config key `train.precision`: unknown variant `fp8`");
    check(&["train"], &["train.recompute=everything"], "config key `train.recompute`: got \"everything\"; allowed:");
    check(&["train"], &["train.host_memory=keep"], "config key `train.host_memory`: unknown variant `keep`");
    check(&["train"], &["model.n_head=5"], "config key `model.n_head`: must divide model.d_model");
}

#[test]
fn missing_data_file() {
    check(&["train", "--data", "no/such/corpus.txt"], &[], "no such file or folder: no/such/corpus.txt");
}

#[test]
fn malformed_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run.toml");
    std::fs::write(&path, "[train]\nsteps = = 3\n").unwrap();
    check(&["train", "--config", path.to_str().unwrap()], &[], "is not valid TOML");
    check(&["train", "--config", "no-such-config.toml"], &[], "cannot read config file no-such-config.toml");
}

#[test]
fn usage_error() {
    check(&["train", "--no-such-flag"], &[], "--no-such-flag");
}

#[test]
fn a_bad_injection_test_switch_is_a_usage_error() {
    let switches = [
        ("STOKE_TEST_SLOW_FORWARD", "10", "11"),
        ("STOKE_TEST_SLOW_BACKWARD", "10", "11"),
        ("STOKE_TEST_SLOW_OPTIMIZER", "10", "11"),
        ("STOKE_TEST_DATA_WAIT_MS", "1000", "1001"),
        ("STOKE_TEST_MORE_MEMORY", "10", "11"),
    ];
    for (var, max, too_large) in switches {
        for bad in ["fast", "-0.1", "nan", too_large] {
            let mut cmd = stoke(&["train"], &[]);
            cmd.env(var, bad);
            let out = cmd.output().expect("stoke runs");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{var}={bad}: {stderr}");
            assert!(stderr.contains(var) && stderr.contains(&format!("from 0 to {max}")), "{var}={bad}: {stderr}");
        }
    }
}
