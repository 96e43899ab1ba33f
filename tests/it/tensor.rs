//! Tensor parallelism with real processes over loopback: a `gpt-rms` model cut over 2 and 4
//! ranks (`gpt` and `llama` over 2), and over 2 ranks with data parallelism over 2 copies, follows one process's fp32
//! losses within 1e-5 over 20 steps (with the gradient clip biting too), under `stoke launch`
//! and `mpirun`; a cut model's checkpoint holds whole tensors and resumes on one process, on
//! two data-parallel ranks and cut again with the uninterrupted losses; ZeRO 1-3 within the
//! copies of a cut model follow one process too (2 and 3 also with the sequence in pieces, and the
//! sequence in pieces in pipeline stages) and resume on one; what a cut model does not run with
//! yet is refused at start, naming the key.

use std::path::Path;

use crate::dist::{assert_same_trajectory, family_reference_losses, overrides, refs};
use crate::{losses, run_ok, stoke};

const RMS: (&str, &[&str]) = ("gpt-rms", &["model.family=\"gpt-rms\""]);
/// Grouped-query attention: 4 query heads, 2 key/value heads, one of each per rank.
const LLAMA: (&str, &[&str]) = ("llama", &["model.family=\"llama\"", "model.n_kv_head=2"]);
const GPT: (&str, &[&str]) = ("gpt", &["model.family=\"gpt\""]);

/// These runs compare losses only (checkpoints have a test of their own below).
const NO_CHECKPOINTS: &[&str] = &["ckpt.every=0", "ckpt.at_end=false"];

fn cut_run(dir: &Path, name: &str, extra: &[&str]) -> Vec<String> {
    family_cut_run(RMS, dir, name, extra)
}

fn family_cut_run((_, family): (&str, &[&str]), dir: &Path, name: &str, extra: &[&str]) -> Vec<String> {
    let mut all: Vec<&str> = family.to_vec();
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

/// Llama's blocks cut over 2 ranks: query and key/value heads, SwiGLU's inner slice, an untied
/// vocabulary-parallel head.
#[test]
fn a_llama_cut_over_two_ranks_follows_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let reference = family_reference_losses(dir.path(), LLAMA);
    let args = family_cut_run(LLAMA, dir.path(), "llama-t2", &["dist.tensor=2", "train.micro_batch=6"]);
    let out = launch("2", &args);
    assert_same_trajectory(&reference, &dir.path().join("llama-t2"), "llama, tensor 2", &out);
}

/// The GPT (the default family) cut over 2 ranks: biased q, k, v and MLP rows, the output
/// projections' biases added once after the sum, LayerNorms replicated, the tied
/// vocabulary-parallel head; its Rust kernels and unit casts off. Launched by `--layout`.
#[test]
fn a_gpt_cut_over_two_ranks_follows_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let reference = family_reference_losses(dir.path(), GPT);
    // Through `--layout T,P,D` (2 ranks of tensor parallelism, 1 stage, 1 copy).
    let args = family_cut_run(GPT, dir.path(), "gpt-t2", &["train.micro_batch=6"]);
    let out = run_ok(&mut stoke(&["launch", "--layout", "2,1,1", "--", "train", "--quiet"], &refs(&args)));
    assert!(String::from_utf8_lossy(&out.stdout).contains("the model cut over 2 ranks, 1 copies"));
    assert_same_trajectory(&reference, &dir.path().join("gpt-t2"), "gpt, tensor 2", &out);
}

