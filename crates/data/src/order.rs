//! The order of samples, as a pure function of `(seed, epoch, index)`.
//!
//! `Permutation` is a keyed bijection of `0..n` built from a balanced Feistel network on the smallest
//! even number of bits that covers `n`, with cycle walking to stay inside `0..n`: no table, O(1)
//! memory, an expected < 4 network evaluations per index. `SampleStream` lays epochs end to end and
//! blends several datasets by weight, so global position `p` maps to `(dataset, sample)` in O(number
//! of datasets) with no state.

use crate::rng::mix64;

const ROUNDS: usize = 6;

/// A pseudo-random bijection of `0..n`, fixed by its key.
#[derive(Debug, Clone)]
pub struct Permutation {
    n: u64,
    half_bits: u32,
    round_keys: [u64; ROUNDS],
}

impl Permutation {
    pub fn new(n: u64, key: u64) -> Permutation {
        // Bits needed for the largest index n-1, rounded up to even so both halves have equal width.
        let bits = 64 - n.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        let mut round_keys = [0u64; ROUNDS];
        for (round_idx, round_key) in round_keys.iter_mut().enumerate() {
            *round_key = mix64(key ^ mix64(round_idx as u64 + 1));
        }
        Permutation { n, half_bits, round_keys }
    }

    /// The permutation of `0..n` used in `epoch` of a dataset shuffled with `seed`.
    pub fn for_epoch(n: u64, seed: u64, epoch: u64) -> Permutation {
        Permutation::new(n, mix64(seed ^ mix64(epoch ^ 0x6570_6f63_6800_0000)))
    }

    pub fn len(&self) -> u64 {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    fn network(&self, value: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let mut left = value >> self.half_bits;
        let mut right = value & mask;
        for round_key in &self.round_keys {
            let mixed = left ^ (mix64(right ^ round_key) & mask);
            left = right;
            right = mixed;
        }
        (left << self.half_bits) | right
    }

    /// The image of `index`; `index` must be below `len()`.
    pub fn apply(&self, index: u64) -> u64 {
        assert!(index < self.n, "index {index} outside permutation of {}", self.n);
        let mut value = index;
        // Cycle walking: the network permutes 0..2^(2*half_bits) ⊇ 0..n, so following the cycle of
        // `index` returns inside 0..n; the domain is < 4n, so the expected walk is < 4 steps.
        loop {
            value = self.network(value);
            if value < self.n {
                return value;
            }
        }
    }
}

/// Where one dataset sits in a blend: its samples per epoch and its share of the stream.
#[derive(Debug, Clone)]
struct Member {
    n_samples: u64,
    /// Fraction of the positions left after the earlier members that go to this one, as a 32-bit
    /// fixed-point number (1 << 32 means all of them).
    share_fp32: u64,
    seed: u64,
}

/// The global sample stream: position `p` -> `(dataset index, sample index)`.
///
/// One dataset: epochs of `n_samples` positions, each a fresh permutation. Several datasets: the
/// positions are split between them by weight deterministically (dataset 0 takes every position where
/// `floor((p+1)·w0) > floor(p·w0)`, the rest are split the same way among the others), and each
/// dataset walks its own epochs and permutations at its own pace.
#[derive(Debug, Clone)]
pub struct SampleStream {
    members: Vec<Member>,
}

impl SampleStream {
    /// A stream over one dataset of `n_samples` samples.
    pub fn single(n_samples: u64, seed: u64) -> SampleStream {
        SampleStream { members: vec![Member { n_samples, share_fp32: 1 << 32, seed }] }
    }

