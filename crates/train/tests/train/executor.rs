//! The block executor against the single-graph step, recomputation, accumulation and callbacks.

use std::ops::Range;

use stoke_train::{
    AttentionPrecision, Executor, ExecutorKind, Gpt, GptRms, GptShape, Llama, LlamaShape, LoraConfig, Model, Precision,
    Recompute, StepClock, StepHooks, TrainError,
};
use tch::{Device, Kind, Tensor};

const SHAPE: GptShape = GptShape { n_layer: 4, n_head: 4, d_model: 64, seq_len: 32, vocab_size: 96 };

fn model(precision: Precision) -> Gpt {
    tch::manual_seed(7);
    Gpt::new(SHAPE, precision, AttentionPrecision::Auto, Device::Cpu)
}

/// The llama family at `SHAPE`: half as many key/value heads, an MLP of 3d.
fn llama_shape() -> LlamaShape {
    LlamaShape {
        base: SHAPE,
        n_kv_head: SHAPE.n_head / 2,
        ffn_hidden: 3 * SHAPE.d_model,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        tie_head: false,
        rope_scaling: None,
    }
}

/// Every model family, fresh from the same seed: the tests of the executor's mechanics
/// (single graph, recomputation, accumulation) run each.
fn families(precision: Precision) -> Vec<(&'static str, Box<dyn Model>)> {
    tch::manual_seed(7);
    let gpt: Box<dyn Model> = Box::new(Gpt::new(SHAPE, precision, AttentionPrecision::Auto, Device::Cpu));
    tch::manual_seed(7);
    let rms: Box<dyn Model> = Box::new(GptRms::new(SHAPE, precision, Device::Cpu));
    let llama_shape = llama_shape();
    tch::manual_seed(7);
    let llama: Box<dyn Model> = Box::new(Llama::new(llama_shape, precision, Device::Cpu));
    // LoRA with its base frozen: the embedding and head units hold no trained parameter.
    tch::manual_seed(7);
    let lora_config =
        LoraConfig { rank: 4, targets: vec!["q_proj".into(), "down_proj".into()], ..LoraConfig::default() };
    let mut lora = Llama::with_lora(llama_shape, precision, &lora_config, Device::Cpu);
    lora.params_mut().freeze(&|name| !name.contains(".lora_"));
    vec![("gpt", gpt), ("gpt-rms", rms), ("llama", llama), ("llama-lora", Box::new(lora))]
}

fn tokens(inputs: &Tensor, targets: &Tensor) -> stoke_train::Inputs {
    stoke_train::Inputs::tokens(inputs.shallow_clone(), targets.shallow_clone())
}

fn batch(rows: i64, seed: i64) -> (Tensor, Tensor) {
    tch::manual_seed(seed);
    let tokens = Tensor::randint(SHAPE.vocab_size as i64, [rows, SHAPE.seq_len as i64 + 1], (Kind::Int64, Device::Cpu));
    (tokens.narrow(1, 0, SHAPE.seq_len as i64).contiguous(), tokens.narrow(1, 1, SHAPE.seq_len as i64).contiguous())
}

/// The flat gradient after `micro_batches` run through `executor` (the loss averaged over them).
fn gradients(model: &dyn Model, executor: &Executor, micro_batches: &[(Tensor, Tensor)]) -> Vec<f32> {
    gradients_with(model, executor, micro_batches, &mut stoke_train::NoHooks)
}

/// `gradients` with `hooks` between the units.
fn gradients_with(
    model: &dyn Model,
    executor: &Executor,
    micro_batches: &[(Tensor, Tensor)],
    hooks: &mut dyn StepHooks,
) -> Vec<f32> {
    model.params().zero_grad();
    let mut clock = StepClock::start(Device::Cpu, true);
    let k = micro_batches.len();
    for (idx, (inputs, targets)) in micro_batches.iter().enumerate() {
        executor
            .run_micro_batch(model, &tokens(inputs, targets), 1.0 / k as f64, idx + 1 == k, false, &mut clock, hooks)
            .unwrap();
    }
    assert!(model.params().grads_are_bound(), "a gradient left the flat buffer");
    Vec::<f32>::try_from(model.params().flat_grad()).unwrap()
}

