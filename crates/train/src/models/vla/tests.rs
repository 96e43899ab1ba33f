use super::*;
use crate::config::{ExecutorKind, Recompute};
use crate::executor::Executor;
use crate::StepClock;

fn shape() -> VlaShape {
    let config = crate::config::ModelConfig {
        family: "vla".into(),
        preset: "vla-tiny".into(),
        d_model: 32,
        n_head: 2,
        n_layer: 2,
        vision_layers: 2,
        image_side: 16,
        patch: 8,
        frames: 2,
        state_dim: 3,
        action_dim: 2,
        chunk: 4,
        instruction_tokens: 6,
        flow_steps: 3,
        ..Default::default()
    };
    config.vla_shape().unwrap()
}

fn inputs(shape: &VlaShape, batch: i64, seed: i64) -> Inputs {
    tch::manual_seed(seed);
    let (side, chunk, action) = (shape.image_side as i64, shape.chunk as i64, shape.action_dim as i64);
    let f32s = (Kind::Float, Device::Cpu);
    let mask = Tensor::ones([batch, chunk], f32s);
    let _ = mask.narrow(0, 0, 1).narrow(1, chunk - 1, 1).fill_(0.0);
    let n = shape.instruction_tokens as i64;
    let tokens = Tensor::randint(shape.base.vocab_size as i64, [batch, n], (Kind::Int64, Device::Cpu));
    let frames = Tensor::randint(256, [batch, shape.frames as i64, side, side, 3], (Kind::Uint8, Device::Cpu));
    // About a third of the instruction's next tokens are padding, skipped as -100.
    let padded = Tensor::rand([batch, n - 1], f32s).le(0.3);
    let targets = tokens.narrow(1, 1, n - 1).masked_fill(&padded, -100);
    let token_mask = Tensor::cat(&[Tensor::ones([batch, 1], f32s), padded.logical_not().to_kind(Kind::Float)], 1);
    Inputs {
        tokens,
        targets,
        episode: Some(EpisodeInputs {
            frames,
            state: Tensor::randn([batch, shape.state_dim as i64], f32s),
            actions: Tensor::randn([batch, chunk, action], f32s),
            action_mask: mask,
            noise: Tensor::randn([batch, chunk, action], f32s),
            time: Tensor::rand([batch], f32s),
            token_mask,
        }),
    }
}

/// A copy of `e`'s tensors.
fn copied(e: &EpisodeInputs) -> EpisodeInputs {
    EpisodeInputs {
        frames: e.frames.copy(),
        state: e.state.copy(),
        actions: e.actions.copy(),
        action_mask: e.action_mask.copy(),
        noise: e.noise.copy(),
        time: e.time.copy(),
        token_mask: e.token_mask.copy(),
    }
}

#[test]
fn parameters_fill_the_declared_units() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let shape = shape();
    let model = Vla::new(shape, Precision::Fp32, ActionLoss::Flow, Device::Cpu);
    assert_eq!(model.params().n_elements() as usize, model.n_params());
    let names: Vec<&str> = model.params().units().iter().map(|u| u.name.as_str()).collect();
    assert_eq!(
        names,
        ["embedding", "vision.blocks.0", "vision.blocks.1", "backbone.blocks.0", "backbone.blocks.1", "head"]
    );
    let planned = stoke_plan::model_units(&plan_model(&shape));
    let built: Vec<u64> = model.params().units().iter().map(|u| (u.range.end - u.range.start) as u64).collect();
    assert_eq!(planned, built);
}

/// One micro-batch of `batch` through `model` by an executor of `kind` with `recompute`, from
/// zeroed gradients: its loss and the flat gradient.
fn micro_batch(model: &Vla, batch: &Inputs, kind: ExecutorKind, recompute: Recompute) -> (f64, Vec<f32>) {
    model.params().zero_grad();
    let executor = Executor::new(kind, recompute).unwrap();
    let mut clock = StepClock::start(Device::Cpu, true);
    let result = executor.run_micro_batch(model, batch, 1.0, true, false, &mut clock, &mut crate::NoHooks).unwrap();
    (result.loss.double_value(&[]), Vec::<f32>::try_from(model.params().flat_grad()).unwrap())
}