    /// A weighted blend; `datasets` holds `(n_samples, weight)`. Weights need not sum to one.
    pub fn blend(datasets: &[(u64, f64)], seed: u64) -> SampleStream {
        let mut members = Vec::with_capacity(datasets.len());
        let mut remaining: f64 = datasets.iter().map(|&(_, w)| w).sum();
        for (dataset_idx, &(n_samples, weight)) in datasets.iter().enumerate() {
            let last = dataset_idx + 1 == datasets.len();
            let share = if last || remaining <= 0.0 { 1.0 } else { (weight / remaining).clamp(0.0, 1.0) };
            let share_fp32 = if last { 1 << 32 } else { (share * (1u64 << 32) as f64).round() as u64 };
            members.push(Member { n_samples, share_fp32, seed: mix64(seed ^ mix64(dataset_idx as u64 + 0xb1e4d)) });
            remaining -= weight;
        }
        if members.len() == 1 {
            members[0].seed = seed;
        }
        SampleStream { members }
    }

    /// Samples per epoch when the stream has one dataset (the epoch length in positions).
    pub fn epoch_len(&self) -> Option<u64> {
        match self.members.as_slice() {
            [only] => Some(only.n_samples),
            _ => None,
        }
    }

    pub fn n_datasets(&self) -> usize {
        self.members.len()
    }

    /// `(dataset index, epoch of that dataset, sample index)` at global position `position`.
    pub fn locate(&self, position: u64) -> (usize, u64, u64) {
        let mut local = position;
        let mut dataset_idx = 0;
        // Invariant: `local` is the position within the sub-stream left to members dataset_idx.. .
        while dataset_idx + 1 < self.members.len() {
            let share = self.members[dataset_idx].share_fp32;
            let before = ((local as u128 * share as u128) >> 32) as u64;
            let through = (((local + 1) as u128 * share as u128) >> 32) as u64;
            if through > before {
                local = before;
                break;
            }
            local -= before;
            dataset_idx += 1;
        }
        let member = &self.members[dataset_idx];
        let epoch = local / member.n_samples;
        let sample = Permutation::for_epoch(member.n_samples, member.seed, epoch).apply(local % member.n_samples);
        (dataset_idx, epoch, sample)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutations_are_bijections() {
        for n in (1..300).chain([1000, 4097, 65_536, 100_003]) {
            for key in [0, 1, 0xdead_beef] {
                let permutation = Permutation::new(n, key);
                let mut seen = vec![false; n as usize];
                for index in 0..n {
                    let image = permutation.apply(index);
                    assert!(!seen[image as usize], "n {n} key {key}: {image} twice");
                    seen[image as usize] = true;
                }
            }
        }
    }

    #[test]
    fn epochs_and_seeds_change_the_order() {
        let order = |seed, epoch| (0..64).map(|i| Permutation::for_epoch(64, seed, epoch).apply(i)).collect::<Vec<_>>();
        assert_ne!(order(1, 0), order(1, 1));
        assert_ne!(order(1, 0), order(2, 0));
        assert_eq!(order(1, 0), order(1, 0));
        assert_ne!(order(1, 0), (0..64).collect::<Vec<_>>());
    }

    #[test]
    fn huge_domains_need_no_table() {
        let permutation = Permutation::new(1 << 40, 7);
        let image = permutation.apply((1 << 40) - 1);
        assert!(image < 1 << 40);
    }

    #[test]
    fn blend_follows_weights_and_covers_each_dataset() {
        let stream = SampleStream::blend(&[(10, 0.5), (20, 0.3), (7, 0.2)], 3);
        let mut counts = [0u64; 3];
        let mut seen: Vec<Vec<u64>> = vec![vec![]; 3];
        for position in 0..10_000 {
            let (dataset_idx, epoch, sample) = stream.locate(position);
            counts[dataset_idx] += 1;
            if epoch == 0 {
                seen[dataset_idx].push(sample);
            }
        }
        for (dataset_idx, (count, weight)) in counts.iter().zip([0.5, 0.3, 0.2]).enumerate() {
            let expected = 10_000.0 * weight;
            assert!((*count as f64 - expected).abs() <= 2.0, "dataset {dataset_idx}: {count} vs {expected}");
        }
        for (dataset_idx, n) in [10u64, 20, 7].into_iter().enumerate() {
            seen[dataset_idx].sort();
            assert_eq!(seen[dataset_idx], (0..n).collect::<Vec<_>>());
        }
    }
}
