//! The block executor: one micro-batch's forward and backward, run unit by unit.
//!
//! tch has no autograd hooks, so a step that needs to act between blocks (start reducing a
//! block's gradients, gather a sharded block's parameters, recompute a block's activations) must
//! drive the backward itself. The model is a sequence of units: the embedding (unit 0), the blocks
//! (units 1..=n_layer), the head with the loss (the last unit). Forward runs them in order; each
//! block half (attention, MLP) starts from a detached copy of its input, so its autograd graph ends
//! there (in one process, with no hooks between blocks, consecutive whole blocks share one graph:
//! `StepHooks::between_blocks`). Backward runs in reverse: the head's backward starts from the
//! loss, and each earlier segment's from the gradient of its output, which is the gradient its
//! successor left on its detached input. Parameter gradients accumulate into the model's flat
//! gradient buffer (see `params`), so a unit's gradients are final, for the last micro-batch of a
//! step, as soon as its backward is done.
//!
//! Invariants:
//! - Forward fires `before_forward(u)` for u = 0, 1, ..., n_units-1; backward fires
//!   `before_backward(u)` for u = n_units-1, ..., 0; on the last micro-batch of a step
//!   `grads_final(u)` follows unit u's backward, so it fires in reverse unit order, exactly once per
//!   unit per step.
//! - With fp32 and any recompute policy, the gradients are bit-identical to the policy "none":
//!   recomputation reruns the same ops on the same inputs, and every activation gets at most two
//!   gradient contributions (the residual and the branch), whose sum does not depend on order.

use std::ops::Range;

use tch::{Device, Tensor};

use crate::clock::StepClock;
use crate::config::{ExecutorKind, Recompute};
use crate::kernels::LayerNormStats;
use crate::models::{BlockBackward, Branch, BranchBackward, ByHand, CoreBackward, Inputs, Model, Norm};
use crate::{Phase, TrainError};

mod hooks;

pub use hooks::{Gathered, NoHooks, StepHooks};

/// A block's autograd segments: the whole block, or one of its halves (a residual branch).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Half {
    Whole,
    Attention,
    Mlp,
}

impl Half {
    /// The branch a half runs; `None` for a whole block.
    fn branch(self) -> Option<Branch> {
        match self {
            Half::Whole => None,
            Half::Attention => Some(Branch::Attention),
            Half::Mlp => Some(Branch::Mlp),
        }
    }
}

/// The autograd segments block `layer_idx` runs as, in forward order, each with whether it is
/// recomputed. A block runs as one segment unless only one of its halves is recomputed: fewer
/// segments are fewer backward calls.
fn segments(recompute: Recompute, layer_idx: usize) -> &'static [(Half, bool)] {
    match recompute {
        Recompute::None => &[(Half::Whole, false)],
        Recompute::Mlp => &[(Half::Attention, false), (Half::Mlp, true)],
        Recompute::Attention => &[(Half::Attention, true), (Half::Mlp, false)],
        Recompute::Block => &[(Half::Whole, true)],
        Recompute::Every(k) => {
            if layer_idx % k == 0 {
                &[(Half::Whole, true)]
            } else {
                &[(Half::Whole, false)]
            }
        }
    }
}

