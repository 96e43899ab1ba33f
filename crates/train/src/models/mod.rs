//! The seam between a model and what drives it. The block executor, recomputation, ZeRO's units
//! and checkpoints see a model only through [`Model`]: a sequence of units (the embedding, the
//! blocks, the head with the loss) over one pair of flat parameter buffers ([`FlatParams`](crate::FlatParams), whose
//! units and entries give ZeRO its ranges and checkpoints their names and shapes). A block is two
//! residual branches, each `x + branch(norm(x))`; the executor cuts the autograd graph around a
//! block or a branch to run it, recompute it, or hook between units. Parts a family runs
//! outside libtorch's graph, with its backward written by hand, it offers through [`ByHand`].
//!
//! Families live in folders beside this file; [`build_model`] makes the one `model.family` names.

mod gpt;
mod gpt_rms;
mod seam;

use tch::Device;

use crate::config::{ModelConfig, TrainConfig, MODEL_FAMILIES};
use crate::TrainError;

pub use gpt::Gpt;
pub use gpt_rms::GptRms;
pub use seam::{Branch, BranchBackward, ByHand, CoreBackward, HeadBackward, HeadLoss, Model, Norm};

/// A freshly initialized model of the family `model.family` names, with the kernels and casts
/// `train` asks for (their Rust kernels split over `kernel_threads`). Seed libtorch first for a
/// reproducible init.
pub fn build_model(
    model: &ModelConfig,
    train: &TrainConfig,
    kernel_threads: usize,
    device: Device,
) -> Result<Box<dyn Model>, TrainError> {
    let shape = model.shape()?;
    match model.family.as_str() {
        "gpt" => Ok(Box::new(Gpt::for_training(shape, train, kernel_threads, device))),
        "gpt-rms" => Ok(Box::new(GptRms::new(shape, train.precision, device))),
        other => Err(TrainError::InvalidConfig {
            key: "model.family",
            message: format!("must be one of {}; got {other:?}", MODEL_FAMILIES.join(", ")),
        }),
    }
}
