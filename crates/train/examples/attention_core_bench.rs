//! The bf16-math attention's core, forward and backward, as libtorch's autograd runs it against the
//! core by hand with the causal softmax kernel (`train.fused_softmax`), on the model's shapes.
//!
//! libtorch: q, k, v leaves `[batch * n_head, seq, head_dim]`, scores `baddbmm` over the expanded
//! causal mask, `softmax`, times v; backward seeded from `<y as fp32, dy>`, the same seed timed on a
//! bf16 leaf alone subtracted. By hand: the scores `bmm`-ed into one buffer, the kernel in place,
//! times v; backward `dY V^T` into one buffer, `P^T dY`, the kernel, `dS K`, `dS^T Q`. Both take the
//! whole square (`train.causal_block_rows` at least the context). The 6 matrix multiplies alone are
//! timed beside (the physical floor of either).
//!
//! ```text
//! cargo run --release -p stoke-train --example attention_core_bench -- [--rounds R] [--iters K] [--threads N]
//! ```
//!
//! Runs with the C allocator keeping freed memory (stoke's default `train.host_memory`; until
//! 2026-12-03 the bench set those variables after its start, where glibc no longer reads them).
//! Each round times libtorch's, the kernel's and the multiplies alone in turn (interleaved), K calls
//! each, and takes each one's median; the table gives the median of the rounds with min and max.

use stoke_train::{causal_softmax_backward_bf16, causal_softmax_bf16, CausalBlock};
use tch::{Device, Kind, Tensor};

mod support;
use support::{median, restart_with_retained_memory, rounds_iters_threads, time_ms};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (rounds, iters, n_threads) = rounds_iters_threads(&args, 15);
    restart_with_retained_memory();
    println!("threads: kernel {n_threads}, libtorch {}", tch::get_num_threads());
    println!("| heads x seq x head_dim | libtorch fwd+bwd ms (seed subtracted) | by hand fwd+bwd ms | by hand / libtorch | 6 bmm alone ms |");
    println!("|---|---|---|---|---|");
    // tiny and small at micro-batch 16 (4 and 6 heads of 64).
    for (bh, seq, hd) in [(64i64, 128i64, 64i64), (96, 256, 64)] {
        tch::manual_seed(1);
        let opts = (Kind::BFloat16, Device::Cpu);
        let (q, k, v) = (
            Tensor::randn([bh, seq, hd], opts),
            Tensor::randn([bh, seq, hd], opts),
            Tensor::randn([bh, seq, hd], opts),
        );
        let dy = Tensor::randn([bh, seq, hd], opts);
        let dy_f32 = dy.to_kind(Kind::Float);
        let mask = Tensor::full([seq, seq], f64::NEG_INFINITY, opts).triu(1);
        let scale = 1.0 / (hd as f64).sqrt();
        let (blocks, total) = CausalBlock::layout(seq as usize, 0, bh as usize);
        let mut cells: [Vec<f64>; 4] = Default::default();
        for _ in 0..rounds {
            let libtorch = time_ms(iters, || {
                let (ql, kl, vl) = (
                    q.detach().set_requires_grad(true),
                    k.detach().set_requires_grad(true),
                    v.detach().set_requires_grad(true),
                );
                let scores = mask.expand([bh, seq, seq], false).baddbmm(&ql, &kl.transpose(1, 2), 1.0, scale);
                let y = scores.softmax(-1, None).bmm(&vl);
                y.to_kind(Kind::Float).view([-1]).dot(&dy_f32.view([-1])).backward();
                let _ = std::hint::black_box((ql.grad(), kl.grad(), vl.grad()));
            });
            let seed = time_ms(iters, || {
                let leaf = dy.detach().set_requires_grad(true);
                leaf.to_kind(Kind::Float).view([-1]).dot(&dy_f32.view([-1])).backward();
                let _ = std::hint::black_box(leaf.grad());
            });
            let by_hand = time_ms(iters, || {
                let _guard = tch::no_grad_guard();
                let probs = Tensor::empty([total as i64], opts);
                let p = probs.view([bh, seq, seq]);
                let _ = q.bmm_out(&p, &k.transpose(1, 2));
                causal_softmax_bf16(&probs, &blocks, bh as usize, scale as f32, n_threads);
                let y = p.bmm(&v);
                let grads = Tensor::empty([3, bh, seq, hd], opts);
                let grad_probs = Tensor::empty([total as i64], opts);
                let dp = grad_probs.view([bh, seq, seq]);
                let _ = dy.bmm_out(&dp, &v.transpose(1, 2));
                let _ = p.transpose(1, 2).bmm_out(&grads.get(2), &dy);
                causal_softmax_backward_bf16(&probs, &grad_probs, &blocks, bh as usize, scale as f32, n_threads);
                let _ = dp.bmm_out(&grads.get(0), &k);
                let _ = dp.transpose(1, 2).bmm_out(&grads.get(1), &q);
                let _ = std::hint::black_box((y, grads));
            });
            let matmuls = time_ms(iters, || {
                let _guard = tch::no_grad_guard();
                let p = q.bmm(&k.transpose(1, 2));
                let y = p.bmm(&v);
                let dp = dy.bmm(&v.transpose(1, 2));
                let dv = p.transpose(1, 2).bmm(&dy);
                let dq = dp.bmm(&k);
                let dk = dp.transpose(1, 2).bmm(&q);
                let _ = std::hint::black_box((y, dv, dq, dk));
            });
            let libtorch = libtorch - seed;
            for (cell, value) in cells.iter_mut().zip([libtorch, by_hand, by_hand / libtorch, matmuls]) {
                cell.push(value);
            }
        }
        let spread = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            let m = median(v);
            format!("{m:.3} ({:.3}-{:.3})", v[0], v[v.len() - 1])
        };
        let [a, b, c, d] = &mut cells;
        println!("| {bh} x {seq} x {hd} | {} | {} | {} | {} |", spread(a), spread(b), spread(c), spread(d));
    }
}