/// A part of a half the model runs by hand, while the half's output is kept: its backward.
enum Part<'m> {
    /// A whole block by hand (`Model::block_by_hand`), with no graph over its body.
    Block(Box<dyn BlockBackward + 'm>),
    /// The whole branch after the norm by hand, with no graph.
    Branch(Box<dyn BranchBackward + 'm>),
    /// The branch's core, between two of libtorch's graphs.
    Core(Box<dyn CoreBackward + 'm>),
}

/// One block segment between forward and backward.
struct Segment<'m> {
    layer_idx: usize,
    /// The last block of a run of whole blocks chained in one graph (`StepHooks::between_blocks`);
    /// `layer_idx` otherwise.
    last_layer: usize,
    half: Half,
    /// The half's input: a leaf that requires grad when `output` holds its graph, else a plain
    /// detached tensor from which the backward recomputes.
    input: Tensor,
    output: Option<Tensor>,
    /// With the fused LayerNorm, while `output` is kept: the normed input (a leaf that requires
    /// grad, or a plain tensor when the whole branch runs by hand) and its statistics, for the
    /// norm's backward.
    normed: Option<(Tensor, LayerNormStats)>,
    /// With the branch's core by hand (or, after the norm by hand, the whole branch), while
    /// `output` is kept: its backward.
    part: Option<Part<'m>>,
}

/// A half's forward (see `forward_half`).
struct HalfForward<'m> {
    /// The input as the backward uses it.
    input: Tensor,
    output: Tensor,
    normed: Option<(Tensor, LayerNormStats)>,
    part: Option<Part<'m>>,
}

/// What one micro-batch gave.
pub struct MicroBatch {
    /// The micro-batch's mean loss, detached and unscaled.
    pub loss: Tensor,
    /// Host bytes each block's kept activations hold, when measured (CPU only).
    pub activation_bytes: Option<Vec<u64>>,
    /// Host bytes in use at the end of the forward pass, when measured: the step's peak, since
    /// every activation the backward needs is alive then and none has been freed yet.
    pub peak_bytes_in_use: Option<u64>,
}

/// Drives the forward and backward of micro-batches; see the module doc.
pub struct Executor {
    kind: ExecutorKind,
    recompute: Recompute,
}

impl Executor {
    pub fn new(kind: ExecutorKind, recompute: Recompute) -> Result<Executor, TrainError> {
        if kind == ExecutorKind::SingleGraph && recompute != Recompute::None {
            return Err(TrainError::InvalidConfig {
                key: "train.recompute",
                message: format!(
                    "is {recompute}, but train.executor = \"single-graph\" cannot recompute; use \"blocks\""
                ),
            });
        }
        Ok(Executor { kind, recompute })
    }

    /// The autograd segments of block `layer_idx`: the policy's, with a whole block split in
    /// its halves when the model runs its norms by hand (each half's norm is then outside
    /// libtorch's graph, between the half and its input), or a branch's core.
    fn block_segments(&self, model: &dyn Model, layer_idx: usize) -> Vec<(Half, bool)> {
        let segments = segments(self.recompute, layer_idx);
        let by_hand =
            model.by_hand().is_some_and(|h| h.norms() || h.branch(Branch::Attention) || h.branch(Branch::Mlp));
        if !by_hand {
            return segments.to_vec();
        }
        segments
            .iter()
            .flat_map(|&(half, recomputed)| match half {
                Half::Whole => vec![(Half::Attention, recomputed), (Half::Mlp, recomputed)],
                _ => vec![(half, recomputed)],
            })
            .collect()
    }

    pub fn recompute(&self) -> Recompute {
        self.recompute
    }

    pub fn kind(&self) -> ExecutorKind {
        self.kind
    }

