//! Diagnosis rules over a step report: each has an id, a configurable threshold (`ProfConfig`), the
//! evidence, the cause, the fix, and the bound on the gain (Amdahl: step / (step - removable time)).
//!
//! | id | fires when (default) | bound |
//! |---|---|---|
//! | `data_wait` | data_wait > 5% of step | step / (step - data_wait) |
//! | `comm_exposed` | comm_exposed > 10% | step / (step - comm_exposed) |
//! | `ckpt_stall` | ckpt_stall > 2% | step / (step - ckpt_stall) |
//! | `low_compute_ratio` | matmuls timed alone / step < 70% | the time over the matmuls no other finding claims, down to the step at 70% |
//! | `memory_pressure` | peak memory > 90% of capacity | none (a risk, not a cost) |
//! | `fp32_on_bf16_hardware` | fp32 run where bf16 peak ≥ 1.5x fp32 | compute phases sped up by the peak ratio |
//! | `bf16_slower_than_fp32` | bf16/fp16 run where fp32 peak ≥ 1.5x bf16 | compute phases sped up by the peak ratio |
//! | `loss_scale_thrashing` | loss scale changes on > 5% of steps | step / (step - skipped steps' share) |
//! | `step_outliers` | > 1% of steps beyond mean + 3 sigma | mean step / mean of the others |
//! | `small_batch` | compute phases < 30% of peak and a micro-batch < 8192 tokens | compute phases at 30% of peak |

use crate::findings::{amdahl, pct, sort_by_bound, Finding, RuleId};
use crate::input::{ProfConfig, StepSample};
use crate::report::{measured_steps, RunReport};
use crate::vocab::{Phase, Precision};