/// The block executor (per-block graphs, recomputation) gives the single graph's gradients, for
/// both action losses and with the instruction's loss (the head reading the embedding's rows):
/// the vision blocks' pass-through and the projector go through the seam.
#[test]
fn the_block_executor_gives_the_single_graphs_gradients() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let shape = shape();
    for (loss, instruction_lm) in [(ActionLoss::Flow, 0.0), (ActionLoss::L1, 0.0), (ActionLoss::Flow, 0.5)] {
        tch::manual_seed(3);
        let mut model = Vla::new(shape, Precision::Fp32, loss, Device::Cpu);
        model.set_instruction_lm(instruction_lm);
        let batch = inputs(&shape, 3, 4);
        let grads = |kind, recompute| micro_batch(&model, &batch, kind, recompute);
        let (loss_a, a) = grads(ExecutorKind::SingleGraph, Recompute::None);
        for recompute in [Recompute::None, Recompute::Block, Recompute::Mlp] {
            let (loss_b, b) = grads(ExecutorKind::Blocks, recompute);
            assert_eq!(loss_a, loss_b, "{loss:?} {recompute:?}");
            let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
            let worst = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(scale > 0.0 && worst <= 1e-6 * scale, "{loss:?} {recompute:?}: {worst} of {scale}");
        }
    }
}

/// The two attention paths, batched matrix multiplies and libtorch's SDPA (which the backbone
/// takes in fp32 on a CPU), give the same loss and gradients, under the prefix mask with and
/// without the instruction's causal part.
#[test]
fn math_and_sdpa_attention_give_the_same_loss_and_gradients() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let shape = shape();
    assert!(shape.base.n_layer > shape.vision_layers, "the test needs a backbone block");
    for instruction_lm in [0.0, 0.5] {
        // One model and one batch, only the path switched between runs.
        tch::manual_seed(7);
        let mut model = Vla::new(shape, Precision::Fp32, ActionLoss::Flow, Device::Cpu);
        model.set_instruction_lm(instruction_lm);
        let batch = inputs(&shape, 3, 8);
        let mut runs = Vec::new();
        for math in [[true, true], [false, false], [true, false]] {
            model.math_attention = math;
            model.params().zero_grad();
            let loss = model.loss(&batch);
            loss.backward();
            runs.push((loss.double_value(&[]), Vec::<f32>::try_from(model.params().flat_grad()).unwrap()));
        }
        let (loss_a, a) = &runs[0];
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        for (loss_b, b) in &runs[1..] {
            assert!((loss_a - loss_b).abs() <= 1e-6 * loss_a.abs(), "{instruction_lm}: {loss_a} against {loss_b}");
            let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(scale > 0.0 && worst <= 1e-5 * scale, "{instruction_lm}: {worst} of {scale}");
        }
    }
}

/// The prefix never attends to the action chunk, and a frame's patches only to their own frame
/// in the vision tower: changing the chunk's input leaves the prefix's states alone, and changing
/// one frame leaves the other frame's vision tokens alone after the tower.
#[test]
fn the_prefix_does_not_see_the_chunk_and_frames_do_not_see_each_other_in_the_tower() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let shape = shape();
    let model = Vla::new(shape, Precision::Fp32, ActionLoss::Flow, Device::Cpu);
    let batch = inputs(&shape, 2, 5);
    let episode = batch.episode.as_ref().unwrap();
    let prefix = (shape.base.seq_len - shape.chunk) as i64;
    let (a, b) = tch::no_grad(|| {
        let a = model.trunk(model.sequence(&batch, &episode.noise, &episode.time));
        let b = model.trunk(model.sequence(&batch, &(&episode.noise + 1.0), &episode.time));
        (a, b)
    });
    let prefix_change = (a.narrow(1, 0, prefix) - b.narrow(1, 0, prefix)).abs().max().double_value(&[]);
    assert_eq!(prefix_change, 0.0, "the chunk leaked into the prefix");
    let chunk_change = (a.narrow(1, prefix, 1) - b.narrow(1, prefix, 1)).abs().max().double_value(&[]);
    assert!(chunk_change > 0.0);

    let per_frame = shape.patches_per_frame() as i64;
    let tower = |frames: &Tensor| {
        tch::no_grad(|| {
            let mut x = model.patches(frames);
            let rest = Tensor::zeros(
                [2, shape.base.seq_len as i64 - shape.vision_tokens() as i64, 32],
                (Kind::Float, Device::Cpu),
            );
            x = Tensor::cat(&[x, rest], 1);
            for layer_idx in 0..shape.vision_layers {
                x = model.residual(layer_idx, Branch::Attention, &x);
                x = model.residual(layer_idx, Branch::Mlp, &x);
            }
            x
        })
    };
    let changed = episode.frames.copy();
    let _ = changed.narrow(1, 1, 1).fill_(7);
    let (a, b) = (tower(&episode.frames), tower(&changed));
    let first_frame = (a.narrow(1, 0, per_frame) - b.narrow(1, 0, per_frame)).abs().max().double_value(&[]);
    assert_eq!(first_frame, 0.0, "frame 1 leaked into frame 0 in the vision tower");
}

