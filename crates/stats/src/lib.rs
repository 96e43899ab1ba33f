//! stoke-stats: the order statistics every figure of stoke uses, defined once: the median, a
//! percentile and the median absolute deviation. No dependencies, so every crate (and every
//! benchmark) can use the same definitions; the PyTorch peers in `benches/peers/` compute theirs
//! the same way.
//!
//! A missing figure never becomes a plausible number: each function returns NaN for an empty
//! input or one that holds a NaN.
//!
//! ```
//! assert_eq!(stoke_stats::median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
//! assert_eq!(stoke_stats::percentile(&[1.0, 2.0, 3.0, 4.0], 50.0), 2.0);
//! assert_eq!(stoke_stats::mad(&[1.0, 2.0, 3.0, 4.0, 100.0]), 1.0);
//! ```

/// The values sorted, or None when empty or any is NaN.
fn sorted(values: &[f64]) -> Option<Vec<f64>> {
    if values.is_empty() || values.iter().any(|v| v.is_nan()) {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    Some(sorted)
}

/// The median: the middle value, or the mean of the two middle values for an even count. NaN
/// when empty or when any value is NaN.
pub fn median(values: &[f64]) -> f64 {
    let Some(sorted) = sorted(values) else { return f64::NAN };
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        0.5 * (sorted[n / 2 - 1] + sorted[n / 2])
    }
}

/// The `p`-th percentile (0..=100) by nearest rank: the smallest value with at least p% of the
/// values at or below it. NaN when empty or when any value is NaN.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    let Some(sorted) = sorted(values) else { return f64::NAN };
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The median absolute deviation: the median of each value's distance from the median (not
/// scaled to a normal distribution's standard deviation). NaN when empty or when any value is NaN.
pub fn mad(values: &[f64]) -> f64 {
    let center = median(values);
    let deviations: Vec<f64> = values.iter().map(|v| (v - center).abs()).collect();
    median(&deviations)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(values, median, 90th percentile, MAD)`.
    fn check(values: &[f64], expected: (f64, f64, f64)) {
        let got = (median(values), percentile(values, 90.0), mad(values));
        let same = |a: f64, b: f64| a == b || (a.is_nan() && b.is_nan());
        assert!(
            same(got.0, expected.0) && same(got.1, expected.1) && same(got.2, expected.2),
            "{values:?}: got (median, p90, mad) {got:?}, expected {expected:?}"
        );
    }

    #[test]
    fn odd_and_even_counts() {
        check(&[3.0, 1.0, 2.0], (2.0, 3.0, 1.0));
        check(&[4.0, 1.0, 3.0, 2.0], (2.5, 4.0, 1.0));
        check(&[7.0], (7.0, 7.0, 0.0));
        check(&[1.0, 2.0], (1.5, 2.0, 0.5));
        check(&[5.0, 5.0, 5.0, 5.0], (5.0, 5.0, 0.0));
    }

    #[test]
    fn an_outlier_moves_neither_the_median_nor_the_mad() {
        check(&[1.0, 2.0, 3.0, 4.0, 1e9], (3.0, 1e9, 1.0));
    }

    #[test]
    fn nothing_or_a_nan_is_nan() {
        check(&[], (f64::NAN, f64::NAN, f64::NAN));
        check(&[1.0, f64::NAN], (f64::NAN, f64::NAN, f64::NAN));
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let ten: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&ten, 90.0), 9.0);
        assert_eq!(percentile(&ten, 100.0), 10.0);
        assert_eq!(percentile(&ten, 0.0), 1.0);
        assert_eq!(percentile(&ten, 50.0), 5.0);
        assert_eq!(percentile(&ten, 91.0), 10.0);
    }
}