/// Runs every rule; findings come sorted by bound, largest first (risks without a bound last).
/// `steps` are all of the run's steps; those the report skipped are left out here too.
pub fn diagnose(report: &RunReport, steps: &[StepSample], config: &ProfConfig) -> Vec<Finding> {
    let (measured, _) = measured_steps(steps, config.skip_steps);
    let steps: Vec<StepSample> = measured.into_iter().cloned().collect();
    let step = report.step_ms;
    let share = |phase: Phase| report.phase_shares.get(&phase).copied().unwrap_or(0.0);
    let ms = |phase: Phase| report.phases.get(&phase).copied().unwrap_or(0.0);
    let mut findings = Vec::new();
    let mut claimed_ms = 0.0;
    let mut finding = |rule: RuleId, threshold: String, value: f64, evidence: String, bound: Option<f64>| {
        findings.push(Finding::new(rule, threshold, value, evidence, bound))
    };

    if share(Phase::DataWait) > config.data_wait_max {
        claimed_ms += ms(Phase::DataWait);
        finding(
            RuleId::StepDataWait,
            format!("> {} of step", pct(config.data_wait_max)),
            share(Phase::DataWait),
            format!(
                "data_wait {:.2} ms of {:.2} ms per step ({})",
                ms(Phase::DataWait),
                step,
                pct(share(Phase::DataWait))
            ),
            Some(amdahl(step, ms(Phase::DataWait))),
        );
    }
    if share(Phase::CommExposed) > config.comm_exposed_max {
        claimed_ms += ms(Phase::CommExposed);
        finding(
            RuleId::StepCommExposed,
            format!("> {} of step", pct(config.comm_exposed_max)),
            share(Phase::CommExposed),
            format!(
                "comm_exposed {:.2} ms per step ({}) of comm_total {:.2} ms",
                ms(Phase::CommExposed),
                pct(share(Phase::CommExposed)),
                report.comm_total_ms
            ),
            Some(amdahl(step, ms(Phase::CommExposed))),
        );
    }
    if share(Phase::CkptStall) > config.ckpt_stall_max {
        claimed_ms += ms(Phase::CkptStall);
        finding(
            RuleId::StepCkptStall,
            format!("> {} of step", pct(config.ckpt_stall_max)),
            share(Phase::CkptStall),
            format!(
                "checkpointing stalls {:.2} ms per step on average ({})",
                ms(Phase::CkptStall),
                pct(share(Phase::CkptStall))
            ),
            Some(amdahl(step, ms(Phase::CkptStall))),
        );
    }
    if let (Some(fp32), Some(bf16)) = (report.machine.peak_flops_fp32, report.machine.peak_flops_bf16) {
        // The other precision's peak over the run's: fp32_on_bf16_hardware on an fp32 run,
        // bf16_slower_than_fp32 on a 16-bit one.
        let run = report.train.precision;
        let (rule, faster, slower) = if run == Precision::Fp32 {
            (RuleId::StepFp32OnBf16Hardware, ("bf16", bf16), ("fp32", fp32))
        } else {
            (RuleId::StepBf16SlowerThanFp32, ("fp32", fp32), ("bf16", bf16))
        };
        let ratio = faster.1 / slower.1;
        if ratio >= config.bf16_speedup_min {
            let compute: f64 = Phase::COMPUTE.iter().map(|&p| ms(p)).sum();
            let saved = compute * (1.0 - 1.0 / ratio);
            finding(
                rule,
                format!("{run} run where the {} peak is >= {:.1}x {}", faster.0, config.bf16_speedup_min, slower.0),
                ratio,
                format!(
                    "measured peaks: {} {:.0} GFLOP/s, {} {:.0} GFLOP/s ({ratio:.1}x); compute phases {:.2} ms per step",
                    faster.0,
                    faster.1 / 1e9,
                    slower.0,
                    slower.1 / 1e9,
                    compute
                ),
                Some(amdahl(step, saved)),
            );
        }
    }
    let scales: Vec<f64> = steps.iter().filter_map(|s| s.loss_scale).collect();
    if scales.len() > 1 {
        let changes = scales.windows(2).filter(|w| w[0] != w[1]).count();
        let decreases = scales.windows(2).filter(|w| w[1] < w[0]).count();
        let rate = changes as f64 / (scales.len() - 1) as f64;
        if rate > config.loss_scale_changes_max {
            let skipped = decreases as f64 / scales.len() as f64;
            finding(
                RuleId::StepLossScaleThrashing,
                format!("loss scale changes on > {} of steps", pct(config.loss_scale_changes_max)),
                rate,
                format!("{changes} changes in {} steps, {decreases} of them overflows (skipped steps)", scales.len()),
                Some(1.0 / (1.0 - skipped).max(1e-9)),
            );
        }
    }
    let n = report.steps_measured.max(1) as f64;
    let outlier_share = report.outlier_steps.len() as f64 / n;
    if outlier_share > config.outlier_fraction_max {
        let outliers: std::collections::BTreeSet<u64> = report.outlier_steps.iter().copied().collect();
        let (mut all, mut rest, mut n_rest) = (0.0, 0.0, 0usize);
        for s in &steps {
            all += s.wall_ms;
            if !outliers.contains(&s.step) {
                rest += s.wall_ms;
                n_rest += 1;
            }
        }
        let mean_all = all / steps.len().max(1) as f64;
        let mean_rest = rest / n_rest.max(1) as f64;
        let shown: Vec<String> = report.outlier_steps.iter().take(8).map(u64::to_string).collect();
        finding(
            RuleId::StepOutliers,
            format!("> {} of steps beyond mean + {} sigma", pct(config.outlier_fraction_max), config.outlier_sigma),
            outlier_share,
            format!(
                "{} of {} steps (steps {}{}) exceed {:.2} ms + {}·{:.2} ms",
                report.outlier_steps.len(),
                report.steps_measured,
                shown.join(", "),
                if report.outlier_steps.len() > 8 { ", ..." } else { "" },
                mean_all,
                config.outlier_sigma,
                report.step_ms_std
            ),
            Some(if mean_rest > 0.0 { mean_all / mean_rest } else { 1.0 }),
        );
    }
    let tokens_per_micro_batch = (report.train.micro_batch * report.model.seq_len) as u64;
    if report.compute_mfu > 0.0
        && report.compute_mfu < config.batch_mfu_min
        && tokens_per_micro_batch < config.batch_tokens_small
    {
        let compute: f64 = Phase::COMPUTE.iter().map(|&p| ms(p)).sum();
        let saved = compute * (1.0 - report.compute_mfu / config.batch_mfu_min);
        claimed_ms += 0.0;
        finding(
            RuleId::StepSmallBatch,
            format!(
                "compute phases < {} of peak and < {} tokens per micro-batch",
                pct(config.batch_mfu_min),
                config.batch_tokens_small
            ),
            report.compute_mfu,
            format!(
                "the compute phases run at {} of peak with {} tokens per micro-batch ({} x {})",
                pct(report.compute_mfu),
                tokens_per_micro_batch,
                report.train.micro_batch,
                report.model.seq_len
            ),
            Some(amdahl(step, saved)),
        );
    }
    if report.effective_compute_ratio < config.compute_ratio_min {
        let compute: f64 = Phase::COMPUTE.iter().map(|&p| ms(p)).sum();
        let mut parts: Vec<(Phase, f64)> = report
            .phases
            .iter()
            .filter(|(phase, ms)| !phase.is_compute() && **ms > 0.0)
            .map(|(&phase, &ms)| (phase, ms))
            .collect();
        parts.sort_by(|a, b| b.1.total_cmp(&a.1));
        let listed: Vec<String> = parts.iter().map(|(name, ms)| format!("{name} {ms:.2} ms")).collect();
        let (evidence, bound) = match report.train.gemm_ms_per_step {
            Some(gemm) => (
                format!(
                    "the step's matrix multiplies alone take {gemm:.2} of its {step:.2} ms ({}); the compute phases \
                     {compute:.2} ms ({} over the multiplies: casts, copies, launches, element-wise work), the \
                     rest: {}",
                    pct(report.effective_compute_ratio),
                    pct((compute - gemm).max(0.0) / step),
                    listed.join(", ")
                ),
                {
                    // What this rule can claim: the compute phases' time over the multiplies, and
                    // the time outside compute that no specific rule above claimed; the step can
                    // shrink by that, but not below its multiplies at the threshold ratio.
                    let claimable = (compute - gemm).max(0.0) + (step - compute - claimed_ms).max(0.0);
                    let at = (step - claimable).max(gemm / config.compute_ratio_min);
                    Some(step / at).filter(|b| b.is_finite() && *b >= 1.0)
                },
            ),
            // Unmeasured: the umbrella claims only what the specific rules above did not, so that it
            // never outranks the finding that names the real cause.
            None => (
                format!(
                    "compute {:.2} of {:.2} ms per step ({}); the rest: {}",
                    compute,
                    step,
                    pct(report.effective_compute_ratio),
                    listed.join(", ")
                ),
                Some(amdahl(step, (step - compute - claimed_ms).max(0.0))),
            ),
        };
        finding(
            RuleId::StepLowComputeRatio,
            format!("effective compute ratio < {}", pct(config.compute_ratio_min)),
            report.effective_compute_ratio,
            evidence,
            bound,
        );
    }
    if let Some(capacity) = report.machine.memory_capacity_bytes.filter(|&c| c > 0) {
        let used = report.peak_memory_bytes as f64 / capacity as f64;
        if used > config.memory_max {
            finding(
                RuleId::StepMemoryPressure,
                format!("peak memory > {} of capacity", pct(config.memory_max)),
                used,
                format!("peak {} of {} bytes ({})", report.peak_memory_bytes, capacity, pct(used)),
                None,
            );
        }
    }
    if let Some(stages) = &report.frame_stages {
        // A frame loader says where its threads' time goes: the data-wait finding names that stage.
        for found in findings.iter_mut().filter(|f| f.id == RuleId::StepDataWait.rule().id) {
            let (stage, fix) = stages.dominant();
            found.evidence.push_str(&format!(
                "; the loader's threads per batch: decoding {:.2} ms, augmenting {:.2} ms, reading and \
                 assembling {:.2} ms",
                stages.decode_ms, stages.augment_ms, stages.read_ms
            ));
            found.cause =
                format!("the trainer waits for batches, and the loader's threads spend most of a batch {stage}");
            found.fix = fix.to_string();
        }
    }
    sort_by_bound(&mut findings);
    findings
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::tests::{facts, step};
    use crate::step::build_report;

    /// Builds a run of 50 identical steps and returns the ids of the findings, in order.
    fn check(parts: &[(Phase, f64)], tweak: impl Fn(&mut crate::RunFacts), expected: &[&str]) {
        let mut facts = facts();
        tweak(&mut facts);
        let steps: Vec<StepSample> = (1..=50).map(|i| step(i, parts)).collect();
        let report = build_report(&facts, &steps, 1 << 20, 0.0, &ProfConfig::default());
        let ids: Vec<&str> = report.findings.iter().map(|f| f.id.as_str()).collect();
        assert_eq!(ids, expected, "{}", report.render_text());
    }

    // A large batch so the small_batch rule stays out of the way unless asked for.
    fn big(facts: &mut crate::RunFacts) {
        facts.train.micro_batch = 1024;
    }

    #[test]
    fn balanced_steps_raise_nothing() {
        check(
            &[
                (Phase::DataWait, 0.1),
                (Phase::Forward, 3.0),
                (Phase::Backward, 6.0),
                (Phase::Optimizer, 1.0),
                (Phase::Other, 0.2),
            ],
            big,
            &[],
        );
    }

    #[test]
    fn a_step_far_from_its_matrix_multiplies_is_named_with_the_step_at_the_threshold_as_its_bound() {
        let parts = [(Phase::Forward, 3.0), (Phase::Backward, 6.0), (Phase::Optimizer, 1.0)];
        // The compute phases are the whole step, but the products alone take 5 of its 10 ms.
        let measured = |facts: &mut crate::RunFacts| {
            big(facts);
            facts.train.gemm_ms_per_step = Some(5.0);
        };
        check(&parts, measured, &["low_compute_ratio"]);
        let mut facts = facts();
        measured(&mut facts);
        let steps: Vec<StepSample> = (1..=50).map(|i| step(i, &parts)).collect();
        let report = build_report(&facts, &steps, 1 << 20, 0.0, &ProfConfig::default());
        assert_eq!(report.effective_compute_ratio, 0.5);
        assert!((report.compute_share - 1.0).abs() < 1e-12);
        let f = &report.findings[0];
        // At 70% the step would be 5 / 0.7 ms: 10 / (5 / 0.7) = 1.4x.
        assert!((f.bound.unwrap() - 1.4).abs() < 1e-12, "{f:?}");
        assert!(f.evidence.contains("matrix multiplies alone take 5.00 of its 10.00 ms"), "{}", f.evidence);
        // At 8 of 10 ms nothing fires.
        check(
            &parts,
            |f| {
                big(f);
                f.train.gemm_ms_per_step = Some(8.0)
            },
            &[],
        );
    }

    #[test]
    fn data_starvation_is_the_top_finding() {
        check(
            &[
                (Phase::DataWait, 10.0),
                (Phase::Forward, 3.0),
                (Phase::Backward, 6.0),
                (Phase::Optimizer, 1.0),
                (Phase::Other, 0.5),
            ],
            big,
            &["data_wait", "low_compute_ratio"],
        );
    }

    #[test]
    fn each_rule_fires_on_its_own_evidence() {
        let compute = [(Phase::Forward, 3.0), (Phase::Backward, 6.0), (Phase::Optimizer, 1.0)];
        let with = |extra: (Phase, f64)| -> Vec<(Phase, f64)> {
            compute.iter().copied().chain(std::iter::once(extra)).collect()
        };
        check(&with((Phase::CommExposed, 2.0)), big, &["comm_exposed"]);
        check(&with((Phase::CkptStall, 0.5)), big, &["ckpt_stall"]);
        check(&with((Phase::Other, 6.0)), big, &["low_compute_ratio"]);
        check(
            &compute,
            |f| {
                big(f);
                f.train.precision = Precision::Fp32;
            },
            &["fp32_on_bf16_hardware"],
        );
        check(
            &compute,
            |f| {
                big(f);
                f.machine.peak_flops_fp32 = Some(4e11);
                f.machine.peak_flops_bf16 = Some(1e11);
            },
            &["bf16_slower_than_fp32"],
        );
        check(
            &compute,
            |f| {
                big(f);
                f.machine.memory_capacity_bytes = Some(1 << 20);
            },
            &["memory_pressure"],
        );
        // 10 ms steps of 256 tokens at 6e5 FLOPs each over a 1e12 peak: far below 30% of peak.
        check(&compute, |_| {}, &["small_batch"]);
    }

    #[test]
    fn thrashing_loss_scale_and_outliers() {
        let mut steps: Vec<StepSample> =
            (1..=200).map(|i| step(i, &[(Phase::Forward, 5.0 + (i % 2) as f64), (Phase::Backward, 5.0)])).collect();
        for s in steps.iter_mut() {
            s.loss_scale = Some(if s.step % 4 == 0 { 1024.0 } else { 2048.0 });
        }
        for i in [50, 120, 170] {
            steps[i].phases.add(Phase::Other, 30.0);
            steps[i].wall_ms += 30.0;
        }
        let mut facts = facts();
        big(&mut facts);
        let report = build_report(&facts, &steps, 0, 0.0, &ProfConfig::default());
        let ids: Vec<&str> = report.findings.iter().map(|f| f.id.as_str()).collect();
        assert!(ids.contains(&"loss_scale_thrashing") && ids.contains(&"step_outliers"), "{ids:?}");
        assert_eq!(report.outlier_steps, vec![51, 121, 171]);
    }

    /// A frame loader's counters turn the data-wait finding into one about the stage that takes
    /// most of its threads' time, with that stage's fix; a text run's finding stays general.
    #[test]
    fn a_frame_loaders_data_wait_names_its_slowest_stage() {
        let parts = [(Phase::DataWait, 4.0), (Phase::Forward, 3.0), (Phase::Backward, 6.0)];
        let run = |counters: Option<(u64, u64, u64)>| {
            let steps: Vec<StepSample> = (1..=50u64)
                .map(|i| StepSample {
                    frame_stages: counters.map(|(decode, augment, other)| crate::FrameCounters {
                        batches: i,
                        decode_ns: i * decode,
                        augment_ns: i * augment,
                        busy_ns: i * (decode + augment + other),
                    }),
                    ..step(i, &parts)
                })
                .collect();
            let report = build_report(&facts(), &steps, 1 << 20, 0.0, &ProfConfig::default());
            let found = report.findings.iter().find(|f| f.id == "data_wait").expect("a data_wait finding").clone();
            (report, found)
        };
        let (report, decode) = run(Some((3_000_000, 1_000_000, 500_000)));
        let stages = report.frame_stages.expect("the report keeps the loader's stages");
        assert_eq!(stages.batches, 50);
        assert!((stages.decode_ms - 3.0).abs() < 1e-9 && (stages.read_ms - 0.5).abs() < 1e-9, "{stages:?}");
        assert!(decode.cause.contains("decoding frames") && decode.fix.contains("--keep-encoded"), "{decode:?}");
        assert!(decode.evidence.contains("decoding 3.00 ms, augmenting 1.00 ms"), "{decode:?}");
        let (_, augment) = run(Some((200_000, 2_000_000, 100_000)));
        assert!(augment.cause.contains("augmenting frames") && augment.fix.contains("data.workers"), "{augment:?}");
        let (_, read) = run(Some((0, 100_000, 4_000_000)));
        assert!(read.cause.contains("reading records"), "{read:?}");
        let (report, text) = run(None);
        assert!(report.frame_stages.is_none());
        assert_eq!(text.cause, RuleId::StepDataWait.rule().cause);
    }
}