    /// Forward and backward of one micro-batch. The backward starts from the loss times
    /// `loss_multiplier` (1/k for k accumulated micro-batches, times the fp16 loss scale).
    /// Gradients accumulate into the model's flat gradient buffer; `last` says this is the step's
    /// last micro-batch, so `grads_final` fires. `measure_memory` records each block's activation
    /// bytes (host memory, so only on a CPU).
    #[allow(clippy::too_many_arguments)]
    pub fn run_micro_batch(
        &self,
        model: &dyn Model,
        inputs: &Inputs,
        loss_multiplier: f64,
        last: bool,
        measure_memory: bool,
        clock: &mut StepClock,
        hooks: &mut dyn StepHooks,
    ) -> Result<MicroBatch, TrainError> {
        match self.kind {
            ExecutorKind::Blocks => self.run_blocks(model, inputs, loss_multiplier, last, measure_memory, clock, hooks),
            ExecutorKind::SingleGraph => run_single_graph(model, inputs, loss_multiplier, last, clock, hooks),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn run_blocks(
        &self,
        model: &dyn Model,
        inputs: &Inputs,
        loss_multiplier: f64,
        last: bool,
        measure_memory: bool,
        clock: &mut StepClock,
        hooks: &mut dyn StepHooks,
    ) -> Result<MicroBatch, TrainError> {
        let units = 0..model.n_units();
        let forwarded =
            self.forward_units(model, units, StageInput::Batch, inputs, loss_multiplier, measure_memory, clock, hooks)?;
        let activation_bytes = forwarded.activation_bytes.clone();
        let backward = self.backward_units(model, forwarded, None, last, clock, hooks)?;
        Ok(MicroBatch {
            loss: backward.loss.expect("the whole model ends with its head"),
            activation_bytes,
            peak_bytes_in_use: backward.peak_bytes_in_use,
        })
    }

    /// The forward of `units` (a contiguous run of the model's units: a pipeline stage's, or all
    /// of them) for one micro-batch, from the batch (when `units` starts at the embedding) or from
    /// the previous stage's output. What the backward needs is kept in the returned
    /// [`Forwarded`]; its `output` is what the next stage receives (None when `units` ends with the
    /// head: then the loss is computed here, and with the fused cross-entropy its logits'
    /// gradient too).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_units<'m>(
        &self,
        model: &'m dyn Model,
        units: Range<usize>,
        input: StageInput,
        inputs: &Inputs,
        loss_multiplier: f64,
        measure_memory: bool,
        clock: &mut StepClock,
        hooks: &mut dyn StepHooks,
    ) -> Result<Forwarded<'m>, TrainError> {
        let n_layer = model.shape().n_layer;
        let head_unit = n_layer + 1;
        let measure_memory = measure_memory && inputs.tokens.device() == Device::Cpu;
        let chain = !hooks.between_blocks() && !model.blocks_by_hand();
        let mut activation_bytes = Vec::with_capacity(n_layer);

        let (start, mut current) = match input {
            StageInput::Batch => {
                debug_assert_eq!(units.start, 0, "only the embedding's stage reads the batch");
                hooks.before_forward(0, clock)?;
                let embedded = model.embed(inputs);
                // Under sequence parallelism the blocks take this rank's piece of the sequence.
                let current = model.sequence_group().map_or_else(|| embedded.detach(), |g| g.piece(&embedded));
                (Start::Embedded(embedded), current)
            }
            StageInput::Received(received) => (Start::Received, received.detach()),
        };
        let blocks = units.start.max(1) - 1..units.end.min(head_unit) - 1;
        let mut segments: Vec<Segment> = Vec::with_capacity(2 * blocks.len());
        for layer_idx in blocks {
            hooks.before_forward(layer_idx + 1, clock)?;
            let bytes_before = measure_memory.then(crate::peak::host_bytes_in_use).flatten();
            for (half, recomputed) in self.block_segments(model, layer_idx) {
                // A kept whole block continues the graph of the kept whole block before it.
                let chained = segments.last_mut().filter(|last| {
                    chain
                        && half == Half::Whole
                        && !recomputed
                        && last.half == Half::Whole
                        && last.output.is_some()
                        && last.last_layer + 1 == layer_idx
                });
                if let Some(last) = chained {
                    let output = run_half(model, layer_idx, half, &current);
                    current = output.shallow_clone();
                    (last.output, last.last_layer) = (Some(output), layer_idx);
                    continue;
                }
                let input = current.detach();
                let last_layer = layer_idx;
                let segment = if recomputed {
                    current = tch::no_grad(|| forward_half(model, layer_idx, half, &input).output);
                    Segment { layer_idx, last_layer, half, input, output: None, normed: None, part: None }
                } else {
                    let HalfForward { input, output, normed, part } = forward_half(model, layer_idx, half, &input);
                    current = output.shallow_clone();
                    Segment { layer_idx, last_layer, half, input, output: Some(output), normed, part }
                };
                segments.push(segment);
            }
            if let (Some(before), Some(after)) =
                (bytes_before, measure_memory.then(crate::peak::host_bytes_in_use).flatten())
            {
                activation_bytes.push(after.saturating_sub(before));
            }
        }
        if units.end <= head_unit {
            // A stage before the last: its output goes to the next stage, detached; the
            // gradient that comes back is the gradient of `current`.
            let output = current.detach();
            let peak_bytes_in_use = measure_memory.then(crate::peak::host_bytes_in_use).flatten();
            clock.lap(Phase::Forward);
            return Ok(Forwarded {
                units,
                start,
                segments,
                end: End::Output(current),
                output: Some(output),
                activation_bytes: measure_memory.then_some(activation_bytes),
                peak_bytes_in_use,
            });
        }
        hooks.before_forward(head_unit, clock)?;
        let head_input = current.detach();
        drop(current);
        // With the fused LayerNorm the head starts from the normed output, a leaf.
        let (head_input, head_normed) = match model.by_hand().and_then(|h| h.norm(Norm::Final, &head_input)) {
            Some((normed, stats)) => (head_input, Some((normed.set_requires_grad(true), stats))),
            None => (head_input.set_requires_grad(true), None),
        };
        // With the fused cross-entropy the logits' gradient is computed here, in the forward.
        let head = match &head_normed {
            Some((normed, _)) => model.head_loss_for_backward(normed, true, inputs, loss_multiplier),
            None => model.head_loss_for_backward(&head_input, false, inputs, loss_multiplier),
        };
        let peak_bytes_in_use = measure_memory.then(crate::peak::host_bytes_in_use).flatten();
        clock.lap(Phase::Forward);
        Ok(Forwarded {
            units,
            start,
            segments,
            end: End::Head { head_input, head_normed, head, loss_multiplier },
            output: None,
            activation_bytes: measure_memory.then_some(activation_bytes),
            peak_bytes_in_use,
        })
    }

