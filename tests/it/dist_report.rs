//! Observability of a data-parallel run with real processes over loopback: each rank serves its
//! own `/metrics` (port base + local rank, labelled with rank and world), rank 0's report.json has
//! every rank and names a made-slow rank as the straggler, and trace.json has a process per rank.

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::stoke;

const STEPS: u64 = 60;

/// Two consecutive ports that are free now (the ranks' /metrics: base and base + 1), below the
/// kernel's ephemeral range, so that no port another test gets by binding port 0 (a master port)
/// can be one of them.
fn free_port_pair() -> u16 {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let ephemeral_start: u16 = range.split_whitespace().next().and_then(|p| p.parse().ok()).unwrap_or(32768);
    assert!(ephemeral_start > 10_100, "the ephemeral port range starts at {ephemeral_start}");
    // Start somewhere different in every process, and walk up in steps of two.
    let span = (ephemeral_start - 10_002) / 2;
    let first = 10_000 + 2 * (std::process::id() as u16 % span);
    for i in 0..span {
        let base = 10_000 + (first - 10_000 + 2 * i) % (2 * span);
        let Ok(_a) = TcpListener::bind(("127.0.0.1", base)) else { continue };
        if TcpListener::bind(("127.0.0.1", base + 1)).is_ok() {
            return base;
        }
    }
    panic!("no two consecutive free ports on 127.0.0.1 below {ephemeral_start}");
}

/// Rank `rank` of 2, started alone (not by `stoke launch`) so that it alone gets `slow_forward`.
fn worker(rank: usize, master_port: u16, args: &[String], slow_forward: Option<&str>) -> Child {
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = stoke(&["train", "--quiet"], &refs);
    cmd.env("RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", master_port.to_string())
        .env_remove("STOKE_TEST_SLOW_FORWARD")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(fraction) = slow_forward {
        cmd.env("STOKE_TEST_SLOW_FORWARD", fraction);
    }
    cmd.spawn().expect("a worker starts")
}

fn stderr_of(child: &mut Child) -> String {
    let mut err = String::new();
    if let Some(stderr) = child.stderr.as_mut() {
        let _ = std::io::Read::read_to_string(stderr, &mut err);
    }
    err
}

/// The value of `stoke_steps_total` for `rank` of 2 in a scrape, if the series is there.
fn steps_in(body: &str, rank: usize) -> Option<f64> {
    let series = format!("stoke_steps_total{{rank=\"{rank}\",world=\"2\"}} ");
    body.lines().find_map(|line| line.strip_prefix(series.as_str())).and_then(|v| v.trim().parse().ok())
}

fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn a_slow_rank_is_the_straggler_in_the_merged_report_trace_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let base = free_port_pair();
    let args: Vec<String> = [
        "model.n_layer=2",
        "model.d_model=64",
        "model.n_head=4",
        "model.seq_len=32",
        "train.micro_batch=4",
        "train.threads=1",
        "data.builtin_bytes=200000",
        "ckpt.every=0",
        "ckpt.at_end=false",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([
        format!("train.steps={STEPS}"),
        format!("prof.prometheus_port={base}"),
        format!("run.dir={}", dir.path().display()),
        "run.name=straggler".to_string(),
    ])
    .collect();
    let master_port = crate::free_port();
    // Rank 1's forward takes three times as long (a busy-wait of twice its time).
    let mut workers = [worker(0, master_port, &args, None), worker(1, master_port, &args, Some("2.0"))];

    // Each rank answers on its own port while it trains, with its rank and the world on the series.
    let mut answered = [false, false];
    let deadline = Instant::now() + Duration::from_secs(300);
    while answered.contains(&false) {
        for (rank, done) in answered.iter_mut().enumerate() {
            let addr: SocketAddr = ([127, 0, 0, 1], base + rank as u16).into();
            if let Ok(body) = stoke_prof::scrape(addr) {
                stoke_prof::validate_exposition(&body).unwrap_or_else(|e| panic!("rank {rank}: {e}\n{body}"));
                assert!(steps_in(&body, 1 - rank).is_none(), "rank {rank}'s port serves the other rank:\n{body}");
                *done |= steps_in(&body, rank).is_some_and(|steps| steps >= 1.0);
            }
        }
        for (rank, w) in workers.iter_mut().enumerate() {
            if let Some(status) = w.try_wait().unwrap() {
                assert!(
                    answered.iter().all(|&a| a),
                    "rank {rank} ended ({status}) before both ranks' /metrics answered \
                    with a step: answered {answered:?}\n{}",
                    stderr_of(w)
                );
            }
        }
        assert!(Instant::now() < deadline, "no /metrics with a step from both ranks: {answered:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    for (rank, w) in workers.iter_mut().enumerate() {
        let status = w.wait().unwrap();
        let err = stderr_of(w);
        assert!(status.success(), "rank {rank} failed with {status}: {err}");
        assert!(
            err.contains(&format!("metrics: http://127.0.0.1:{}/metrics", base + rank as u16)),
            "rank {rank}: {err}"
        );
    }

    let run = dir.path().join("straggler");
    let report = read_json(&run.join("report.json"));
    assert_eq!(report["train"]["world_size"], 2);
    let ranks = &report["ranks"];
    assert_eq!(ranks["world_size"], 2, "{ranks}");
    let per_rank = ranks["ranks"].as_array().unwrap();
    assert_eq!(per_rank.iter().map(|r| r["rank"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1], "{ranks}");
    for r in per_rank {
        assert_eq!(r["steps_measured"], STEPS - 1, "{r}");
        for key in ["step_ms", "step_ms_mean", "step_ms_p90", "busy_ms", "comm_total_ms"] {
            assert!(r[key].as_f64().unwrap() > 0.0, "{key}: {r}");
        }
        assert!(r["data_wait_ms"].as_f64().unwrap() >= 0.0, "{r}");
        let phases: f64 = r["phases"].as_object().unwrap().values().map(|v| v.as_f64().unwrap()).sum();
        assert!((phases - r["step_ms"].as_f64().unwrap()).abs() < 1e-6, "the phases sum to the step: {r}");
    }
    // The headline is the job's: the ranks' rates together, rank 0's own beside it.
    let sum: f64 = per_rank.iter().map(|r| r["tokens_per_s"].as_f64().unwrap()).sum();
    let job = report["tokens_per_s"].as_f64().unwrap();
    assert!((job - sum).abs() <= 1e-9 * sum, "job {job} against the ranks' {sum}");
    assert_eq!(report["rank0"]["tokens_per_s"], per_rank[0]["tokens_per_s"], "{}", report["rank0"]);
    let samples = report["samples_per_s"].as_f64().unwrap();
    assert!((samples - job / 32.0).abs() <= 1e-9 * job, "samples/s {samples} of {job} tokens/s");
    println!("ranks: {}", serde_json::to_string_pretty(ranks).unwrap());
    assert_eq!(ranks["slowest_rank"], 1, "{ranks}");
    assert_eq!(ranks["median_rank"], 0, "{ranks}");
    // Rank 0 waits for rank 1 in comm_exposed; rank 1 hardly waits at all.
    let exposed = |r: usize| per_rank[r]["comm_exposed_ms"].as_f64().unwrap();
    assert!(exposed(0) > exposed(1), "{ranks}");
    let straggler = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == "straggler")
        .unwrap_or_else(|| panic!("no straggler finding: {}", report["findings"]));
    let evidence = straggler["evidence"].as_str().unwrap();
    assert!(evidence.starts_with("rank 1 is busy") && evidence.contains("median rank (rank 0)"), "{evidence}");
    assert!(straggler["value"].as_f64().unwrap() > 0.2, "{straggler}");
    println!("straggler: {}", straggler["evidence"]);
    assert!(straggler["bound"].as_f64().unwrap() > 1.0, "{straggler}");
    let html = std::fs::read_to_string(run.join("report.html")).unwrap();
    assert!(
        html.contains("<h2>Ranks</h2>") && html.contains("slowest rank <b>1</b>"),
        "report.html has no ranks table"
    );
    assert!(html.contains("<td class=\"l\">straggler</td>"), "report.html lacks the straggler finding");
    assert!(html.contains("all 2 ranks together"), "report.html gives rank 0's rate as the job's");

    // One trace, a process per rank, each with every step and its phases.
    let text = std::fs::read_to_string(run.join("trace.json")).unwrap();
    stoke_prof::validate_chrome_trace(&text).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let mut step_spans = Vec::new();
    for rank in 0..2u64 {
        let name = events.iter().find(|e| e["name"] == "process_name" && e["pid"] == rank);
        assert_eq!(name.map(|e| &e["args"]["name"]), Some(&serde_json::json!(format!("rank {rank}"))));
        let on_rank = |name: &str| -> Vec<&serde_json::Value> {
            events.iter().filter(|e| e["ph"] == "X" && e["pid"] == rank && e["name"] == name).collect()
        };
        let steps: Vec<(f64, f64)> = (1..=STEPS)
            .map(|step| {
                let span = on_rank(&format!("step {step}"));
                assert_eq!(span.len(), 1, "rank {rank} step {step}");
                let (ts, dur) = (span[0]["ts"].as_f64().unwrap(), span[0]["dur"].as_f64().unwrap());
                (ts, ts + dur)
            })
            .collect();
        assert_eq!(on_rank("forward").len() as u64, STEPS, "rank {rank}");
        assert_eq!(on_rank("comm_total").len() as u64, STEPS, "rank {rank}");
        step_spans.push(steps);
    }
    let offsets = ranks["clock_offsets"].as_array().unwrap();
    assert_eq!(offsets.len(), 1, "{ranks}");
    assert_eq!(offsets[0]["rank"], 1);
    // Both ranks run on this host, whose CLOCK_MONOTONIC they share: the true offset. The estimate
    // is off by at most half its round trip (plus 5 us per rank for reading two clocks at zero).
    let round_trip_us = offsets[0]["round_trip_us"].as_f64().unwrap();
    let estimate_us = offsets[0]["offset_us"].as_f64().unwrap();
    let truth_us = offsets[0]["host_clock_offset_us"].as_f64().unwrap();
    println!("clock offset of rank 1: estimated {estimate_us:.1} us, true {truth_us:.1} us, round trip {round_trip_us:.1} us");
    assert!(round_trip_us > 0.0, "{ranks}");
    assert!((estimate_us - truth_us).abs() <= round_trip_us / 2.0 + 10.0, "{ranks}");
    // The clocks share a start: a step's all-reduce holds both ranks inside that step at once, so
    // on the common time line step k of rank 0 and step k of rank 1 overlap.
    let mut end_gaps = Vec::new();
    for (k, (a, b)) in step_spans[0].iter().zip(&step_spans[1]).enumerate() {
        assert!(a.0 < b.1 && b.0 < a.1, "step {}: rank 0 spans {a:?} us, rank 1 {b:?} us", k + 1);
        end_gaps.push((a.1 - b.1).abs());
    }
    end_gaps.sort_by(f64::total_cmp);
    println!(
        "step ends of rank 0 and rank 1 on the common time line differ by {:.0} us (median), {:.0} us (max)",
        end_gaps[end_gaps.len() / 2],
        end_gaps[end_gaps.len() - 1]
    );
}
