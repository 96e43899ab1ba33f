//! `stoke trace`: analysis of PyTorch profiler (Kineto) traces.
//!
//! Pipeline: `ingest` streams each file through the `scan` tokenizer into a compact `RankTrace`
//! (several files in parallel, gzip inflated on its own thread); `analyze` computes one rank's
//! breakdowns from it, after which the trace is dropped; `ranks` compares ranks; `diagnose` turns
//! numbers into findings; `diff` compares two analyses; `render` writes tables, Markdown,
//! Prometheus text and an overlay Chrome trace; `synth` writes synthetic traces for tests and
//! benchmarks.

mod analyze;
mod classify;
mod diagnose;
mod diff;
mod error;
mod event;
mod figures;
mod ingest;
mod intervals;
mod ranks;
mod render;
mod scan;
mod synth;

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::findings::Finding;

pub use analyze::AnalyzeOptions;
pub use classify::{kernel_type, peak_flops_for, KernelType};
pub use diff::{diff, DiffOptions, NameDiff, StepStats, TraceDiff};
pub use error::TraceError;
pub use event::{DeviceInfo, Event, IngestStats, Kind, MemorySample, RankTrace};
pub use figures::{
    Categories, Category, Dist, GpuTime, KernelStat, KernelTypeTime, LaunchStats, MemcpyStat, MemoryStat, Overlap,
    QueueStat, RankReport, StepReport, StreamIdle, TensorCoreStat,
};
pub use ingest::{find_trace_files, load_trace, load_traces};
pub use ranks::{cross_rank, AlignedStep, CrossRank, RankCollectives};
pub use render::{diff_markdown, diff_table, markdown, overlay_trace, prometheus, table};
pub use synth::{write_synthetic, SynthOptions};

/// The analysis of a set of traces (one per rank).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Analysis {
    pub ranks: Vec<RankReport>,
    /// Present with two or more ranks.
    pub cross_rank: Option<CrossRank>,
}

impl Analysis {
    /// Every finding: per rank, then across ranks.
    pub fn findings(&self) -> impl Iterator<Item = (Option<u32>, &Finding)> {
        self.ranks
            .iter()
            .flat_map(|r| r.findings.iter().map(move |f| (Some(r.rank), f)))
            .chain(self.cross_rank.iter().flat_map(|c| c.findings.iter().map(|f| (None, f))))
    }
}

/// One rank's report: its figures (`analyze`), then its findings (`diagnose`).
pub fn analyze_rank(trace: &RankTrace, opts: &AnalyzeOptions) -> RankReport {
    let mut report = analyze::measure_rank(trace, opts);
    diagnose::diagnose(&mut report, trace.devices.first());
    report
}

/// Analyzes already loaded traces.
pub fn analyze(traces: &[RankTrace], opts: &AnalyzeOptions) -> Analysis {
    let ranks: Vec<RankReport> = traces.iter().map(|t| analyze_rank(t, opts)).collect();
    let cross_rank = cross_rank(&ranks);
    Analysis { ranks, cross_rank }
}

/// Reads and analyzes trace files and directories. Files are processed in parallel and each
/// trace is dropped once analyzed, so peak memory is that of the largest traces in flight, not
/// of all of them.
pub fn analyze_paths(inputs: &[PathBuf], opts: &AnalyzeOptions) -> Result<Analysis, TraceError> {
    let files = find_trace_files(inputs)?;
    use rayon::prelude::*;
    // Each worker holds one trace at a time and drops it once analyzed.
    let analyzed: Vec<Result<RankReport, TraceError>> =
        files.par_iter().map(|path| load_trace(path).map(|t| analyze_rank(&t, opts))).collect();
    // The first file's error in file order, as analyzing them one by one would report.
    let mut ranks = analyzed.into_iter().collect::<Result<Vec<RankReport>, TraceError>>()?;
    let mut slots: Vec<ingest::RankSlot<'_>> = ranks
        .iter_mut()
        .zip(&files)
        .map(|(r, path)| ingest::RankSlot { rank: &mut r.rank, source: &mut r.rank_source, path: path.as_path() })
        .collect();
    ingest::assign_ranks(&mut slots)?;
    ranks.sort_by_key(|r| r.rank);
    let cross_rank = cross_rank(&ranks);
    Ok(Analysis { ranks, cross_rank })
}

/// The rank a file name names (`rank3`, `rank-3`, `rank_3`), if any.
pub fn rank_from_file_name(path: &Path) -> Option<u32> {
    ingest::rank_from_file_name(path)
}

#[cfg(test)]
mod tests;