/// Evaluation's chunk is the flow integrated by Euler steps from the sample's noise: with
/// `flow_steps` steps it is the noise plus each step's predicted velocity over `flow_steps`, the
/// velocity read at times 0, 1/n, ...; its error is the squared error to the actions that exist
/// over a full chunk's values.
#[test]
fn evaluation_integrates_the_flow_by_euler_steps() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let shape = shape();
    let model = Vla::new(shape, Precision::Fp32, ActionLoss::Flow, Device::Cpu);
    let batch = inputs(&shape, 2, 6);
    let episode = batch.episode.as_ref().unwrap();
    let n = shape.flow_steps;
    let by_hand = tch::no_grad(|| {
        let mut actions = episode.noise.copy();
        for step in 0..n {
            let time = Tensor::full([2], step as f64 / n as f64, (Kind::Float, Device::Cpu));
            actions = &actions + model.predict(&model.trunk(model.sequence(&batch, &actions, &time))) / n as f64;
        }
        actions
    });
    let acted = tch::no_grad(|| model.act(&batch));
    assert_eq!((acted - &by_hand).abs().max().double_value(&[]), 0.0);
    let error = tch::no_grad(|| model.eval_loss(&batch)).double_value(&[]);
    let mask = episode.action_mask.unsqueeze(-1);
    let expected = ((by_hand - &episode.actions).square() * &mask).sum(Kind::Float).double_value(&[])
        / (2 * shape.chunk * shape.action_dim) as f64;
    assert!((error - expected).abs() <= 1e-6 * expected, "{error} against {expected}");
}

/// With the instruction's loss on, no instruction token's state depends on a later token (the
/// frames, which every token reads, no longer read the instruction); with it off the prefix reads
/// itself both ways, so the same change reaches the first token.
#[test]
fn with_the_instruction_loss_no_token_sees_the_ones_after_it() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let shape = shape();
    let (vision, later) = (shape.vision_tokens() as i64, 3);
    let mut model = Vla::new(shape, Precision::Fp32, ActionLoss::Flow, Device::Cpu);
    let batch = inputs(&shape, 2, 7);
    // A copy, not a second draw with the same seed: the tests beside this one share libtorch's
    // generator and may take numbers from it between the seed and the draws.
    let episode = batch.episode.as_ref().expect("a vla batch");
    let changed = Inputs { tokens: batch.tokens.copy(), targets: batch.targets.copy(), episode: Some(copied(episode)) };
    let _ = changed.tokens.narrow(1, later, 1).copy_(&(batch.tokens.narrow(1, later, 1) + 1).remainder(256));
    let states = |model: &Vla, inputs: &Inputs| tch::no_grad(|| model.trunk(model.embed(inputs)));
    let moved = |model: &Vla, from: i64, len: i64| {
        let (a, b) = (states(model, &batch), states(model, &changed));
        (a.narrow(1, from, len) - b.narrow(1, from, len)).abs().max().double_value(&[])
    };
    assert!(moved(&model, vision, 1) > 0.0, "without the loss the first token reads the whole instruction");
    model.set_instruction_lm(1.0);
    assert_eq!(moved(&model, 0, vision + later), 0.0, "a later token leaked into the frames or an earlier token");
    assert!(moved(&model, vision + later, 1) > 0.0);
}