    /// The backward of a [`Forward`]'s units: from the loss (when they end with the head) or from
    /// `grad_output`, the gradient of their output that the next stage sent back. Returns the
    /// gradient of their input for the previous stage (None when they start with the
    /// embedding) and, with the head, the micro-batch's loss.
    pub fn backward_units(
        &self,
        model: &dyn Model,
        forwarded: Forwarded<'_>,
        grad_output: Option<Tensor>,
        last: bool,
        clock: &mut StepClock,
        hooks: &mut dyn StepHooks,
    ) -> Result<Backward, TrainError> {
        let Forwarded { units, start, mut segments, end, peak_bytes_in_use, .. } = forwarded;
        let measure_memory = peak_bytes_in_use.is_some();
        let head_unit = model.shape().n_layer + 1;
        let mut loss = None;
        let mut peak_bytes_in_use = peak_bytes_in_use;
        // Invariant: `grad_output` is the gradient of the loss (times the multiplier) with respect
        // to the output of the segment on top of `segments`.
        let mut grad_output = match end {
            End::Output(output) => {
                // The gradient of `output`, which the top segment keeps (or recomputes).
                drop(output);
                grad_output.expect("a stage before the last backward-s from the gradient sent back")
            }
            End::Head { head_input, head_normed, head, loss_multiplier } => {
                hooks.before_backward(head_unit, clock)?;
                let head_loss = head.loss;
                // With the fused cross-entropy the head's matrix multiplies are backward-ed by
                // hand, from the logits' gradient, to the gradient of the head's input in the
                // compute type.
                let head_grad = match head.by_hand {
                    Some(by_hand) => Some(by_hand.backward()),
                    None => {
                        (&head_loss * loss_multiplier).backward();
                        None
                    }
                };
                // The head's backward (logit gradients) runs while every activation is still alive.
                peak_bytes_in_use = peak_bytes_in_use
                    .zip(measure_memory.then(crate::peak::host_bytes_in_use).flatten())
                    .map(|(a, b)| a.max(b));
                let grad = match (head_normed, head_grad) {
                    // With the fused head the normed leaf is its input: its gradient is the one just computed.
                    (Some((normed, stats)), head_grad) => {
                        let grad_normed = head_grad.map_or_else(|| normed.grad(), |(_, grad)| grad);
                        hand(model).norm_backward(Norm::Final, &grad_normed, &head_input, &stats, None)
                    }
                    (None, Some((input, grad_input))) => {
                        backward_from(&input, &grad_input);
                        head_input.grad()
                    }
                    (None, None) => head_input.grad(),
                };
                model.add_cast_grads(None);
                drop(head_input);
                clock.lap(Phase::Backward);
                grads_final(model, head_unit, last, clock, hooks)?;
                loss = Some(head_loss.detach());
                grad
            }
        };

        while let Some(segment) = segments.pop() {
            let unit = segment.layer_idx + 1;
            // The units of the segment's blocks, last first (one, unless whole blocks are chained).
            let units = (unit..=segment.last_layer + 1).rev();
            // A block's last segment is backward-ed first; its first segment completes the unit.
            if matches!(segment.half, Half::Whole | Half::Mlp) {
                for unit in units.clone() {
                    hooks.before_backward(unit, clock)?;
                }
            }
            let HalfForward { input, output, normed, part } = match segment.output {
                Some(output) => {
                    HalfForward { input: segment.input, output, normed: segment.normed, part: segment.part }
                }
                None => {
                    clock.lap(Phase::Backward);
                    let recomputed = forward_half(model, segment.layer_idx, segment.half, &segment.input);
                    clock.lap(Phase::Recompute);
                    recomputed
                }
            };
            let layer_idx = segment.layer_idx;
            grad_output = match part {
                // A whole block by hand gives its input's gradient itself.
                Some(Part::Block(block)) => {
                    drop(output);
                    let grad_input = block.backward(grad_output);
                    model.add_cast_grads(Some(layer_idx));
                    grad_input
                }
                part => {
                    // A whole branch by hand has no graph: it gives its normed input's gradient.
                    let grad_normed = match part {
                        Some(Part::Branch(branch)) => Some(branch.backward(&grad_output)),
                        part => {
                            backward_from(&output, &grad_output);
                            drop(output);
                            // A branch's core by hand, between two graphs.
                            if let Some(Part::Core(core)) = part {
                                let (tensor, grad) = core.backward();
                                backward_from(&tensor, &grad);
                            }
                            None
                        }
                    };
                    for layer_idx in layer_idx..=segment.last_layer {
                        model.add_cast_grads(Some(layer_idx));
                    }
                    // The residual passes `grad_output` through to the input unchanged; the
                    // fused LayerNorm's backward adds its part to it in place.
                    match normed {
                        Some((normed, stats)) => hand(model).norm_backward(
                            norm_of(layer_idx, segment.half),
                            &grad_normed.unwrap_or_else(|| normed.grad()),
                            &input,
                            &stats,
                            Some(grad_output),
                        ),
                        None => input.grad(),
                    }
                }
            };
            if matches!(segment.half, Half::Whole | Half::Attention) {
                clock.lap(Phase::Backward);
                for unit in units {
                    grads_final(model, unit, last, clock, hooks)?;
                }
            }
        }
        let grad_input = match start {
            Start::Embedded(embedded) => {
                debug_assert_eq!(units.start, 0);
                hooks.before_backward(0, clock)?;
                let grad_output = match model.sequence_group() {
                    Some(group) => group.all_gather_seq(&grad_output),
                    None => grad_output,
                };
                backward_from(&embedded, &grad_output);
                clock.lap(Phase::Backward);
                grads_final(model, 0, last, clock, hooks)?;
                None
            }
            Start::Received => Some(grad_output),
        };
        Ok(Backward { grad_input, loss, peak_bytes_in_use })
    }
}

