//! What the ranks of a data-parallel run tell rank 0 (`RankStepReport`: a rank's summary, steps
//! and memory) and what rank 0's report says of them (`RanksReport`). Plain data; `ranks` fills it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::ProfError;
use crate::findings::pct;
use crate::input::StepSample;
use crate::vocab::Phase;

/// One rank's step report in brief: `report.json`'s `ranks.ranks[i]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankSummary {
    pub rank: usize,
    pub steps_measured: u64,
    /// Median, mean and 90th percentile of the rank's step wall time, ms.
    pub step_ms: f64,
    pub step_ms_mean: f64,
    pub step_ms_p90: f64,
    /// The rank's phases (its own report's), ms per step; they sum to `step_ms`.
    pub phases: BTreeMap<Phase, f64>,
    pub comm_exposed_ms: f64,
    /// All of the rank's communication per step, hidden or exposed.
    pub comm_total_ms: f64,
    pub data_wait_ms: f64,
    /// `step_ms - comm_exposed_ms`: the time the rank worked rather than waited for the others.
    pub busy_ms: f64,
    pub tokens_per_s: f64,
    /// A pipeline stage's waits and span, medians (`RunReport::pipeline_stage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<crate::pipeline::StageStep>,
}

/// One rank's memory: the model states it holds by the formula of its ZeRO stage (bytes of
/// parameters, gradients, optimizer state and communication buffers), and its measured peak
/// resident set during training.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankMemory {
    pub rank: usize,
    /// ZeRO stage (0: none).
    pub zero: u8,
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer: u64,
    pub comm_buffers: u64,
    /// Resident bytes when the measurement started (after set-up, before the first step).
    pub rss_start_bytes: Option<u64>,
    /// Peak resident bytes from then to the end of training (`VmHWM`).
    pub peak_rss_bytes: Option<u64>,
}

/// A step and when it started, in microseconds after the run's common start (see
/// `ChromeTraceWriter::rank_step`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimedStep {
    pub start_us: f64,
    pub sample: StepSample,
}

/// What a rank sends rank 0 at the end of a data-parallel run: its summary (None when it measured
/// no step) and its steps for the merged trace (empty when the trace is off).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankStepReport {
    pub rank: usize,
    pub summary: Option<RankSummary>,
    pub steps: Vec<TimedStep>,
    /// CLOCK_MONOTONIC at the rank's time zero, ns (see `ClockOffset::host_clock_offset_us`).
    #[serde(default)]
    pub clock_zero_host_ns: Option<u64>,
    /// The rank's memory, when measured.
    #[serde(default)]
    pub memory: Option<RankMemory>,
}

impl RankStepReport {
    /// The bytes sent over the communicator (JSON: small next to the run, and readable in a dump).
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a rank report serializes")
    }

    /// Parses the bytes rank `from` sent; a report that does not parse or names another rank is an
    /// error naming the sender.
    pub fn from_bytes(from: usize, bytes: &[u8]) -> Result<RankStepReport, ProfError> {
        let report: RankStepReport = serde_json::from_slice(bytes).map_err(|e| ProfError::RankReport {
            rank: from,
            reason: format!("{} bytes do not parse: {e}", bytes.len()),
        })?;
        if report.rank != from {
            return Err(ProfError::RankReport { rank: from, reason: format!("it names rank {}", report.rank) });
        }
        Ok(report)
    }
}

/// Rank `rank`'s trace clock against rank 0's, as rank 0 measured it at the start: rank `rank`'s
/// reading minus rank 0's at the same moment, from the ping-pong with the shortest round trip (the
/// estimate is off by at most half of it).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ClockOffset {
    pub rank: usize,
    pub offset_us: f64,
    pub round_trip_us: f64,
    /// The same offset from the ranks' CLOCK_MONOTONIC readings at their time zeros. The processes
    /// of one host share that clock, so when the rank runs on rank 0's host this is the true offset
    /// (a check of `offset_us`); across hosts it means nothing.
    #[serde(default)]
    pub host_clock_offset_us: Option<f64>,
}

/// `report.json`'s `ranks`: every rank's summary, the slowest rank and how much slower it is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RanksReport {
    pub world_size: usize,
    /// Every rank that measured steps, in rank order.
    pub ranks: Vec<RankSummary>,
    /// The rank with the most busy time per step (the one the others wait for).
    pub slowest_rank: usize,
    /// The median rank by busy time (the lower median: with two ranks, the faster one).
    pub median_rank: usize,
    /// The slowest rank's busy time over the median rank's, minus 1 (0.25: 25% slower).
    pub slowest_excess: f64,
    /// How each other rank's trace was moved onto rank 0's time line.
    #[serde(default)]
    pub clock_offsets: Vec<ClockOffset>,
    /// Every rank's memory that was measured, in rank order.
    #[serde(default)]
    pub memory: Vec<RankMemory>,
}

impl RanksReport {
    /// The per-rank table of the terminal report.
    pub fn render_text(&self) -> String {
        let mut out = format!(
            "ranks: {} of {} reported | slowest rank {} ({} more busy time than the median rank, rank {})\n",
            self.ranks.len(),
            self.world_size,
            self.slowest_rank,
            pct(self.slowest_excess),
            self.median_rank
        );
        out.push_str(&format!(
            "  {:>5} {:>10} {:>10} {:>10} {:>10} {:>13} {:>11} {:>10}\n",
            "rank", "step ms", "mean", "p90", "busy", "comm_exposed", "comm_total", "data_wait"
        ));
        for r in &self.ranks {
            out.push_str(&format!(
                "  {:>5} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>13.2} {:>11.2} {:>10.2}\n",
                r.rank,
                r.step_ms,
                r.step_ms_mean,
                r.step_ms_p90,
                r.busy_ms,
                r.comm_exposed_ms,
                r.comm_total_ms,
                r.data_wait_ms
            ));
        }
        out
    }
}
