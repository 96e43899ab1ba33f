//! Training end to end: the loss falls, seeds reproduce, Ctrl-C and --resume continue exactly,
//! and bad states fail loudly.

use std::time::{Duration, Instant};

use crate::{losses, run_ok, stoke, FAMILIES, SMALL};

fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    SMALL.iter().copied().chain(extra.iter().copied()).collect()
}

#[test]
fn loss_falls_below_sixty_percent_of_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let out = run_ok(&mut stoke(&["train", "--quiet"], &with(&[&run_dir, "run.name=a", "train.steps=60"])));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("step report") && stdout.contains("tokens/s"), "summary missing:\n{stdout}");
    let losses = losses(&dir.path().join("a"));
    assert_eq!(losses.len(), 60);
    let (first, last) = (losses[0].1, losses[59].1);
    assert!(last < 0.6 * first, "loss went from {first} to {last}");
    let config = std::fs::read_to_string(dir.path().join("a/config.toml")).unwrap();
    assert!(config.contains("steps = 60"), "the resolved config is saved:\n{config}");
}

#[test]
fn same_seed_same_losses_other_seed_other_losses() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    for (name, seed) in [("a", "train.seed=7"), ("b", "train.seed=7"), ("c", "train.seed=8")] {
        let name = format!("run.name={name}");
        run_ok(&mut stoke(&["train", "--quiet"], &with(&[&run_dir, &name, seed, "train.steps=8"])));
    }
    let (a, b, c) = (losses(&dir.path().join("a")), losses(&dir.path().join("b")), losses(&dir.path().join("c")));
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn host_memory_and_optimizer_kernels_leave_the_losses_alone() {
    // The allocator policy changes where freed memory goes, never a value: losses are identical.
    // The unfused optimizer (tensor ops) rounds differently from the fused pass (FMA, order of
    // the norm's sum), and bf16 matmuls amplify that over steps, so its losses only agree to 1%
    // (the first, before any update, exactly).
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    for (name, extra) in [
        ("retain", "train.host_memory=retain"),
        ("system", "train.host_memory=system"),
        ("unfused", "train.fused_optimizer=false"),
    ] {
        let name = format!("run.name={name}");
        run_ok(&mut stoke(&["train", "--quiet"], &with(&[&run_dir, &name, extra, "train.steps=8"])));
    }
    let (retain, system, unfused) =
        (losses(&dir.path().join("retain")), losses(&dir.path().join("system")), losses(&dir.path().join("unfused")));
    assert_eq!(retain, system);
    assert_eq!(retain.len(), unfused.len());
    assert_eq!(retain[0], unfused[0]);
    for ((step, a), (_, b)) in retain.iter().zip(&unfused) {
        assert!((a - b).abs() < 1e-2 * a.abs(), "step {step}: fused {a} vs unfused {b}");
    }
}

#[test]
fn interrupt_then_resume_gives_the_uninterrupted_losses() {
    for &(tag, family) in FAMILIES {
        interrupt_then_resume(tag, family);
    }
}

/// `interrupt_then_resume_gives_the_uninterrupted_losses` for the model family `family`.
fn interrupt_then_resume(tag: &str, family: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let steps = "train.steps=40";
    run_ok(&mut stoke(
        &["train", "--quiet"],
        &with(&[&[run_dir.as_str(), "run.name=straight", steps, "ckpt.every=0"], family].concat()),
    ));
    let expected = losses(&dir.path().join("straight"));

    // Ctrl-C once a few steps are logged: the run stops after the current step and checkpoints.
    let mut child = stoke(
        &["train", "--quiet"],
        &with(&[&[run_dir.as_str(), "run.name=cut", steps, "ckpt.every=0"], family].concat()),
    )
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null())
    .spawn()
    .unwrap();
    let metrics = dir.path().join("cut/metrics.jsonl");
    let start = Instant::now();
    while std::fs::read_to_string(&metrics).map(|t| t.lines().count()).unwrap_or(0) < 5 {
        assert!(start.elapsed() < Duration::from_secs(300), "{tag}: the run never logged 5 steps");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill only sends a signal to the child we spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert_eq!(child.wait().unwrap().code(), Some(75), "{tag}: preempted, resumable");
    let cut = losses(&dir.path().join("cut"));
    assert!(cut.len() < 40, "{tag}: the interrupt landed after the run finished; make the run longer");
    assert_eq!(cut[..], expected[..cut.len()], "{tag}: what was written before the interrupt is kept");

    let resume = with(&[&[run_dir.as_str(), "run.name=cut", steps, "ckpt.every=0"], family].concat());
    run_ok(&mut stoke(&["train", "--quiet", "--resume"], &resume));
    assert_eq!(losses(&dir.path().join("cut")), expected, "{tag}: resumed losses equal the uninterrupted run's");
}

#[test]
fn fresh_run_refuses_to_overwrite_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    run_ok(&mut stoke(&["train", "--quiet"], &with(&[&run_dir, "run.name=a", "train.steps=2"])));
    let out = stoke(&["train", "--quiet"], &with(&[&run_dir, "run.name=a", "train.steps=2"])).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("pass --resume"));
}

#[test]
fn corrupt_checkpoint_is_named_and_nothing_is_overwritten() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    run_ok(&mut stoke(&["train", "--quiet"], &with(&[&run_dir, "run.name=a", "train.steps=3"])));
    let shard = dir.path().join("a/checkpoints/step-3/model.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&shard, &bytes).unwrap();
    let out =
        stoke(&["train", "--quiet", "--resume"], &with(&[&run_dir, "run.name=a", "train.steps=6"])).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("step-3/model.safetensors") && stderr.contains("CRC-32"), "{stderr}");
    assert_eq!(std::fs::read(&shard).unwrap(), bytes, "the failed resume leaves the checkpoint as it was");
}

#[test]
fn diverging_loss_stops_with_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let out = stoke(
        &["train", "--quiet"],
        &with(&[&run_dir, "run.name=a", "train.steps=20", "train.lr=1e30", "train.grad_clip=0"]),
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("at step") && stderr.contains("training diverged"), "{stderr}");
}
