//! How a pipeline cuts a model into stages: contiguous runs of units (the embedding, each block,
//! the head) balanced by their cost. The one definition stoke's trainer cuts by and the planner
//! predicts with.

use std::ops::Range;

/// The units of each of `stages` stages: contiguous runs minimizing the most expensive stage's
/// cost (each unit's `costs`), every stage at least one unit; or `split`, units per stage.
pub fn stage_units(costs: &[f64], stages: usize, split: &[usize]) -> Result<Vec<Range<usize>>, String> {
    let n = costs.len();
    if stages == 0 || stages > n {
        return Err(format!("is {stages}, but the model has {n} units (the embedding, each block, the head)"));
    }
    if !split.is_empty() {
        if split.len() != stages || split.contains(&0) || split.iter().sum::<usize>() != n {
            return Err(format!(
                "dist.pipeline_split {split:?} must give each of the {stages} stages at least one unit, {n} in all"
            ));
        }
        let mut at = 0;
        return Ok(split
            .iter()
            .map(|&k| {
                at += k;
                at - k..at
            })
            .collect());
    }
    // Dynamic programming over (units, stages) for the smallest maximum stage cost (tens of
    // units: O(units^2 x stages) is nothing), then the cuts.
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(costs.iter().scan(0.0, |sum, c| {
            *sum += c;
            Some(*sum)
        }))
        .collect();
    let cost = |a: usize, b: usize| prefix[b] - prefix[a];
    // best[s][i]: the least maximum for units 0..i over s + 1 stages; cut[s][i] the last cut.
    let mut best = vec![vec![f64::INFINITY; n + 1]; stages];
    let mut cut = vec![vec![0usize; n + 1]; stages];
    for (i, first) in best[0].iter_mut().enumerate().skip(1) {
        *first = cost(0, i);
    }
    for s in 1..stages {
        for i in s + 1..=n {
            for j in s..i {
                let candidate = best[s - 1][j].max(cost(j, i));
                // Ties go to the later cut: earlier stages (more micro-batches in flight under 1F1B) lighter.
                if candidate <= best[s][i] {
                    best[s][i] = candidate;
                    cut[s][i] = j;
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(stages);
    let mut end = n;
    for s in (0..stages).rev() {
        let start = if s == 0 { 0 } else { cut[s][end] };
        ranges.push(start..end);
        end = start;
    }
    ranges.reverse();
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_balance_the_costs() {
        // An embedding of no cost, four equal blocks, a head worth two blocks.
        let costs = [0.0, 1.0, 1.0, 1.0, 1.0, 2.0];
        assert_eq!(stage_units(&costs, 2, &[]).unwrap(), vec![0..4, 4..6]);
        assert_eq!(stage_units(&costs, 3, &[]).unwrap(), vec![0..3, 3..5, 5..6]);
        assert_eq!(stage_units(&costs, 6, &[]).unwrap().len(), 6);
        // A small head: the blocks split evenly.
        let costs = [0.0, 5.0, 5.0, 5.0, 5.0, 0.4];
        assert_eq!(stage_units(&costs, 2, &[]).unwrap(), vec![0..3, 3..6]);
        assert_eq!(stage_units(&costs, 4, &[]).unwrap(), vec![0..2, 2..3, 3..4, 4..6]);
        assert_eq!(stage_units(&costs, 2, &[2, 4]).unwrap(), vec![0..2, 2..6]);
        assert!(stage_units(&costs, 2, &[3, 4]).unwrap_err().contains("at least one unit"));
        assert!(stage_units(&costs, 7, &[]).unwrap_err().contains("6 units"));
    }
}