/// Where a run of units starts ([`Executor::forward_units`]).
pub enum StageInput {
    /// The embedding, from the micro-batch.
    Batch,
    /// The previous pipeline stage's output.
    Received(Tensor),
}

enum Start {
    /// The embedding's output, with its graph back to the embedding's parameters.
    Embedded(Tensor),
    /// A received tensor: the gradient of the first segment's input goes back to its sender.
    Received,
}

enum End<'m> {
    /// The last block's output (with its graph when kept).
    Output(Tensor),
    Head {
        head_input: Tensor,
        head_normed: Option<(Tensor, LayerNormStats)>,
        head: crate::models::HeadLoss<'m>,
        loss_multiplier: f64,
    },
}

/// A run of units between its forward and its backward ([`Executor::forward_units`]).
pub struct Forwarded<'m> {
    units: Range<usize>,
    start: Start,
    segments: Vec<Segment<'m>>,
    end: End<'m>,
    /// What the next stage receives (None when the units end with the head).
    pub output: Option<Tensor>,
    /// Host bytes each block's kept activations hold, when measured.
    pub activation_bytes: Option<Vec<u64>>,
    /// Host bytes in use at the end of the forward, when measured.
    pub peak_bytes_in_use: Option<u64>,
}

/// What a run of units' backward gave ([`Executor::backward_units`]).
pub struct Backward {
    /// The gradient of the units' input, for the previous stage (None from the embedding).
    pub grad_input: Option<Tensor>,
    /// The micro-batch's mean loss, detached and unscaled (the head's stage only).
    pub loss: Option<Tensor>,
    /// The forward's peak, raised by the head's backward (when measured).
    pub peak_bytes_in_use: Option<u64>,
}