/// Sequence parallelism: the residual stream between the branches as each rank's piece of the
/// sequence, the norms and biases on pieces, their gradients' shares summed over the cut. The
/// GPT, gpt-rms and llama (rotary positions on the gathered sequence, grouped-query heads) over 2
/// ranks, gpt-rms over 2 ranks x 2 copies, and gpt-rms over 2 ranks with a clip that bites (the
/// norm counts the summed shares once) follow one process.
#[test]
fn sequence_parallel_cuts_follow_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let sp = "dist.sequence_parallel=true";
    let reference = family_reference_losses(dir.path(), GPT);
    let args = family_cut_run(GPT, dir.path(), "gpt-sp2", &["dist.tensor=2", "train.micro_batch=6", sp]);
    let out = launch("2", &args);
    assert_same_trajectory(&reference, &dir.path().join("gpt-sp2"), "gpt, tensor 2, sequence parallel", &out);
    let reference = family_reference_losses(dir.path(), RMS);
    for (name, nproc, micro) in [("sp2", "2", "train.micro_batch=6"), ("sp2d2", "4", "train.micro_batch=3")] {
        let out = launch(nproc, &cut_run(dir.path(), name, &["dist.tensor=2", micro, sp]));
        assert_same_trajectory(&reference, &dir.path().join(name), &format!("gpt-rms {name}"), &out);
    }
    let reference = family_reference_losses(dir.path(), LLAMA);
    let args = family_cut_run(LLAMA, dir.path(), "llama-sp2", &["dist.tensor=2", "train.micro_batch=6", sp]);
    let out = launch("2", &args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("the sequence in 2 pieces between its branches"), "{stdout}");
    assert_same_trajectory(&reference, &dir.path().join("llama-sp2"), "llama, tensor 2, sequence parallel", &out);
    let clip = "train.grad_clip=0.05";
    let reference = family_reference_losses(dir.path(), ("clipped", &[RMS.1[0], clip]));
    let out = launch("2", &cut_run(dir.path(), "sp2-clip", &["dist.tensor=2", "train.micro_batch=6", sp, clip]));
    assert_same_trajectory(
        &reference,
        &dir.path().join("sp2-clip"),
        "gpt-rms, tensor 2, sequence parallel, clip",
        &out,
    );
    // In 2 interleaved pipeline stages (each of its 2 chunks one unit), each stage cut over 2
    // ranks: a stage's parts sum their shares before the optimizer, and the clip sees them.
    let stages = ["dist.tensor=2", "dist.pipeline=2", "dist.pipeline_schedule=\"interleaved\""];
    let batch = ["train.micro_batch=3", "train.global_batch=6"];
    let args = cut_run(dir.path(), "sp2p2-clip", &[&stages[..], &batch[..], &[sp, clip]].concat());
    let out = launch("4", &args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("the sequence in 2 pieces") && stdout.contains("2 stages (interleaved)"), "{stdout}");
    assert_same_trajectory(
        &reference,
        &dir.path().join("sp2p2-clip"),
        "gpt-rms, tensor 2 x pipeline 2 interleaved, sequence parallel, clip",
        &out,
    );
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
    let dir = tempfile::tempdir().unwrap();
    let args = cut_run(dir.path(), "mpi-t2", &["dist.tensor=2", "train.micro_batch=6", "dist.backend=\"mpi\""]);
    let Some(out) = crate::dist::mpirun_train("2", &args) else { return };
    let reference = family_reference_losses(dir.path(), RMS);
    assert_same_trajectory(&reference, &dir.path().join("mpi-t2"), "mpirun -np 2, tensor 2", &out);
}

/// Each refusal exits 2 before any step, naming the key and why.
#[test]
fn what_a_cut_model_does_not_run_with_yet_is_refused_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let cases: &[(&str, &[&str], &str, &str)] = &[
        ("2", &["model.family=\"gpt-rms\"", "dist.tensor=3"], "dist.tensor", "does not divide the job's 2 ranks"),
        ("2", &["dist.sequence_parallel=true"], "dist.sequence_parallel", "needs dist.tensor above 1"),
        (
            "2",
            &["dist.tensor=2", "dist.sequence_parallel=true", "model.seq_len=63"],
            "dist.sequence_parallel",
            "does not cut into dist.tensor = 2 pieces",
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
            &["model.family=\"gpt-rms\"", "dist.tensor=2", "dist.compress=\"int8\""],
            "dist.compress",
            "does not run with yet",
        ),
        (
            "4",
            &["model.family=\"gpt-rms\"", "dist.tensor=2", "dist.pipeline=2", "dist.zero=1"],
            "dist.zero",
            "does not run with yet",
        ),
        (
            "2",
            &["model.family=\"gpt-rms\"", "dist.tensor=2", "train.optimizer=\"lamb\""],
            "dist.tensor",
            "whole tensors",
        ),
        (
            "2",
            &["model.family=\"llama\"", "model.n_kv_head=1", "dist.tensor=2"],
            "dist.tensor",
            "does not divide model.n_kv_head = 1",
        ),
        (
            "2",
            &["model.family=\"llama\"", "model.n_kv_head=2", "dist.tensor=2", "train.lora.rank=4"],
            "dist.tensor",
            "frozen parameters",
        ),
    ];
    // The vla family declares no split (its own keys, not the text families' overrides).
    crate::dist::assert_refused(
        dir.path(),
        cases,
        "dist.tensor=2",
        ("dist.tensor", "declares no tensor-parallel split"),
    );
}

