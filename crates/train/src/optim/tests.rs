use tch::{Device, Kind};

use super::*;
use crate::params::{Init, ParamSpec, UnitSpec};

fn params() -> FlatParams {
    let spec = |name: &str, shape: Vec<i64>, decay: bool| ParamSpec {
        name: name.into(),
        shape,
        init: Init::Normal { std: 0.5 },
        decay,
    };
    tch::manual_seed(0);
    // Large enough that the fused path splits the work across threads.
    FlatParams::new(
        vec![UnitSpec { name: "u".into(), params: vec![spec("b", vec![200], false), spec("w", vec![400, 200], true)] }],
        Device::Cpu,
    )
}

/// Final parameters and the norms seen, after three steps on a fixed loss.
fn train_three_steps(kernel: UpdateKernel) -> (Vec<f32>, Vec<f64>) {
    let params = params();
    let mut optimizer = AdamW::new(&params);
    let hp = AdamWStep { lr: 0.01, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
    let mut norms = Vec::new();
    for step in 1..=3 {
        let w = params.get("w");
        let loss = (w.square().sum(Kind::Float) * 0.01 + params.get("b").sum(Kind::Float)) * step as f64;
        loss.backward();
        norms.push(optimizer.step(&params, hp, 5.0, None, kernel, 2).grad_norm);
    }
    (Vec::<f32>::try_from(params.flat()).unwrap(), norms)
}

#[test]
fn an_update_that_saves_and_measures_leaves_the_old_state_in_the_rooms_and_updates_as_one_that_does_not() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let hp = AdamWStep { lr: 0.01, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
    // Segments shorter than a block (saved block by block), and whole buffers (saved from the
    // update's registers).
    let cases = [(UpdateKernel::Fused, 5003), (UpdateKernel::Fused, usize::MAX), (UpdateKernel::TensorOps, 5003)];
    for (kernel, segment) in cases {
        let (plain, saving) = (params(), params());
        let (mut plain_opt, mut saving_opt) = (AdamW::new(&plain), AdamW::new(&saving));
        let mut rooms = vec![0f32; 3 * plain.n_elements() as usize + 1];
        for step in 1..=3 {
            for (p, o) in [(&plain, &mut plain_opt), (&saving, &mut saving_opt)] {
                let loss = (p.get("w").square().sum(Kind::Float) * 0.01 + p.get("b").sum(Kind::Float)) * step as f64;
                loss.backward();
                if step == 3 && std::ptr::eq(p, &saving) {
                    // Rooms one element off 16-byte alignment, in segments that do not
                    // line up with the blocks or the parameters.
                    let n = p.n_elements() as usize;
                    let sources = [p.flat(), &o.exp_avg, &o.exp_avg_sq].map(|t| t.data_ptr() as usize);
                    let mut segments = Vec::new();
                    for (i, src) in sources.into_iter().enumerate() {
                        let mut at = 0;
                        while at < n {
                            let len = segment.min(n - at);
                            let dst = rooms[1 + i * n + at..].as_mut_ptr() as usize;
                            segments.push((src + 4 * at, 4 * len, dst));
                            at += len;
                        }
                    }
                    let before: Vec<f32> = [p.flat(), &o.exp_avg, &o.exp_avg_sq]
                        .iter()
                        .flat_map(|t| Vec::<f32>::try_from(*t).unwrap())
                        .collect();
                    let save = Arc::new(SaveMap::new(segments));
                    o.save_in_next_update(Some(Arc::clone(&save)));
                    // Measuring takes the block-by-block way: not with whole buffers.
                    let measure = segment != usize::MAX;
                    if measure {
                        o.measure_next_update();
                    }
                    o.step(p, hp, 5.0, None, kernel, 2);
                    assert!(save.is_complete(), "{kernel:?}: the update marked the rooms filled");
                    // The measured norms: each parameter's change and weights, as from copies.
                    let norms = o.take_update_norms();
                    if kernel == UpdateKernel::Fused && measure {
                        let norms = norms.expect("the fused update measured");
                        let after = Vec::<f32>::try_from(p.flat()).unwrap();
                        for (e, &(change, weight)) in p.entries().iter().zip(&norms) {
                            let r = e.offset as usize..(e.offset + e.numel) as usize;
                            let w: f64 = before[r.clone()].iter().map(|&x| f64::from(x).powi(2)).sum();
                            let c: f64 =
                                after[r.clone()].iter().zip(&before[r]).map(|(&a, &b)| f64::from(a - b).powi(2)).sum();
                            assert!((weight - w).abs() <= 1e-12 * w && (change - c).abs() <= 1e-12 * c, "{}", e.name);
                            assert!(c > 0.0);
                        }
                    } else {
                        assert!(norms.is_none(), "{kernel:?}: no norms where none were measured");
                    }
                    assert!(rooms[1..] == before[..], "{kernel:?}: the rooms hold the state before the update");
                    assert_eq!(rooms[0], 0.0);
                    // The CRC-32s handed to the writer cover every room's byte once and are
                    // those of the bytes in the rooms.
                    let mut checksums = save.take_checksums();
                    checksums.sort_unstable();
                    let base = rooms[1..].as_ptr() as usize;
                    let mut at = base;
                    for &(address, len, crc) in &checksums {
                        assert_eq!(address, at, "{kernel:?}: the checksummed pieces tile the rooms");
                        // SAFETY: `address..address + len` lies in `rooms` (checked by the
                        // tiling: it starts where the last ended and ends by the rooms' end).
                        assert!(address + len <= base + 4 * (rooms.len() - 1));
                        let bytes = unsafe { std::slice::from_raw_parts(address as *const u8, len) };
                        assert_eq!(crc, stoke_ckpt::checksum(bytes), "{kernel:?}: a piece's CRC-32");
                        at += len;
                    }
                    assert_eq!(at, base + 4 * (rooms.len() - 1), "{kernel:?}: every room's bytes checksummed");
                } else {
                    o.step(p, hp, 5.0, None, kernel, 2);
                }
            }
        }
        let flat = |p: &FlatParams| Vec::<f32>::try_from(p.flat()).unwrap();
        assert!(flat(&plain) == flat(&saving), "{kernel:?}: saving changed the update");
        let moments = |o: &AdamW| Vec::<f32>::try_from(&o.exp_avg_sq).unwrap();
        assert!(moments(&plain_opt) == moments(&saving_opt));
    }
}

#[test]
fn the_saving_update_folds_each_rooms_crc_from_its_registers_and_updates_as_update_does() {
    let k = UpdateConsts { clip: 0.5, w1: 0.1, w2: 0.01, inv_sqrt_bc2: 1.2, eps: 1e-8, decay: 0.999, step_size: 0.01 };
    let values = |seed: usize, n: usize| -> Vec<f32> {
        (0..n).map(|i| ((i * 7919 + seed * 104_729) % 1000) as f32 / 250.0 - 2.0).collect()
    };
    // Lengths with and without a tail; rooms at every offset from 32-byte alignment.
    for (n, offset) in [(1000, 0), (1003, 1), (17, 5), (5, 3), (4099, 7)] {
        let ways = [Some(RegisterSave::Plain), saves_in_registers([std::ptr::null_mut(); 3])];
        for way in ways.into_iter().flatten() {
            // The second moment is never negative.
            let v: Vec<f32> = values(4, n).iter().map(|x| x.abs()).collect();
            let (mut g, mut p, mut m, mut v) = (values(1, n), values(2, n), values(3, n), v);
            let old = [p.clone(), m.clone(), v.clone()];
            let (mut g2, mut p2, mut m2, mut v2) = (g.clone(), p.clone(), m.clone(), v.clone());
            update(&mut g2, &mut p2, &mut m2, &mut v2, &k);
            // Room space aligned to 32 bytes, each room `offset` f32 past a boundary.
            let stride = n.div_ceil(8) * 8 + 8;
            let mut space = vec![0f32; 3 * stride + 8];
            let base = space.as_mut_ptr().align_offset(32);
            let rooms: [*mut f32; 3] = std::array::from_fn(|j| space[base + j * stride + offset..].as_mut_ptr());
            if saves_in_registers(rooms).is_none() {
                eprintln!("skipped: this CPU saves no block from registers");
                return;
            }
            // SAFETY: each room has `n` f32 of `space`, which nothing else touches.
            let crcs = unsafe { update_saving(&mut g, &mut p, &mut m, &mut v, &k, rooms, way) };
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert!(
                bits(&p) == bits(&p2) && bits(&m) == bits(&m2) && bits(&v) == bits(&v2) && bits(&g) == bits(&g2),
                "{way:?} n {n}: the update is update's"
            );
            for (j, old) in old.iter().enumerate() {
                let start = base + j * stride + offset;
                assert!(space[start..start + n] == old[..], "{way:?} n {n}: room {j} holds the old values");
            }
            match way {
                RegisterSave::Plain => assert_eq!(crcs, None),
                RegisterSave::WithChecksums => {
                    let expected = old.clone().map(|x| stoke_ckpt::checksum(f32_bytes(&x)));
                    assert_eq!(crcs, Some(expected), "n {n} offset {offset}");
                }
            }
        }
    }
}

#[test]
fn fused_cpu_step_matches_the_tensor_ops() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let (fused, fused_norms) = train_three_steps(UpdateKernel::Fused);
    let (reference, reference_norms) = train_three_steps(UpdateKernel::TensorOps);
    for (a, b) in fused_norms.iter().zip(&reference_norms) {
        assert!((a - b).abs() < 1e-4 * b.abs().max(1.0), "norms {fused_norms:?} vs {reference_norms:?}");
    }
    assert!(reference_norms[2] > 5.0, "the test must exercise clipping: {reference_norms:?}");
    let worst = fused.iter().zip(&reference).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-5, "fused and tensor AdamW differ by {worst}");
}

