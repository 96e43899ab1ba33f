//! Checkpoints end to end: resume that cannot drift, damaged checkpoints named and skipped with
//! --fallback, `stoke ckpt verify`, and preemption by real signals.

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::{losses, run_ok, stoke, SMALL};

fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    SMALL.iter().copied().chain(extra.iter().copied()).collect()
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// (step, lr) of every line of a run's metrics.jsonl.
fn lrs(run_dir: &Path) -> Vec<(u64, f64)> {
    let text = std::fs::read_to_string(run_dir.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            (v["step"].as_u64().unwrap(), v["lr"].as_f64().unwrap())
        })
        .collect()
}

fn wait_for_lines(path: &Path, n: usize, child: &mut Child) {
    let start = Instant::now();
    while std::fs::read_to_string(path).map(|t| t.lines().count()).unwrap_or(0) < n {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before logging {n} steps");
        if start.elapsed() > Duration::from_secs(300) {
            // Not left running after the test: it would slow every test after it.
            let _ = child.kill();
            let _ = child.wait();
            panic!("the run never logged {n} steps");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn signal(child: &Child, signal: i32) {
    // SAFETY: kill only sends a signal to the child we spawned.
    let rc = unsafe { libc::kill(child.id() as i32, signal) };
    assert_eq!(rc, 0, "the child exists");
}

#[test]
fn resume_refuses_trajectory_changes_naming_the_keys() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    run_ok(&mut stoke(&["train", "--quiet"], &with(&[&run_dir, "run.name=a", "train.steps=4"])));
    let out = stoke(
        &["train", "--quiet", "--resume"],
        &with(&[&run_dir, "run.name=a", "train.steps=6", "train.seed=8", "train.lr=0.02", "prof.enabled=false"]),
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("train.seed (checkpoint: 1337, asked: 8)"), "{stderr}");
    assert!(stderr.contains("train.lr (checkpoint: 0.01, asked: 0.02)"), "{stderr}");
    assert!(
        !stderr.contains("train.steps") && !stderr.contains("prof.enabled"),
        "allowed keys are not named: {stderr}"
    );
    // Without the overrides the saved config is used: the model shape need not be repeated.
    let name = "run.name=a".to_string();
    run_ok(&mut stoke(&["train", "--quiet", "--resume"], &[run_dir.as_str(), name.as_str(), "train.steps=5"]));
    assert_eq!(losses(&dir.path().join("a")).len(), 5);
}

#[test]
fn extending_steps_keeps_the_schedule_unless_the_horizon_is_set() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let base = with(&[&run_dir, "train.warmup_steps=2", "ckpt.every=0"]);
    let named = |name: &str, extra: &[&str]| {
        let mut v: Vec<String> = base.iter().map(|s| s.to_string()).collect();
        v.push(format!("run.name={name}"));
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    run_ok(&mut stoke(&["train", "--quiet"], &refs(&named("ext", &["train.steps=10"]))));
    run_ok(&mut stoke(&["train", "--quiet", "--resume"], &refs(&named("ext", &["train.steps=16"]))));
    run_ok(&mut stoke(&["train", "--quiet"], &refs(&named("ref", &["train.steps=16", "train.lr_horizon=10"]))));
    assert_eq!(losses(&dir.path().join("ext")), losses(&dir.path().join("ref")));
    assert_eq!(lrs(&dir.path().join("ext")), lrs(&dir.path().join("ref")));
    let config = std::fs::read_to_string(dir.path().join("ext/config.toml")).unwrap();
    assert!(config.contains("lr_horizon = 10") && config.contains("steps = 16"), "{config}");

    // An explicit horizon on resume stretches the decay instead.
    run_ok(&mut stoke(&["train", "--quiet"], &refs(&named("stretch", &["train.steps=10"]))));
    let extra = ["train.steps=16", "train.lr_horizon=16"];
    run_ok(&mut stoke(&["train", "--quiet", "--resume"], &refs(&named("stretch", &extra))));
    let (stretched, kept) = (lrs(&dir.path().join("stretch")), lrs(&dir.path().join("ref")));
    assert_eq!(stretched[..10], kept[..10]);
    assert!(stretched[12].1 > kept[12].1, "{:?} vs {:?}", stretched[12], kept[12]);
}

#[test]
fn flipped_byte_is_named_by_verify_and_resume_and_fallback_skips_it() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let ckpt = ["ckpt.every=2", "ckpt.keep=3"];
    let args = |name: &str, steps: &str| {
        let mut v = with(&[&run_dir, steps]);
        v.extend(ckpt);
        let mut v: Vec<String> = v.iter().map(|s| s.to_string()).collect();
        v.push(format!("run.name={name}"));
        v
    };
    run_ok(&mut stoke(&["train", "--quiet"], &refs(&args("a", "train.steps=6"))));
    let run = dir.path().join("a");
    let verify_ok = stoke(&["ckpt", "verify"], &[]).arg(&run).output().unwrap();
    assert!(verify_ok.status.success(), "{}", String::from_utf8_lossy(&verify_ok.stderr));
    assert!(String::from_utf8_lossy(&verify_ok.stdout).contains("3 checkpoints"));

    let shard = run.join("checkpoints/step-6/optim.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = bytes.len() - 3;
    bytes[at] ^= 0x01;
    std::fs::write(&shard, &bytes).unwrap();

    let verify = stoke(&["ckpt", "verify"], &[]).arg(&run).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&verify.stdout), String::from_utf8_lossy(&verify.stderr));
    assert_eq!(verify.status.code(), Some(1), "{text}");
    assert!(text.contains("step-6/optim.safetensors") && text.contains("CRC-32"), "{text}");
    assert!(text.contains("ok       step-4"), "{text}");

    let out = stoke(&["train", "--quiet", "--resume"], &refs(&args("a", "train.steps=8"))).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("step-6/optim.safetensors") && stderr.contains("--fallback"), "{stderr}");

    let out = run_ok(&mut stoke(&["train", "--quiet", "--resume", "--fallback"], &refs(&args("a", "train.steps=8"))));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("skipping the damaged checkpoint step 6"), "{stderr}");
    let mut reference = args("ref", "train.steps=8");
    reference.push("train.lr_horizon=6".into());
    run_ok(&mut stoke(&["train", "--quiet"], &refs(&reference)));
    let (resumed, expected) = (losses(&run), losses(&dir.path().join("ref")));
    assert_eq!(resumed, expected, "resumed from step 4: steps 5-8 again, each once");
    let verify = stoke(&["ckpt", "verify"], &[]).arg(&run).output().unwrap();
    assert!(verify.status.success(), "step 6 was rewritten: {}", String::from_utf8_lossy(&verify.stderr));
}