/// A cut model's checkpoint holds the whole tensors, written as one process's would be: a run cut
/// over 2 ranks stops at step 10 with a checkpoint, and copies of its folder resume on one
/// process, on 2 data-parallel ranks and cut over 2 ranks again, each with the losses of one
/// uninterrupted process (the global batch of 6 rows kept by accumulation).
#[test]
fn a_cut_models_checkpoint_resumes_on_any_layout_with_the_uninterrupted_losses() {
    let dir = tempfile::tempdir().unwrap();
    let batch: &[&str] = &["train.micro_batch=3", "train.global_batch=6", "ckpt.every=0"];
    let mut family = RMS.1.to_vec();
    family.extend_from_slice(batch);
    let one = overrides(dir.path(), "one", &[&family[..], &["train.steps=20"]].concat());
    run_ok(&mut stoke(&["train", "--quiet"], &refs(&one)));
    let reference = losses(&dir.path().join("one"));
    // Cut over 2 ranks for 10 of the schedule's 20 steps, checkpointed at the end.
    let first = [&family[..], &["dist.tensor=2", "train.steps=10", "train.lr_horizon=20", "ckpt.at_end=true"]].concat();
    launch("2", &overrides(dir.path(), "cut", &first));
    let checkpoint = dir.path().join("cut/checkpoints/step-10");
    let manifest = std::fs::read_to_string(checkpoint.join("manifest.json")).unwrap();
    assert!(manifest.contains("\"tensor\": 2") || manifest.contains("\"tensor\":2"), "{manifest}");
    // The checkpoint's tensors are whole: the vocabulary's 256 rows, q, k and v of every head.
    run_ok(&mut stoke(&["ckpt", "verify", checkpoint.to_str().unwrap()], &[]));
    let bytes = std::fs::read(checkpoint.join("model.safetensors")).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let shape = |name: &str| header[name]["shape"].clone();
    assert_eq!(shape("transformer.wte.weight"), serde_json::json!([256, 64]));
    assert_eq!(shape("transformer.h.0.attn.c_attn.weight"), serde_json::json!([192, 64]));
    assert_eq!(shape("transformer.h.1.mlp.c_proj.weight"), serde_json::json!([64, 256]));
    for (name, nproc, tensor) in [("on-one", "1", "1"), ("on-data-2", "2", "1"), ("cut-again", "2", "2")] {
        let folder = dir.path().join(name);
        copy_dir(&dir.path().join("cut"), &folder);
        let tensor = format!("dist.tensor={tensor}");
        let args = overrides(dir.path(), name, &[&family[..], &["train.steps=20", &tensor]].concat());
        let out = if nproc == "1" {
            run_ok(&mut stoke(&["train", "--quiet", "--resume"], &refs(&args)))
        } else {
            run_ok(&mut stoke(&["launch", "--nproc", nproc, "--", "train", "--quiet", "--resume"], &refs(&args)))
        };
        let got = losses(&folder);
        assert_eq!(got.len(), 20, "{name}: {got:?}\n{}", String::from_utf8_lossy(&out.stderr));
        for (&(step, want), &(_, loss)) in reference.iter().zip(&got) {
            let rel = (loss - want).abs() / want.abs();
            assert!(rel <= 1e-5, "{name}, step {step}: {loss} against one uninterrupted process's {want}");
        }
    }
}

