//! Comparing two analyses: operators and kernels added, removed and changed, and the step time
//! with a tolerance that grows with the noise of the measurements.

use std::collections::{BTreeSet, HashMap};

use serde::Serialize;

use super::{Analysis, TraceError};

#[derive(Clone, Debug, PartialEq)]
pub struct DiffOptions {
    /// Relative step-time increase always tolerated. Default 0.05.
    pub tolerance: f64,
    /// Rows of the op and kernel tables (largest time change first). Default 20.
    pub top: usize,
}

impl Default for DiffOptions {
    fn default() -> Self {
        DiffOptions { tolerance: 0.05, top: 20 }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StepStats {
    pub n_steps: u64,
    pub mean_ns: f64,
    pub std_ns: f64,
}

impl StepStats {
    fn of(a: &Analysis) -> StepStats {
        let walls: Vec<f64> = a.ranks.iter().flat_map(|r| r.steps.iter().map(|s| s.wall_ns as f64)).collect();
        let n = walls.len();
        if n == 0 {
            return StepStats::default();
        }
        let mean = walls.iter().sum::<f64>() / n as f64;
        let var = if n > 1 { walls.iter().map(|w| (w - mean).powi(2)).sum::<f64>() / (n - 1) as f64 } else { 0.0 };
        StepStats { n_steps: n as u64, mean_ns: mean, std_ns: var.sqrt() }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NameDiff {
    pub name: String,
    /// `added`, `removed`, or `changed`.
    pub status: &'static str,
    pub base_count: u64,
    pub new_count: u64,
    pub base_ns: i64,
    pub new_ns: i64,
    pub delta_ns: i64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TraceDiff {
    pub base: StepStats,
    pub new: StepStats,
    /// (new mean - base mean) / base mean.
    pub step_change: f64,
    /// The largest change not called a regression: the tolerance, or three standard errors of
    /// the difference of the means, whichever is larger.
    pub allowed_change: f64,
    pub regression: bool,
    pub n_ops_added: usize,
    pub n_ops_removed: usize,
    pub n_kernels_added: usize,
    pub n_kernels_removed: usize,
    pub ops: Vec<NameDiff>,
    pub kernels: Vec<NameDiff>,
}

fn merged(
    a: &Analysis,
    pick: impl Fn(&super::RankReport) -> &HashMap<String, (u64, i64)>,
) -> HashMap<String, (u64, i64)> {
    let mut out: HashMap<String, (u64, i64)> = HashMap::new();
    for r in &a.ranks {
        for (name, &(count, ns)) in pick(r) {
            let e = out.entry(name.clone()).or_default();
            e.0 += count;
            e.1 += ns;
        }
    }
    out
}

fn name_diffs(
    base: &HashMap<String, (u64, i64)>,
    new: &HashMap<String, (u64, i64)>,
    top: usize,
) -> (Vec<NameDiff>, usize, usize) {
    let names: BTreeSet<&String> = base.keys().chain(new.keys()).collect();
    let mut rows: Vec<NameDiff> = names
        .into_iter()
        .filter_map(|name| {
            let (bc, bns) = base.get(name).copied().unwrap_or((0, 0));
            let (nc, nns) = new.get(name).copied().unwrap_or((0, 0));
            let status = match (base.contains_key(name), new.contains_key(name)) {
                (false, true) => "added",
                (true, false) => "removed",
                _ if bc == nc && bns == nns => return None,
                _ => "changed",
            };
            Some(NameDiff {
                name: name.clone(),
                status,
                base_count: bc,
                new_count: nc,
                base_ns: bns,
                new_ns: nns,
                delta_ns: nns - bns,
            })
        })
        .collect();
    let added = rows.iter().filter(|r| r.status == "added").count();
    let removed = rows.iter().filter(|r| r.status == "removed").count();
    rows.sort_by(|a, b| b.delta_ns.abs().cmp(&a.delta_ns.abs()).then(a.name.cmp(&b.name)));
    rows.truncate(top);
    (rows, added, removed)
}

/// Why `analysis` gives no step time to compare (no rank, no step, or steps of no duration),
/// naming its files and the events dropped on the way in; none when it can be measured.
fn unmeasurable(analysis: &Analysis, stats: &StepStats) -> Option<String> {
    if stats.n_steps > 0 && stats.mean_ns > 0.0 && stats.mean_ns.is_finite() {
        return None;
    }
    let files: Vec<String> = analysis
        .ranks
        .iter()
        .map(|r| {
            let dropped = r.ingest.dropped_reasons();
            let dropped = if dropped.is_empty() { String::new() } else { format!("; dropped {dropped}") };
            format!("{} ({} events kept of {} entries{dropped})", r.file, r.ingest.n_events, r.ingest.n_entries)
        })
        .collect();
    let what = if stats.n_steps == 0 || analysis.ranks.iter().all(|r| r.ingest.n_events == 0) {
        "no timed events"
    } else {
        "steps of zero duration"
    };
    Some(format!("{what}: {}", if files.is_empty() { "no trace".to_string() } else { files.join(", ") }))
}

/// Compares `new` against `base`. Refuses (naming the side and why) a side that gives no step
/// time: an empty trace, one whose events all lack numeric timestamps, or whose durations are all
/// negative would otherwise read as a 100% speed-up.
pub fn diff(base: &Analysis, new: &Analysis, opts: &DiffOptions) -> Result<TraceDiff, TraceError> {
    let (b, n) = (StepStats::of(base), StepStats::of(new));
    for (side, analysis, stats) in [("OLD", base, &b), ("NEW", new, &n)] {
        if let Some(why) = unmeasurable(analysis, stats) {
            return Err(TraceError::Unmeasurable { side, why });
        }
    }
    let step_change = if b.mean_ns > 0.0 { (n.mean_ns - b.mean_ns) / b.mean_ns } else { 0.0 };
    let stderr = if b.n_steps > 0 && n.n_steps > 0 && b.mean_ns > 0.0 {
        (b.std_ns.powi(2) / b.n_steps as f64 + n.std_ns.powi(2) / n.n_steps as f64).sqrt() / b.mean_ns
    } else {
        0.0
    };
    let allowed_change = opts.tolerance.max(3.0 * stderr);
    let (ops, n_ops_added, n_ops_removed) = name_diffs(&merged(base, |r| &r.ops), &merged(new, |r| &r.ops), opts.top);
    let (kernels, n_kernels_added, n_kernels_removed) =
        name_diffs(&merged(base, |r| &r.kernels), &merged(new, |r| &r.kernels), opts.top);
    Ok(TraceDiff {
        regression: step_change > allowed_change,
        base: b,
        new: n,
        step_change,
        allowed_change,
        n_ops_added,
        n_ops_removed,
        n_kernels_added,
        n_kernels_removed,
        ops,
        kernels,
    })
}
