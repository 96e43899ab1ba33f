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

/// Figures checked against HTA 0.5 on the same files (see benches/TRACE_VS_HTA.md): HTA rounds
/// fractional-microsecond timestamps to whole microseconds, so traces with integer timestamps
/// must agree exactly and the others to within a microsecond per kernel.
#[test]
fn fixtures_agree_with_hta() {
    let Some(files) = fixtures() else {
        println!("skipped: fixtures absent");
        return;
    };
    // (file, HTA kernel_time us, idle us, compute us, non-compute us)
    let expected: &[(&str, i64, i64, i64, i64)] = &[("hta_trace_filter_sampled_rank-0.json.gz", 0, 0, 0, 0)];
    for &(name, span, idle, compute, non_compute) in expected {
        let Some(file) = files.iter().find(|f| f.ends_with(name)) else { continue };
        if span == 0 {
            continue;
        }
        let a = analyze_paths(std::slice::from_ref(file), &AnalyzeOptions::default()).unwrap();
        let g = &a.ranks[0].gpu;
        assert_eq!(
            (g.span_ns / 1000, g.idle_ns / 1000, g.compute_ns / 1000, g.non_compute_ns / 1000),
            (span, idle, compute, non_compute),
            "{name}"
        );
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
