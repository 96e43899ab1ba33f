//! A run's rates and distributions: a throughput and a summary of step times, on the median and
//! percentile of `stoke_stats` (the one definition of each). The PyTorch peers in `benches/peers/`
//! compute theirs the same way (`_measure.py` says so next to each).

use serde::{Deserialize, Serialize};
use stoke_stats::{median, percentile};

/// Tokens per second of `tokens` trained in `wall_ms` milliseconds; 0 when no time passed.
///
/// The headline rate of a run is `tokens_per_s(tokens per step, median step time)`, over the steps
/// after the warm-up ones, on both sides of every comparison.
pub fn tokens_per_s(tokens: f64, wall_ms: f64) -> f64 {
    if wall_ms > 0.0 {
        tokens / (wall_ms / 1e3)
    } else {
        0.0
    }
}

/// A distribution of step times, ms.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub median: f64,
    pub mean: f64,
    pub p90: f64,
    /// Population standard deviation.
    pub std: f64,
}

impl Spread {
    pub fn of(values: &[f64]) -> Spread {
        let n = values.len().max(1) as f64;
        let mean = values.iter().sum::<f64>() / n;
        let var = values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
        Spread { median: median(values), mean, p90: percentile(values, 90.0), std: var.sqrt() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_percentiles_and_rates() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan() && median(&[1.0, f64::NAN]).is_nan());
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&ten, 90.0), 9.0);
        assert_eq!(percentile(&ten, 100.0), 10.0);
        assert_eq!(percentile(&ten, 0.0), 1.0);
        assert_eq!(tokens_per_s(1000.0, 250.0), 4000.0);
        assert_eq!(tokens_per_s(1000.0, 0.0), 0.0);
        let spread = Spread::of(&[1.0, 1.0, 1.0, 5.0]);
        assert_eq!((spread.median, spread.mean, spread.p90), (1.0, 2.0, 5.0));
    }
}
