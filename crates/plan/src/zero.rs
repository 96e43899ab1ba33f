//! Per-rank bytes of stoke's own trainer under `dist.zero = 0..3`: the one formula that the run's
//! report.json (per rank, next to the measured peak) and `stoke plan --zero-table` both print.
//!
//! The model is a sequence of units (the embedding, each block, the head), each one contiguous
//! range of the flat fp32 parameter and gradient buffers. Sharding cuts every unit on its own with
//! [`stoke_comm::shard_range`], the cut the reduce-scatter and all-gather use, so rank r owns
//! S_r = Σ_u |shard_range(n_u, W, r)| elements (ranks differ by at most one element per unit).
//! With P the parameter elements, k the optimizer's state buffers per element and 4 bytes per
//! element (fp32 throughout):
//!
//! | stage | parameters        | gradients         | optimizer                                    |
//! |-------|-------------------|-------------------|----------------------------------------------|
//! | 0     | 4P                | 4P                | 4kP                                          |
//! | 1     | 4P                | 4P                | 4k·S_r (+ 8S_r: parameter and gradient slices, copied) |
//! | 2     | 4P                | 4S_r + 4G         | 4k·S_r (+ 4S_r: parameter slice, copied)     |
//! | 3     | 4S_r + 4A         | 4S_r + 4G         | 4k·S_r                                       |
//!
//! The optimizer updates this rank's slices of the model's parameters (and at stage 1 reads its
//! slices of the gradients): in place when they are views of the model's buffers
//! ([`Slices::Mapped`], what the fused CPU optimizer does), else fp32 copies updated and copied
//! back ([`Slices::Copied`]). At stage 2 the gradient shard is the reduce-scatter's result; at
//! stage 3 the shard is where the parameters live. G is the largest sum of `gradient_units`
//! consecutive units (full gradients whose backward has run and whose reduce-scatter has not
//! finished; their pages are given back after it). A is what stage 3 holds gathered at once: the
//! embedding (unit 0, whose weights the tied head reads, kept from its forward to its backward)
//! plus the largest sum of `gathered_units` consecutive other units (the one running and the ones
//! prefetched, 1 + `dist.prefetch_blocks`). Communication buffers beyond the in-place gradient
//! buckets: none (0 bytes) at every stage.
//!
//! With mapped slices and nothing in flight this is Rajbhandari et al. (2020)'s fp32 model states
//! ([`crate::model_states`]) exactly. With copied slices and AdamW (k = 2), stage 1 holds
//! 8P + 16·S_r, as much as stage 0 on 2 ranks.

use serde::{Deserialize, Serialize};

use crate::cluster::Precision;
use crate::layout::ZeroStage;
use crate::memory::model_states;
use crate::model::ModelConfig;
use crate::PlanError;

/// Bytes of one fp32 element.
const ELEMENT_BYTES: u64 = 4;

/// Model-state bytes of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RankBytes {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer: u64,
    pub comm_buffers: u64,
}

impl RankBytes {
    /// The four together.
    pub fn total(&self) -> u64 {
        self.parameters + self.gradients + self.optimizer + self.comm_buffers
    }
}

/// Units held whole at once on top of the shards (stages 2 and 3); zero for both gives the
/// persistent bytes, the state between two steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ZeroInFlight {
    /// Full gradients alive at once (stages 2 and 3): units whose backward has run and whose
    /// reduce-scatter has not completed.
    pub gradient_units: usize,
    /// Gathered parameter units alive at once besides the embedding (stage 3): the one running
    /// and the prefetched ones, 1 + `dist.prefetch_blocks`. Zero: nothing gathered, the embedding
    /// included.
    pub gathered_units: usize,
}

impl ZeroInFlight {
    /// The state between two steps: no full gradient, no gathered unit.
    pub const NONE: ZeroInFlight = ZeroInFlight { gradient_units: 0, gathered_units: 0 };
}

/// Where the optimizer's slices of the parameters (and at stage 1 of the gradients) live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Slices {
    /// Views of the model's buffers, updated in place (no extra bytes).
    Mapped,
    /// fp32 copies, updated and copied back.
    Copied,
}

