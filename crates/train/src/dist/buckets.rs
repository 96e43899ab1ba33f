//! The gradient buckets of a data-parallel step: consecutive units of the flat gradient buffer,
//! grouped in backward order, each all-reduced as one message as soon as all its units' gradients
//! are final.
//!
//! Units are contiguous ranges of the flat buffer, laid out unit by unit, so consecutive units form
//! one contiguous range. Walking the units from the last (the head, whose gradients are final
//! first) to the first, a bucket takes units until it holds at least its size: the first bucket's
//! size is small (the reduction starts early, while most of backward is still ahead), the others
//! larger (fewer, larger messages run closer to the link's bandwidth). A bucket may exceed its
//! size by at most one unit, and the last one (the embedding's) takes what is left.

use std::fmt;
use std::ops::Range;

use crate::params::UnitRange;

/// Bucket sizes in bytes of fp32 gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketSizes {
    /// The first bucket (the last units of the model).
    pub first_bytes: u64,
    /// Every later bucket.
    pub bytes: u64,
}

/// Bytes of one gradient element (the flat gradient buffer is fp32).
const GRAD_ELEMENT_BYTES: u64 = 4;

/// One bucket: the consecutive units `units`, whose gradients are `range` of the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    pub units: Range<usize>,
    pub range: Range<i64>,
}

impl Bucket {
    pub fn bytes(&self) -> u64 {
        (self.range.end - self.range.start) as u64 * GRAD_ELEMENT_BYTES
    }
}

/// The buckets of a model, in reduction order (bucket 0 holds the last units).
#[derive(Debug, Clone, PartialEq)]
pub struct BucketPlan {
    buckets: Vec<Bucket>,
    /// For each unit, the index of its bucket.
    bucket_of_unit: Vec<usize>,
    unit_names: Vec<String>,
    sizes: BucketSizes,
}

impl BucketPlan {
    /// Groups `units` (the flat buffer's units in declaration order) into buckets of `sizes`.
    ///
    /// # Panics
    /// When the units are not contiguous and in order (`FlatParams` lays them out that way).
    pub fn new(units: &[UnitRange], sizes: BucketSizes) -> BucketPlan {
        let mut buckets = Vec::new();
        // The open bucket holds units `unit_idx..upper`.
        let mut upper = units.len();
        let mut bytes = 0u64;
        for unit_idx in (0..units.len()).rev() {
            if let Some(next) = units.get(unit_idx + 1) {
                assert_eq!(
                    units[unit_idx].range.end, next.range.start,
                    "units {} and {} are not adjacent in the flat buffer",
                    units[unit_idx].name, next.name
                );
            }
            bytes += (units[unit_idx].range.end - units[unit_idx].range.start) as u64 * GRAD_ELEMENT_BYTES;
            let size = if buckets.is_empty() { sizes.first_bytes } else { sizes.bytes };
            if bytes >= size {
                buckets.push(Bucket {
                    units: unit_idx..upper,
                    range: units[unit_idx].range.start..units[upper - 1].range.end,
                });
                upper = unit_idx;
                bytes = 0;
            }
        }
        if upper > 0 {
            buckets.push(Bucket { units: 0..upper, range: units[0].range.start..units[upper - 1].range.end });
        }
        let mut bucket_of_unit = vec![0; units.len()];
        for (bucket_idx, bucket) in buckets.iter().enumerate() {
            for unit_idx in bucket.units.clone() {
                bucket_of_unit[unit_idx] = bucket_idx;
            }
        }
        // Invariant: the buckets tile the units (and so the flat buffer) from the end, without gaps.
        debug_assert!(buckets.windows(2).all(|w| w[1].units.end == w[0].units.start));
        BucketPlan { buckets, bucket_of_unit, unit_names: units.iter().map(|u| u.name.clone()).collect(), sizes }
    }

    pub fn buckets(&self) -> &[Bucket] {
        &self.buckets
    }

    pub fn n_units(&self) -> usize {
        self.bucket_of_unit.len()
    }

    /// The bucket that unit `unit_idx` belongs to.
    pub fn bucket_of(&self, unit_idx: usize) -> usize {
        self.bucket_of_unit[unit_idx]
    }

    /// Whether unit `unit_idx`'s gradients complete its bucket: it is the bucket's first unit, the
    /// last one backward reaches.
    pub fn completes_bucket(&self, unit_idx: usize) -> bool {
        self.buckets[self.bucket_of_unit[unit_idx]].units.start == unit_idx
    }
}

