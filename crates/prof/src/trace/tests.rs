//! Boundary tests of the trace analyzer: hand-written traces with known answers, hostile input,
//! and a fuzzer over mutated traces.

use std::path::Path;

use proptest::prelude::*;

use super::ingest::parse_trace;
use super::*;

fn parse(json: &str) -> Result<RankTrace, TraceError> {
    parse_trace(Path::new("test.json"), json.as_bytes()).map_err(|e| e.with_path(Path::new("test.json")))
}

/// A complete event; `extra` is spliced into the object (e.g. `"args": {...}`).
fn x(cat: &str, name: &str, ts_us: f64, dur_us: f64, extra: &str) -> String {
    let sep = if extra.is_empty() { "" } else { ", " };
    format!(
        r#"{{"ph": "X", "cat": "{cat}", "name": "{name}", "pid": 1, "tid": 1, "ts": {ts_us}, "dur": {dur_us}{sep}{extra}}}"#
    )
}

fn gpu(cat: &str, name: &str, ts_us: f64, dur_us: f64, stream: u32, corr: u64) -> String {
    format!(
        r#"{{"ph": "X", "cat": "{cat}", "name": "{name}", "pid": 0, "tid": {stream}, "ts": {ts_us}, "dur": {dur_us}, "args": {{"device": 0, "stream": {stream}, "correlation": {corr}}}}}"#
    )
}

