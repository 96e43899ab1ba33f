use tch::{Device, Kind, Tensor};

use super::*;
use crate::params::{Init, ParamSpec, UnitSpec};

/// Small tensors of three shapes, one without decay, over two units.
/// Two small units and a large one, with fixed values that take nothing from libtorch's global
/// generator: it is shared by the tests running beside this one, so a seed set here could be
/// consumed by another thread between two calls (two "identical" models that differed), and draws
/// here would move the numbers of the tests that hold `GLOBAL_RNG`.
fn params() -> FlatParams {
    let spec =
        |name: &str, shape: Vec<i64>, decay: bool| ParamSpec { name: name.into(), shape, init: Init::Zeros, decay };
    let flat = FlatParams::new(
        vec![
            UnitSpec { name: "a".into(), params: vec![spec("a.w", vec![7, 5], true), spec("a.b", vec![5], false)] },
            UnitSpec { name: "b".into(), params: vec![spec("b.w", vec![300, 301], true)] },
        ],
        Device::Cpu,
    );
    tch::no_grad(|| {
        for (i, e) in flat.entries().iter().enumerate() {
            let n = e.tensor.numel() as i64;
            let values = ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.37 + i as f64).sin() * 0.5)
                .reshape(e.tensor.size());
            let mut tensor = e.tensor.shallow_clone();
            tensor.copy_(&values);
        }
    });
    flat
}

fn hyper() -> Hyper {
    Hyper { lr: 0.01, beta1: 0.9, beta2: 0.99, eps: 1e-6, weight_decay: 0.1, momentum: 0.9, nesterov: false }
}

/// A fixed loss whose gradient differs step by step.
fn backward(params: &FlatParams, step: usize) {
    let mut loss = Tensor::zeros([], (Kind::Float, Device::Cpu));
    for (i, e) in params.entries().iter().enumerate() {
        loss += (e.tensor.square().sum(Kind::Float) * (0.3 + i as f64) + e.tensor.sum(Kind::Float)) * step as f64;
    }
    loss.backward();
}

/// LAMB written per tensor from the paper with plain libtorch ops, for comparison: the trust
/// ratio on the tensors in `adapt`, clamped into `clamp`.
fn reference_lamb(
    init: &[Tensor],
    decay: &[bool],
    adapt: &[bool],
    clamp: (f64, f64),
    grads: &[Vec<Tensor>],
    hp: &Hyper,
) -> Vec<Tensor> {
    let mut w: Vec<Tensor> = init.iter().map(|t| t.to_kind(Kind::Double)).collect();
    let mut m: Vec<Tensor> = w.iter().map(Tensor::zeros_like).collect();
    let mut v: Vec<Tensor> = w.iter().map(Tensor::zeros_like).collect();
    for (t, step_grads) in grads.iter().enumerate() {
        let t = (t + 1) as i32;
        for i in 0..w.len() {
            let g = step_grads[i].to_kind(Kind::Double);
            m[i] = &m[i] * hp.beta1 + &g * (1.0 - hp.beta1);
            v[i] = &v[i] * hp.beta2 + g.square() * (1.0 - hp.beta2);
            let m_hat = &m[i] / (1.0 - hp.beta1.powi(t));
            let v_hat = &v[i] / (1.0 - hp.beta2.powi(t));
            let mut u = m_hat / (v_hat.sqrt() + hp.eps);
            if decay[i] {
                u = u + &w[i] * hp.weight_decay;
            }
            let (wn, un) = (w[i].norm().double_value(&[]), u.norm().double_value(&[]));
            let trust = match (adapt[i], wn > 0.0 && un > 0.0) {
                (true, true) => (wn / un).clamp(clamp.0, clamp.1),
                (true, false) => 1.0f64.clamp(clamp.0, clamp.1),
                (false, _) => 1.0,
            };
            w[i] = &w[i] - u * (hp.lr * trust);
        }
    }
    w
}

/// Runs `steps` steps of `kind`, returning the initial tensors, each step's gradients and the
/// final tensors.
fn run(kind: OptimizerKind, kernel: UpdateKernel, hp: &Hyper) -> (Vec<Tensor>, Vec<Vec<Tensor>>, Vec<Tensor>) {
    run_with(|params| Optimizer::new(kind, params), kernel, hp)
}

