//! The trace analyzer on real traces (HTA's test data, in the shared fixtures folder) and on
//! synthetic ones written to a temporary folder.

use std::path::PathBuf;

use stoke_prof::{analyze_paths, AnalyzeOptions, Category};

fn fixtures() -> Option<Vec<PathBuf>> {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures/traces"));
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir).ok()?.filter_map(|e| e.ok().map(|e| e.path())).collect();
    files.sort();
    if files.is_empty() {
        return None;
    }
    Some(files)
}

/// Every fixture parses, and every step's categories sum to its wall time (exactly: the
/// breakdown is integer nanoseconds, so the 0.1% allowance is not needed).
#[test]
fn fixtures_parse_and_categories_sum_to_wall_time() {
    let Some(files) = fixtures() else {
        println!("skipped: fixtures absent");
        return;
    };
    for file in files {
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
    let Some(files) = fixtures() else {
        println!("skipped: fixtures absent");
        return;
    };
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
        let Some(file) = files.iter().find(|f| f.ends_with(name)) else { continue };
        let a = analyze_paths(std::slice::from_ref(file), &AnalyzeOptions::default()).unwrap();
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
    let Some(files) = fixtures() else {
        println!("skipped: fixtures absent");
        return;
    };
    let pair: Vec<PathBuf> =
        files.into_iter().filter(|f| f.to_string_lossy().contains("trace_filter_sampled_rank")).collect();
    if pair.len() != 2 {
        println!("skipped: fixtures absent");
        return;
    }
    let a = analyze_paths(&pair, &AnalyzeOptions::default()).unwrap();
    assert_eq!(a.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(), vec![0, 1]);
    let cross = a.cross_rank.expect("two ranks");
    assert!(!cross.steps.is_empty());
}
