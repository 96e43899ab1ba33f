//! Across ranks: steps aligned by number, stragglers, and collective wait versus transfer.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::diagnose::STRAGGLER_FACTOR;
use super::figures::RankReport;
use crate::findings::{Finding, RuleId};

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AlignedStep {
    pub step: u64,
    /// (rank, wall ns) for every rank that has the step.
    pub wall_ns: Vec<(u32, i64)>,
    pub min_ns: i64,
    pub median_ns: i64,
    pub max_ns: i64,
    pub slowest_rank: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankCollectives {
    pub rank: u32,
    /// Communication kernels matched on every rank (same name, same occurrence).
    pub n_matched: u64,
    pub total_ns: i64,
    /// Time in collectives beyond the fastest rank's duration of the same collective: waiting
    /// for the last rank to arrive.
    pub wait_ns: i64,
    /// The fastest rank's duration, summed: the transfer itself.
    pub transfer_ns: i64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CrossRank {
    pub n_ranks: usize,
    pub steps: Vec<AlignedStep>,
    pub collectives: Vec<RankCollectives>,
    /// Ranks whose mean step is more than `STRAGGLER_FACTOR` times the median rank's, or which
    /// the others wait for in collectives.
    pub stragglers: Vec<u32>,
    pub findings: Vec<Finding>,
}

/// The median (`stoke_stats::median`) of nanosecond figures, to the nearest nanosecond; 0 when
/// there are none.
fn median_ns(values: &[i64]) -> i64 {
    if values.is_empty() {
        return 0;
    }
    let values: Vec<f64> = values.iter().map(|&v| v as f64).collect();
    stoke_stats::median(&values).round() as i64
}

pub fn cross_rank(ranks: &[RankReport]) -> Option<CrossRank> {
    if ranks.len() < 2 {
        return None;
    }
    let mut by_step: BTreeMap<u64, Vec<(u32, i64)>> = BTreeMap::new();
    for r in ranks {
        for s in &r.steps {
            if let Some(n) = s.step {
                by_step.entry(n).or_default().push((r.rank, s.wall_ns));
            }
        }
    }
    let steps: Vec<AlignedStep> = by_step
        .into_iter()
        .filter(|(_, v)| v.len() >= 2)
        .map(|(step, wall_ns)| {
            let walls: Vec<i64> = wall_ns.iter().map(|w| w.1).collect();
            let slowest = *wall_ns.iter().max_by_key(|w| (w.1, std::cmp::Reverse(w.0))).expect("two or more");
            AlignedStep {
                step,
                min_ns: *walls.iter().min().expect("non-empty"),
                max_ns: slowest.1,
                median_ns: median_ns(&walls),
                slowest_rank: slowest.0,
                wall_ns,
            }
        })
        .collect();

    // Collectives: the k-th kernel of a given name on each rank is the same collective.
    let mut occurrences: HashMap<(String, usize), Vec<(usize, i64)>> = HashMap::new();
    for (ri, r) in ranks.iter().enumerate() {
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (_, dur, name) in &r.collectives {
            let k = seen.entry(name.as_str()).or_default();
            occurrences.entry((name.clone(), *k)).or_default().push((ri, *dur));
            *k += 1;
        }
    }
    let mut collectives: Vec<RankCollectives> = ranks
        .iter()
        .map(|r| RankCollectives { rank: r.rank, n_matched: 0, total_ns: 0, wait_ns: 0, transfer_ns: 0 })
        .collect();
    for list in occurrences.values().filter(|l| l.len() == ranks.len()) {
        let fastest = list.iter().map(|x| x.1).min().expect("non-empty");
        for &(ri, dur) in list {
            let c = &mut collectives[ri];
            c.n_matched += 1;
            c.total_ns += dur;
            c.transfer_ns += fastest;
            c.wait_ns += dur - fastest;
        }
    }

    let mut stragglers = Vec::new();
    let mut findings = Vec::new();
    let means: Vec<i64> = ranks.iter().map(|r| r.mean_step_ns as i64).collect();
    let med = median_ns(&means);
    for (r, &m) in ranks.iter().zip(&means) {
        if med > 0 && m as f64 > STRAGGLER_FACTOR * med as f64 {
            stragglers.push(r.rank);
            findings.push(Finding::new(
                RuleId::StragglerSlowSteps,
                format!("mean step > {STRAGGLER_FACTOR}x the median rank's"),
                m as f64 / med as f64,
                format!("rank {} mean step {:.3} ms vs median {:.3} ms", r.rank, m as f64 / 1e6, med as f64 / 1e6),
                Some(m as f64 / med as f64),
            ));
        }
    }
    // The rank that waits least in matched collectives arrives last: the others wait for it.
    let matched: Vec<&RankCollectives> = collectives.iter().filter(|c| c.n_matched > 0).collect();
    if matched.len() >= 2 {
        let least = matched.iter().min_by_key(|c| (c.wait_ns, c.rank)).expect("two or more");
        let others_wait = median_ns(&matched.iter().map(|c| c.wait_ns).collect::<Vec<_>>());
        if others_wait > 0 && least.wait_ns * 2 < others_wait && !stragglers.contains(&least.rank) {
            stragglers.push(least.rank);
            findings.push(Finding::new(
                RuleId::StragglerLastArrival,
                "waits less than half the median rank's collective wait".into(),
                least.wait_ns as f64 / others_wait as f64,
                format!(
                    "rank {} waits {:.3} ms in collectives, the median rank {:.3} ms",
                    least.rank,
                    least.wait_ns as f64 / 1e6,
                    others_wait as f64 / 1e6
                ),
                None,
            ));
        }
    }
    Some(CrossRank { n_ranks: ranks.len(), steps, collectives, stragglers, findings })
}
