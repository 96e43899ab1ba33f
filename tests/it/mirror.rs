//! The second checkpoint tier against a real S3-compatible server on loopback (moto's server
//! mode, started here and stopped after): checkpoints are mirrored in the background with the
//! mirror's own retention, partial uploads never count, and a run whose local checkpoints are
//! gone resumes from the mirror with the losses of a resume from the local tier.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{free_port, losses, run_ok, stoke, SMALL};

/// moto's S3 server on a free loopback port, with one bucket; killed on drop.
struct S3Server {
    child: Child,
    port: u16,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The project's Python (`cargo xtask setup` makes it), with moto's server installed into it
/// when it is missing.
fn python() -> PathBuf {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join(".stoke/venv/bin/python");
    assert!(python.exists(), "{} is missing: run `cargo xtask setup`", python.display());
    let has_moto = |python: &Path| {
        Command::new(python)
            .args(["-c", "import moto.server, flask"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !has_moto(&python) {
        let out = Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "moto[server]==5.2.5"])
            .output()
            .expect("pip runs");
        assert!(out.status.success(), "cannot install moto's S3 server: {}", String::from_utf8_lossy(&out.stderr));
    }
    python
}

/// An HTTP request without a body to the server; the status code.
fn http(port: u16, method: &str, path: &str) -> u16 {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).expect("the S3 server accepts");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

fn start_s3(bucket: &str) -> S3Server {
    let python = python();
    let port = free_port();
    let child = Command::new(python)
        .args(["-m", "moto.server", "-H", "127.0.0.1", "-p", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("moto's server starts");
    let server = S3Server { child, port };
    let deadline = Instant::now() + Duration::from_secs(120);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the S3 server did not listen on port {port}");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(http(port, "PUT", &format!("/{bucket}")), 200, "cannot create bucket {bucket}");
    server
}

/// `stoke` with an S3 endpoint on loopback `port` and test credentials in the `AWS_*` variables.
fn stoke_s3(port: u16, args: &[&str], overrides: &[&str]) -> Command {
    let mut cmd = stoke(args, overrides);
    cmd.env("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}"))
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_REGION", "us-east-1")
        .stdin(Stdio::null());
    cmd
}

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
