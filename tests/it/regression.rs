//! Regression tests keyed by what broke: the probes a hostile tester ran against the binary, each
//! caused for real (real processes, files, signals, resource limits) and checked for the clear
//! error or the unchanged data. Bounded: every child runs under an address-space limit well below
//! 2 GB of its own allocations, and none trains for more than a few seconds.

use std::io::Write;
use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{run_ok, stoke, SMALL};

/// Address space a child may map: libtorch maps about 1-2 GB it never touches; this leaves less
/// than 2 GB for anything a bug would allocate.
const CHILD_ADDRESS_SPACE: u64 = 4 << 30;

/// Runs `cmd` under `CHILD_ADDRESS_SPACE`, with no standard input.
fn bounded(cmd: &mut Command) -> Output {
    limit_address_space(cmd, CHILD_ADDRESS_SPACE);
    cmd.stdin(Stdio::null()).output().expect("stoke runs")
}

fn limit_address_space(cmd: &mut Command, bytes: u64) {
    // SAFETY: the closure runs in the child between fork and exec and only calls setrlimit, which
    // is async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            let limit = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A usage error (exit 2) whose message holds every one of `says`, and no panic.
fn check_refused(out: &Output, says: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(2), "expected exit 2:\n{err}");
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "a panic:\n{err}");
    for needle in says {
        assert!(err.contains(needle), "{needle:?} missing:\n{err}");
    }
}

fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    base.iter().chain(extra).copied().collect()
}

#[test]
fn a_model_too_large_for_memory_is_refused_before_anything_is_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    for shape in [
        &["model.d_model=100000000", "model.n_head=1"][..],
        &["model.n_layer=100000"],
        &["model.vocab_size=4000000000"],
        // Fits the machine, not the 4 GB of address space the child is given.
        &["model.d_model=8192", "model.n_head=8"],
    ] {
        let overrides = with(&[&run_dir, "train.steps=1"], shape);
        let out = bounded(&mut stoke(&["train", "--quiet"], &overrides));
        check_refused(&out, &["too large", "GiB", "--force"]);
    }
    let out = bounded(&mut stoke(&["train", "--quiet"], &[&run_dir, "train.steps=1", "model.d_model=8192"]));
    assert!(stderr(&out).contains("RLIMIT_AS"), "the limit that decided is named:\n{}", stderr(&out));
}

#[test]
fn config_files_are_read_with_a_cap_and_long_values_are_not_echoed() {
    let dir = tempfile::tempdir().unwrap();
    let out = bounded(&mut stoke(&["config", "--config", "/dev/zero"], &[]));
    check_refused(&out, &["/dev/zero", "more than 1048576 bytes"]);
    let huge = dir.path().join("huge.toml");
    std::fs::write(&huge, format!("[run]\nname = \"{}\"\n", "x".repeat(50 << 20))).unwrap();
    let out = bounded(&mut stoke(&["config", "--config", huge.to_str().unwrap()], &[]));
    check_refused(&out, &["huge.toml", "more than"]);
    // Under the cap, a wrong value is quoted by its start and length only.
    let long = dir.path().join("long.toml");
    std::fs::write(&long, format!("[train]\nsteps = \"{}\"\n", "y".repeat(500_000))).unwrap();
    let out = bounded(&mut stoke(&["config", "--config", long.to_str().unwrap()], &[]));
    check_refused(&out, &["train.steps", "bytes in all"]);
    assert!(out.stderr.len() < 4096, "{} bytes of stderr", out.stderr.len());
    let name = format!("run.name=\"{}\"", "n".repeat(100_000));
    let out = bounded(&mut stoke(&["config"], &[&name]));
    check_refused(&out, &["run.name", "100000 bytes"]);
    assert!(out.stderr.len() < 4096, "{} bytes of stderr", out.stderr.len());
}

/// A prepared dataset of the built-in corpus in `dir/name`.
fn prepared(dir: &Path, name: &str) -> std::path::PathBuf {
    let corpus = dir.join("corpus.txt");
    if !corpus.exists() {
        run_ok(&mut stoke(&["corpus", "--out", corpus.to_str().unwrap(), "--bytes", "200000"], &[]));
    }
    let out = dir.join(name);
    run_ok(&mut stoke(&["prep", "text", corpus.to_str().unwrap(), "--out", out.to_str().unwrap()], &[]));
    out
}

#[test]
fn a_flipped_bit_in_a_shard_stops_training_naming_the_shard() {
    let dir = tempfile::tempdir().unwrap();
    let data = prepared(dir.path(), "data");
    let shard = data.join("shard-00000.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 1;
    std::fs::write(&shard, bytes).unwrap();
    let (run_dir, data_path) = (format!("run.dir={}", dir.path().display()), format!("data.path={:?}", data));
    let out = bounded(&mut stoke(&["train", "--quiet"], &with(SMALL, &[&run_dir, &data_path, "train.steps=3"])));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("shard-00000.bin") && err.contains("checksum mismatch"), "{err}");
    assert!(!err.contains("done:"), "{err}");
}

