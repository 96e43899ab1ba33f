//! The trace analyzer on real traces (HolisticTraceAnalysis's test data, kept in
//! `tests/fixtures/traces` with their source and licence) and on synthetic ones written to a
//! temporary folder.

use std::path::PathBuf;

use stoke_prof::{analyze_paths, AnalyzeOptions, Category};

/// Every trace the tests read; `tests/fixtures/traces/README.md` names each one's source.
const FIXTURE_NAMES: &[&str] = &[
    "hta_amd_trace_mi250_minitoy_train_ROCm6_2_kineto.json.gz",
    "hta_critical_path_cuda_event_sync_event_sync_trace.json.gz",
    "hta_critical_path_simple_add_benchmark_result_493459_1694039959_trace.json.gz",
    "hta_nccl_parser_config_nccl_data.json.gz",
    "hta_ns_resolution_trace_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
    "hta_trace_compare_base_base.json.gz",
    "hta_trace_filter_sampled_rank-0.json.gz",
    "hta_trace_filter_sampled_rank-1.json.gz",
    "hta_triton_example_triton_example.json.gz",
];

/// The path of one fixture; a missing file fails the test that asked for it.
fn fixture(name: &str) -> PathBuf {
    let path = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/traces")).join(name);
    assert!(path.is_file(), "fixture missing: {} (it is part of the repository)", path.display());
    path
}

/// Every fixture, in name order.
fn fixtures() -> Vec<PathBuf> {
    FIXTURE_NAMES.iter().map(|name| fixture(name)).collect()
}

/// The folder holds exactly the listed traces, so a trace added there is also tested.
#[test]
fn fixture_folder_matches_the_list() {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/traces"));
    let mut found: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".json.gz"))
        .collect();
    found.sort();
    assert_eq!(found, FIXTURE_NAMES);
}

/// Every fixture parses, and every step's categories sum to its wall time (exactly: the
/// breakdown is integer nanoseconds, so the 0.1% allowance is not needed).
#[test]
fn fixtures_parse_and_categories_sum_to_wall_time() {
    for file in fixtures() {
        let a = analyze_paths(std::slice::from_ref(&file), &AnalyzeOptions::default())
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let r = &a.ranks[0];
        assert!(r.ingest.n_events > 0, "{}", file.display());
        assert!(!r.steps.is_empty(), "{}", file.display());
        for s in &r.steps {
            let sum: i64 = Category::PRIORITY.iter().map(|&c| s.categories.get(c)).sum();
            assert_eq!(sum, s.wall_ns, "{} step {:?}", file.display(), s.step);
            assert!(s.categories.other >= 0 && s.wall_ns > 0, "{} step {:?}", file.display(), s.step);
        }
        assert!(r.gpu.idle_ns + r.gpu.compute_ns + r.gpu.non_compute_ns == r.gpu.span_ns, "{}", file.display());
    }
}

/// HTA's temporal breakdown (HolisticTraceAnalysis 0.5, run by benches/peers/hta_analyze.py) on
/// the same files, in µs: (file, kernel_time, idle, compute, non-compute, tolerance). Traces
/// with integer-µs timestamps agree exactly. HTA rounds fractional timestamps to whole µs (start
/// up, end down), so each GPU event may differ by up to 1 µs: the tolerance is the number of GPU
/// events plus 2. Files where HTA counts non-GPU events as GPU time (cuda_sync events; a CPU op
/// with a `stream` argument) are explained in benches/TRACE_VS_HTA.md and not listed here.
#[test]
fn fixtures_agree_with_hta() {
    let expected: &[(&str, i64, i64, i64, i64, i64)] = &[
        ("hta_trace_filter_sampled_rank-0.json.gz", 600_058, 321_378, 106_252, 172_428, 0),
        ("hta_trace_filter_sampled_rank-1.json.gz", 600_674, 328_671, 135_548, 136_455, 0),
        ("hta_trace_compare_base_base.json.gz", 4, 0, 4, 0, 0),
        ("hta_nccl_parser_config_nccl_data.json.gz", 435_586, 338_781, 75_169, 21_636, 2_516 + 2),
        (
            "hta_ns_resolution_trace_rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz",
            384_634,
            10_113,
            372_150,
            2_371,
            4_876 + 2,
        ),
        ("hta_amd_trace_mi250_minitoy_train_ROCm6_2_kineto.json.gz", 8_911, 8_780, 96, 35, 16 + 2),
    ];
    for &(name, span, idle, compute, non_compute, tolerance_us) in expected {
        let file = fixture(name);
        let a = analyze_paths(std::slice::from_ref(&file), &AnalyzeOptions::default()).unwrap();
        let g = &a.ranks[0].gpu;
        assert!(g.n_events as i64 + 2 >= tolerance_us || tolerance_us == 0, "{name}: {} GPU events", g.n_events);
        let ours = [g.span_ns, g.idle_ns, g.compute_ns, g.non_compute_ns];
        for (what, (ns, hta_us)) in
            ["span", "idle", "compute", "non-compute"].iter().zip(ours.iter().zip([span, idle, compute, non_compute]))
        {
            let diff_ns = (ns - hta_us * 1000).abs();
            assert!(diff_ns <= tolerance_us * 1000, "{name} {what}: stoke {ns} ns, HTA {hta_us} us");
        }
    }
}

/// Both sampled ranks of the HTA filter fixture load as one two-rank analysis.
#[test]
fn fixture_ranks_align() {
    let pair =
        vec![fixture("hta_trace_filter_sampled_rank-0.json.gz"), fixture("hta_trace_filter_sampled_rank-1.json.gz")];
    let a = analyze_paths(&pair, &AnalyzeOptions::default()).unwrap();
    assert_eq!(a.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(), vec![0, 1]);
    let cross = a.cross_rank.expect("two ranks");
    assert!(!cross.steps.is_empty());
}