/// max |a - b| over max |b|: the difference relative to the gradient's scale (element-wise
/// relative differences are meaningless for the many gradients near zero).
/// The gradient of parameter `name`, flattened.
fn grad_of(model: &dyn Model, name: &str) -> Vec<f32> {
    Vec::<f32>::try_from(model.params().get(name).grad().contiguous().view([-1])).unwrap()
}

/// The loss of the first micro-batch of `data`, through `executor`.
fn first_loss(model: &dyn Model, executor: &Executor, data: &[(Tensor, Tensor)]) -> f64 {
    let mut clock = StepClock::start(Device::Cpu, true);
    let (inputs, targets) = &data[0];
    executor
        .run_micro_batch(model, &tokens(inputs, targets), 1.0, true, false, &mut clock, &mut stoke_train::NoHooks)
        .unwrap()
        .loss
        .double_value(&[])
}

fn relative_difference(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
    let worst = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) as f64;
    worst / scale
}

#[test]
fn executor_gradients_equal_the_single_graph_gradients() {
    let _rng = super::rng_lock();
    let data = [batch(4, 1)];
    for ((family, single), (_, blocks)) in families(Precision::Fp32).into_iter().zip(families(Precision::Fp32)) {
        let reference =
            gradients(single.as_ref(), &Executor::new(ExecutorKind::SingleGraph, Recompute::None).unwrap(), &data);
        let blocks = gradients(blocks.as_ref(), &Executor::new(ExecutorKind::Blocks, Recompute::None).unwrap(), &data);
        assert!(reference.iter().any(|&g| g != 0.0), "{family}");
        let diff = relative_difference(&blocks, &reference);
        assert!(diff <= 1e-6, "{family}: block executor vs single graph: relative difference {diff:e}");
    }
}

/// Hooks that act between blocks (they do nothing, but say so): the executor cuts the graph at
/// every block, as for data parallelism.
struct Between;

impl StepHooks for Between {}

#[test]
fn chained_whole_blocks_give_the_same_bits_as_blocks_cut_apart() {
    let _rng = super::rng_lock();
    let data = [batch(2, 3), batch(2, 4)];
    let executor = Executor::new(ExecutorKind::Blocks, Recompute::None).unwrap();
    for (precision, unit_casts) in [(Precision::Fp32, false), (Precision::Bf16, false), (Precision::Bf16, true)] {
        let run = |hooks: &mut dyn StepHooks| {
            let mut model = model(precision);
            model.set_unit_casts(unit_casts);
            gradients_with(&model, &executor, &data, hooks)
        };
        let (chained, cut) = (run(&mut stoke_train::NoHooks), run(&mut Between));
        assert!(chained.iter().any(|&g| g != 0.0));
        let differing = chained.iter().zip(&cut).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differing, 0, "{precision:?}, unit casts {unit_casts}: {differing} gradient elements differ");
    }
}

#[test]
fn recomputation_is_bit_identical_in_fp32() {
    let _rng = super::rng_lock();
    let data = [batch(4, 2)];
    for (family, model) in families(Precision::Fp32) {
        let none = gradients(model.as_ref(), &Executor::new(ExecutorKind::Blocks, Recompute::None).unwrap(), &data);
        for policy in [Recompute::Mlp, Recompute::Attention, Recompute::Block, Recompute::Every(2)] {
            let recomputed = gradients(model.as_ref(), &Executor::new(ExecutorKind::Blocks, policy).unwrap(), &data);
            let differing = none.iter().zip(&recomputed).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(
                differing, 0,
                "{family}, recompute {policy}: {differing} gradient elements differ from \"none\""
            );
        }
    }
}

#[test]
fn accumulated_micro_batches_equal_one_large_batch() {
    let _rng = super::rng_lock();
    let k = 4;
    let (inputs, targets) = batch(2 * k, 3);
    let whole = [(inputs.shallow_clone(), targets.shallow_clone())];
    let parts: Vec<(Tensor, Tensor)> =
        (0..k).map(|i| (inputs.narrow(0, 2 * i, 2), targets.narrow(0, 2 * i, 2))).collect();
    let executor = Executor::new(ExecutorKind::Blocks, Recompute::Mlp).unwrap();
    for (family, model) in families(Precision::Fp32) {
        let one = gradients(model.as_ref(), &executor, &whole);
        let accumulated = gradients(model.as_ref(), &executor, &parts);
        let diff = relative_difference(&accumulated, &one);
        assert!(diff <= 1e-6, "{family}: {k} accumulated micro-batches vs one batch: relative difference {diff:e}");
    }
}

