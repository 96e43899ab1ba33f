//! `stoke sched simulate` on a job list: a table per policy, timelines written, and a malformed
//! list refused naming the line.

use crate::{run_ok, stoke};

#[test]
fn simulate_compares_policies_on_a_job_list_and_names_a_bad_line() {
    let dir = tempfile::tempdir().unwrap();
    let jobs = dir.path().join("jobs.csv");
    std::fs::write(
        &jobs,
        "submit_s,name,work,min_workers,max_workers,scaling,resize_s\n0,big,40000,1,4,amdahl:100:0.6,30\n60,small,6000,1,1,linear:100,30\n",
    )
    .unwrap();
    let out_dir = dir.path().join("out");
    let out = run_ok(&mut stoke(
        &["sched", "simulate", "--slots", "4", "--jobs", jobs.to_str().unwrap(), "--out", out_dir.to_str().unwrap()],
        &[],
    ));
    let stdout = String::from_utf8_lossy(&out.stdout);
    for policy in ["fifo", "fair", "goodput"] {
        assert!(stdout.lines().any(|l| l.starts_with("jobs") && l.contains(policy)), "{stdout}");
        let html = std::fs::read_to_string(out_dir.join(format!("timeline-jobs-{policy}.html"))).unwrap();
        assert!(html.contains("<svg") && html.contains("big: "), "{policy}");
    }
    let figures: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("figures.json")).unwrap()).unwrap();
    let mean = |policy: &str| {
        figures.as_array().unwrap().iter().find(|f| f["policy"] == policy).unwrap()["figures"]["mean_completion_s"]
            .as_f64()
            .unwrap()
    };
    let per_job: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("jobs-jobs-fair.json")).unwrap()).unwrap();
    let big = &per_job["jobs"][0];
    assert_eq!(big["name"], "big");
    assert!(big["finish_s"].as_f64().unwrap() > 0.0 && big["allocations"][0]["workers"] == 4, "{per_job}");
    // Under FIFO the small job waits for the big one; the goodput policy shrinks the big job.
    assert!(mean("goodput") < mean("fifo"), "{figures}");

    std::fs::write(&jobs, "submit_s,name,work,min_workers,max_workers,scaling\n0,a,100,1,2,amdahl:1\n").unwrap();
    let out = stoke(&["sched", "simulate", "--jobs", jobs.to_str().unwrap(), "--out", out_dir.to_str().unwrap()], &[])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("jobs.csv") && stderr.contains("line 2") && stderr.contains("amdahl:1"), "{stderr}");

    let out = stoke(
        &["sched", "simulate", "--tick-s", "0", "--seeds", "1", "--n-jobs", "3", "--out", out_dir.to_str().unwrap()],
        &[],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--tick-s 0") && stderr.contains("tick_s"), "{stderr}");
    let out = stoke(
        &[
            "sched",
            "simulate",
            "--slots",
            "4",
            "--slots-per-node",
            "8",
            "--seeds",
            "1",
            "--n-jobs",
            "3",
            "--out",
            out_dir.to_str().unwrap(),
        ],
        &[],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--slots-per-node 8") && stderr.contains("<= 4"), "{stderr}");
}