/// A half's forward from `input` (detached). With the norm by hand (a half, not a whole block,
/// with the model's `ByHand::norm` taking the input) the input needs no gradient of its own: the
/// residual passes the output's through, and the normed input is a leaf that requires grad.
/// Otherwise the input becomes a leaf that requires grad, and libtorch runs the whole half,
/// except a branch's core when the model runs it by hand (`ByHand::branch_core`). With both the
/// norm and the branch by hand, the whole branch runs by hand with no graph
/// (`ByHand::branch_whole`), and so does its backward: no seed over any of its tensors. A whole
/// block the model runs by hand (`Model::block_by_hand`) is its own, likewise.
fn forward_half<'m>(model: &'m dyn Model, layer_idx: usize, half: Half, input: &Tensor) -> HalfForward<'m> {
    if half == Half::Whole {
        if let Some((output, block)) = model.block_by_hand(layer_idx, input) {
            return HalfForward { input: input.shallow_clone(), output, normed: None, part: Some(Part::Block(block)) };
        }
    }
    let by_hand = model.by_hand();
    let fused = match half.branch() {
        None => None,
        Some(branch) => by_hand.and_then(|h| h.norm(Norm::before(layer_idx, branch), input)),
    };
    let branch_by_hand = match half.branch() {
        None => false,
        Some(branch) => by_hand.is_some_and(|h| h.branch(branch)),
    };
    let (input, normed, normed_input) = match fused {
        // After the norm by hand a branch by hand runs whole outside libtorch's graph.
        Some((normed, stats)) if branch_by_hand => {
            let branch = half.branch().expect("a norm by hand is a half's");
            let (output, part) = hand(model).branch_whole(layer_idx, branch, &normed);
            let output = tch::no_grad(|| input + output);
            return HalfForward {
                input: input.shallow_clone(),
                output,
                normed: Some((normed, stats)),
                part: Some(Part::Branch(part)),
            };
        }
        Some((normed, stats)) => {
            let normed = normed.set_requires_grad(true);
            (input.shallow_clone(), normed.shallow_clone(), Some((normed, stats)))
        }
        None if !branch_by_hand => {
            let input = input.shallow_clone().set_requires_grad(true);
            let output = run_half(model, layer_idx, half, &input);
            return HalfForward { input, output, normed: None, part: None };
        }
        None => {
            let input = input.shallow_clone().set_requires_grad(true);
            let normed = model.norm(norm_of(layer_idx, half), &input);
            (input, normed, None)
        }
    };
    let branch = half.branch().expect("a whole block returned above");
    let (output, part) = if branch_by_hand {
        let (output, core) = hand(model).branch_core(layer_idx, branch, &normed);
        (output, Some(Part::Core(core)))
    } else {
        (model.branch(layer_idx, branch, &normed), None)
    };
    let output = &input + output;
    HalfForward { input, output, normed: normed_input, part }
}