/// Records every callback.
#[derive(Default)]
struct Recorder {
    events: Vec<String>,
}

impl StepHooks for Recorder {
    fn before_forward(&mut self, unit: usize, _clock: &mut StepClock) -> Result<(), TrainError> {
        self.events.push(format!("f{unit}"));
        Ok(())
    }

    fn before_backward(&mut self, unit: usize, _clock: &mut StepClock) -> Result<(), TrainError> {
        self.events.push(format!("b{unit}"));
        Ok(())
    }

    fn grads_final(
        &mut self,
        unit: usize,
        range: Range<i64>,
        flat_grad: &Tensor,
        _clock: &mut StepClock,
    ) -> Result<(), TrainError> {
        // The bucket is final: its values no longer change until the next step.
        let norm = flat_grad.narrow(0, range.start, range.end - range.start).norm().double_value(&[]);
        assert!(norm > 0.0, "unit {unit}'s gradients are zero when declared final");
        self.events.push(format!("g{unit}"));
        Ok(())
    }
}

#[test]
fn callbacks_fire_in_unit_order_and_grads_final_once_per_step() {
    let _rng = super::rng_lock();
    let gpt = model(Precision::Fp32);
    let executor = Executor::new(ExecutorKind::Blocks, Recompute::Block).unwrap();
    let mut hooks = Recorder::default();
    let mut clock = StepClock::start(Device::Cpu, true);
    for (idx, seed) in [4, 5].into_iter().enumerate() {
        let (inputs, targets) = batch(2, seed);
        executor
            .run_micro_batch(&gpt, &tokens(&inputs, &targets), 0.5, idx == 1, false, &mut clock, &mut hooks)
            .unwrap();
    }
    let n = gpt.n_units();
    let forward: Vec<String> = (0..n).map(|u| format!("f{u}")).collect();
    let backward_first: Vec<String> = (0..n).rev().map(|u| format!("b{u}")).collect();
    let backward_last: Vec<String> = (0..n).rev().flat_map(|u| [format!("b{u}"), format!("g{u}")]).collect();
    let expected: Vec<String> = [forward.clone(), backward_first, forward, backward_last].concat();
    assert_eq!(hooks.events, expected);
    let (phases, _) = clock.finish();
    assert!(phases.get(stoke_train::Phase::Recompute) > 0.0, "recomputation was not timed as its own phase");
}

#[test]
fn recomputation_keeps_less_activation_memory() {
    let _rng = super::rng_lock();
    let gpt = model(Precision::Fp32);
    let (inputs, targets) = batch(16, 6);
    let measure = |policy: Recompute| {
        let executor = Executor::new(ExecutorKind::Blocks, policy).unwrap();
        let mut clock = StepClock::start(Device::Cpu, true);
        let result = executor
            .run_micro_batch(&gpt, &tokens(&inputs, &targets), 1.0, true, true, &mut clock, &mut stoke_train::NoHooks)
            .unwrap();
        result.activation_bytes.expect("measured on a CPU").iter().sum::<u64>()
    };
    let (none, mlp, block) = (measure(Recompute::None), measure(Recompute::Mlp), measure(Recompute::Block));
    assert!(mlp < none && block < mlp, "activation bytes: none {none}, mlp {mlp}, block {block}");
}

