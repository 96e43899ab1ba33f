//! The merged report of a data-parallel run: every rank computes its own step report, sends rank 0
//! a [`RankStepReport`](crate::RankStepReport) (its summary and its steps, for the trace), and rank 0 adds the `ranks` section
//! and the `straggler` finding to its report (`merge_ranks`).
//!
//! Synchronous collectives make every rank's step as long as the slowest rank's: a fast rank spends
//! the difference waiting in `comm_exposed`. So ranks are compared by their *busy* time, the step
//! minus `comm_exposed` (the time a rank worked rather than waited for the others): the straggler is
//! the rank with the most, and its excess over the median rank's busy time is what the others wait
//! for, which bounds the gain if it were as fast as the median rank.

use crate::findings::{amdahl_bound, pct, sort_by_bound, Finding, RuleId};
use crate::input::ProfConfig;
use crate::rank_report::{ClockOffset, RankSummary, RanksReport};
use crate::report::RunReport;
use crate::vocab::Phase;

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
            pipeline: report.pipeline_stage,
        }
    }
}

/// Adds the `ranks` section to rank 0's `report` from every rank's summary (rank 0's included) and,
/// when the slowest rank's busy time exceeds the median rank's by more than
/// `config.straggler_min`, the `straggler` finding (findings re-sorted by bound). `tensor`: the
/// ranks one model is cut over (tensor parallelism), which train the same rows, as do a copy's
/// pipeline stages (`report.train.pipeline`), whose bubble the `pipeline` section gives.
pub fn merge_ranks(
    report: &mut RunReport,
    world_size: usize,
    tensor: usize,
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
    // The job's rates: every copy of the model trains its own rows in the same steps, so the job's
    // rate is the sum of the ranks' over the ranks of a copy; ranks that sent no summary count at
    // the reporting ranks' mean.
    let stages = report.train.pipeline.max(1);
    if stages > 1 {
        // The first copy's stages, one part of each (rank = (copy x stages + stage) x tensor + part).
        let measured = ranks
            .iter()
            .filter(|r| r.rank < stages * tensor.max(1) && r.rank % tensor.max(1) == 0)
            .filter_map(|r| r.pipeline.map(|p| (r.rank / tensor.max(1), r.rank, p)))
            .collect();
        let schedule = report.train.pipeline_schedule.clone();
        report.pipeline = Some(crate::pipeline::PipelineReport::new(
            (stages, report.train.pipeline_chunks.max(1)),
            report.train.grad_accum,
            &schedule,
            measured,
        ));
    }
    let reported: f64 = ranks.iter().map(|r| r.tokens_per_s).sum();
    if reported > 0.0 && report.tokens_per_s > 0.0 {
        let job = reported * world_size as f64 / ranks.len() as f64 / (tensor.max(1) * stages) as f64;
        let scale = job / report.tokens_per_s;
        report.rank0 = Some(crate::report::RankRates {
            tokens_per_s: report.tokens_per_s,
            tokens_per_s_mean: report.tokens_per_s_mean,
            samples_per_s: report.samples_per_s,
            mfu: report.mfu,
        });
        report.tokens_per_s = job;
        report.tokens_per_s_mean *= scale;
        report.tokens_per_s_p90_step *= scale;
        report.samples_per_s *= scale;
        report.frames_per_s *= scale;
        // Against the peaks of all ranks: the mean of the ranks' MFU.
        report.mfu *= scale / world_size as f64;
        report.compute_mfu *= scale / world_size as f64;
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
    use std::collections::BTreeMap;

    use super::*;
    use crate::input::StepSample;
    use crate::rank_report::{RankMemory, RankStepReport, TimedStep};
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
            pipeline: None,
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
        merge_ranks(&mut report, busy.len(), 1, ranks, Vec::new(), &ProfConfig::default());
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
    fn a_multi_rank_headline_is_the_job_s_with_rank_0_s_beside_it() {
        let steps: Vec<StepSample> = (1..=20).map(|i| step(i, &[(Phase::Forward, 20.0)])).collect();
        let mut facts = facts();
        facts.machine.peak_flops = 1e12;
        let mut report = build_report(&facts, &steps, 0, 0.0, &ProfConfig::default());
        let (rate, samples, mfu) = (report.tokens_per_s, report.samples_per_s, report.mfu);
        assert!(rate > 0.0 && mfu > 0.0 && (samples - rate / 32.0).abs() < 1e-9);
        // Three ranks each as fast as rank 0; one of four never reported.
        let ranks = (0..3).map(|r| RankSummary { tokens_per_s: rate, ..summary(r, 20.0, 20.0) }).collect();
        merge_ranks(&mut report, 4, 1, ranks, Vec::new(), &ProfConfig::default());
        assert!((report.tokens_per_s - 4.0 * rate).abs() < 1e-6 * rate, "{} vs {rate}", report.tokens_per_s);
        assert!((report.samples_per_s - 4.0 * samples).abs() < 1e-6 * samples);
        // The job's MFU is against four ranks' peaks: the same as each rank's.
        assert!((report.mfu - mfu).abs() < 1e-12, "{} vs {mfu}", report.mfu);
        let rank0 = report.rank0.as_ref().expect("rank 0's own rates are kept");
        assert_eq!((rank0.tokens_per_s, rank0.mfu), (rate, mfu));
        let text = report.render_text();
        assert!(text.contains("over all 4 ranks; rank 0 alone"), "{text}");
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
