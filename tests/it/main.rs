//! End-to-end tests of the `stoke` binary: real processes, real files, a small model.

mod boundary;
mod ckpt;
mod ckpt_crash;
mod config_errors;
mod dist;
mod dist_report;
mod doctor;
mod dynamics;
mod elastic;
mod environment;
mod hf;
mod house;
mod instructions;
mod launch;
mod mirror;
mod nodes;
mod pipeline;
mod plan;
mod prep;
mod regression;
#[cfg(feature = "remote")]
mod remote_data;
mod resume_keys;
mod s3;
mod sched;
mod sched_serve;
mod sched_slurm;
mod tensor;
mod train;
mod vla;
mod zero;

use std::path::Path;
use std::process::{Command, Output};

/// A model small enough to train in seconds on two busy cores.
pub const SMALL: &[&str] = &[
    "model.n_layer=2",
    "model.d_model=64",
    "model.n_head=2",
    "model.seq_len=32",
    "train.micro_batch=8",
    "train.lr=0.01",
    "train.warmup_steps=5",
    "train.threads=1",
    "data.builtin_bytes=200000",
];

/// Every model family, by a short tag for run names and the overrides that select it: the tests
/// of training, data parallelism, ZeRO and resuming run each. llama runs with grouped-query
/// attention (half as many key/value heads as the tests' models have heads).
pub const FAMILIES: &[(&str, &[&str])] = &[
    ("gpt", &["model.family=\"gpt\""]),
    ("gpt-rms", &["model.family=\"gpt-rms\""]),
    ("llama", &["model.family=\"llama\"", "model.n_kv_head=1"]),
];

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub fn stoke(args: &[&str], overrides: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stoke"));
    cmd.args(args);
    for o in overrides {
        cmd.arg("--set").arg(o);
    }
    cmd
}

pub fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("stoke runs");
    assert!(
        out.status.success(),
        "stoke failed with {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// (step, loss) of every line of a run's metrics.jsonl.
pub fn losses(run_dir: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).expect("metrics.jsonl exists");
    text.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("each line is JSON");
            for key in ["step", "loss", "lr", "tokens_per_s", "step_ms"] {
                assert!(v.get(key).is_some(), "metrics line lacks {key}: {line}");
            }
            (v["step"].as_u64().unwrap(), v["loss"].as_f64().unwrap())
        })
        .collect()
}

/// Two safetensors files of the same tensors (names, shapes, f32): the largest difference of any
/// tensor as a share of that tensor's largest value in `a`, and the sorted names.
pub fn largest_tensor_difference(a: &Path, b: &Path) -> (f32, Vec<String>) {
    let (a, b) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    let (a, b) =
        (safetensors::SafeTensors::deserialize(&a).unwrap(), safetensors::SafeTensors::deserialize(&b).unwrap());
    let (mut names, mut other) = (a.names(), b.names());
    names.sort();
    other.sort();
    assert_eq!(names, other);
    let values = |t: safetensors::tensor::TensorView<'_>| -> Vec<f32> {
        assert_eq!(t.dtype(), safetensors::Dtype::F32);
        t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    };
    let mut worst = 0.0f32;
    for name in &names {
        let (x, y) = (a.tensor(name).unwrap(), b.tensor(name).unwrap());
        assert_eq!(x.shape(), y.shape(), "{name}");
        let (x, y) = (values(x), values(y));
        let scale = x.iter().fold(1e-12f32, |m, v| m.max(v.abs()));
        let diff = x.iter().zip(&y).fold(0.0f32, |m, (p, q)| m.max((p - q).abs()));
        worst = worst.max(diff / scale);
    }
    println!("{} tensors, largest difference {worst:e} of a tensor's largest value", names.len());
    (worst, names.into_iter().map(str::to_string).collect())
}
