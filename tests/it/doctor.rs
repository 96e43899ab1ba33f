//! The profiler end to end: `stoke doctor` finds a data-starved run's bottleneck and raises no data
//! alarm on a balanced one; phases sum to the wall time; `/metrics` scraped over loopback is valid
//! exposition format; trace.json is a valid Chrome trace; report.json is what the planner reads.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::{run_ok, stoke, SMALL};

fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
    base.iter().copied().chain(extra.iter().copied()).collect()
}

fn read_report(run_dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(run_dir.join("report.json")).expect("report.json exists");
    serde_json::from_str(&text).expect("report.json is JSON")
}

fn finding_ids(report: &serde_json::Value) -> Vec<String> {
    report["findings"].as_array().unwrap().iter().map(|f| f["id"].as_str().unwrap().to_string()).collect()
}

/// A raw token file (nanoGPT layout: little-endian u16) too large to be read in the time of a few
/// steps, written, synced and dropped from the page cache: each row the loader cuts from it is a
/// read from the disk, as for a dataset larger than memory.
fn cold_token_file(path: &Path, n_tokens: usize) {
    let mut file = std::fs::File::create(path).unwrap();
    let mut chunk = Vec::with_capacity(1 << 21);
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut written = 0;
    while written < n_tokens {
        chunk.clear();
        for _ in 0..(1 << 20).min(n_tokens - written) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.extend_from_slice(&((state % 256) as u16).to_le_bytes());
        }
        written += chunk.len() / 2;
        file.write_all(&chunk).unwrap();
    }
    file.sync_all().unwrap();
    use std::os::fd::AsRawFd;
    // SAFETY: posix_fadvise only advises the kernel about the open file descriptor we own.
    let status = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(status, 0, "posix_fadvise");
}

/// A model whose steps are short, so that reading the data is the bottleneck when the data is cold;
/// 8192 tokens per micro-batch, so that the batch is not the finding, in 1024 rows of 8, each row a
/// read from the disk. The umbrella finding (compute outside the multiplies) outranks the data wait
/// once the wait is under half the step, which 512 rows of 16 reached on a loaded 2-core machine.
const STARVED_MODEL: &[&str] = &[
    "model.n_layer=1",
    "model.d_model=16",
    "model.n_head=1",
    "model.seq_len=8",
    "train.micro_batch=1024",
    "train.threads=1",
    // Short steps on any CPU: bf16 on one without bf16 instructions is the first finding instead.
    "train.precision=\"auto\"",
    "prof.prometheus=false",
    "ckpt.every=0",
    "ckpt.at_end=false",
];

#[test]
fn doctor_names_data_wait_first_on_a_data_starved_run() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("tokens.bin");
    cold_token_file(&data, 96 << 20);
    let run_dir = format!("run.dir={}", dir.path().display());
    let data_path = format!("data.path={}", data.display());
    // Synchronous loading (no loader thread) over data that is not in memory: every row is a read
    // the step waits for, however busy the other tests keep the cores.
    let overrides = with(STARVED_MODEL, &[&run_dir, "run.name=starved", &data_path, "data.workers=0"]);
    let out = run_ok(&mut stoke(&["doctor", "--steps", "20"], &overrides));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report = read_report(&dir.path().join("starved"));
    let ids = finding_ids(&report);
    let (step, wait) = (report["step_ms"].as_f64().unwrap(), report["phases"]["data_wait"].as_f64().unwrap());
    assert_eq!(ids.first().map(String::as_str), Some("data_wait"), "findings {ids:?}\n{stdout}");
    let bound = report["findings"][0]["bound"].as_f64().unwrap();
    assert!(
        (bound - step / (step - wait)).abs() < 1e-9,
        "the bound is Amdahl's: {bound} vs {step} / ({step} - {wait})"
    );
    assert!(bound > 1.05 && wait > 0.05 * step, "{stdout}");
    assert!(stdout.contains("[data_wait] bound"), "{stdout}");
}

#[test]
fn doctor_raises_no_data_alarm_on_a_balanced_run() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    // In-memory data, the default loader, and steps long enough that handing over a ready batch
    // is a small part of them.
    let overrides =
        with(SMALL, &[&run_dir, "run.name=balanced", "model.d_model=128", "model.seq_len=64", "train.micro_batch=16"]);
    let overrides = with(&overrides, &["prof.prometheus=false", "ckpt.every=0", "ckpt.at_end=false"]);
    let out = run_ok(&mut stoke(&["doctor", "--steps", "12"], &overrides));
    let report = read_report(&dir.path().join("balanced"));
    let ids = finding_ids(&report);
    for alarm in ["data_wait", "comm_exposed", "ckpt_stall", "memory_pressure", "fp32_on_bf16_hardware"] {
        assert!(!ids.iter().any(|id| id == alarm), "false alarm {alarm}: {}", String::from_utf8_lossy(&out.stdout));
    }
}

