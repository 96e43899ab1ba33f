//! `stoke prep` end to end: prepare, verify, train on the result; damaged data and bad command lines
//! are errors that name the file, with the documented exit codes.

use crate::{losses, run_ok, stoke, SMALL};

#[test]
fn prepare_verify_and_train_on_a_prepared_directory() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("corpus.txt");
    std::fs::write(&text, stoke_data::builtin_corpus(7, 100_000)).unwrap();
    let jsonl = dir.path().join("more.jsonl");
    std::fs::write(&jsonl, "{\"text\": \"alice sees the cat .\"}\n{\"text\": \"12+30=42.\"}\n").unwrap();
    let prepared = dir.path().join("prepared");
    let out = run_ok(&mut stoke(
        &["prep", "text", text.to_str().unwrap(), jsonl.to_str().unwrap(), "--out", prepared.to_str().unwrap()],
        &[],
    ));
    assert!(String::from_utf8_lossy(&out.stdout).contains("3 documents"));
    run_ok(&mut stoke(&["prep", "verify", prepared.to_str().unwrap()], &[]));

    let run_dir = format!("run.dir={}", dir.path().display());
    let overrides: Vec<&str> = SMALL.iter().copied().chain([run_dir.as_str(), "run.name=p", "train.steps=4"]).collect();
    run_ok(&mut stoke(&["train", "--quiet", "--data", prepared.to_str().unwrap()], &overrides));
    assert_eq!(losses(&dir.path().join("p")).len(), 4);

    // The built-in corpus blended with the prepared directory, 1:3.
    let blend = format!("data.blend=[{:?}]", prepared.to_str().unwrap());
    let blended: Vec<&str> = SMALL
        .iter()
        .copied()
        .chain([run_dir.as_str(), "run.name=b", "train.steps=3", &blend, "data.weights=[1, 3]"])
        .collect();
    run_ok(&mut stoke(&["train", "--quiet"], &blended));
    assert_eq!(losses(&dir.path().join("b")).len(), 3);
    let bad_weights: Vec<&str> = blended.iter().copied().chain(["run.name=c", "data.weights=[1]"]).collect();
    let out = stoke(&["train", "--quiet"], &bad_weights).output().unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("data.weights"));

    // A flipped byte in a shard: verify fails with exit 1 and names the shard.
    let shard = prepared.join("shard-00000.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[10] ^= 1;
    std::fs::write(&shard, bytes).unwrap();
    let out = stoke(&["prep", "verify", prepared.to_str().unwrap()], &[]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("shard-00000.bin") && stderr.contains("checksum"), "{stderr}");

    // A truncated shard: training refuses it with the file and what is missing.
    std::fs::write(&shard, b"x").unwrap();
    let overrides: Vec<&str> =
        overrides.into_iter().map(|o| if o == "run.name=p" { "run.name=q" } else { o }).collect();
    let out = stoke(&["train", "--quiet", "--data", prepared.to_str().unwrap()], &overrides).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("shard-00000.bin") && stderr.contains("truncated"), "{stderr}");
}

#[test]
fn bad_prep_command_lines_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("out");
    for args in [
        vec!["prep", "text", "/no/such/input.txt", "--out", out_dir.to_str().unwrap()],
        vec!["prep", "text", "--out", out_dir.to_str().unwrap()],
        vec!["prep", "records", dir.path().to_str().unwrap(), "--out", out_dir.to_str().unwrap(), "--threads", "0"],
    ] {
        let out = stoke(&args, &[]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// The built-in robot episodes (real JPEG files and JSON lines) prepare both ways and verify; a
/// flipped bit in a frame shard is found by `prep verify`, naming the shard.
#[test]
fn built_in_episodes_prepare_verify_and_report_a_damaged_frame_shard() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("raw");
    let out = run_ok(&mut stoke(
        &["corpus", "--episodes", raw.to_str().unwrap(), "--n-episodes", "4", "--steps", "5", "--resolution", "32"],
        &[],
    ));
    // Episodes end at the move that reaches their block, so the count of steps is read back.
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    let steps = said.split("4 episodes, ").nth(1).and_then(|rest| rest.split(" steps").next()).unwrap_or_default();
    let n_steps: usize = steps.parse().unwrap_or_else(|_| panic!("no step count in {said:?}"));
    assert!((4..=20).contains(&n_steps), "{said}");
    let counted = format!("4 episodes, {n_steps} steps");
    for (name, extra) in [("decoded", &[][..]), ("encoded", &["--keep-encoded"][..])] {
        let prepared = dir.path().join(name);
        let mut args = vec!["prep", "episodes", raw.to_str().unwrap(), "--out", prepared.to_str().unwrap()];
        args.extend_from_slice(extra);
        let out = run_ok(&mut stoke(&args, &[]));
        assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("{counted}, state 2, action 2")));
        let out = run_ok(&mut stoke(&["prep", "verify", prepared.to_str().unwrap()], &[]));
        assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("ok, {counted}")));
    }
    let shard = dir.path().join("decoded/frames/records-00000.rec");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&shard, bytes).unwrap();
    let out = stoke(&["prep", "verify", dir.path().join("decoded").to_str().unwrap()], &[]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("records-00000.rec") && err.contains("checksum"), "{err}");
}