impl fmt::Display for BucketPlan {
    /// One line: `3 buckets (first 1.0 MiB, then 25.0 MiB): #0 head..transformer.h.1 0.52 MiB, ...`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
        write!(
            f,
            "{} bucket{} (first {:.2} MiB, then {:.2} MiB), in reduction order:",
            self.buckets.len(),
            if self.buckets.len() == 1 { "" } else { "s" },
            mib(self.sizes.first_bytes),
            mib(self.sizes.bytes)
        )?;
        for (bucket_idx, bucket) in self.buckets.iter().enumerate() {
            let last = &self.unit_names[bucket.units.end - 1];
            let first = &self.unit_names[bucket.units.start];
            let sep = if bucket_idx == 0 { " " } else { "; " };
            if bucket.units.len() == 1 {
                write!(f, "{sep}#{bucket_idx} {last} {:.2} MiB", mib(bucket.bytes()))?;
            } else {
                write!(f, "{sep}#{bucket_idx} {last}..{first} {:.2} MiB", mib(bucket.bytes()))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Units of `elements` fp32 gradients each, laid out one after another.
    fn units(elements: &[i64]) -> Vec<UnitRange> {
        let mut offset = 0;
        elements
            .iter()
            .enumerate()
            .map(|(unit_idx, &n)| {
                let range = offset..offset + n;
                offset += n;
                UnitRange { name: format!("u{unit_idx}"), range, entries: 0..0 }
            })
            .collect()
    }

    /// Plans `elements` with sizes given in elements, and checks the buckets' unit ranges.
    fn check(elements: &[i64], first: u64, rest: u64, expected: &[Range<usize>]) {
        let units = units(elements);
        let sizes = BucketSizes { first_bytes: first * 4, bytes: rest * 4 };
        let plan = BucketPlan::new(&units, sizes);
        let got: Vec<Range<usize>> = plan.buckets().iter().map(|b| b.units.clone()).collect();
        assert_eq!(got, expected, "elements {elements:?}, first {first}, then {rest}");
        // Each bucket is the contiguous range of its units, and every unit knows its bucket.
        for (bucket_idx, bucket) in plan.buckets().iter().enumerate() {
            assert_eq!(bucket.range, units[bucket.units.start].range.start..units[bucket.units.end - 1].range.end);
            for unit_idx in bucket.units.clone() {
                assert_eq!(plan.bucket_of(unit_idx), bucket_idx);
                assert_eq!(plan.completes_bucket(unit_idx), unit_idx == bucket.units.start);
            }
        }
        let total: u64 = plan.buckets().iter().map(Bucket::bytes).sum();
        assert_eq!(total, elements.iter().sum::<i64>() as u64 * 4);
    }

    #[test]
    fn units_group_in_backward_order_first_bucket_smaller() {
        // embedding 100, four blocks of 30, head 10.
        let model = [100, 30, 30, 30, 30, 10];
        // First bucket >= 20: head + last block; then >= 60: two blocks each; the rest.
        check(&model, 20, 60, &[4..6, 2..4, 0..2]);
        // A first bucket as small as the head: the head alone.
        check(&model, 10, 60, &[5..6, 3..5, 1..3, 0..1]);
        // Everything in one bucket when the first size exceeds the model.
        check(&model, 1 << 20, 1 << 20, &[0..6]);
        // One unit per bucket when sizes are tiny.
        check(&model, 1, 1, &[5..6, 4..5, 3..4, 2..3, 1..2, 0..1]);
        // The remainder (the embedding) gets its own bucket though it is under the size.
        check(&[5, 30, 30], 30, 30, &[2..3, 1..2, 0..1]);
        // Empty units are carried along with their neighbours.
        check(&[10, 0, 10, 0], 10, 10, &[2..4, 0..2]);
        check(&[], 10, 10, &[]);
    }

    #[test]
    fn the_layout_prints_on_one_line() {
        let plan =
            BucketPlan::new(&units(&[262_144, 262_144, 262_144]), BucketSizes { first_bytes: 1 << 20, bytes: 2 << 20 });
        assert_eq!(
            plan.to_string(),
            "2 buckets (first 1.00 MiB, then 2.00 MiB), in reduction order: #0 u2 1.00 MiB; #1 u1..u0 2.00 MiB"
        );
    }
}