#[test]
fn a_damaged_newest_checkpoint_is_refused_and_named_and_fallback_names_each_one_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let overrides = with(SMALL, &[&run_dir, "run.name=r", "train.steps=4", "ckpt.every=2", "ckpt.keep=5"]);
    run_ok(&mut stoke(&["train", "--quiet"], &overrides));
    let checkpoints = dir.path().join("r/checkpoints");
    let resume = |fallback: bool| {
        let mut args = vec!["train", "--quiet", "--resume"];
        if fallback {
            args.push("--fallback");
        }
        bounded(&mut stoke(&args, &with(SMALL, &[&run_dir, "run.name=r", "train.steps=6"])))
    };
    let pristine = std::fs::read(checkpoints.join("step-4/model.safetensors")).unwrap();
    type Damage = fn(&Path);
    let damages: [(&str, Damage); 3] = [
        ("a short model file", |step| {
            let file = std::fs::OpenOptions::new().write(true).open(step.join("model.safetensors")).unwrap();
            file.set_len(100).unwrap();
        }),
        ("a truncated manifest", |step| {
            let file = std::fs::OpenOptions::new().write(true).open(step.join("manifest.json")).unwrap();
            file.set_len(10).unwrap();
        }),
        ("a deleted manifest", |step| std::fs::remove_file(step.join("manifest.json")).unwrap()),
    ];
    for (what, damage) in damages {
        let step_4 = checkpoints.join("step-4");
        let manifest = std::fs::read(step_4.join("manifest.json")).unwrap();
        damage(&step_4);
        let out = resume(false);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{what}: {err}");
        assert!(err.contains("step 4") && err.contains("damaged") && err.contains("--fallback"), "{what}: {err}");
        // Nothing was trained, so nothing overwrote the damaged checkpoint.
        assert!(!checkpoints.join("step-6").exists(), "{what}");
        std::fs::write(step_4.join("manifest.json"), manifest).unwrap();
        std::fs::write(step_4.join("model.safetensors"), &pristine).unwrap();
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(checkpoints.join("step-4/optim.safetensors"))
        .unwrap()
        .set_len(7)
        .unwrap();
    let out = resume(true);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("skipping the damaged checkpoint step 4"), "{}", stderr(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("resuming from step 2"));
    // Every checkpoint damaged: the error names each.
    for step in ["step-2", "step-4", "step-6"] {
        let path = checkpoints.join(step).join("model.safetensors");
        if path.exists() {
            std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(3).unwrap();
        }
    }
    let out = resume(true);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("none of the") && err.contains("step 2:") && err.contains("step 6:"), "{err}");
}

/// A Chrome trace with `events` as its `traceEvents`.
fn trace_file(dir: &Path, name: &str, events: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, format!("{{\"traceEvents\": [{events}]}}")).unwrap();
    path.display().to_string()
}

#[test]
fn trace_diff_refuses_a_trace_it_cannot_measure() {
    let dir = tempfile::tempdir().unwrap();
    let good = trace_file(
        dir.path(),
        "good.json",
        r#"{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100, "pid": 1, "tid": 1},
           {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 50, "pid": 1, "tid": 1}"#,
    );
    let empty = trace_file(dir.path(), "empty.json", "");
    let no_numbers = trace_file(
        dir.path(),
        "words.json",
        r#"{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": "early", "dur": "long", "pid": 1, "tid": 1}"#,
    );
    let negative = trace_file(
        dir.path(),
        "negative.json",
        r#"{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": -100, "pid": 1, "tid": 1}"#,
    );
    for bad in [&empty, &no_numbers, &negative] {
        let out = bounded(&mut stoke(&["trace", "diff", &good, bad], &[]));
        let file_name = Path::new(bad).file_name().unwrap().to_str().unwrap();
        check_refused(&out, &["NEW cannot be measured: no timed events", file_name]);
        let out = bounded(&mut stoke(&["trace", "diff", bad, &good], &[]));
        check_refused(&out, &["OLD cannot be measured"]);
    }
    let out = run_ok(&mut stoke(&["trace", "analyze", &negative], &[]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("dropped 1 events: 1 with a negative dur"));
}

#[test]
fn metrics_answer_beside_idle_and_slow_clients_of_a_real_run() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let overrides =
        with(SMALL, &[&run_dir, "run.name=m", "train.steps=100000", "prof.prometheus_port=0", "ckpt.every=0"]);
    let mut cmd = stoke(&["train", "--quiet"], &overrides);
    limit_address_space(&mut cmd, CHILD_ADDRESS_SPACE);
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let start = Instant::now();
    let addr: std::net::SocketAddr = loop {
        assert!(start.elapsed() < Duration::from_secs(120), "the run never served /metrics");
        std::thread::sleep(Duration::from_millis(50));
        if let Ok(text) = std::fs::read_to_string(dir.path().join("m/metrics.addr")) {
            break text.trim().parse().unwrap();
        }
    };
    let idle: Vec<TcpStream> = (0..20).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let slow: Vec<TcpStream> = (0..5)
        .map(|_| {
            let mut stream = TcpStream::connect(addr).unwrap();
            stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: loopback\r\n").unwrap();
            stream
        })
        .collect();
    let scraped = stoke_http::get(addr, "/metrics", Duration::from_secs(20));
    // SAFETY: kill only sends a signal to the child we spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    drop((idle, slow));
    let (code, body) = scraped.expect("a scrape answers while 25 other clients hold connections");
    assert_eq!(code, 200);
    assert!(body.contains("stoke_steps_total"), "{body}");
    assert_eq!(status.code(), Some(75));
}