fn launch(ts_us: f64, dur_us: f64, corr: u64) -> String {
    x("cuda_runtime", "cudaLaunchKernel", ts_us, dur_us, &format!(r#""args": {{"correlation": {corr}}}"#))
}

fn trace_of(events: &[String]) -> String {
    format!(r#"{{"schemaVersion": 1, "traceEvents": [{}]}}"#, events.join(",\n"))
}

/// Checks each step's (number, wall, categories) in µs, in priority order.
fn check(json: &str, expected: &[(Option<u64>, i64, [i64; 8])]) {
    let trace = parse(json).expect("parses");
    let report = analyze_rank(&trace, &AnalyzeOptions::default());
    let got: Vec<(Option<u64>, i64, [i64; 8])> = report
        .steps
        .iter()
        .map(|s| (s.step, s.wall_ns / 1000, Category::PRIORITY.map(|c| s.categories.get(c) / 1000)))
        .collect();
    assert_eq!(got, expected);
    for s in &report.steps {
        assert_eq!(s.categories.sum(), s.wall_ns);
    }
}

#[test]
fn priority_assigns_overlaps_to_the_higher_category() {
    // Step 0..100 µs. DataLoader 0..20; CPU op 20..60 with a launch 30..40; kernel 45..80;
    // memcpy 70..90 (its 70..80 part is under the kernel).
    let json = trace_of(&[
        x("user_annotation", "ProfilerStep#7", 0.0, 100.0, ""),
        x("user_annotation", "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", 0.0, 20.0, ""),
        x("cpu_op", "aten::mm", 20.0, 40.0, ""),
        launch(30.0, 10.0, 5),
        gpu("kernel", "ampere_sgemm_128x64_nn", 45.0, 35.0, 7, 5),
        gpu("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 70.0, 20.0, 7, 0),
    ]);
    //               kernel memcpy memset comm runtime dataldr cpu_op other
    check(&json, &[(Some(7), 100, [35, 10, 0, 0, 10, 20, 15, 10])]);
}

#[test]
fn gpu_work_extends_the_last_step_and_steps_do_not_overlap() {
    let json = trace_of(&[
        x("user_annotation", "ProfilerStep#1", 0.0, 50.0, ""),
        launch(10.0, 5.0, 1),
        gpu("kernel", "k", 20.0, 50.0, 7, 1), // runs into step 2
        x("user_annotation", "ProfilerStep#2", 50.0, 30.0, ""),
        launch(60.0, 5.0, 2),
        gpu("kernel", "k", 70.0, 40.0, 7, 2), // ends at 110, after the step's CPU end at 80
    ]);
    check(&json, &[(Some(1), 50, [30, 0, 0, 0, 5, 0, 0, 15]), (Some(2), 60, [60, 0, 0, 0, 0, 0, 0, 0])]);
}

#[test]
fn communication_kernels_and_ops_are_communication() {
    let json = trace_of(&[
        x("user_annotation", "ProfilerStep#3", 0.0, 100.0, ""),
        x("user_annotation", "nccl:all_reduce", 0.0, 10.0, ""),
        gpu("kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", 10.0, 40.0, 20, 0),
        gpu("kernel", "void gemm", 30.0, 40.0, 7, 0),
    ]);
    check(&json, &[(Some(3), 100, [40, 0, 0, 30, 0, 0, 0, 30])]);
    let report = analyze_rank(&parse(&json).unwrap(), &AnalyzeOptions::default());
    assert_eq!(report.overlap.comm_ns, 40_000);
    assert_eq!(report.overlap.exposed_ns, 20_000);
    assert_eq!(report.steps[0].comm_exposed_ns, 20_000);
}

#[test]
fn the_effective_compute_ratio_counts_matrix_multiply_and_convolution_kernels_alone() {
    // Step 0..100 µs: a GEMM 10..30, a convolution 30..40, a softmax 40..70 and a flash attention
    // kernel 70..90 are all compute; the ratio counts the first two, 30 of 100 µs.
    let json = trace_of(&[
        x("user_annotation", "ProfilerStep#1", 0.0, 100.0, ""),
        gpu("kernel", "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_tn", 10.0, 20.0, 7, 1),
        gpu("kernel", "implicit_convolve_sgemm", 30.0, 10.0, 7, 2),
        gpu("kernel", "void at::native::softmax_warp_forward", 40.0, 30.0, 7, 3),
        gpu("kernel", "void pytorch_flash::flash_fwd_kernel", 70.0, 20.0, 7, 4),
    ]);
    let report = analyze_rank(&parse(&json).unwrap(), &AnalyzeOptions::default());
    let step = &report.steps[0];
    assert_eq!((step.gemm_ns, step.compute_ns, step.wall_ns), (30_000, 80_000, 100_000));
    let finding = report.findings.iter().find(|f| f.id == "low_compute_ratio").expect("30% is under 70%");
    assert_eq!(finding.value, 0.3);
    assert!(finding.evidence.contains("all compute kernels 0.080 ms (80.0%)"), "{}", finding.evidence);
}

#[test]
fn a_trace_without_steps_is_one_window() {
    let json = trace_of(&[x("cpu_op", "aten::add", 10.0, 5.0, ""), gpu("kernel", "k", 20.0, 10.0, 7, 0)]);
    check(&json, &[(None, 20, [10, 0, 0, 0, 0, 0, 5, 5])]);
}

#[test]
fn legacy_array_categories_and_string_ids() {
    let json = r#"[
        {"ph": "X", "cat": "Operator", "name": "ProfilerStep#1", "pid": "host", "tid": "main", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "Runtime", "name": "cudaLaunchKernel", "pid": "host", "tid": "main", "ts": 10, "dur": 10, "args": {"correlation": 99}},
        {"ph": "X", "cat": "Kernel", "name": "k", "pid": "0", "tid": "stream 7", "ts": 30, "dur": 20, "args": {"correlation": 99}},
        {"ph": "X", "cat": "Memset", "name": "Memset (Device)", "pid": 0, "tid": "stream 7", "ts": 60, "dur": 10},
        {"ph": "X", "cat": "Memcpy", "name": "Memcpy HtoD", "pid": 0, "tid": "stream 7", "ts": 80, "dur": 10}
    ]"#;
    check(json, &[(Some(1), 100, [20, 10, 10, 0, 10, 0, 0, 50])]);
    let t = parse(json).unwrap();
    let kernel = t.events.iter().find(|e| e.kind == Kind::Kernel).unwrap();
    assert_eq!((kernel.stream, kernel.device), (7, 0));
}

#[test]
fn nanosecond_decimals_are_exact_and_base_time_is_kept() {
    let json = r#"{"baseTimeNanoseconds": 1700000000000000000, "traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 4203669604595.407, "dur": 1.001, "args": {"stream": 7}}
    ]}"#;
    let t = parse(json).unwrap();
    assert_eq!((t.events[0].ts, t.events[0].dur), (4_203_669_604_595_407, 1_001));
    assert_eq!(t.base_time_ns, 1_700_000_000_000_000_000);
}

#[test]
fn huge_integers_invalid_utf8_and_unknown_fields_are_tolerated() {
    let mut bytes = br#"{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "op"#.to_vec();
    bytes.extend_from_slice(&[0xff, 0xfe]);
    bytes.extend_from_slice(
        br#"", "pid": 123456789012345678901234567890, "tid": 1, "ts": 1, "dur": 2, "args": {"External id": 99999999999999999999999, "correlation": 18446744073709551615, "x": [1, {"y": null}], "z": true}, "extra": -1.5e300}], "future": {"a": [1, 2]}}"#,
    );
    let t = parse_trace(Path::new("t.json"), &bytes[..]).unwrap();
    assert_eq!(t.events.len(), 1);
    assert_eq!(t.names[t.events[0].name as usize], "op\u{FFFD}\u{FFFD}");
    assert_eq!(t.events[0].correlation, u64::MAX);
}

#[test]
fn rank_comes_from_distributed_info_then_file_name() {
    let t = parse(r#"{"distributedInfo": {"rank": "3", "world_size": 8}, "traceEvents": []}"#).unwrap();
    assert_eq!((t.rank, t.rank_source, t.world_size), (3, "distributedInfo", Some(8)));
    for (name, expected) in [
        ("rank-0.json", Some(0)),
        ("trace_rank_12.json.gz", Some(12)),
        ("x.Rank3.pt.trace.json", Some(3)),
        ("ranks.json", None),
    ] {
        assert_eq!(rank_from_file_name(Path::new(name)), expected, "{name}");
    }
}

fn check_error(input: &[u8], expected: &str) {
    let err = parse_trace(Path::new("bad.json"), input).map(|_| ()).map_err(|e| e.with_path(Path::new("bad.json")));
    let message = format!("{}", err.expect_err("must fail"));
    assert!(message.contains(expected), "input {:?}: {message}", String::from_utf8_lossy(input));
    assert!(message.starts_with("bad.json"), "{message}");
}

#[test]
fn malformed_traces_give_clear_errors() {
    check_error(b"", "expected '{' or '['");
    check_error(b"hello", "expected '{' or '['");
    check_error(br#"{"traceEvents": [{"ph": "X", "ts": 1"#, "truncated");
    check_error(br#"{"traceEvents": [{"ph": "X", "name": "abc"#, "ends inside a string");
    check_error(br#"{"traceEvents": [{"ph": "X"} {"ph": "X"}]}"#, "expected ',' or ']'");
    check_error(br#"{"traceEvents": [{"ts": 99999999999999999999}]}"#, "does not fit in 64-bit nanoseconds");
    check_error(br#"{"other": 1}"#, "no \"traceEvents\"");
    check_error(br#"{"traceEvents": []} trailing"#, "after the end of the trace");
    check_error(br#"{"traceEvents": [{"name": "\q"}]}"#, "invalid string escape");
    check_error(format!(r#"{{"traceEvents": [{{"args": {}}}]}}"#, "[".repeat(100_000)).as_bytes(), "nesting deeper");
}

#[test]
fn every_truncation_of_a_trace_is_an_error_not_a_panic() {
    let json = trace_of(&[
        x("user_annotation", "ProfilerStep#1", 0.0, 100.0, ""),
        launch(10.0, 5.0, 1),
        gpu("kernel", "k\\u00e9", 20.0, 50.5, 7, 1),
    ]);
    let bytes = json.as_bytes();
    for cut in 0..bytes.len() - 1 {
        // Whitespace at the end is the only harmless cut.
        if bytes[cut..].iter().all(|b| b.is_ascii_whitespace()) {
            continue;
        }
        assert!(parse_trace(Path::new("t.json"), &bytes[..cut]).is_err(), "prefix of {cut} bytes parsed");
    }
}

#[test]
fn gzip_is_detected_by_content() {
    use std::io::Write;
    let json = trace_of(&[x("user_annotation", "ProfilerStep#1", 0.0, 10.0, "")]);
    let dir = std::env::temp_dir().join(format!("stoke-trace-gz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("rank-2.trace.json.gz");
    let mut enc = flate2::write::GzEncoder::new(std::fs::File::create(&path).unwrap(), flate2::Compression::fast());
    enc.write_all(json.as_bytes()).unwrap();
    enc.finish().unwrap();
    let a = analyze_paths(std::slice::from_ref(&dir), &AnalyzeOptions::default()).unwrap();
    assert_eq!((a.ranks.len(), a.ranks[0].rank, a.ranks[0].steps[0].wall_ns), (1, 2, 10_000));
    // A truncated gzip stream is an error too.
    let full = std::fs::read(&path).unwrap();
    std::fs::write(&path, &full[..full.len() / 2]).unwrap();
    let err = analyze_paths(std::slice::from_ref(&path), &AnalyzeOptions::default()).unwrap_err();
    assert!(format!("{err}").contains("rank-2.trace.json.gz"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn synthetic_traces_diagnose_and_diff() {
    let dir = std::env::temp_dir().join(format!("stoke-trace-synth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, opts: &SynthOptions| {
        let path = dir.join(name);
        write_synthetic(std::fs::File::create(&path).unwrap(), opts).unwrap();
        path
    };
    let base_opts =
        SynthOptions { max_steps: Some(6), kernels_per_step: 50, dataloader_ns: 100_000, ..SynthOptions::default() };
    let base = write("base.json", &base_opts);
    let slow = write("slow.json", &SynthOptions { dataloader_ns: 20_000_000, ..base_opts.clone() });
    let opts = AnalyzeOptions::default();
    let (a, b) = (analyze_paths(std::slice::from_ref(&base), &opts).unwrap(), analyze_paths(&[slow], &opts).unwrap());
    assert_eq!(a.ranks[0].steps.len(), 6);
    for s in a.ranks.iter().chain(&b.ranks).flat_map(|r| &r.steps) {
        assert_eq!(s.categories.sum(), s.wall_ns);
    }
    let ids = |an: &Analysis| an.ranks[0].findings.iter().map(|f| f.id.clone()).collect::<Vec<String>>();
    assert!(!ids(&a).iter().any(|id| id == "dataloader"), "{:?}", ids(&a));
    let has = |an: &Analysis, id: &str| ids(an).iter().any(|i| i == id);
    assert!(has(&b, "dataloader") && has(&b, "data_wait"), "{:?}", ids(&b));
    let same = diff(&a, &a, &DiffOptions::default()).unwrap();
    assert!(!same.regression && same.ops.is_empty());
    let worse = diff(&a, &b, &DiffOptions::default()).unwrap();
    assert!(worse.regression, "{}", diff_table(&worse));
    assert!(!diff(&b, &a, &DiffOptions::default()).unwrap().regression);

    // Two ranks, rank 1 slower: a straggler across ranks.
    let r0 = write(
        "trace_rank0.json",
        &SynthOptions { world_size: 2, dataloader_ns_per_rank: 5_000_000, ..base_opts.clone() },
    );
    let r1 = write(
        "trace_rank1.json",
        &SynthOptions { rank: 1, world_size: 2, dataloader_ns_per_rank: 5_000_000, ..base_opts },
    );
    let two = analyze_paths(&[r0, r1], &opts).unwrap();
    let cross = two.cross_rank.as_ref().unwrap();
    assert_eq!(cross.steps.len(), 6);
    assert!(cross.steps.iter().all(|s| s.slowest_rank == 1));
    // Output formats render without panicking and carry the findings.
    assert!(table(&two).contains("rank 1"));
    assert!(markdown(&two).contains("| step |"));
    assert!(prometheus(&two).contains("stoke_trace_finding{rank=\"1\",id=\"dataloader\"} 1"));
    let mut overlay = Vec::new();
    overlay_trace(&two, &mut overlay).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&overlay).unwrap();
    assert!(v["traceEvents"].as_array().unwrap().len() > 12);
    let json = serde_json::to_value(&two).unwrap();
    assert!(json["ranks"][0]["steps"][0]["categories"]["kernel"].as_i64().unwrap() > 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any mutation of a valid trace parses or fails with an error; when it parses, the
    /// breakdown still partitions every step.
    #[test]
    fn fuzz_mutated_traces(cuts in proptest::collection::vec((0usize..2000, any::<u8>()), 1..6), truncate in 0usize..2000) {
        let json = trace_of(&[
            x("user_annotation", "ProfilerStep#1", 0.0, 100.0, ""),
            x("user_annotation", "enumerate(DataLoader)#it", 0.0, 10.5, r#""args": {"a": [1, {"b": "c\"d"}]}"#),
            launch(10.0, 5.0, 1),
            gpu("kernel", "k", 20.0, 50.5, 7, 1),
            gpu("kernel", "ncclKernel_x", 60.0, 50.5, 9, 2),
            x("user_annotation", "ProfilerStep#2", 100.0, 100.0, ""),
        ]);
        let mut bytes = json.into_bytes();
        for (at, byte) in cuts {
            let i = at % bytes.len();
            bytes[i] = byte;
        }
        bytes.truncate(truncate.max(1).min(bytes.len()));
        if let Ok(trace) = parse_trace(Path::new("f.json"), &bytes[..]) {
            let report = analyze_rank(&trace, &AnalyzeOptions::default());
            for s in &report.steps {
                prop_assert_eq!(s.categories.sum(), s.wall_ns);
            }
        }
    }

    /// Arbitrary bytes never panic the parser.
    #[test]
    fn fuzz_random_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse_trace(Path::new("r.json"), &bytes[..]);
    }

    /// Arbitrary event values: numbers of any size, strings, nesting.
    #[test]
    fn fuzz_event_values(ts in "-?[0-9]{1,25}(\\.[0-9]{0,12})?(e-?[0-9]{1,3})?", dur in "[0-9]{1,8}(\\.[0-9]{1,6})?", pid in "\"[^\"\\\\]{0,8}\"|[0-9]{1,30}") {
        let json = format!(r#"{{"traceEvents": [{{"ph": "X", "cat": "kernel", "name": "k", "pid": {pid}, "tid": {pid}, "ts": {ts}, "dur": {dur}}}]}}"#);
        if let Ok(trace) = parse_trace(Path::new("v.json"), json.as_bytes()) {
            let report = analyze_rank(&trace, &AnalyzeOptions::default());
            for s in &report.steps {
                prop_assert_eq!(s.categories.sum(), s.wall_ns);
            }
        }
    }
}

fn rank_findings(json: &str, opts: &AnalyzeOptions) -> (RankReport, Vec<String>) {
    let report = analyze_rank(&parse(json).expect("parses"), opts);
    let ids = report.findings.iter().map(|f| f.id.clone()).collect();
    (report, ids)
}

#[test]
fn memory_tensor_cores_outliers_and_mfu() {
    // An 80 GB device, allocator samples up to 76 GB reserved, fp32 GEMMs only, and a slow step.
    let memory = |ts: f64, reserved: u64| {
        format!(
            r#"{{"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": {ts}, "s": "t", "args": {{"Device Type": 1, "Device Id": 0, "Bytes": 1024, "Total Allocated": {reserved}, "Total Reserved": {reserved}}}}}"#
        )
    };
    let mut events = Vec::new();
    for (i, wall) in [100.0, 100.0, 100.0, 400.0].iter().enumerate() {
        let start = 1000.0 * i as f64;
        events.push(x("user_annotation", &format!("ProfilerStep#{i}"), start, *wall, ""));
        events.push(launch(start + 1.0, 2.0, i as u64 + 1));
        events.push(gpu("kernel", "volta_sgemm_128x64_nn", start + 5.0, wall - 10.0, 7, i as u64 + 1));
    }
    events.push(memory(10.0, 40_000_000_000));
    events.push(memory(20.0, 76_000_000_000));
    let json = format!(
        r#"{{"deviceProperties": [{{"id": 0, "name": "NVIDIA A100-SXM4-80GB", "totalGlobalMem": 80000000000, "computeMajor": 8, "computeMinor": 0}}], "traceEvents": [{}]}}"#,
        events.join(",\n")
    );
    let opts = AnalyzeOptions { model_flops_per_step: Some(31.2e9), ..AnalyzeOptions::default() };
    let (report, ids) = rank_findings(&json, &opts);
    assert_eq!(report.memory.len(), 1);
    assert_eq!(report.memory[0].peak_reserved_bytes, 76_000_000_000);
    assert!(ids.iter().any(|i| i == "memory_pressure"), "{ids:?}");
    assert!(ids.iter().any(|i| i == "no_tensor_cores"), "{ids:?}");
    assert!(ids.iter().any(|i| i == "step_outliers"), "{ids:?}");
    assert!(!ids.iter().any(|i| i == "low_gpu_utilization"), "{ids:?}");
    // 31.2 GFLOP in a mean step of 175 µs on a 312 TFLOP/s A100.
    let mfu = report.mfu.expect("model FLOPs given and the device is known");
    assert!((mfu - 31.2e9 / 175e-6 / 312e12).abs() < 1e-9, "{mfu}");

    // The same trace on Tensor Cores: no finding.
    let tc = json.replace("volta_sgemm_128x64_nn", "sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize96x128x32");
    let (_, ids) = rank_findings(&tc, &opts);
    assert!(!ids.iter().any(|i| i == "no_tensor_cores"), "{ids:?}");
}

/// Traces that give no step time are refused by `diff` on either side, naming the side and why,
/// and the events dropped on the way in are counted by reason instead of clamped or lost.
#[test]
fn diff_refuses_traces_it_cannot_measure() {
    let analysis = |json: &str| {
        let trace = parse(json).unwrap();
        analyze(&[trace], &AnalyzeOptions::default())
    };
    let good = analysis(&format!(
        r#"{{"traceEvents": [{}, {}]}}"#,
        x("user_annotation", "ProfilerStep#1", 0.0, 100.0, ""),
        x("cpu_op", "aten::mm", 10.0, 50.0, "")
    ));
    let negative = format!(
        r#"{{"traceEvents": [{}, {}]}}"#,
        x("user_annotation", "ProfilerStep#1", 0.0, -100.0, ""),
        x("cpu_op", "aten::mm", 10.0, -50.0, "")
    );
    let no_numbers = r#"{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "a", "ts": "soon", "dur": "long"}]}"#;
    let negative = analysis(&negative);
    assert_eq!(negative.ranks[0].ingest.n_negative_duration, 2);
    assert!(table(&negative).contains("dropped 2 events: 2 with a negative dur"), "{}", table(&negative));
    let no_numbers = analysis(no_numbers);
    assert_eq!(no_numbers.ranks[0].ingest.n_without_time, 1);
    for bad in [analysis(r#"{"traceEvents": []}"#), negative, no_numbers] {
        let err = diff(&good, &bad, &DiffOptions::default()).unwrap_err().to_string();
        assert!(err.starts_with("NEW cannot be measured"), "{err}");
        let err = diff(&bad, &good, &DiffOptions::default()).unwrap_err().to_string();
        assert!(err.starts_with("OLD cannot be measured"), "{err}");
    }
    assert!(!diff(&good, &good, &DiffOptions::default()).unwrap().regression);
}
