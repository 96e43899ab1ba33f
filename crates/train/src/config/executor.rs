//! The block executor's settings (`train.executor`, `train.recompute`), plain data.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Which parts of each block keep only their input in the forward pass and run their forward
/// again inside the backward pass (`train.recompute`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Recompute {
    /// Keep every activation.
    None,
    /// Recompute each block's MLP half (LayerNorm, both linears, GELU): most of a block's
    /// activation memory for about a third of its forward arithmetic.
    Mlp,
    /// Recompute each block's attention half.
    Attention,
    /// Recompute every block whole: only block inputs are kept.
    Block,
    /// Recompute whole blocks 0, K, 2K, ... (one block in every K).
    Every(usize),
}

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Recompute::None => f.write_str("none"),
            Recompute::Mlp => f.write_str("mlp"),
            Recompute::Attention => f.write_str("attention"),
            Recompute::Block => f.write_str("block"),
            Recompute::Every(k) => write!(f, "every:{k}"),
        }
    }
}

impl FromStr for Recompute {
    type Err = String;

    fn from_str(text: &str) -> Result<Recompute, String> {
        let allowed = "allowed: \"none\", \"mlp\", \"attention\", \"block\", \"every:K\" (K >= 1)";
        match text {
            "none" => Ok(Recompute::None),
            "mlp" => Ok(Recompute::Mlp),
            "attention" => Ok(Recompute::Attention),
            "block" => Ok(Recompute::Block),
            _ => match text.strip_prefix("every:").map(str::parse::<usize>) {
                Some(Ok(k)) if k >= 1 => Ok(Recompute::Every(k)),
                _ => Err(format!("got {text:?}; {allowed}")),
            },
        }
    }
}

impl Serialize for Recompute {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Recompute {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Recompute, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// How a step's forward and backward are driven (`train.executor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ExecutorKind {
    /// Unit by unit, with callbacks between units and recomputation.
    Blocks,
    /// The whole model as one autograd graph and one `backward()`: no recomputation, callbacks
    /// only before and after. Kept as the reference the block executor is measured against.
    SingleGraph,
}