fn run_with(
    make: impl FnOnce(&FlatParams) -> Optimizer,
    kernel: UpdateKernel,
    hp: &Hyper,
) -> (Vec<Tensor>, Vec<Vec<Tensor>>, Vec<Tensor>) {
    let params = params();
    let init: Vec<Tensor> = params.entries().iter().map(|e| e.tensor.detach().copy()).collect();
    let mut optimizer = make(&params);
    let mut grads = Vec::new();
    for step in 1..=3 {
        backward(&params, step);
        grads.push(params.entries().iter().map(|e| e.tensor.grad().copy()).collect());
        optimizer.step(&params, hp, 0.0, None, kernel, 2).unwrap();
    }
    let last = params.entries().iter().map(|e| e.tensor.detach().copy()).collect();
    (init, grads, last)
}

fn worst(a: &[Tensor], b: &[Tensor]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(a, b)| (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

#[test]
fn lamb_matches_a_per_tensor_implementation() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let decay: Vec<bool> = params().entries().iter().map(|e| e.decay).collect();
    let no_clamp = (0.0, f64::INFINITY);
    for kernel in [UpdateKernel::Fused, UpdateKernel::TensorOps] {
        // The default: the trust ratio on the decayed tensors only (the bias "a.b" takes Adam's step).
        let (init, grads, got) = run(OptimizerKind::Lamb, kernel, &hyper());
        let want = reference_lamb(&init, &decay, &decay, no_clamp, &grads, &hyper());
        let err = worst(&got, &want);
        assert!(err < 1e-6, "{kernel:?}: LAMB differs from the per-tensor reference by {err}");
        // The trust ratio matters: plain Adam steps would be far off.
        assert!(worst(&got, &init) > 1e-3, "the parameters moved");
        let all = vec![true; decay.len()];
        let adapted_everywhere = reference_lamb(&init, &decay, &all, no_clamp, &grads, &hyper());
        assert!(worst(&got[1..2], &adapted_everywhere[1..2]) > 1e-3, "the bias takes no trust ratio");
        assert!(worst(&got[..1], &adapted_everywhere[..1]) < 1e-6, "each tensor's ratio is its own");
        // NVLAMB (every tensor adapted), and a clamp that binds: at step 1 the ratios are
        // ||w|| / ||u|| ~ 0.5 / 1 for these tensors, so [0.9, 10] lifts them.
        for (options, clamp) in [
            (LambOptions { adapt_all: true, ..LambOptions::default() }, no_clamp),
            (LambOptions { adapt_all: false, min_trust: 0.9, max_trust: 10.0 }, (0.9, 10.0)),
        ] {
            let make = |p: &FlatParams| Optimizer::Lamb(Lamb::with_options(p, options));
            let (init, grads, got) = run_with(make, kernel, &hyper());
            let adapt: Vec<bool> = decay.iter().map(|&d| d || options.adapt_all).collect();
            let want = reference_lamb(&init, &decay, &adapt, clamp, &grads, &hyper());
            let err = worst(&got, &want);
            assert!(err < 1e-6, "{kernel:?} {options:?}: LAMB differs from the per-tensor reference by {err}");
            let unclamped = reference_lamb(&init, &decay, &adapt, no_clamp, &grads, &hyper());
            if clamp != no_clamp {
                assert!(worst(&got, &unclamped) > 1e-3, "the clamp binds");
            }
        }
    }
}

#[test]
fn lamb_shards_add_up_to_the_whole() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let hp = hyper();
    let whole_params = params();
    let split_params = params();
    for p in [&whole_params, &split_params] {
        backward(p, 1);
    }
    let (mut whole, mut split) = (Lamb::new(&whole_params), Lamb::new(&split_params));
    let n = whole_params.n_elements();
    let mut norms = TensorNorms::zeros(3);
    whole.begin_step();
    whole.prepare_range(&whole_params, 0..n, &hp, 1.0, UpdateKernel::Fused, 1, &mut norms);
    whole.apply_range(&whole_params, 0..n, hp.lr, &norms, UpdateKernel::Fused, 1);
    // Two "shards" cutting through the middle of a tensor, each with its own partial norms.
    let (mut first, mut second) = (TensorNorms::zeros(3), TensorNorms::zeros(3));
    split.begin_step();
    split.prepare_range(&split_params, 0..20, &hp, 1.0, UpdateKernel::Fused, 1, &mut first);
    split.prepare_range(&split_params, 20..n, &hp, 1.0, UpdateKernel::TensorOps, 1, &mut second);
    let mut summed = TensorNorms::zeros(3);
    for part in [&first, &second] {
        for i in 0..3 {
            summed.param_sq[i] += part.param_sq[i];
            summed.update_sq[i] += part.update_sq[i];
        }
    }
    split.apply_range(&split_params, 0..20, hp.lr, &summed, UpdateKernel::TensorOps, 1);
    split.apply_range(&split_params, 20..n, hp.lr, &summed, UpdateKernel::Fused, 1);
    let diff = (whole_params.flat() - split_params.flat()).abs().max().double_value(&[]);
    assert!(diff < 1e-6, "sharded LAMB differs by {diff}");
    assert_eq!(split_params.flat_grad().abs().sum(Kind::Double).double_value(&[]), 0.0, "gradients cleared");
}

