//! A batch from the data source as the model's [`Inputs`] on the run's device, checked against
//! the model's shape first so that data of another shape is an error naming both, never a panic
//! inside libtorch.

use stoke_data::{Batch, EpisodeBatch};
use tch::{Device, Tensor};

use crate::config::{GptShape, VlaShape};
use crate::models::{EpisodeInputs, Inputs};
use crate::TrainError;

/// The target cross-entropy skips: libtorch's `nll_loss` default `ignore_index`, which every
/// family's loss in libtorch's graph uses.
const IGNORED_TARGET: i64 = -100;

fn mismatch(message: String) -> TrainError {
    TrainError::InvalidConfig { key: "data", message }
}

/// `batch` for a model of `shape` (with `vla` the episode model's shape), at step `step`.
pub(super) fn inputs_of(
    batch: &Batch,
    shape: GptShape,
    vla: Option<&VlaShape>,
    micro_batch: usize,
    step: u64,
    device: Device,
) -> Result<Inputs, TrainError> {
    match (&batch.episode, vla) {
        (Some(episode), Some(vla)) => episode_inputs(episode, vla, micro_batch, step, device),
        (None, None) => token_inputs(batch, shape, micro_batch, step, device),
        (Some(_), None) => {
            Err(mismatch("the data source gives robot episodes, which only model.family = \"vla\" reads".into()))
        }
        (None, Some(_)) => Err(mismatch(
            "model.family = \"vla\" reads robot episodes: set data.path to a folder from `stoke prep episodes`".into(),
        )),
    }
}

fn token_inputs(
    batch: &Batch,
    shape: GptShape,
    micro_batch: usize,
    step: u64,
    device: Device,
) -> Result<Inputs, TrainError> {
    let seq_len = shape.seq_len;
    if batch.micro_batch != micro_batch || batch.seq_len != seq_len {
        return Err(mismatch(format!(
            "the data source gave a [{}, {}] batch, the run wants [{micro_batch}, {seq_len}]",
            batch.micro_batch, batch.seq_len
        )));
    }
    if let Some(&token) = batch.tokens.iter().find(|&&t| t < 0 || t as usize >= shape.vocab_size) {
        return Err(TrainError::TokenOutOfVocab { step, token, vocab_size: shape.vocab_size });
    }
    let (rows_n, width) = (micro_batch as i64, seq_len as i64 + 1);
    let rows = Tensor::from_slice(&batch.tokens).view([rows_n, width]).to_device(device);
    let inputs = rows.narrow(1, 0, seq_len as i64).contiguous();
    let mut targets = rows.narrow(1, 1, seq_len as i64).contiguous();
    // Targets the loss skips (an instruction's prompt, padding) take cross-entropy's ignored
    // index, so the mean runs over the counted ones.
    if !batch.loss_mask.is_empty() {
        let ignored = Tensor::from_slice(&batch.loss_mask).view([rows_n, width]).narrow(1, 1, seq_len as i64);
        targets = targets.masked_fill(&ignored.to_device(device), IGNORED_TARGET);
    }
    Ok(Inputs::tokens(inputs, targets))
}

fn episode_inputs(
    batch: &EpisodeBatch,
    vla: &VlaShape,
    micro_batch: usize,
    step: u64,
    device: Device,
) -> Result<Inputs, TrainError> {
    let b = micro_batch;
    let side = vla.image_side;
    let expected = [
        ("rows", batch.micro_batch, b),
        ("frames per sample (model.frames)", batch.n_frames, vla.frames),
        ("frame side in pixels (model.image_side)", batch.side as usize, side),
        ("frame bytes", batch.frames.len(), b * vla.frames * side * side * 3),
        ("state values (model.state_dim)", batch.state.len(), b * vla.state_dim),
        ("action values (model.chunk x model.action_dim)", batch.actions.len(), b * vla.chunk * vla.action_dim),
        ("noise values", batch.noise.len(), b * vla.chunk * vla.action_dim),
        ("instruction tokens (model.instruction_tokens)", batch.tokens.len(), b * vla.instruction_tokens),
    ];
    if let Some((what, got, want)) = expected.iter().find(|(_, got, want)| got != want) {
        return Err(mismatch(format!("the episode batch holds {got} {what}, the model wants {want}")));
    }
    if let Some(&token) = batch.tokens.iter().find(|&&t| t < 0 || t as usize >= vla.base.vocab_size) {
        return Err(TrainError::TokenOutOfVocab { step, token, vocab_size: vla.base.vocab_size });
    }
    let (b, chunk, action) = (b as i64, vla.chunk as i64, vla.action_dim as i64);
    let side = side as i64;
    let to = |t: Tensor| t.to_device(device);
    let episode = EpisodeInputs {
        frames: to(Tensor::from_slice(&batch.frames).view([b, vla.frames as i64, side, side, 3])),
        state: to(Tensor::from_slice(&batch.state).view([b, vla.state_dim as i64])),
        actions: to(Tensor::from_slice(&batch.actions).view([b, chunk, action])),
        action_mask: to(Tensor::from_slice(&batch.action_mask).view([b, chunk]).to_kind(tch::Kind::Float)),
        noise: to(Tensor::from_slice(&batch.noise).view([b, chunk, action])),
        time: to(Tensor::from_slice(&batch.time)),
        token_mask: to(Tensor::from_slice(&batch.token_mask)
            .view([b, vla.instruction_tokens as i64])
            .to_kind(tch::Kind::Float)),
    };
    let n = vla.instruction_tokens as i64;
    let tokens = Tensor::from_slice(&batch.tokens).view([b, n]);
    // The instruction's next tokens, padding skipped as a text row's ignored targets are.
    let padded = Tensor::from_slice(&batch.token_mask).view([b, n]).narrow(1, 1, n - 1).eq(0);
    let targets = tokens.narrow(1, 1, n - 1).masked_fill(&padded, IGNORED_TARGET);
    Ok(Inputs { tokens: to(tokens), targets: to(targets), episode: Some(episode) })
}