#[test]
fn sigterm_and_sigusr1_preempt_with_a_checkpoint_and_exit_75() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let steps = "train.steps=40";
    run_ok(&mut stoke(&["train", "--quiet"], &with(&[&run_dir, "run.name=straight", steps, "ckpt.every=0"])));
    let expected = losses(&dir.path().join("straight"));
    for (name, sig) in [("term", libc::SIGTERM), ("usr1", libc::SIGUSR1)] {
        let run_name = format!("run.name={name}");
        let mut child = stoke(&["train", "--quiet"], &with(&[&run_dir, &run_name, steps, "ckpt.every=0"]))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let run = dir.path().join(name);
        wait_for_lines(&run.join("metrics.jsonl"), 3, &mut child);
        signal(&child, sig);
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(75), "{name}: {stderr}");
        assert!(stderr.contains("preempted, resumable"), "{stderr}");
        let cut = losses(&run);
        assert!(cut.len() < 40, "the signal landed after the run finished; make the run longer");
        let last = cut.last().unwrap().0;
        assert!(run.join(format!("checkpoints/step-{last}/manifest.json")).is_file(), "checkpoint of the last step");
        run_ok(&mut stoke(&["train", "--quiet", "--resume"], &[run_dir.as_str(), run_name.as_str()]));
        assert_eq!(losses(&run), expected, "{name}: resumed losses equal the uninterrupted run's");
    }
}

#[test]
fn a_second_signal_exits_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    // A larger model (steps of about a second here), so the step after the first signal is still
    // running when the second comes; in the precision this CPU is fast in (bf16 on one without
    // bf16 instructions takes over a minute a step).
    let mut child = stoke(
        &["train", "--quiet"],
        &with(&[
            &run_dir,
            "run.name=a",
            "train.precision=\"auto\"",
            "train.steps=100000",
            "model.n_layer=12",
            "model.d_model=512",
            "model.n_head=8",
            "ckpt.every=0",
        ]),
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_for_lines(&dir.path().join("a/metrics.jsonl"), 2, &mut child);
    signal(&child, libc::SIGTERM);
    // Two signals pending together are delivered lowest number first (SIGINT before SIGTERM), so
    // the second is sent only once the first has had time to be handled.
    std::thread::sleep(std::time::Duration::from_millis(100));
    signal(&child, libc::SIGINT);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(128 + libc::SIGINT), "{status:?}");
}

/// Every `.safetensors` file under `dir` (checkpoint folders only), by path relative to `dir`.
fn safetensors_files(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut files = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "safetensors") {
                files.insert(path.strip_prefix(dir).unwrap().display().to_string(), std::fs::read(&path).unwrap());
            }
        }
    }
    files
}

#[test]
fn a_copy_beside_the_next_step_holds_its_own_steps_state() {
    // Checkpoints every other step, kept: their state is saved by the next step's fused AdamW
    // update as it overwrites it, or (the tensor-op optimizer) copied beside the next step's
    // forward and backward (ckpt.overlap); or copied inside their own step. Byte for byte the
    // same files for each optimizer path, so the save read each step's state before the next
    // optimizer step wrote it.
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    for fused in [true, false] {
        let mut trees = Vec::new();
        for overlap in [true, false] {
            let name = format!("fused-{fused}-overlap-{overlap}");
            let args = [
                run_dir.as_str(),
                &format!("run.name={name}"),
                "model.d_model=128",
                "train.steps=7",
                "ckpt.every=2",
                "ckpt.keep=0",
                &format!("ckpt.overlap={overlap}"),
                &format!("train.fused_optimizer={fused}"),
            ];
            run_ok(&mut stoke(&["train", "--quiet"], &with(&args)));
            let files = safetensors_files(&dir.path().join(&name));
            let steps: std::collections::BTreeSet<&str> =
                files.keys().filter_map(|k| k.split('/').find(|p| p.starts_with("step-"))).collect();
            assert_eq!(steps.len(), 4, "checkpoints of steps 2, 4, 6 and the last: {:?}", files.keys());
            trees.push(files);
        }
        assert_eq!(trees[0].keys().collect::<Vec<_>>(), trees[1].keys().collect::<Vec<_>>());
        for (path, bytes) in &trees[0] {
            assert!(
                bytes == &trees[1][path],
                "{path} differs between a checkpoint saved beside the next step and one copied inside its own (fused optimizer: {fused})"
            );
        }
    }
}