impl Slices {
    /// Parses "mapped" or "copied".
    pub fn parse(text: &str) -> Option<Slices> {
        match text {
            "mapped" => Some(Slices::Mapped),
            "copied" => Some(Slices::Copied),
            _ => None,
        }
    }
}

/// State buffers per parameter element of stoke's optimizers ("adamw" and "lamb": two moments;
/// "sgd": the momentum buffer); `None` for a name stoke does not know.
pub fn optimizer_state_buffers(optimizer: &str) -> Option<u64> {
    match optimizer {
        "adamw" | "lamb" => Some(2),
        "sgd" => Some(1),
        _ => None,
    }
}

/// Elements of each unit of stoke's GPT, in its layout order: the embedding (token and, when
/// learned, position tables), each block, the head (the final norm, and the output matrix when it
/// is not tied to the token embedding).
pub fn model_units(model: &ModelConfig) -> Vec<u64> {
    if let Some(units) = &model.units {
        return [vec![units.embedding], units.blocks.clone(), vec![units.head]].concat();
    }
    let h = model.d_model as u64;
    let positions = if model.learned_positions { model.seq_len as u64 * h } else { 0 };
    let embedding = model.vocab_size as u64 * h + positions;
    let final_norm = if model.biases { 2 * h } else { h };
    let head = final_norm + if model.tied_embeddings { 0 } else { model.vocab_size as u64 * h };
    let mut units = Vec::with_capacity(model.n_layer + 2);
    units.push(embedding);
    units.extend(std::iter::repeat_n(model.params_per_layer() as u64, model.n_layer));
    units.push(head);
    units
}

/// Elements of `units` that rank `rank` of `world` owns: each unit cut by `shard_range`.
pub fn shard_elements(units: &[u64], world: usize, rank: usize) -> u64 {
    units.iter().map(|&n| stoke_comm::shard_range(n as usize, world, rank).len() as u64).sum()
}

/// The largest sum of `count` consecutive units (all of them when `count` is at least their number).
pub fn largest_window(units: &[u64], count: usize) -> u64 {
    if count == 0 || units.is_empty() {
        return 0;
    }
    units.windows(count.min(units.len())).map(|w| w.iter().sum::<u64>()).max().unwrap_or(0)
}

/// Model-state bytes of rank `rank` of `world` at ZeRO stage `stage`, for a model of `units`
/// (elements per unit, in layout order) trained by an optimizer with `optimizer_buffers` state
/// buffers per element (see [`optimizer_state_buffers`]) over `slices`, with `in_flight` whole
/// units on top of the shards (see the module's table). Errors name the argument out of range.
pub fn zero_rank_bytes(
    units: &[u64],
    world: usize,
    rank: usize,
    stage: ZeroStage,
    optimizer_buffers: u64,
    slices: Slices,
    in_flight: ZeroInFlight,
) -> Result<RankBytes, PlanError> {
    if world == 0 {
        return Err(PlanError::InvalidConfig { key: "world", message: "must be at least 1".into() });
    }
    if rank >= world {
        return Err(PlanError::InvalidConfig { key: "rank", message: format!("{rank} is not below world {world}") });
    }
    let full: u64 = units.iter().sum();
    let shard = shard_elements(units, world, rank);
    let gradients_in_flight = largest_window(units, in_flight.gradient_units);
    let gathered = match units.split_first() {
        Some((embedding, others)) if in_flight.gathered_units > 0 => {
            embedding + largest_window(others, in_flight.gathered_units)
        }
        _ => 0,
    };
    let moments = optimizer_buffers * shard;
    let copied = if slices == Slices::Copied { shard } else { 0 };
    // Elements of each category; the one place the stages differ.
    let (parameters, gradients, optimizer) = match stage {
        ZeroStage::None => (full, full, optimizer_buffers * full),
        ZeroStage::Optimizer => (full, full, moments + 2 * copied),
        ZeroStage::Gradients => (full, shard + gradients_in_flight, moments + copied),
        ZeroStage::Parameters => (shard + gathered, shard + gradients_in_flight, moments),
    };
    let comm_buffers = 0;
    Ok(RankBytes {
        parameters: ELEMENT_BYTES * parameters,
        gradients: ELEMENT_BYTES * gradients,
        optimizer: ELEMENT_BYTES * optimizer,
        comm_buffers: ELEMENT_BYTES * comm_buffers,
    })
}

