//! The second checkpoint tier against a real S3-compatible server on loopback (moto's server
//! mode, started here and stopped after): checkpoints are mirrored in the background with the
//! mirror's own retention, partial uploads never count, and a run whose local checkpoints are
//! gone resumes from the mirror with the losses of a resume from the local tier.

use std::path::Path;

use crate::s3::{http, start_s3, stoke_s3};
use crate::{free_port, losses, run_ok, stoke, SMALL};

fn overrides(dir: &Path, name: &str, extra: &[String]) -> Vec<String> {
    let mut v: Vec<String> = SMALL.iter().map(|s| s.to_string()).collect();
    v.extend(["train.precision=\"fp32\"".to_string(), "prof.enabled=false".to_string()]);
    v.extend(extra.iter().cloned());
    v.push(format!("run.dir={}", dir.display()));
    v.push(format!("run.name={name}"));
    v
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn checkpoints_mirror_to_s3_and_a_run_without_local_checkpoints_resumes_from_there() {
    let server = start_s3("ckpts");
    let dir = tempfile::tempdir().unwrap();
    let url = "s3://ckpts/runs/mirrored";
    let mirror = [format!("ckpt.mirror=\"{url}\""), "ckpt.mirror_keep=2".into(), "ckpt.mirror_keep_every=10".into()];
    let base = ["train.steps=20".to_string(), "ckpt.every=5".into(), "ckpt.keep=1".into(), "ckpt.keep_every=10".into()];

    // A run mirrored to S3, and the same run without a mirror.
    let args = overrides(dir.path(), "mirrored", &[&base[..], &mirror[..]].concat());
    let out = run_ok(&mut stoke_s3(server.port, &["train", "--quiet"], &refs(&args)));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("mirror: 4 checkpoints"), "{stdout}");
    let local_only = overrides(dir.path(), "local", &base);
    run_ok(&mut stoke(&["train", "--quiet"], &refs(&local_only)));

    // The mirror holds the newest two and its milestones (its own retention); the local tier the
    // newest one and its milestones.
    let endpoint = format!("http://127.0.0.1:{}", server.port);
    let options = [
        ("aws_endpoint", endpoint.as_str()),
        ("aws_allow_http", "true"),
        ("aws_access_key_id", "test"),
        ("aws_secret_access_key", "test"),
        ("aws_region", "us-east-1"),
    ];
    let store = stoke_ckpt::MirrorStore::open_with(url, &options).unwrap();
    assert_eq!(store.list().unwrap(), vec![10, 15, 20]);
    let run = dir.path().join("mirrored");
    let local = stoke_ckpt::CheckpointStore::new(run.join("checkpoints"));
    assert_eq!(local.list().unwrap(), vec![10, 20]);

    // An object under a step folder without a manifest (an upload killed midway) is no checkpoint.
    assert_eq!(http(server.port, "PUT", "/ckpts/runs/mirrored/step-25/model.safetensors"), 200);
    assert_eq!(store.list().unwrap(), vec![10, 15, 20]);

    // The local disk is lost: the resume fetches step 20 from the mirror.
    std::fs::remove_dir_all(run.join("checkpoints")).unwrap();
    let extend = ["train.steps=30".to_string(), format!("ckpt.mirror=\"{url}\"")];
    let resume = overrides(dir.path(), "mirrored", &extend);
    let out = run_ok(&mut stoke_s3(server.port, &["train", "--quiet", "--resume"], &refs(&resume)));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains(&format!("fetched step 20 from the mirror {url}")), "{stdout}");
    assert!(stdout.contains(&format!("resuming from step 20 of the mirror {url}")), "{stdout}");
    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("checkpoint-stats.json")).unwrap()).unwrap();
    assert_eq!(stats["resume"]["tier"], format!("mirror {url}"));

    // The same extension of the run without a mirror, from its local tier: the same losses.
    let resume_local = overrides(dir.path(), "local", &["train.steps=30".to_string()]);
    let out = run_ok(&mut stoke(&["train", "--quiet", "--resume"], &refs(&resume_local)));
    assert!(String::from_utf8_lossy(&out.stdout).contains("resuming from step 20 of the local tier"));
    let (a, b) = (losses(&run), losses(&dir.path().join("local")));
    assert_eq!(a.len(), 30);
    assert_eq!(a, b, "resumed from the mirror vs from the local tier");
}

#[test]
fn a_mirror_that_does_not_answer_is_an_error_naming_it() {
    // A closed port: nothing listens there.
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let args = overrides(
        dir.path(),
        "nowhere",
        &["train.steps=2".to_string(), "ckpt.mirror=\"s3://missing/prefix\"".to_string()],
    );
    let out =
        stoke_s3(port, &["train", "--quiet", "--resume"], &refs(&args)).env("AWS_MAX_RETRIES", "1").output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("checkpoint mirror s3://missing/prefix: cannot list"), "{stderr}");
}