#[test]
fn ranges_add_up_to_the_whole() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let params = params();
    params.get("w").square().sum(Kind::Float).backward();
    let optimizer = AdamW::new(&params);
    for kernel in [UpdateKernel::Fused, UpdateKernel::TensorOps] {
        let whole = optimizer.grad_sq_sum(&params, 0..params.n_elements(), kernel, 2);
        // A split that cuts through the middle of a parameter, as a ZeRO shard would.
        let parts = optimizer.grad_sq_sum(&params, 0..30_000, kernel, 2)
            + optimizer.grad_sq_sum(&params, 30_000..params.n_elements(), kernel, 2);
        assert!((whole - parts).abs() < 1e-9 * whole, "{kernel:?}: {whole} vs {parts}");
    }
}

#[test]
fn state_loads_by_name_and_refuses_another_layout() {
    let _rng = crate::GLOBAL_RNG.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let params = params();
    params.get("w").square().sum(Kind::Float).backward();
    let mut optimizer = AdamW::new(&params);
    let hp = AdamWStep { lr: 0.01, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 };
    optimizer.step(&params, hp, 0.0, None, UpdateKernel::Fused, 1);
    let saved: Vec<(String, Vec<i64>, Tensor)> =
        optimizer.state_tensors(&params).into_iter().map(|s| (s.name, s.shape, s.tensor.copy())).collect();
    let mut restored = AdamW::new(&params);
    let find = |saved: &[(String, Vec<i64>, Tensor)], name: &str| {
        saved.iter().find(|s| s.0 == name).map(|s| (s.1.clone(), s.2.shallow_clone()))
    };
    restored.load_state(&params, 1, |name| find(&saved, name)).unwrap();
    assert!(restored.exp_avg.equal(&optimizer.exp_avg) && restored.exp_avg_sq.equal(&optimizer.exp_avg_sq));
    // Another model whose "w" has another shape: the error names the tensor.
    let other = FlatParams::new(
        vec![UnitSpec {
            name: "u".into(),
            params: vec![
                ParamSpec { name: "b".into(), shape: vec![200], init: Init::Zeros, decay: false },
                ParamSpec { name: "w".into(), shape: vec![200, 400], init: Init::Zeros, decay: true },
            ],
        }],
        Device::Cpu,
    );
    let err = AdamW::new(&other).load_state(&other, 1, |name| find(&saved, name)).unwrap_err();
    assert!(err.contains("\"w.exp_avg\"") && err.contains("[400, 200]"), "{err}");
}