/// Rajbhandari et al. (2020), Figure 1: model states per device of Ψ = 7.5B parameters on N_d = 64
/// data-parallel devices under mixed-precision Adam (K = 12).
pub const ZERO_FIGURE_1_PARAMS: f64 = 7.5e9;
/// N_d of Figure 1.
pub const ZERO_FIGURE_1_DEVICES: usize = 64;

/// One bar of Figure 1: the stage, the published gigabytes (10^9 bytes) and the decimals printed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PublishedStates {
    pub stage: ZeroStage,
    pub published_gb: f64,
    pub published_decimals: i32,
}

/// Figure 1's four bars: baseline 120 GB, P_os 31.4 GB, P_os+g 16.6 GB, P_os+g+p 1.9 GB.
pub const ZERO_FIGURE_1: [PublishedStates; 4] = [
    PublishedStates { stage: ZeroStage::None, published_gb: 120.0, published_decimals: 0 },
    PublishedStates { stage: ZeroStage::Optimizer, published_gb: 31.4, published_decimals: 1 },
    PublishedStates { stage: ZeroStage::Gradients, published_gb: 16.6, published_decimals: 1 },
    PublishedStates { stage: ZeroStage::Parameters, published_gb: 1.9, published_decimals: 1 },
];

impl PublishedStates {
    /// Gigabytes [`model_states`] gives for this bar's stage with Figure 1's inputs.
    pub fn computed_gb(&self) -> f64 {
        model_states(ZERO_FIGURE_1_PARAMS, ZERO_FIGURE_1_DEVICES, self.stage, Precision::Bf16).total() / 1e9
    }