#[test]
fn fused_cross_entropy_gives_libtorchs_loss_and_gradients_in_bf16() {
    let _rng = super::rng_lock();
    let data = [batch(4, 5), batch(4, 6)];
    let executor = Executor::new(ExecutorKind::Blocks, Recompute::None).unwrap();
    // The head's input comes from libtorch's LayerNorm (a graph) or the fused one's (a leaf).
    for fused_layer_norm in [false, true] {
        let run = |fused: bool| {
            let mut model = model(Precision::Bf16);
            model.set_fused_cross_entropy(fused, 2);
            model.set_fused_layer_norm(fused_layer_norm, 2);
            let grads = gradients(&model, &executor, &data);
            let (head, ln_f) = (grad_of(&model, "transformer.wte.weight"), grad_of(&model, "transformer.ln_f.weight"));
            let loss = first_loss(&model, &executor, &data);
            (grads, head, ln_f, loss)
        };
        let (libtorch, libtorch_wte, libtorch_ln_f, libtorch_loss) = run(false);
        let (fused, fused_wte, fused_ln_f, fused_loss) = run(true);
        let case = format!("fused LayerNorm {fused_layer_norm}");
        assert!(
            (fused_loss - libtorch_loss).abs() <= 1e-5 * libtorch_loss,
            "{case}: loss {fused_loss} against {libtorch_loss}"
        );
        // The logits' gradients differ by at most one bf16 rounding; through the bf16 backward
        // that stays within bf16's precision of the gradient's scale.
        let diff = relative_difference(&fused, &libtorch);
        assert!(diff <= 1e-2, "{case}: fused vs libtorch cross-entropy: relative difference {diff:e}");
        // The head's backward by hand: the tied embedding's gradient (head and embedding) and the
        // final norm's, which only the head's input gradient reaches.
        let diff = relative_difference(&fused_wte, &libtorch_wte);
        assert!(diff <= 1e-2, "{case}: the embedding's gradient: relative difference {diff:e}");
        let diff = relative_difference(&fused_ln_f, &libtorch_ln_f);
        assert!(diff <= 2e-2, "{case}: ln_f's gradient: relative difference {diff:e}");
        assert!(fused_ln_f.iter().any(|&g| g != 0.0), "{case}: no gradient reached ln_f");
    }
}

#[test]
fn fused_layer_norm_gives_libtorchs_loss_and_gradients_in_bf16() {
    let _rng = super::rng_lock();
    let data = [batch(4, 5), batch(4, 6)];
    let norms = ["transformer.h.0.ln_1.weight", "transformer.h.3.ln_2.bias", "transformer.ln_f.weight"];
    let run = |fused: bool, policy: Recompute| {
        let executor = Executor::new(ExecutorKind::Blocks, policy).unwrap();
        let mut model = model(Precision::Bf16);
        model.set_fused_layer_norm(fused, 2);
        let grads = gradients(&model, &executor, &data);
        let norm_grads: Vec<Vec<f32>> = norms.iter().map(|name| grad_of(&model, name)).collect();
        let loss = first_loss(&model, &executor, &data);
        (grads, norm_grads, loss)
    };
    let (libtorch, libtorch_norms, libtorch_loss) = run(false, Recompute::None);
    let (fused, fused_norms, fused_loss) = run(true, Recompute::None);
    // Both norm in fp32 and round to bf16; the kernel's sums are in another order.
    assert!((fused_loss - libtorch_loss).abs() <= 1e-3 * libtorch_loss, "loss {fused_loss} against {libtorch_loss}");
    let diff = relative_difference(&fused, &libtorch);
    assert!(diff <= 1e-2, "fused vs libtorch LayerNorm: relative difference {diff:e}");
    // Equal bit for bit would mean the kernel never ran (its sums round differently).
    assert!(fused != libtorch, "the fused LayerNorm changed no gradient");
    // The norms' own gradients, each against its own scale (the whole buffer's is the embedding's).
    for ((name, got), want) in norms.iter().zip(&fused_norms).zip(&libtorch_norms) {
        let diff = relative_difference(got, want);
        assert!(diff <= 2e-2, "{name}: relative difference {diff:e}");
    }
    // Recomputation reruns the same kernels on the same inputs: the same gradients, bit for bit.
    for policy in [Recompute::Block, Recompute::Mlp, Recompute::Attention, Recompute::Every(2)] {
        let (recomputed, _, _) = run(true, policy);
        assert!(recomputed == fused, "fused LayerNorm under recompute {policy}: gradients differ");
    }
}