#[test]
fn sgd_matches_pytorch_arithmetic() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for nesterov in [false, true] {
        let hp = Hyper { nesterov, ..hyper() };
        let decay: Vec<bool> = params().entries().iter().map(|e| e.decay).collect();
        for kernel in [UpdateKernel::Fused, UpdateKernel::TensorOps] {
            let (init, grads, got) = run(OptimizerKind::Sgd, kernel, &hp);
            let mut w: Vec<Tensor> = init.iter().map(|t| t.to_kind(Kind::Double)).collect();
            let mut b: Vec<Tensor> = w.iter().map(Tensor::zeros_like).collect();
            for step_grads in &grads {
                for i in 0..w.len() {
                    let mut g = step_grads[i].to_kind(Kind::Double);
                    if decay[i] {
                        g = g + &w[i] * hp.weight_decay;
                    }
                    b[i] = &b[i] * hp.momentum + &g;
                    let d = if nesterov { g + &b[i] * hp.momentum } else { b[i].shallow_clone() };
                    w[i] = &w[i] - d * hp.lr;
                }
            }
            let err = worst(&got, &w);
            assert!(err < 1e-5, "nesterov {nesterov} {kernel:?}: SGD differs by {err}");
        }
    }
}

#[test]
fn state_round_trips_by_name() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for kind in [OptimizerKind::Lamb, OptimizerKind::Sgd] {
        let params = params();
        let mut optimizer = Optimizer::new(kind, &params);
        backward(&params, 1);
        optimizer.step(&params, &hyper(), 0.0, None, UpdateKernel::Fused, 1).unwrap();
        let saved: Vec<(String, Vec<i64>, Tensor)> =
            optimizer.state_tensors(&params).into_iter().map(|s| (s.name, s.shape, s.tensor.copy())).collect();
        let expected = if kind == OptimizerKind::Sgd { 3 } else { 6 };
        assert_eq!(saved.len(), expected);
        let mut restored = Optimizer::new(kind, &params);
        restored
            .load_state(&params, 1, |name| {
                saved.iter().find(|s| s.0 == name).map(|s| (s.1.clone(), s.2.shallow_clone()))
            })
            .unwrap();
        for (a, b) in restored.state_tensors(&params).iter().zip(&saved) {
            assert!(a.tensor.equal(&b.2), "{kind:?} {}", b.0);
        }
        let err = Optimizer::new(kind, &params).load_state(&params, 1, |_| None).unwrap_err();
        assert!(err.contains("a.w."), "{err}");
    }
}

#[test]
fn a_non_finite_gradient_stops_before_the_update() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    for kind in [OptimizerKind::AdamW, OptimizerKind::Lamb, OptimizerKind::Sgd] {
        let params = params();
        let before = params.flat().copy();
        backward(&params, 1);
        let _ = params.flat_grad().narrow(0, 3, 1).fill_(f64::NAN);
        let mut optimizer = Optimizer::new(kind, &params);
        let norm = optimizer.step(&params, &hyper(), 1.0, None, UpdateKernel::Fused, 1).unwrap_err();
        assert!(norm.is_nan());
        assert!(params.flat().equal(&before), "{kind:?} changed the parameters");
        assert_eq!(optimizer.n_steps(), 0);
    }
}