    /// True when the computed figure rounds to the published one (within half of its last digit).
    pub fn agrees(&self) -> bool {
        (self.computed_gb() - self.published_gb).abs() <= 0.5 * 10f64.powi(-self.published_decimals)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Units of 10, 7 and 5 elements on 3 ranks: shard_range cuts them 3/3/4, 2/2/3, 1/2/2.
    const UNITS: [u64; 3] = [10, 7, 5];

    #[test]
    fn shards_partition_every_unit() {
        assert_eq!([0, 1, 2].map(|r| shard_elements(&UNITS, 3, r)), [6, 7, 9]);
        for world in 1..=5 {
            let sum: u64 = (0..world).map(|r| shard_elements(&UNITS, world, r)).sum();
            assert_eq!(sum, 22, "world {world}");
        }
    }

    #[test]
    fn windows_take_the_heaviest_neighbours() {
        assert_eq!(largest_window(&UNITS, 0), 0);
        assert_eq!(largest_window(&UNITS, 1), 10);
        assert_eq!(largest_window(&[1, 9, 1, 8, 8], 2), 16);
        assert_eq!(largest_window(&UNITS, 9), 22);
    }

    #[test]
    fn each_stage_by_hand() {
        let in_flight = ZeroInFlight { gradient_units: 1, gathered_units: 2 };
        let bytes = |stage, slices| zero_rank_bytes(&UNITS, 3, 2, stage, 2, slices, in_flight).unwrap();
        // P = 22, S_2 = 9, one gradient unit = 10; gathered: the embedding (10) and two more (7 + 5).
        let expect = |p: u64, g: u64, o: u64| RankBytes {
            parameters: 4 * p,
            gradients: 4 * g,
            optimizer: 4 * o,
            comm_buffers: 0,
        };
        for (slices, copies) in [(Slices::Mapped, 0), (Slices::Copied, 9)] {
            assert_eq!(bytes(ZeroStage::None, slices), expect(22, 22, 44));
            assert_eq!(bytes(ZeroStage::Optimizer, slices), expect(22, 22, 18 + 2 * copies));
            assert_eq!(bytes(ZeroStage::Gradients, slices), expect(22, 9 + 10, 18 + copies));
            assert_eq!(bytes(ZeroStage::Parameters, slices), expect(9 + 22, 9 + 10, 18));
        }
        let one = zero_rank_bytes(
            &[1, 9, 1, 8, 8],
            1,
            0,
            ZeroStage::Parameters,
            2,
            Slices::Mapped,
            ZeroInFlight { gradient_units: 0, gathered_units: 1 },
        );
        assert_eq!(one.unwrap().parameters, 4 * (27 + 1 + 9), "the embedding and the largest other unit");
    }

    #[test]
    fn out_of_range_ranks_are_named() {
        let err = zero_rank_bytes(&UNITS, 2, 2, ZeroStage::None, 2, Slices::Mapped, ZeroInFlight::NONE).unwrap_err();
        assert!(err.to_string().contains("rank"), "{err}");
        let err = zero_rank_bytes(&UNITS, 0, 0, ZeroStage::None, 2, Slices::Mapped, ZeroInFlight::NONE).unwrap_err();
        assert!(err.to_string().contains("world"), "{err}");
    }

    #[test]
    fn the_paper_formula_plus_the_copied_slices() {
        // With every unit divisible by the world, S_r = P / W and the paper's fp32 model states
        // (4 + 4 + 8)·Ψ are stoke's with mapped slices, and differ by the copies with copied ones.
        let units = [64u64, 128, 128, 32];
        let p: u64 = units.iter().sum();
        for world in [1, 2, 4] {
            let shard = p / world as u64;
            for stage in ZeroStage::ALL {
                let total = |slices| {
                    zero_rank_bytes(&units, world, world - 1, stage, 2, slices, ZeroInFlight::NONE).unwrap().total()
                };
                let paper = model_states(p as f64, world, stage, Precision::Fp32).total() as u64;
                let copies = match stage {
                    ZeroStage::Optimizer => 8 * shard,
                    ZeroStage::Gradients => 4 * shard,
                    ZeroStage::None | ZeroStage::Parameters => 0,
                };
                assert_eq!(total(Slices::Mapped), paper, "{stage:?} on {world}");
                assert_eq!(total(Slices::Copied), paper + copies, "{stage:?} on {world}");
            }
        }
    }

    #[test]
    fn sharding_saves_more_at_each_stage_between_steps() {
        let units = model_units(&ModelConfig::preset("gpt2-124m").unwrap());
        for world in [2, 3, 4, 8] {
            let totals = |slices| {
                ZeroStage::ALL.map(|stage| {
                    zero_rank_bytes(&units, world, 0, stage, 2, slices, ZeroInFlight::NONE).unwrap().total()
                })
            };
            let mapped = totals(Slices::Mapped);
            assert!(mapped.windows(2).all(|w| w[1] < w[0]), "world {world}: {mapped:?}");
            let copied = totals(Slices::Copied);
            assert!(copied[1..].windows(2).all(|w| w[1] < w[0]), "world {world}: {copied:?}");
            // Copied, stage 1 trades 8P of moments for 16·S_r of slices: a saving from 3 ranks on.
            assert_eq!(copied[1] < copied[0], world > 2, "world {world}: {copied:?}");
        }
    }

    #[test]
    fn figure_1_bars_agree_with_model_states() {
        for bar in ZERO_FIGURE_1 {
            assert!(bar.agrees(), "{:?}: {:.3} GB vs published {}", bar.stage, bar.computed_gb(), bar.published_gb);
        }
    }

    #[test]
    fn units_of_the_tiny_preset_match_its_parameter_count() {
        let model = ModelConfig::preset("tiny").unwrap();
        let units = model_units(&model);
        assert_eq!(units.len(), model.n_layer + 2);
        assert_eq!(units.iter().sum::<u64>(), model.n_params() as u64);
        // stoke's tiny GPT: (256 + 128)·256 embedding, 12·256² + 13·256 per block, a 2·256 final norm.
        assert_eq!(units, vec![98_304, 789_760, 789_760, 789_760, 789_760, 512]);
    }
}