#[test]
fn fused_rms_norm_gives_libtorchs_loss_and_gradients() {
    // The llama family's block RMSNorms by the kernel against libtorch's ops, in bf16 and fp32,
    // whole and under LoRA (its norm scales frozen: no gradient to add to), with and without
    // recomputation.
    let _rng = super::rng_lock();
    let data = [batch(4, 5), batch(4, 6)];
    let shape = llama_shape();
    for (lora, precision) in
        [(false, Precision::Bf16), (true, Precision::Bf16), (false, Precision::Fp32), (true, Precision::Fp32)]
    {
        // fp32: the kernel's sums in another order than libtorch's, to fp32 rounding.
        let grad_tol = if precision == Precision::Fp32 { 1e-4 } else { 1e-2 };
        let run = |fused: bool, policy: Recompute| {
            let executor = Executor::new(ExecutorKind::Blocks, policy).unwrap();
            tch::manual_seed(7);
            let config = if lora {
                LoraConfig { rank: 4, targets: vec!["q_proj".into(), "down_proj".into()], ..LoraConfig::default() }
            } else {
                LoraConfig::default()
            };
            let mut model = Llama::with_lora(shape, precision, &config, Device::Cpu);
            if lora {
                model.params_mut().freeze(&|name| !name.contains(".lora_"));
            }
            model.set_fused_rms_norm(fused, 2);
            let grads = gradients(&model, &executor, &data);
            let mut clock = StepClock::start(Device::Cpu, true);
            let (inputs, targets) = &data[0];
            let loss = executor
                .run_micro_batch(
                    &model,
                    &tokens(inputs, targets),
                    1.0,
                    true,
                    false,
                    &mut clock,
                    &mut stoke_train::NoHooks,
                )
                .unwrap()
                .loss
                .double_value(&[]);
            let norm = (!lora).then(|| {
                Vec::<f32>::try_from(model.params().get("model.layers.1.input_layernorm.weight").grad().contiguous())
                    .unwrap()
            });
            (grads, norm, loss)
        };
        let (libtorch, libtorch_norm, libtorch_loss) = run(false, Recompute::None);
        let (fused, fused_norm, fused_loss) = run(true, Recompute::None);
        let case = if lora { "LoRA" } else { "whole" };
        assert!(
            (fused_loss - libtorch_loss).abs() <= 1e-3 * libtorch_loss,
            "{case}: loss {fused_loss} against {libtorch_loss}"
        );
        let diff = relative_difference(&fused, &libtorch);
        assert!(diff <= 1e-2, "{case}: fused vs libtorch RMSNorm: relative difference {diff:e}");
        assert!(fused != libtorch, "{case}: the fused RMSNorm changed no gradient");
        if let (Some(got), Some(want)) = (fused_norm, libtorch_norm) {
            let diff = relative_difference(&got, &want);
            assert!(diff <= 2.0 * grad_tol, "{case}: the norm's scale: relative difference {diff:e}");
        }
        for policy in [Recompute::Block, Recompute::Mlp] {
            let (recomputed, _, _) = run(true, policy);
            assert!(recomputed == fused, "{case}: fused RMSNorm under recompute {policy}: gradients differ");
        }
    }
}

/// What one configuration gives: the flat gradient, the gradients of some named parameters, and
/// the first micro-batch's loss.
type Outcome = (Vec<f32>, Vec<Vec<f32>>, f64);

/// A part run by hand (`run(true, policy)`) against libtorch's ops (`run(false, none)`): the loss
/// within 1e-3, the gradients within 1e-2 and not the same bits (the part by hand ran), each of
/// `names` (reached only through the part by hand) given a gradient within 2e-2, and each
/// recomputation policy the same gradients bit for bit.
fn check_by_hand(case: &str, names: &[&str], policies: &[Recompute], run: impl Fn(bool, Recompute) -> Outcome) {
    let (libtorch, libtorch_own, libtorch_loss) = run(false, Recompute::None);
    let (fused, fused_own, fused_loss) = run(true, Recompute::None);
    assert!(
        (fused_loss - libtorch_loss).abs() <= 1e-3 * libtorch_loss,
        "{case}: loss {fused_loss} against {libtorch_loss}"
    );
    let diff = relative_difference(&fused, &libtorch);
    assert!(diff <= 1e-2, "{case}: relative difference {diff:e}");
    assert!(fused != libtorch, "{case}: the part by hand changed no gradient");
    for ((name, got), want) in names.iter().zip(&fused_own).zip(&libtorch_own) {
        assert!(got.iter().any(|&g| g != 0.0), "{case}: no gradient reached {name}");
        let diff = relative_difference(got, want);
        assert!(diff <= 2e-2, "{case}: {name}: relative difference {diff:e}");
    }
    // Recomputation reruns the same part on the same inputs.
    for &policy in policies {
        let (recomputed, _, _) = run(true, policy);
        assert!(recomputed == fused, "{case}, recompute {policy}: gradients differ");
    }
}

