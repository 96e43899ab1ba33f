//! What a run ran on: `stoke env`, and the same record in every run's environment.json, report.json
//! and checkpoint manifests.

use crate::{run_ok, stoke, SMALL};

#[test]
fn every_run_records_its_versions_and_performance_variables() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let overrides: Vec<&str> = SMALL.iter().copied().chain([run_dir.as_str(), "run.name=a", "train.steps=3"]).collect();
    let mut cmd = stoke(&["train", "--quiet"], &overrides);
    cmd.env("MALLOC_ARENA_MAX", "2").env("STOKE_TEST_TOKEN", "do-not-print");
    run_ok(&mut cmd);
    let run = dir.path().join("a");
    let read = |path: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let environment = read(&run.join("environment.json"));
    let libtorch = environment["libtorch"]["path"].as_str().expect("the loaded libtorch is named");
    assert!(libtorch.ends_with("libtorch_cpu.so"), "{libtorch}");
    assert!(environment["libtorch"]["version"].as_str().unwrap().starts_with("2."), "{environment}");
    assert!(environment["kernel"].is_string() && environment["cpus"].as_u64().unwrap() >= 1, "{environment}");
    assert_eq!(environment["variables"]["MALLOC_ARENA_MAX"], "2");
    assert_eq!(environment["variables"]["STOKE_TEST_TOKEN"], "(set; value not recorded)");
    assert!(!std::fs::read_to_string(run.join("environment.json")).unwrap().contains("do-not-print"));
    let report = read(&run.join("report.json"));
    assert_eq!(report["environment"], environment, "report.json carries the same record");
    let manifest = read(&run.join("checkpoints/step-3/manifest.json"));
    assert_eq!(manifest["meta"]["environment"], environment, "the checkpoint's manifest carries it too");

    let out = run_ok(&mut stoke(&["env", "--json"], &[]));
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in ["stoke_version", "stoke_commit", "libtorch", "kernel", "os", "cpu_model", "cpus"] {
        assert_eq!(printed[key], environment[key], "`stoke env --json` and the run agree on {key}");
    }
    let text = String::from_utf8_lossy(&run_ok(&mut stoke(&["env"], &[])).stdout).into_owned();
    assert!(text.contains("libtorch") && text.contains("kernel") && text.contains("open mpi"), "{text}");
}

#[test]
fn an_mfu_above_one_is_never_reported_the_peak_is_measured_again() {
    // A cached peak of 1 kFLOP/s, fresh and at every load level a test could see: the run's MFU
    // against it would be millions.
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let load: f64 =
        std::fs::read_to_string("/proc/loadavg").unwrap().split_whitespace().next().unwrap().parse().unwrap();
    let cpus = std::thread::available_parallelism().unwrap().get() as f64;
    let reading = serde_json::json!({ "flops": 1e3, "measured_at": now, "load_per_cpu": load / cpus });
    let entries: serde_json::Map<String, serde_json::Value> =
        ["fp32-cpu-t1", "bf16-cpu-t1"].iter().map(|k| (k.to_string(), reading.clone())).collect();
    std::fs::write(cache.join(".machine-peak.json"), serde_json::Value::Object(entries).to_string()).unwrap();
    let run_dir = format!("run.dir={}", dir.path().display());
    let overrides: Vec<&str> =
        SMALL.iter().copied().chain([run_dir.as_str(), "run.name=a", "train.steps=6", "ckpt.every=0"]).collect();
    let mut cmd = stoke(&["train", "--quiet"], &overrides);
    cmd.env("STOKE_CACHE_DIR", &cache);
    let out = run_ok(&mut cmd);
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("a/report.json")).unwrap()).unwrap();
    let peak = report["machine"]["peak_flops"].as_f64().unwrap();
    let source = report["machine"]["peak_source"].as_str().unwrap_or("");
    assert!(peak > 1e6, "the 1 kFLOP/s peak was kept: {peak} ({source})");
    match report["mfu"].as_f64() {
        Some(mfu) => assert!(mfu > 0.0 && mfu <= 1.0, "MFU {mfu} against {peak} ({source})"),
        None => assert!(report["mfu_withheld"].is_string(), "{report}"),
    }
    // Measured at start (the load level moved) or again at the end: either way the report says so.
    assert!(source.starts_with("measured"), "{source}");
    // The step report says where the peak came from, or why the MFU is withheld (the peak
    // measured again came out too low for the run's speed: the machine is loaded).
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("peak measured") || stdout.contains("MFU withheld"), "{stdout}");
}