fn norm_of(layer_idx: usize, half: Half) -> Norm {
    match half {
        Half::Mlp => Norm::Mlp(layer_idx),
        _ => Norm::Attention(layer_idx),
    }
}

fn run_half(model: &dyn Model, layer_idx: usize, half: Half, input: &Tensor) -> Tensor {
    match half {
        Half::Whole => {
            let x = model.residual(layer_idx, Branch::Attention, input);
            model.residual(layer_idx, Branch::Mlp, &x)
        }
        Half::Attention => model.residual(layer_idx, Branch::Attention, input),
        Half::Mlp => model.residual(layer_idx, Branch::Mlp, input),
    }
}

/// The model's parts by hand, where a norm or a part by hand came from them.
fn hand(model: &dyn Model) -> &dyn ByHand {
    model.by_hand().expect("a part run by hand comes from the model's `ByHand`")
}

/// Runs the backward of `output`'s graph with `grad_output` as its incoming gradient. tch's
/// `backward` starts from a scalar with gradient one, so it starts from the sum of `output x
/// grad_output` in `output`'s type, whose gradient with respect to `output` is exactly
/// `grad_output` (ones times it; the sum's value is never read, so its rounding does not matter).
/// Not `dot`: libtorch's dot on a CPU is a scalar loop for bf16, 4.8 ms for the 1.5 M values of a
/// tiny block's q, k and v against 0.49 ms for the product and sum (fp32: 0.86 against 0.23).
pub(crate) fn backward_from(output: &Tensor, grad_output: &Tensor) {
    // A frozen unit (the embedding under LoRA) has nothing to backward into.
    if output.requires_grad() {
        (output * grad_output).sum(output.kind()).backward();
    }
}

fn grads_final(
    model: &dyn Model,
    unit: usize,
    last: bool,
    clock: &mut StepClock,
    hooks: &mut dyn StepHooks,
) -> Result<(), TrainError> {
    if !last {
        return Ok(());
    }
    let range = model.params().units()[unit].range.clone();
    hooks.grads_final(unit, range, model.params().flat_grad(), clock)
}

/// Today's step before the executor: one graph, one `backward()`.
fn run_single_graph(
    model: &dyn Model,
    inputs: &Inputs,
    loss_multiplier: f64,
    last: bool,
    clock: &mut StepClock,
    hooks: &mut dyn StepHooks,
) -> Result<MicroBatch, TrainError> {
    let n_units = model.n_units();
    for unit in 0..n_units {
        hooks.before_forward(unit, clock)?;
    }
    let loss = model.loss(inputs);
    clock.lap(Phase::Forward);
    for unit in (0..n_units).rev() {
        hooks.before_backward(unit, clock)?;
    }
    (&loss * loss_multiplier).backward();
    model.add_all_cast_grads();
    clock.lap(Phase::Backward);
    for unit in (0..n_units).rev() {
        grads_final(model, unit, last, clock, hooks)?;
    }
    Ok(MicroBatch { loss: loss.detach(), activation_bytes: None, peak_bytes_in_use: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recompute_policies_parse_and_print() {
        for text in ["none", "mlp", "attention", "block", "every:2"] {
            assert_eq!(text.parse::<Recompute>().unwrap().to_string(), text);
        }
        for bad in ["every:0", "every:", "all", "Block"] {
            let err = bad.parse::<Recompute>().unwrap_err();
            assert!(err.contains("allowed"), "{err}");
        }
        assert_eq!(segments(Recompute::Every(2), 0), &[(Half::Whole, true)]);
        assert_eq!(segments(Recompute::Every(2), 1), &[(Half::Whole, false)]);
    }
}
