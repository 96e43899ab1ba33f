//! The merged report of a data-parallel run: every rank computes its own step report, sends rank 0
//! a [`RankStepReport`] (its summary and its steps, for the trace), and rank 0 adds the `ranks` section
//! and the `straggler` finding to its report (`merge_ranks`).
//!
//! Synchronous collectives make every rank's step as long as the slowest rank's: a fast rank spends
//! the difference waiting in `comm_exposed`. So ranks are compared by their *busy* time, the step
//! minus `comm_exposed` (the time a rank worked rather than waited for the others): the straggler is
//! the rank with the most, and its excess over the median rank's busy time is what the others wait
//! for, which bounds the gain if it were as fast as the median rank.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::ProfError;
use crate::findings::{amdahl_bound, pct, sort_by_bound, Finding, RuleId};
use crate::report::{ProfConfig, RunReport, StepSample};
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
}

impl RankSummary {
    /// The summary of `report`, rank `rank`'s own step report.
    pub fn of(rank: usize, report: &RunReport) -> RankSummary {
        let phase = |p: Phase| report.phases.get(&p).copied().unwrap_or(0.0);
        RankSummary {
            rank,
            steps_measured: report.steps_measured,
            step_ms: report.step_ms,
            step_ms_mean: report.step_ms_mean,
            step_ms_p90: report.step_ms_p90,
            phases: report.phases.clone(),
            comm_exposed_ms: phase(Phase::CommExposed),
            comm_total_ms: report.comm_total_ms,
            data_wait_ms: phase(Phase::DataWait),
            busy_ms: (report.step_ms - phase(Phase::CommExposed)).max(0.0),
            tokens_per_s: report.tokens_per_s,
        }
    }
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

/// Adds the `ranks` section to rank 0's `report` from every rank's summary (rank 0's included) and,
/// when the slowest rank's busy time exceeds the median rank's by more than
/// `config.straggler_min`, the `straggler` finding (findings re-sorted by bound).
pub fn merge_ranks(
    report: &mut RunReport,
    world_size: usize,
    mut ranks: Vec<RankSummary>,
    clock_offsets: Vec<ClockOffset>,
    config: &ProfConfig,
) {
    ranks.sort_by_key(|r| r.rank);
    if ranks.is_empty() {
        return;
    }
    let mut by_busy: Vec<&RankSummary> = ranks.iter().collect();
    // Ties go to the lower rank, so the result does not depend on the order of arrival.
    by_busy.sort_by(|a, b| a.busy_ms.total_cmp(&b.busy_ms).then(b.rank.cmp(&a.rank)));
    let slowest = by_busy[by_busy.len() - 1];
    let median = by_busy[(by_busy.len() - 1) / 2];
    let excess = if median.busy_ms > 0.0 { slowest.busy_ms / median.busy_ms - 1.0 } else { 0.0 };
    if by_busy.len() > 1 && excess > config.straggler_min {
        let extra_ms = slowest.busy_ms - median.busy_ms;
        let waits: Vec<String> = ranks
            .iter()
            .filter(|r| r.rank != slowest.rank)
            .map(|r| format!("rank {} {:.2} ms", r.rank, r.comm_exposed_ms))
            .collect();
        let evidence = format!(
            "rank {} is busy {:.2} ms per step (step minus comm_exposed), the median rank (rank {}) {:.2} ms: \
             {} slower; the others wait for it in comm_exposed ({}); if it were as fast as the median rank, \
             the {:.2} ms step would lose up to {:.2} ms",
            slowest.rank,
            slowest.busy_ms,
            median.rank,
            median.busy_ms,
            pct(excess),
            waits.join(", "),
            report.step_ms,
            extra_ms
        );
        report.findings.push(Finding::new(
            RuleId::StepStraggler,
            format!("busy time > {} over the median rank's", pct(config.straggler_min)),
            excess,
            evidence,
            amdahl_bound(report.step_ms, extra_ms),
        ));
        sort_by_bound(&mut report.findings);
    }
    report.ranks = Some(RanksReport {
        world_size,
        slowest_rank: slowest.rank,
        median_rank: median.rank,
        slowest_excess: excess,
        ranks,
        clock_offsets,
        memory: Vec::new(),
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::{facts, step};
    use crate::step::build_report;

    fn summary(rank: usize, busy_ms: f64, step_ms: f64) -> RankSummary {
        let mut phases = BTreeMap::new();
        phases.insert(Phase::Forward, busy_ms);
        phases.insert(Phase::CommExposed, step_ms - busy_ms);
        RankSummary {
            rank,
            steps_measured: 10,
            step_ms,
            step_ms_mean: step_ms,
            step_ms_p90: step_ms,
            phases,
            comm_exposed_ms: step_ms - busy_ms,
            comm_total_ms: step_ms - busy_ms,
            data_wait_ms: 0.0,
            busy_ms,
            tokens_per_s: 1.0,
        }
    }

    /// Merges ranks of these busy times (20 ms steps) into a balanced report; returns the ranks
    /// section and the straggler finding, if any.
    fn check(busy: &[f64], expected_slowest: usize, expected_median: usize, fires: bool) -> Option<Finding> {
        let steps: Vec<StepSample> = (1..=20).map(|i| step(i, &[(Phase::Forward, 20.0)])).collect();
        let mut facts = facts();
        facts.train.micro_batch = 1024;
        let mut report = build_report(&facts, &steps, 0, 0.0, &ProfConfig::default());
        // Arrival order is not rank order.
        let ranks: Vec<RankSummary> = busy.iter().enumerate().rev().map(|(r, &b)| summary(r, b, 20.0)).collect();
        merge_ranks(&mut report, busy.len(), ranks, Vec::new(), &ProfConfig::default());
        let section = report.ranks.as_ref().unwrap();
        assert_eq!(section.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(), (0..busy.len()).collect::<Vec<_>>());
        assert_eq!((section.slowest_rank, section.median_rank), (expected_slowest, expected_median));
        let finding = report.findings.iter().find(|f| f.id == "straggler").cloned();
        assert_eq!(finding.is_some(), fires, "{:?}", report.findings);
        finding
    }

    #[test]
    fn the_slowest_rank_is_named_against_the_median_rank() {
        // Two ranks: the median rank is the faster one; rank 1 works 20 ms, rank 0 10 ms.
        let f = check(&[10.0, 20.0], 1, 0, true).unwrap();
        assert!(f.evidence.starts_with("rank 1 is busy 20.00 ms") && f.evidence.contains("100.0% slower"), "{f:?}");
        assert_eq!(f.value, 1.0);
        // 20 ms steps, 10 ms of them waiting for rank 1: at most 2x faster without it.
        assert_eq!(f.bound, Some(2.0));
        // Three ranks: the middle one is the median.
        let f = check(&[12.0, 10.0, 16.0], 2, 0, true).unwrap();
        assert!(f.evidence.contains("median rank (rank 0) 12.00 ms"), "{f:?}");
        assert_eq!(f.bound, Some(20.0 / 16.0));
        // Within the threshold (20%): no finding, but the section still names the slowest.
        check(&[10.0, 11.5, 10.2], 1, 2, false);
        // Equal ranks: the lower rank is "slowest", nothing fires.
        check(&[10.0, 10.0], 0, 1, false);
        // One rank: nothing to compare.
        check(&[10.0], 0, 0, false);
    }

    #[test]
    fn a_rank_report_round_trips_and_a_wrong_sender_is_named() {
        let report = RankStepReport {
            rank: 3,
            summary: Some(summary(3, 5.0, 8.0)),
            steps: vec![TimedStep { start_us: 12.5, sample: step(1, &[(Phase::Forward, 1.0)]) }],
            clock_zero_host_ns: Some(7),
            memory: Some(RankMemory {
                rank: 3,
                zero: 2,
                parameters: 40,
                gradients: 10,
                optimizer: 30,
                comm_buffers: 0,
                rss_start_bytes: Some(1000),
                peak_rss_bytes: Some(2000),
            }),
        };
        let bytes = report.to_bytes();
        assert_eq!(RankStepReport::from_bytes(3, &bytes).unwrap(), report);
        let err = RankStepReport::from_bytes(2, &bytes).unwrap_err().to_string();
        assert!(err.contains("rank 2") && err.contains("names rank 3"), "{err}");
        let err = RankStepReport::from_bytes(1, &bytes[..10]).unwrap_err().to_string();
        assert!(err.contains("rank 1") && err.contains("do not parse"), "{err}");
    }
}