/// ZeRO within the copies of a cut model (tensor 2 x data 2): at stage 1 each copy's rank holds
/// half of its part's optimizer state, at stage 2 half of its gradients too (the replicated
/// tensors' share of the norm then comes from the shards), at stage 3 half of its parameters
/// too. Each follows one process with a clip that bites; its checkpoint holds whole tensors,
/// the sharded state gathered over the copies and then the parts, and resumes on one process
/// with the uninterrupted losses.
#[test]
fn zero_beside_a_cut_model_follows_one_process_and_resumes_on_one() {
    let dir = tempfile::tempdir().unwrap();
    let batch: &[&str] = &["train.micro_batch=3", "train.global_batch=6", "ckpt.every=0", "train.grad_clip=0.05"];
    let mut family = RMS.1.to_vec();
    family.extend_from_slice(batch);
    let one = overrides(dir.path(), "one", &[&family[..], &["train.steps=20"]].concat());
    run_ok(&mut stoke(&["train", "--quiet"], &refs(&one)));
    let reference = losses(&dir.path().join("one"));
    let close = |name: &str, got: &[(u64, f64)], n: usize| {
        assert_eq!(got.len(), n, "{name}: {got:?}");
        for (&(step, want), &(_, loss)) in reference.iter().zip(got) {
            let rel = (loss - want).abs() / want.abs();
            assert!(rel <= 1e-5, "{name}, step {step}: {loss} against one process's {want}");
        }
    };
    let stages = [
        (1, "optimizer state sharded"),
        (2, "optimizer state and gradients sharded"),
        (3, "optimizer state, gradients and parameters sharded"),
    ];
    for (stage, sharded) in stages {
        let (cut, resumed) = (format!("cut-zero{stage}"), format!("on-one-zero{stage}"));
        let zero = format!("dist.zero={stage}");
        let first =
            [&family[..], &["dist.tensor=2", &zero, "train.steps=10", "train.lr_horizon=20", "ckpt.at_end=true"]]
                .concat();
        let out = launch("4", &overrides(dir.path(), &cut, &first));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("the model cut over 2 ranks, 2 copies"), "{stdout}");
        assert!(stdout.contains(&format!("ZeRO stage {stage}: {sharded}")), "{stdout}");
        close(&format!("tensor 2 x data 2, ZeRO-{stage}"), &losses(&dir.path().join(&cut)), 10);
        let checkpoint = dir.path().join(&cut).join("checkpoints/step-10");
        run_ok(&mut stoke(&["ckpt", "verify", checkpoint.to_str().unwrap()], &[]));
        // The moments' slices are checked by the resume: a moment out of place moves its losses.
        let folder = dir.path().join(&resumed);
        copy_dir(&dir.path().join(&cut), &folder);
        let args = overrides(dir.path(), &resumed, &[&family[..], &["train.steps=20"]].concat());
        run_ok(&mut stoke(&["train", "--quiet", "--resume"], &refs(&args)));
        close(&format!("ZeRO-{stage}, resumed on one process"), &losses(&folder), 20);
    }
    // The sequence in pieces beside ZeRO 2 and 3: the norms' gradient shares are summed over the
    // cut in the shards, where the copies' reduce-scatters left them.
    for stage in [2, 3] {
        let name = format!("cut-sp-zero{stage}");
        let zero = format!("dist.zero={stage}");
        let args = [&family[..], &["dist.tensor=2", "dist.sequence_parallel=true", &zero, "train.steps=20"]].concat();
        let out = launch("4", &overrides(dir.path(), &name, &args));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("2 copies of it (tensor over shm, data over shm), the sequence in 2 pieces"),
            "{stdout}"
        );
        close(&format!("tensor 2 x data 2, sequence parallel, ZeRO-{stage}"), &losses(&dir.path().join(&name)), 20);
    }
    // The clip did bite: without it the same run ends elsewhere.
    let plain: Vec<&str> = family.iter().copied().filter(|s| !s.starts_with("train.grad_clip")).collect();
    let plain = overrides(dir.path(), "unclipped", &[&plain[..], &["train.steps=20"]].concat());
    run_ok(&mut stoke(&["train", "--quiet"], &refs(&plain)));
    let unclipped = losses(&dir.path().join("unclipped"));
    assert_ne!(reference.last().unwrap().1, unclipped.last().unwrap().1, "a clip of 0.05 changed nothing");
}

fn copy_dir(from: &Path, to: &Path) {
    let status = std::process::Command::new("cp").arg("-r").arg(from).arg(to).status().unwrap();
    assert!(status.success(), "cp -r {} {}", from.display(), to.display());
}

/// `stoke launch --plan best`: the planner's first runnable layout for the command's model on
/// this machine, announced, and the run trains with exactly those settings.
#[test]
fn the_planned_layout_is_announced_and_run() {
    let dir = tempfile::tempdir().unwrap();
    let args = overrides(dir.path(), "planned", &["train.steps=3", "ckpt.every=0", "ckpt.at_end=false"]);
    let out = run_ok(&mut stoke(&["launch", "--nproc", "2", "--plan", "best", "--", "train", "--quiet"], &refs(&args)));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().find(|l| l.starts_with("[launch] plan best of")).unwrap_or_else(|| panic!("{stdout}"));
    // "tensor T x pipeline P x data D, ZeRO Z, recompute R, micro-batch B x M"
    let number_after = |word: &str| -> String {
        let rest = line.split(word).nth(1).unwrap_or_else(|| panic!("no {word:?} in {line}"));
        rest.trim_start().chars().take_while(|c| c.is_ascii_digit()).collect()
    };
    let (tensor, pipeline, data, zero, micro) = (
        number_after("tensor "),
        number_after(" x pipeline "),
        number_after(" x data "),
        number_after("ZeRO "),
        number_after("micro-batch "),
    );
    let ways = |n: &str| n.parse::<usize>().unwrap();
    assert_eq!(ways(&tensor) * ways(&pipeline) * ways(&data), 2, "{line}");
    let config = std::fs::read_to_string(dir.path().join("planned/config.toml")).unwrap();
    let table: toml::Table = config.parse().unwrap();
    assert_eq!(table["dist"]["tensor"].as_integer().unwrap().to_string(), tensor, "{line}\n{config}");
    assert_eq!(table["dist"]["pipeline"].as_integer().unwrap().to_string(), pipeline, "{line}\n{config}");
    assert_eq!(table["dist"]["zero"].as_integer().unwrap().to_string(), zero, "{line}\n{config}");
    assert_eq!(table["train"]["micro_batch"].as_integer().unwrap().to_string(), micro, "{line}\n{config}");
    assert_eq!(losses(&dir.path().join("planned")).len(), 3);
}