/// A parameter's factor on the learning rate (`train.lr_multipliers`) moves it as a run at that
/// rate would, decay included, and leaves the others at the run's rate: every optimizer, both
/// kernels. The loss is a sum of one term per tensor, so each tensor's gradients depend on it
/// alone and three steps can be compared tensor by tensor.
#[test]
fn a_learning_rate_factor_moves_its_parameters_as_that_rate_would() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let factor = 0.25;
    for kind in [OptimizerKind::AdamW, OptimizerKind::Lamb, OptimizerKind::Sgd] {
        for kernel in [UpdateKernel::Fused, UpdateKernel::TensorOps] {
            let run = |lr: f64, scaled: bool| {
                let mut params = params();
                if scaled {
                    params.set_lr_scales(&|name| if name.starts_with("a.") { factor } else { 1.0 });
                }
                let mut optimizer = Optimizer::new(kind, &params);
                let hp = Hyper { lr, ..hyper() };
                for step in 1..=3 {
                    backward(&params, step);
                    optimizer
                        .step_with_sq_sum(&params, 1.0, &hp, 0.0, None, kernel, 2, |_| Ok::<(), ()>(()))
                        .unwrap()
                        .unwrap();
                }
                params
            };
            let (mixed, slow, plain) = (run(0.01, true), run(0.01 * factor, false), run(0.01, false));
            for entry in mixed.entries() {
                let expected = if entry.name.starts_with("a.") { &slow } else { &plain };
                let diff = (&entry.tensor - expected.get(&entry.name)).abs().max().double_value(&[]);
                assert!(diff < 1e-7, "{kind:?} {kernel:?} {}: {diff}", entry.name);
                let moved = (&entry.tensor - params().get(&entry.name)).abs().max().double_value(&[]);
                assert!(moved > 1e-4, "{kind:?} {kernel:?} {} did not move", entry.name);
            }
        }
    }
}

#[test]
fn the_step_on_the_device_is_the_host_step_bit_for_bit() {
    // AdamW and SGD on the tensor-op path, with the clip biting (max norm 1) and not (1e9): the
    // norm kept on the device and the clip computed there change no bit of the trajectory.
    for kind in [OptimizerKind::AdamW, OptimizerKind::Sgd] {
        for max_norm in [1.0, 1e9, 0.0] {
            let (host, device) = (params(), params());
            let (mut host_opt, mut device_opt) = (Optimizer::new(kind, &host), Optimizer::new(kind, &device));
            assert!(device_opt.steps_on_device(&device, UpdateKernel::TensorOps));
            assert!(!device_opt.steps_on_device(&device, UpdateKernel::Fused), "CPU fp32 runs the fused kernel");
            for step in 1..=4 {
                backward(&host, step);
                backward(&device, step);
                let sq = host_opt.grad_sq_sum(&host, 0..host.n_elements(), UpdateKernel::TensorOps, 2);
                let outcome = host_opt
                    .step_with_sq_sum(&host, sq, &hyper(), max_norm, None, UpdateKernel::TensorOps, 2, |_| {
                        Ok::<(), ()>(())
                    })
                    .unwrap()
                    .unwrap();
                let kept = device_opt.step_on_device(&device, &hyper(), max_norm, UpdateKernel::TensorOps);
                assert_eq!(kept.double_value(&[]).to_bits(), sq.to_bits(), "{kind:?} step {step}: the same sum");
                assert_eq!(kept.double_value(&[]).sqrt(), outcome.grad_norm);
                if max_norm == 1.0 {
                    assert!(outcome.grad_norm > 1.0, "the clip bites at step {step}");
                }
                let (a, b) = (Vec::<f32>::try_from(host.flat()).unwrap(), Vec::<f32>::try_from(device.flat()).unwrap());
                assert!(
                    a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{kind:?}, max norm {max_norm}, step {step}"
                );
                assert_eq!(device.flat_grad().abs().sum(Kind::Float).double_value(&[]), 0.0, "gradients cleared");
            }
        }
    }
}