/// `check_by_hand`'s outcome of `model` through a block executor with `policy`.
fn outcome(model: &dyn Model, policy: Recompute, data: &[(Tensor, Tensor)], names: &[&str]) -> Outcome {
    let executor = Executor::new(ExecutorKind::Blocks, policy).unwrap();
    let grads = gradients(model, &executor, data);
    let own = names.iter().map(|name| grad_of(model, name)).collect();
    (grads, own, first_loss(model, &executor, data))
}

#[test]
fn llama_branches_and_head_by_hand_give_libtorchs_loss_and_gradients_in_bf16() {
    // After the RMSNorm kernel, every block's attention and MLP branch by hand and the head's loss
    // through the fused cross-entropy, against autograd's graph after the same kernel: every
    // weight trained (the q, k, v and gate, up products' gradients split by hand), and under
    // LoRA on q, v and down (a group with two adapters and one without, a frozen base cast once).
    let _rng = super::rng_lock();
    let data = [batch(4, 13), batch(4, 14)];
    let shape = llama_shape();
    let whole = [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.gate_proj.weight",
        "model.layers.2.mlp.up_proj.weight",
        "model.layers.3.self_attn.o_proj.weight",
        "lm_head.weight",
        "model.norm.weight",
    ];
    let adapters = [
        "model.layers.0.self_attn.q_proj.lora_A.weight",
        "model.layers.1.self_attn.v_proj.lora_B.weight",
        "model.layers.2.mlp.down_proj.lora_A.weight",
        "model.layers.3.self_attn.q_proj.lora_B.weight",
    ];
    for (lora, names) in [(false, &whole[..]), (true, &adapters[..])] {
        let case = if lora { "LoRA" } else { "whole" };
        check_by_hand(case, names, &[Recompute::Block, Recompute::Mlp], |fused, policy| {
            tch::manual_seed(7);
            let targets = ["q_proj", "v_proj", "down_proj"].map(String::from).to_vec();
            let config =
                if lora { LoraConfig { rank: 4, targets, ..LoraConfig::default() } } else { LoraConfig::default() };
            let mut model = Llama::with_lora(shape, Precision::Bf16, &config, Device::Cpu);
            if lora {
                // Adapters as after some training (B starts at zero, which leaves A no gradient).
                tch::no_grad(|| {
                    for entry in model.params().entries().iter().filter(|e| e.name.ends_with("lora_B.weight")) {
                        entry
                            .tensor
                            .detach()
                            .copy_(&(Tensor::randn(entry.tensor.size(), (Kind::Float, Device::Cpu)) * 0.05));
                    }
                });
                model.params_mut().freeze(&|name| !name.contains(".lora_"));
            }
            model.set_fused_rms_norm(true, 2);
            model.set_branches_by_hand(fused);
            model.set_fused_cross_entropy(fused, 2);
            outcome(&model, policy, &data, names)
        });
    }
}

