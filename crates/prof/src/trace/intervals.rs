//! Sorted, disjoint half-open intervals `[start, end)` in nanoseconds, and the set operations the
//! breakdowns need. All operations are linear merges over sorted lists.

/// Sorted by start, disjoint, non-empty intervals.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Union(pub(crate) Vec<(i64, i64)>);

impl Union {
    /// The union of arbitrary intervals (empty ones are dropped).
    pub(crate) fn from_intervals(mut spans: Vec<(i64, i64)>) -> Union {
        spans.retain(|&(s, e)| e > s);
        spans.sort_unstable();
        let mut out: Vec<(i64, i64)> = Vec::with_capacity(spans.len());
        for (s, e) in spans {
            match out.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => out.push((s, e)),
            }
        }
        Union(out)
    }

    pub(crate) fn len_ns(&self) -> i64 {
        self.0.iter().map(|&(s, e)| e - s).sum()
    }

    /// Total length inside `[lo, hi)`.
    pub(crate) fn clipped_len(&self, lo: i64, hi: i64) -> i64 {
        if hi <= lo {
            return 0;
        }
        let first = self.0.partition_point(|&(_, e)| e <= lo);
        let mut total = 0;
        for &(s, e) in &self.0[first..] {
            if s >= hi {
                break;
            }
            total += e.min(hi) - s.max(lo);
        }
        total
    }

    pub(crate) fn union(&self, other: &Union) -> Union {
        let mut all: Vec<(i64, i64)> = Vec::with_capacity(self.0.len() + other.0.len());
        // Merge two sorted lists, then coalesce.
        let (mut i, mut j) = (0, 0);
        while i < self.0.len() || j < other.0.len() {
            let take_self = j >= other.0.len() || (i < self.0.len() && self.0[i] <= other.0[j]);
            let next = if take_self {
                i += 1;
                self.0[i - 1]
            } else {
                j += 1;
                other.0[j - 1]
            };
            match all.last_mut() {
                Some(last) if next.0 <= last.1 => last.1 = last.1.max(next.1),
                _ => all.push(next),
            }
        }
        Union(all)
    }

    /// The parts of `self` not covered by `other`.
    pub(crate) fn minus(&self, other: &Union) -> Union {
        let mut out = Vec::new();
        let mut j = 0;
        for &(s, e) in &self.0 {
            let mut cur = s;
            while j < other.0.len() && other.0[j].1 <= cur {
                j += 1;
            }
            let mut k = j;
            // Invariant: other.0[k] is the first interval of `other` that ends after `cur`.
            while k < other.0.len() && other.0[k].0 < e {
                let (os, oe) = other.0[k];
                if os > cur {
                    out.push((cur, os.min(e)));
                }
                cur = cur.max(oe);
                if cur >= e {
                    break;
                }
                k += 1;
            }
            if cur < e {
                out.push((cur, e));
            }
        }
        Union(out)
    }

    /// Length of the intersection of `self` and `other`.
    pub(crate) fn overlap_len(&self, other: &Union) -> i64 {
        let (mut i, mut j, mut total) = (0, 0, 0);
        while i < self.0.len() && j < other.0.len() {
            let (a, b) = (self.0[i], other.0[j]);
            let lo = a.0.max(b.0);
            let hi = a.1.min(b.1);
            if hi > lo {
                total += hi - lo;
            }
            if a.1 < b.1 {
                i += 1;
            } else {
                j += 1;
            }
        }
        total
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check_minus(a: &[(i64, i64)], b: &[(i64, i64)], expected: &[(i64, i64)]) {
        let got = Union::from_intervals(a.to_vec()).minus(&Union::from_intervals(b.to_vec()));
        assert_eq!(got.0, expected, "{a:?} minus {b:?}");
    }

    #[test]
    fn minus() {
        check_minus(&[(0, 10)], &[], &[(0, 10)]);
        check_minus(&[(0, 10)], &[(2, 3), (5, 7)], &[(0, 2), (3, 5), (7, 10)]);
        check_minus(&[(0, 10)], &[(-5, 15)], &[]);
        check_minus(&[(0, 4), (6, 10)], &[(3, 7)], &[(0, 3), (7, 10)]);
        check_minus(&[(0, 10), (20, 30)], &[(5, 25)], &[(0, 5), (25, 30)]);
    }

    fn naive_cover(spans: &[(i64, i64)]) -> Vec<bool> {
        let mut cover = vec![false; 64];
        for &(s, e) in spans {
            for t in s.max(0)..e.min(64) {
                cover[t as usize] = true;
            }
        }
        cover
    }

    fn spans() -> impl Strategy<Value = Vec<(i64, i64)>> {
        proptest::collection::vec((0i64..64, 0i64..20).prop_map(|(s, d)| (s, (s + d).min(64))), 0..12)
    }

    proptest! {
        #[test]
        fn set_operations_match_a_bitmap(a in spans(), b in spans(), lo in 0i64..64, hi in 0i64..64) {
            let (ua, ub) = (Union::from_intervals(a.clone()), Union::from_intervals(b.clone()));
            let (ca, cb) = (naive_cover(&a), naive_cover(&b));
            let count = |f: &dyn Fn(usize) -> bool| (0..64).filter(|&t| f(t)).count() as i64;
            prop_assert_eq!(ua.len_ns(), count(&|t| ca[t]));
            prop_assert_eq!(ua.union(&ub).len_ns(), count(&|t| ca[t] || cb[t]));
            prop_assert_eq!(ua.minus(&ub).len_ns(), count(&|t| ca[t] && !cb[t]));
            prop_assert_eq!(ua.overlap_len(&ub), count(&|t| ca[t] && cb[t]));
            prop_assert_eq!(ua.clipped_len(lo, hi), count(&|t| ca[t] && (t as i64) >= lo && (t as i64) < hi));
            for w in ua.minus(&ub).0.windows(2) { prop_assert!(w[0].1 < w[1].0); }
        }
    }
}
