//! One way to lay a training step out over devices.

use std::fmt;

use serde::{Deserialize, Serialize};

/// ZeRO stage (Rajbhandari et al., 2020): which model states are partitioned over data parallelism.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "u8", try_from = "u8")]
pub enum ZeroStage {
    /// Nothing partitioned: every data-parallel rank holds all states.
    None,
    /// Optimizer states partitioned (P_os).
    Optimizer,
    /// Optimizer states and gradients partitioned (P_os+g).
    Gradients,
    /// Optimizer states, gradients and parameters partitioned (P_os+g+p).
    Parameters,
}

impl ZeroStage {
    /// All stages, 0 to 3.
    pub const ALL: [ZeroStage; 4] =
        [ZeroStage::None, ZeroStage::Optimizer, ZeroStage::Gradients, ZeroStage::Parameters];

    /// The stage's number, 0 to 3.
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::None => 0,
            ZeroStage::Optimizer => 1,
            ZeroStage::Gradients => 2,
            ZeroStage::Parameters => 3,
        }
    }
}

impl From<ZeroStage> for u8 {
    fn from(stage: ZeroStage) -> u8 {
        stage.number()
    }
}

impl TryFrom<u8> for ZeroStage {
    type Error = String;
    fn try_from(number: u8) -> Result<ZeroStage, String> {
        ZeroStage::ALL.get(number as usize).copied().ok_or_else(|| format!("ZeRO stage must be 0 to 3; got {number}"))
    }
}

/// Activation recomputation (Korthikanti et al., 2022).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every activation.
    None,
    /// Drop the attention core (softmax and its dropout) and recompute it in backward.
    Selective,
    /// Keep only each block's input and run the block's forward again in backward.
    Full,
}

impl Recompute {
    /// All policies.
    pub const ALL: [Recompute; 3] = [Recompute::None, Recompute::Selective, Recompute::Full];

    /// The policy's name as the CLI spells it.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Selective => "selective",
            Recompute::Full => "full",
        }
    }
}

/// A parallel layout: data x tensor x pipeline parallelism and the choices that go with them.
/// Ranks are numbered tensor-fastest, then data, then pipeline (Megatron-LM's order), so tensor
/// groups sit inside a node whenever `tensor <= devices_per_node`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Layout {
    /// Data-parallel replicas d.
    pub data: usize,
    /// Tensor-parallel ranks t.
    pub tensor: usize,
    /// Pipeline stages p.
    pub pipeline: usize,
    /// Model chunks per pipeline stage v (the interleaved schedule when > 1).
    pub virtual_stages: usize,
    /// Sequence parallelism in the regions tensor parallelism leaves replicated.
    pub sequence_parallel: bool,
    /// ZeRO stage over the data-parallel group.
    pub zero: ZeroStage,
    /// Activation recomputation policy.
    pub recompute: Recompute,
    /// Sequences per micro-batch b.
    pub micro_batch: usize,
    /// Micro-batches per data-parallel replica per step m (the pipeline's micro-batches, or the
    /// gradient accumulation steps without a pipeline).
    pub n_micro_batches: usize,
}

impl Layout {
    /// A single device, one micro-batch of `micro_batch` sequences, nothing partitioned.
    pub fn single(micro_batch: usize) -> Layout {
        Layout {
            data: 1,
            tensor: 1,
            pipeline: 1,
            virtual_stages: 1,
            sequence_parallel: false,
            zero: ZeroStage::None,
            recompute: Recompute::None,
            micro_batch,
            n_micro_batches: 1,
        }
    }

    /// Devices the layout occupies.
    pub fn n_devices(&self) -> usize {
        self.data * self.tensor * self.pipeline
    }

    /// Sequences per step over all replicas.
    pub fn global_batch(&self) -> usize {
        self.data * self.micro_batch * self.n_micro_batches
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "d{} t{}{} p{}",
            self.data,
            self.tensor,
            if self.sequence_parallel { "+sp" } else { "" },
            self.pipeline
        )?;
        if self.virtual_stages > 1 {
            write!(f, "x{}", self.virtual_stages)?;
        }
        write!(f, " z{} {} b{}x{}", self.zero.number(), self.recompute.name(), self.micro_batch, self.n_micro_batches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_every_choice() {
        let layout = Layout {
            data: 4,
            tensor: 8,
            pipeline: 2,
            virtual_stages: 3,
            sequence_parallel: true,
            zero: ZeroStage::Optimizer,
            recompute: Recompute::Selective,
            micro_batch: 1,
            n_micro_batches: 16,
        };
        assert_eq!(layout.to_string(), "d4 t8+sp p2x3 z1 selective b1x16");
        assert_eq!(layout.n_devices(), 64);
        assert_eq!(layout.global_batch(), 64);
    }

    #[test]
    fn zero_stage_round_trips_as_a_number() {
        let json = serde_json::to_string(&ZeroStage::Gradients).unwrap();
        assert_eq!(json, "2");
        assert_eq!(serde_json::from_str::<ZeroStage>("3").unwrap(), ZeroStage::Parameters);
        assert!(serde_json::from_str::<ZeroStage>("4").is_err());
    }
}