#[test]
fn fused_softmax_gives_libtorchs_loss_and_gradients_in_bf16() {
    let _rng = super::rng_lock();
    let data = [batch(4, 5), batch(4, 6)];
    // The q, k, v projection's gradients come only through the core's backward by hand.
    let attention =
        ["transformer.h.0.attn.c_attn.weight", "transformer.h.3.attn.c_attn.bias", "transformer.h.2.ln_1.weight"];
    // A head size of 12: libtorch's path rounds the scores times 1/sqrt(12) to bf16 before its
    // softmax, the kernel scales in fp32, so the gradients differ (with a power-of-two scale they
    // came out the same bits) and show the core by hand ran.
    let shape = GptShape { d_model: 48, ..SHAPE };
    // The whole square (one query block), and query blocks of 12 (blocks of 12, 12 and 8 rows).
    // After the fused LayerNorm the whole branch runs by hand, its weights cast one by one or
    // cut from the block's one cast.
    for (rows, fused_layer_norm, unit_casts) in
        [(0, false, false), (12, false, false), (12, true, false), (0, true, true)]
    {
        let case = format!("query blocks of {rows}, fused LayerNorm {fused_layer_norm}, unit casts {unit_casts}");
        let policies = [Recompute::Attention, Recompute::Block, Recompute::Every(2)];
        check_by_hand(&case, &attention, &policies, |fused, policy| {
            tch::manual_seed(7);
            let mut model = Gpt::new(shape, Precision::Bf16, AttentionPrecision::Auto, Device::Cpu);
            model.set_unit_casts(unit_casts);
            model.set_causal_block_rows(rows);
            model.set_fused_layer_norm(fused_layer_norm, 2);
            model.set_fused_softmax(fused, 2);
            outcome(&model, policy, &data, &attention)
        });
    }
}

#[test]
fn fused_bias_gelu_gives_libtorchs_loss_and_gradients_in_bf16() {
    let _rng = super::rng_lock();
    let data = [batch(4, 8), batch(4, 9)];
    // The first linear layer's weight and bias get their gradients only by hand. The kernel adds
    // the fp32 bias to the product (libtorch rounds the biased product to bf16) and sums the
    // bias's gradient before rounding: not the same bits.
    let mlp = ["transformer.h.0.mlp.c_fc.weight", "transformer.h.3.mlp.c_fc.bias", "transformer.h.1.ln_2.weight"];
    for (unit_casts, fused_layer_norm) in [(false, false), (true, false), (false, true), (true, true)] {
        let case = format!("unit casts {unit_casts}, fused LayerNorm {fused_layer_norm}");
        let policies = [Recompute::Mlp, Recompute::Block, Recompute::Every(2)];
        check_by_hand(&case, &mlp, &policies, |fused, policy| {
            let mut model = model(Precision::Bf16);
            model.set_unit_casts(unit_casts);
            model.set_fused_layer_norm(fused_layer_norm, 2);
            model.set_fused_bias_gelu(fused, 2);
            outcome(&model, policy, &data, &mlp)
        });
    }
}

#[test]
fn whole_blocks_by_hand_give_libtorchs_loss_and_gradients_in_bf16() {
    let _rng = super::rng_lock();
    let data = [batch(4, 11), batch(4, 12)];
    // With the three block kernels on, no block has a libtorch graph: every parameter's gradient
    // comes by hand, over two accumulated micro-batches, with the weights cast per step once.
    let names = [
        "transformer.h.0.attn.c_attn.weight",
        "transformer.h.1.attn.c_proj.bias",
        "transformer.h.2.mlp.c_proj.weight",
        "transformer.h.3.mlp.c_fc.bias",
        "transformer.h.0.ln_1.bias",
    ];
    for reuse in [false, true] {
        let case = format!("reuse casts {reuse}");
        let policies = [Recompute::Mlp, Recompute::Attention, Recompute::Block, Recompute::Every(2)];
        check_by_hand(&case, &names, &policies, |fused, policy| {
            let mut model = model(Precision::Bf16);
            model.set_unit_casts(true);
            model.begin_step_casts(reuse);
            model.set_fused_layer_norm(fused, 2);
            model.set_fused_softmax(fused, 2);
            model.set_fused_bias_gelu(fused, 2);
            let got = outcome(&model, policy, &data, &names);
            model.end_step_casts();
            got
        });
    }
}