#[test]
fn phases_sum_to_the_wall_time_and_outputs_are_valid() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let overrides = with(SMALL, &[&run_dir, "run.name=p", "train.steps=6", "prof.prometheus=false", "ckpt.every=3"]);
    let out = run_ok(&mut stoke(&["train", "--quiet"], &overrides));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("step report") && stdout.contains("effective compute ratio"), "{stdout}");
    let run = dir.path().join("p");

    // Every step's phases add up to its wall time.
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    for line in metrics.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let sum: f64 = v["phases_ms"].as_object().unwrap().values().map(|ms| ms.as_f64().unwrap()).sum();
        let wall = v["step_ms"].as_f64().unwrap();
        assert!((sum - wall).abs() <= 1e-6 * wall.max(1.0), "phases {sum} ms vs wall {wall} ms: {line}");
    }
    // So do the report's means.
    let report = read_report(&run);
    let sum: f64 = report["phases"].as_object().unwrap().values().map(|ms| ms.as_f64().unwrap()).sum();
    let step = report["step_ms"].as_f64().unwrap();
    assert!((sum - step).abs() <= 1e-6 * step, "{sum} vs {step}");
    for key in ["tokens_per_s", "samples_per_s", "effective_compute_ratio", "compute_share", "mfu", "peak_memory_bytes"]
    {
        assert!(report[key].as_f64().is_some_and(|v| v > 0.0), "report.{key}: {}", report[key]);
    }
    // The effective compute ratio is the step's matrix multiplies, timed alone in the same process,
    // over the step; the compute phases' share is kept beside it.
    let gemm = report["train"]["gemm_ms_per_step"].as_f64().expect("the multiplies were timed");
    let ecr = report["effective_compute_ratio"].as_f64().unwrap();
    assert!((ecr - gemm / step).abs() <= 1e-9 * ecr, "{ecr} vs {gemm} / {step}");
    assert!(report["train"]["gemm_flops_per_s"].as_f64().is_some_and(|f| f > 0.0));
    // The planner's calibration reads this report as it is.
    let parsed: stoke_plan::RunReport = serde_json::from_value(report.clone()).expect("the planner parses report.json");
    assert_eq!((parsed.model.n_layer, parsed.train.micro_batch), (2, 8));
    assert!(parsed.machine.peak_flops > 0.0);

    // trace.json is a Chrome trace with a span per step and per phase.
    let trace = std::fs::read_to_string(run.join("trace.json")).unwrap();
    let spans = stoke_prof::validate_chrome_trace(&trace).unwrap_or_else(|e| panic!("{e}"));
    assert!(spans >= 6 * 5, "{spans} spans for 6 steps");
    let html = std::fs::read_to_string(run.join("report.html")).unwrap();
    assert_eq!(html.matches("<svg").count(), 4);
}

#[test]
fn metrics_scraped_over_loopback_are_valid_exposition_format() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let overrides =
        with(SMALL, &[&run_dir, "run.name=m", "train.steps=100000", "prof.prometheus_port=0", "ckpt.every=0"]);
    let mut child = stoke(&["train", "--quiet"], &overrides)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let run = dir.path().join("m");
    let start = Instant::now();
    let body = loop {
        assert!(start.elapsed() < Duration::from_secs(300), "no scrape with a step in it");
        std::thread::sleep(Duration::from_millis(50));
        let Ok(addr) = std::fs::read_to_string(run.join("metrics.addr")) else { continue };
        let body = stoke_prof::scrape(addr.trim().parse().unwrap()).expect("GET /metrics answers");
        if !body.contains("stoke_steps_total{rank=\"0\",world=\"1\"} 0") {
            break body;
        }
    };
    // SAFETY: kill only sends a signal to the child we spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert_eq!(child.wait().unwrap().code(), Some(75), "preempted, resumable");
    let samples = stoke_prof::validate_exposition(&body).unwrap_or_else(|e| panic!("{e}\n{body}"));
    assert!(samples >= 15, "{body}");
    for name in [
        "stoke_tokens_total{rank=\"0\",world=\"1\"}",
        "stoke_phase_seconds_total{rank=\"0\",world=\"1\",phase=\"forward\"}",
        "stoke_loss{rank=\"0\",world=\"1\"}",
        "stoke_mfu",
    ] {
        assert!(body.contains(name), "{name} missing:\n{body}");
    }
}

#[test]
fn sweep_names_the_best_value() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let overrides = with(SMALL, &[&run_dir, "prof.prometheus=false", "ckpt.every=0", "ckpt.at_end=false"]);
    let out = run_ok(&mut stoke(&["doctor", "--steps", "4", "--sweep", "data.prefetch=1,4"], &overrides));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("sweep of data.prefetch") && stdout.contains("best: data.prefetch = "), "{stdout}");
    let sweeps: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with("-sweep.json"))
        .collect();
    assert_eq!(sweeps.len(), 1);
    let sweep: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(sweeps[0].path()).unwrap()).unwrap();
    assert_eq!(sweep["points"].as_array().unwrap().len(), 2);
    assert!(["1", "4"].contains(&sweep["best"].as_str().unwrap()));
}