/// The loss with the instruction's weight w is the action loss plus w times the next-token
/// cross-entropy of the instruction, computed here by hand: log-softmax of the final norm's
/// output times the embedding's rows, the target's entry, over the present targets, divided by
/// the batch's possible targets.
#[test]
fn the_instruction_loss_is_the_weighted_next_token_cross_entropy() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let shape = shape();
    let mut model = Vla::new(shape, Precision::Fp32, ActionLoss::Flow, Device::Cpu);
    model.set_instruction_lm(0.25);
    let batch = inputs(&shape, 3, 8);
    let (vision, n) = (shape.vision_tokens() as i64, shape.instruction_tokens as i64);
    let (total, x) = tch::no_grad(|| {
        let x = model.trunk(model.embed(&batch));
        (model.loss(&batch).double_value(&[]), x)
    });
    let actions = tch::no_grad(|| model.action_loss(&x, &batch)).double_value(&[]);
    let log_p = tch::no_grad(|| {
        model
            .norm(Norm::Final, &x.narrow(1, vision, n))
            .matmul(&model.wte.transpose(0, 1))
            .log_softmax(-1, Kind::Double)
    });
    let (mut sum, mut possible) = (0.0, 0.0);
    for row in 0..3 {
        for at in 0..n - 1 {
            possible += 1.0;
            let target = batch.targets.int64_value(&[row, at]);
            if target != -100 {
                sum -= log_p.double_value(&[row, at, target]);
            }
        }
    }
    let expected = actions + 0.25 * sum / possible;
    assert!(sum > 0.0 && (total - expected).abs() <= 1e-5 * expected, "{total} against {expected}");
}

/// The vision tower is told what to look for: an instruction token changes the vision tokens
/// after the tower (through the FiLM layers), unless the instruction's loss is on. The chunk's
/// tokens carry the state from the embedding on, without a hop through attention.
#[test]
fn the_tower_reads_the_instruction_and_the_chunk_the_state() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let shape = shape();
    let mut model = Vla::new(shape, Precision::Fp32, ActionLoss::Flow, Device::Cpu);
    let batch = inputs(&shape, 2, 9);
    let vision = shape.vision_tokens() as i64;
    let with_tokens =
        |tokens: Tensor| Inputs { tokens, targets: batch.targets.copy(), episode: batch.episode.as_ref().map(copied) };
    let changed = with_tokens((&batch.tokens + 1).remainder(256));
    let tower = |model: &Vla, inputs: &Inputs| {
        tch::no_grad(|| model.blocks_in(0..shape.vision_layers, model.embed(inputs)).narrow(1, 0, vision))
    };
    let moved = |model: &Vla| (tower(model, &batch) - tower(model, &changed)).abs().max().double_value(&[]);
    assert!(moved(&model) > 0.0, "the tower did not read the instruction");
    model.set_instruction_lm(1.0);
    assert_eq!(moved(&model), 0.0, "under the instruction's loss the frames read the instruction");

    let episode = batch.episode.as_ref().unwrap();
    let mut moved_state = with_tokens(batch.tokens.copy());
    moved_state.episode.as_mut().unwrap().state = &episode.state + 1.0;
    let chunk = |inputs: &Inputs| {
        let chunk = shape.chunk as i64;
        tch::no_grad(|| model.embed(inputs).narrow(1, shape.base.seq_len as i64 - chunk, chunk))
    };
    let change = (chunk(&batch) - chunk(&moved_state)).abs().max().double_value(&[]);
    assert!(change > 0.0, "the chunk's tokens do not carry the state");
}