#[test]
fn weights_cast_once_per_step_give_bit_identical_bf16_gradients() {
    let _rng = super::rng_lock();
    let k = 4;
    let (inputs, targets) = batch(2 * k, 8);
    let parts: Vec<(Tensor, Tensor)> =
        (0..k).map(|i| (inputs.narrow(0, 2 * i, 2), targets.narrow(0, 2 * i, 2))).collect();
    for policy in [Recompute::None, Recompute::Block] {
        let executor = Executor::new(ExecutorKind::Blocks, policy).unwrap();
        let per_micro_batch = gradients(&model(Precision::Bf16), &executor, &parts);
        let mut reused = model(Precision::Bf16);
        reused.begin_step_casts(true);
        let once = gradients(&reused, &executor, &parts);
        // Every linear layer's weight and bias, and the head's tied embedding.
        assert_eq!(reused.kept_casts(), SHAPE.n_layer * 8 + 1, "recompute {policy}");
        reused.end_step_casts();
        assert_eq!(reused.kept_casts(), 0);
        assert!(once.iter().any(|&g| g != 0.0));
        let differing = once.iter().zip(&per_micro_batch).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differing, 0, "recompute {policy}: {differing} gradient elements differ");
        // A new step after the weights changed casts them again.
        tch::no_grad(|| {
            let mut flat = reused.params().flat().shallow_clone();
            flat *= 0.5;
        });
        reused.begin_step_casts(true);
        let after = gradients(&reused, &executor, &parts);
        reused.end_step_casts();
        let fresh = model(Precision::Bf16);
        tch::no_grad(|| {
            let mut flat = fresh.params().flat().shallow_clone();
            flat *= 0.5;
        });
        let want = gradients(&fresh, &executor, &parts);
        let differing = after.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differing, 0, "recompute {policy}: a cast from before the weights changed was reused");
    }
}

#[test]
fn unit_casts_give_bit_identical_bf16_gradients() {
    let _rng = super::rng_lock();
    let (inputs, targets) = batch(4, 9);
    let parts: Vec<(Tensor, Tensor)> =
        (0..2).map(|i| (inputs.narrow(0, 2 * i, 2), targets.narrow(0, 2 * i, 2))).collect();
    let one = [batch(4, 10)];
    let policies = [Recompute::None, Recompute::Mlp, Recompute::Attention, Recompute::Block, Recompute::Every(2)];
    // The fused LayerNorm splits a block in two backward segments; the fused head casts the
    // embedding outside the graph; with accumulation the block casts are kept for the step.
    for (fused_layer_norm, fused_head, reuse) in
        [(false, false, false), (true, false, false), (false, true, false), (true, true, true), (false, false, true)]
    {
        for policy in policies {
            let case = format!("fused LayerNorm {fused_layer_norm}, fused head {fused_head}, reuse {reuse}, {policy}");
            let executor = Executor::new(ExecutorKind::Blocks, policy).unwrap();
            let run = |unit_casts: bool, data: &[(Tensor, Tensor)]| {
                let mut model = model(Precision::Bf16);
                model.set_fused_layer_norm(fused_layer_norm, 2);
                model.set_fused_cross_entropy(fused_head, 2);
                model.set_unit_casts(unit_casts);
                model.begin_step_casts(reuse);
                let grads = gradients(&model, &executor, data);
                model.end_step_casts();
                grads
            };
            for data in [&parts[..], &one[..]] {
                let (per_weight, unit) = (run(false, data), run(true, data));
                assert!(unit.iter().any(|&g| g != 0.0), "{case}: no gradient");
                let differing = unit.iter().zip(&per_weight).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(differing, 0, "{case}, {} micro-batches: {differing} gradient elements differ", data.len());
            }
        }
    }
    // The single-graph step adds the leaves' gradients after its one backward, so the tied
    // embedding's two parts (head and embedding) are added in another order: that one parameter
    // may differ in its last bits, every other is the same.
    let executor = Executor::new(ExecutorKind::SingleGraph, Recompute::None).unwrap();
    let run = |unit_casts: bool| {
        let mut model = model(Precision::Bf16);
        model.set_unit_casts(unit_casts);
        gradients(&model, &executor, &parts)
    };
    let (per_weight, unit) = (run(false), run(true));
    let wte = SHAPE.vocab_size * SHAPE.d_model;
    let differing = unit[wte..].iter().zip(&per_weight[wte..]).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
    assert_eq!(differing, 0, "single graph: {differing} gradient elements beyond the embedding's differ");
    let diff = relative_difference(&unit[..wte], &per_weight[..wte]);
    assert!(diff <= 1e-6, "single graph: the embedding's gradient differs by {diff:e}");
}
