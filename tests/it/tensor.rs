//! Tensor parallelism with real processes over loopback: a `gpt-rms` model cut over 2 and 4
//! ranks, and over 2 ranks with data parallelism over 2 copies, follows one process's fp32
//! losses within 1e-5 over 20 steps (with the gradient clip biting too), under `stoke launch`
//! and `mpirun`; what a cut model does not run with yet is refused at start, naming the key.

use std::path::Path;

use crate::dist::{assert_same_trajectory, family_reference_losses, overrides, refs};
use crate::{run_ok, stoke};

const RMS: (&str, &[&str]) = ("gpt-rms", &["model.family=\"gpt-rms\""]);

/// A cut model's checkpoint is not written yet.
const NO_CHECKPOINTS: &[&str] = &["ckpt.every=0", "ckpt.at_end=false"];

fn cut_run(dir: &Path, name: &str, extra: &[&str]) -> Vec<String> {
    let mut all: Vec<&str> = RMS.1.to_vec();
    all.extend(["train.steps=20"]);
    all.extend_from_slice(NO_CHECKPOINTS);
    all.extend_from_slice(extra);
    overrides(dir, name, &all)
}

fn launch(nproc: &str, args: &[String]) -> std::process::Output {
    run_ok(&mut stoke(&["launch", "--nproc", nproc, "--", "train", "--quiet"], &refs(args)))
}

#[test]
fn a_model_cut_over_two_and_four_ranks_and_two_by_two_follows_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let reference = family_reference_losses(dir.path(), RMS);
    // The model's 4 heads over 2 ranks, one copy: every rank reads all 6 rows.
    let args = cut_run(dir.path(), "t2", &["dist.tensor=2", "train.micro_batch=6"]);
    let out = launch("2", &args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("the model cut over 2 ranks, 1 copies"), "{stdout}");
    assert_same_trajectory(&reference, &dir.path().join("t2"), "tensor 2", &out);
    // Cut over 2 ranks, 2 copies reading 3 rows each.
    let args = cut_run(dir.path(), "t2d2", &["dist.tensor=2", "train.micro_batch=3"]);
    let out = launch("4", &args);
    assert!(String::from_utf8_lossy(&out.stdout).contains("the model cut over 2 ranks, 2 copies"));
    assert_same_trajectory(&reference, &dir.path().join("t2d2"), "tensor 2 x data 2", &out);
}

/// A clip that bites on every step: the norm it divides by is the whole model's, its cut
/// parts' sums added over the group with the replicated tensors counted once.
#[test]
fn the_clip_sees_the_whole_models_norm_when_cut_over_four_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let clip = "train.grad_clip=0.05";
    let mut family = RMS.1.to_vec();
    family.push(clip);
    let reference = family_reference_losses(dir.path(), ("clipped", &family));
    let args = cut_run(dir.path(), "t4", &["dist.tensor=4", "train.micro_batch=6", clip]);
    let out = launch("4", &args);
    assert_same_trajectory(&reference, &dir.path().join("t4"), "tensor 4, clip 0.05", &out);
    // The clip did bite: without it the same model ends elsewhere.
    let unclipped = family_reference_losses(dir.path(), RMS);
    let last = |l: &[(u64, f64)]| l.last().unwrap().1;
    assert_ne!(last(&reference), last(&unclipped), "a clip of 0.05 changed nothing");
}

#[test]
fn mpirun_runs_a_model_cut_over_two_ranks() {
    if !stoke_comm::Backend::Mpi.is_built() {
        eprintln!("SKIPPED: this build lacks stoke-comm/mpi (cargo xtask test builds it)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let reference = family_reference_losses(dir.path(), RMS);
    let args = cut_run(dir.path(), "mpi-t2", &["dist.tensor=2", "train.micro_batch=6", "dist.backend=\"mpi\""]);
    let session = tempfile::tempdir().unwrap();
    let mut cmd = crate::dist::mpirun("2", session.path());
    cmd.arg(env!("CARGO_BIN_EXE_stoke")).args(["train", "--quiet"]);
    for o in &args {
        cmd.arg("--set").arg(o);
    }
    let out = run_ok(&mut cmd);
    assert_same_trajectory(&reference, &dir.path().join("mpi-t2"), "mpirun -np 2, tensor 2", &out);
}

/// Each refusal exits 2 before any step, naming the key and why.
#[test]
fn what_a_cut_model_does_not_run_with_yet_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&str, &[&str], &str, &str)] = &[
        (
            "2",
            &["model.family=\"gpt\"", "dist.tensor=2", "ckpt.every=0", "ckpt.at_end=false"],
            "dist.tensor",
            "declares no tensor-parallel split",
        ),
        ("2", &["model.family=\"gpt-rms\"", "dist.tensor=2"], "dist.tensor", "ckpt.every = 0"),
        (
            "2",
            &["model.family=\"gpt-rms\"", "dist.tensor=3", "ckpt.every=0", "ckpt.at_end=false"],
            "dist.tensor",
            "does not divide the job's 2 ranks",
        ),
        (
            "2",
            &[
                "model.family=\"gpt-rms\"",
                "dist.tensor=2",
                "model.n_head=3",
                "model.d_model=48",
                "ckpt.every=0",
                "ckpt.at_end=false",
            ],
            "dist.tensor",
            "does not divide model.n_head = 3",
        ),
        (
            "4",
            &["model.family=\"gpt-rms\"", "dist.tensor=2", "dist.zero=1", "ckpt.every=0", "ckpt.at_end=false"],
            "dist.zero",
            "does not run with yet",
        ),
    ];
    for (i, (nproc, extra, key, why)) in cases.iter().enumerate() {
        let mut all = extra.to_vec();
        all.push("train.steps=2");
        let args = overrides(dir.path(), &format!("refused-{i}"), &all);
        let out = stoke(&["launch", "--nproc", nproc, "--", "train", "--quiet"], &refs(&args)).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "case {i} ran: {stderr}");
        assert!(stderr.contains(key) && stderr.contains(why), "case {i}: want {key:?} and {why:?} in:\n{stderr}");
    }
}
