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