/// A keypoint is where its map's logits peak: a map that reads one feature, given a frame whose
/// only patch holding it is patch p, lands on p's (column, row); a map with nothing to prefer
/// lands on the grid's middle; each frame has its own.
#[test]
fn a_keypoint_lands_on_the_patch_its_map_picks() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let shape = shape();
    let model = Vla::new(shape, Precision::Fp32, ActionLoss::Flow, Device::Cpu);
    let (d, per_frame) = (shape.base.d_model as i64, shape.patches_per_frame() as i64);
    tch::no_grad(|| {
        let mut weight = model.keypoint_logits.0.shallow_clone();
        let _ = weight.zero_().get(3).get(0).fill_(1.0);
    });
    // 2 frames of a 2 x 2 grid: frame 0's feature at patch 1 (column 1, row 0), frame 1's at patch 2.
    let projected = Tensor::zeros([1, shape.vision_tokens() as i64, d], (Kind::Float, Device::Cpu));
    let _ = projected.get(0).get(1).get(0).fill_(60.0);
    let _ = projected.get(0).get(per_frame + 2).get(0).fill_(60.0);
    let coords = model.keypoint_coords(&projected);
    assert_eq!(coords.size(), [1, 2, VLA_KEYPOINTS as i64, 2]);
    let at = |frame: i64, map: i64| Vec::<f32>::try_from(coords.get(0).get(frame).get(map)).unwrap();
    let near = |got: Vec<f32>, want: [f32; 2]| got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-6);
    assert!(near(at(0, 3), [1.0, -1.0]), "frame 0, map 3: {:?}", at(0, 3));
    assert!(near(at(1, 3), [-1.0, 1.0]), "frame 1, map 3: {:?}", at(1, 3));
    assert!(near(at(0, 0), [0.0, 0.0]), "a map with nothing to prefer: {:?}", at(0, 0));
}

/// The blocks by hand (no graph over a block's body: the LayerNorm kernel, in bf16 the bias + GELU
/// and softmax kernels, in fp32 the backbone's flash attention, the products and their backward
/// by hand; the FiLM and the projector in libtorch's graph before it) give libtorch's graph's loss
/// and gradients: in fp32 within its rounding, in bf16 within bf16's; with the executor's
/// recomputation policies (whole blocks, and halves, which run in the graph), for both action
/// losses and with the instruction's loss (its causal prefix mask).
#[test]
fn blocks_by_hand_give_the_graphs_loss_and_gradients() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let shape = shape();
    for (precision, loss_tolerance, grad_tolerance) in [(Precision::Fp32, 1e-6, 1e-5), (Precision::Bf16, 1e-2, 5e-3)] {
        for (loss, instruction_lm) in [(ActionLoss::Flow, 0.0), (ActionLoss::L1, 0.0), (ActionLoss::Flow, 0.5)] {
            tch::manual_seed(5);
            let mut model = Vla::new(shape, precision, loss, Device::Cpu);
            model.set_instruction_lm(instruction_lm);
            let batch = inputs(&shape, 3, 6);
            let mut run = |by_hand: bool, kind, recompute| {
                model.set_blocks_by_hand(by_hand, 2);
                assert_eq!(model.blocks_by_hand(), by_hand);
                micro_batch(&model, &batch, kind, recompute)
            };
            let (loss_a, a) = run(false, ExecutorKind::SingleGraph, Recompute::None);
            let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
            for recompute in [Recompute::None, Recompute::Block, Recompute::Mlp] {
                let case = format!("{precision:?} {loss:?} {instruction_lm} {recompute:?}");
                let (loss_b, b) = run(true, ExecutorKind::Blocks, recompute);
                assert!((loss_a - loss_b).abs() <= loss_tolerance * loss_a.abs(), "{case}: {loss_a} against {loss_b}");
                let worst = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                assert!(scale > 0.0 && worst <= grad_tolerance * scale, "{case}: {worst} of {scale}");
            }
        }
    }
}

/// bf16's products widened to fp32 (what a CPU without native bf16 products runs) give the native
/// products' loss and gradients, in libtorch's graph and with the blocks by hand: the same
/// operands, the same rounding points, only the order of the sums differs.
#[test]
fn widened_products_give_the_native_loss_and_gradients() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let shape = shape();
    for by_hand in [false, true] {
        tch::manual_seed(9);
        let mut model = Vla::new(shape, Precision::Bf16, ActionLoss::Flow, Device::Cpu);
        model.set_blocks_by_hand(by_hand, 2);
        let batch = inputs(&shape, 3, 10);
        let kind = if by_hand { ExecutorKind::Blocks } else { ExecutorKind::SingleGraph };
        let mut run = |widen: bool| {
            model.set_widened_products(widen);
            micro_batch(&model, &batch, kind, Recompute::None)
        };
        let (loss_a, a) = run(false);
        let (loss_b, b) = run(true);
        assert!((loss_a - loss_b).abs() <= 1e-2 * loss_a.abs(), "by hand {by_hand}: {loss_a} against {loss_b}");
        let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
        let worst = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(scale > 0.0 && worst <= 5e-3 * scale, "by hand {by_hand}: {worst} of {scale}");
    }
}