#[test]
fn job_names_that_cannot_be_folder_names_are_refused_at_submit() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("sched");
    let state = state.to_str().unwrap();
    let long = "j".repeat(10_000);
    for (name, says) in [(long.as_str(), "10000 bytes"), ("two\nlines", "'\\n'"), ("../up", "'/'")] {
        let out = bounded(&mut stoke(&["sched", "submit", "--dir", state, "--name", name, "-"], &SMALL[..1]));
        check_refused(&out, &["job name", says]);
        assert!(out.stderr.len() < 2048, "{} bytes of stderr", out.stderr.len());
    }
    let out = bounded(&mut stoke(&["sched", "submit", "--dir", state, "--min", "-1", "-"], &[]));
    check_refused(&out, &["invalid value '-1' for '--min"]);
    assert!(!stderr(&out).contains("tip"), "{}", stderr(&out));
    let out = run_ok(&mut stoke(&["sched", "status", "--dir", state], &[]));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("jjjj"), "no job was stored");
}

#[test]
fn a_second_run_or_resume_of_a_live_run_is_refused_naming_its_pid() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let overrides = with(SMALL, &[&run_dir, "run.name=live", "train.steps=100000", "ckpt.every=5"]);
    let mut cmd = stoke(&["train", "--quiet"], &overrides);
    limit_address_space(&mut cmd, CHILD_ADDRESS_SPACE);
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let checkpoints = dir.path().join("live/checkpoints");
    let start = Instant::now();
    while !checkpoints.join("step-5").exists() {
        assert!(start.elapsed() < Duration::from_secs(120), "no checkpoint written");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = child.id().to_string();
    let second = bounded(&mut stoke(&["train", "--quiet", "--resume"], &with(SMALL, &[&run_dir, "run.name=live"])));
    let config_before = std::fs::read(dir.path().join("live/config.toml")).unwrap();
    // SAFETY: kill only sends a signal to the child we spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert_eq!(child.wait().unwrap().code(), Some(75));
    check_refused(&second, &["is in use by process", &pid]);
    assert_eq!(std::fs::read(dir.path().join("live/config.toml")).unwrap(), config_before);
    // The kernel released the lock with the process: a resume now proceeds.
    let out = bounded(&mut stoke(
        &["train", "--quiet", "--resume"],
        &with(SMALL, &[&run_dir, "run.name=live", "train.steps=12"]),
    ));
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn find_batch_clamps_an_impossible_budget_to_what_the_process_can_have() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let mut cmd =
        stoke(&["train", "--find-batch", "--memory-budget", "18446744073709551615"], &with(SMALL, &[&run_dir]));
    // The clamp follows ulimit -v: 80% of what is left of 3 GB, so no probe can grow past it.
    limit_address_space(&mut cmd, 3 << 30);
    let out = cmd.stdin(Stdio::null()).output().unwrap();
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("is more than 80% of what this process can have") && err.contains("RLIMIT_AS"), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("largest micro-batch that fits"));
}

#[test]
fn resume_without_a_name_ignores_files_beside_the_runs() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    run_ok(&mut stoke(&["train", "--quiet"], &with(SMALL, &[&run_dir, "run.name=only", "train.steps=2"])));
    std::fs::write(dir.path().join(".machine-peak.json"), "{}").unwrap();
    std::fs::write(dir.path().join("notes.txt"), "a file is not a run").unwrap();
    let out = bounded(&mut stoke(&["train", "--quiet", "--resume"], &with(SMALL, &[&run_dir, "train.steps=3"])));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(dir.path().join("only/checkpoints/step-3").exists());
}

/// ... but for what a writer killed after its last commit left: the trash of retention (named as
/// the writer names it, `.trash-<writer>-<what>-<pid>-<n>`) and a temporary.
#[test]
fn a_resume_already_at_its_target_step_says_so_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    run_ok(&mut stoke(&["train", "--quiet"], &with(SMALL, &[&run_dir, "run.name=t", "train.steps=6"])));
    let run = dir.path().join("t");
    let files = ["config.toml", "trace.json", "metrics.jsonl", "report.json"];
    let before: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(run.join(f)).unwrap()).collect();
    let checkpoints = run.join("checkpoints");
    let kept: Vec<std::ffi::OsString> =
        std::fs::read_dir(&checkpoints).unwrap().map(|e| e.unwrap().file_name()).collect();
    for leftover in [".trash-rank0-step-4-4242-0", ".tmp-rank0-step-7"] {
        std::fs::create_dir(checkpoints.join(leftover)).unwrap();
        std::fs::write(checkpoints.join(leftover).join("model.safetensors"), b"half written").unwrap();
    }
    for steps in ["train.steps=3", "train.steps=6"] {
        let out =
            bounded(&mut stoke(&["train", "--quiet", "--resume"], &with(SMALL, &[&run_dir, "run.name=t", steps])));
        assert!(out.status.success(), "{}", stderr(&out));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("nothing to do") && stdout.contains("step 6"), "{stdout}");
        assert!(!stdout.contains("NaN"), "{stdout}");
    }
    let after: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(run.join(f)).unwrap()).collect();
    assert!(before == after, "the run folder changed");
    let mut left: Vec<std::ffi::OsString> =
        std::fs::read_dir(&checkpoints).unwrap().map(|e| e.unwrap().file_name()).collect();
    left.sort();
    let mut kept = kept;
    kept.sort();
    assert_eq!(left, kept, "the leftovers are gone, the checkpoints stay");
}

#[test]
fn prep_out_over_a_dataset_refuses_without_force_and_leaves_no_orphans_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let docs = dir.path().join("docs.jsonl");
    let text: String = (0..40).map(|i| format!("{{\"text\": \"document {i} {}\"}}\n", "words ".repeat(200))).collect();
    std::fs::write(&docs, text).unwrap();
    let out_dir = dir.path().join("ds");
    let prep = |extra: &[&str]| {
        let mut args = vec!["prep", "text", docs.to_str().unwrap(), "--out", out_dir.to_str().unwrap()];
        args.extend_from_slice(extra);
        bounded(&mut stoke(&args, &[]))
    };
    let first = prep(&["--shard-tokens", "5000"]);
    assert!(first.status.success(), "{}", stderr(&first));
    let many = std::fs::read_dir(&out_dir).unwrap().count();
    assert!(many >= 9, "{many} files: several shards");
    let before = std::fs::read(out_dir.join("manifest.json")).unwrap();
    check_refused(&prep(&[]), &["already holds", "--force"]);
    assert_eq!(std::fs::read(out_dir.join("manifest.json")).unwrap(), before, "the dataset is untouched");
    let forced = prep(&["--force"]);
    assert!(forced.status.success(), "{}", stderr(&forced));
    let mut names: Vec<String> =
        std::fs::read_dir(&out_dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["manifest.json", "shard-00000.bin", "shard-00000.idx"], "no shard of the old dataset is left");
    let siblings = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(siblings, 2, "no temporary folder is left beside it");
    run_ok(&mut stoke(&["prep", "verify", out_dir.to_str().unwrap()], &[]));
}

#[test]
fn sighup_stops_a_run_with_a_checkpoint_like_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let overrides = with(SMALL, &[&run_dir, "run.name=hup", "train.steps=100000", "ckpt.every=0"]);
    let mut cmd = stoke(&["train", "--quiet"], &overrides);
    limit_address_space(&mut cmd, CHILD_ADDRESS_SPACE);
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let start = Instant::now();
    while std::fs::read_to_string(dir.path().join("hup/metrics.jsonl")).map_or(true, |t| t.lines().count() < 2) {
        assert!(start.elapsed() < Duration::from_secs(120), "no step logged");
        std::thread::sleep(Duration::from_millis(50));
    }
    // SAFETY: kill only sends a signal to the child we spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGHUP) };
    assert_eq!(child.wait().unwrap().code(), Some(75), "preempted, resumable");
    let checkpoints: Vec<_> = std::fs::read_dir(dir.path().join("hup/checkpoints")).unwrap().collect();
    assert_eq!(checkpoints.len(), 1, "one checkpoint at the step it stopped");
}

#[test]
fn bad_numbers_are_named_for_what_they_are() {
    check_refused(
        &bounded(&mut stoke(&["config"], &["train.steps=99999999999999999999"])),
        &["train.steps", "does not fit in a 64-bit integer"],
    );
    check_refused(&bounded(&mut stoke(&["config"], &["eval.holdout=1.5"])), &["eval.holdout", "(0, 1)"]);
}
