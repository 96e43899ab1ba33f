//! The fused LayerNorm kernels against libtorch's ops they replace, on the model's shapes: the
//! fp32 residual stream `[rows, d]` normed into the bf16 the next linear layer takes, and the
//! backward from a bf16 gradient, with the residual branch's gradient added. libtorch: fp32
//! `layer_norm`, cast to bf16; backward through both and the add. tch's backward starts from a
//! scalar, so libtorch's backward is seeded from `<out as fp32, grad>`, and the same seed timed on
//! a bf16 leaf alone is subtracted (in the model the gradient comes from the next linear layer's
//! backward on both sides). Fused: `layer_norm_bf16`, then `layer_norm_bf16_backward` adding into
//! the residual's gradient in place. A copy of the fp32 input is the physical limit beside.
//!
//! ```text
//! cargo run --release -p stoke-train --example layer_norm_bench -- [--rounds R] [--iters K] [--threads N] [--system-memory]
//! ```
//!
//! The C allocator keeps freed memory (stoke's `train.host_memory = "retain"`, its default) unless
//! `--system-memory`: with glibc's defaults each fresh fp32 temporary of a few MB faults its pages
//! in again, which dominates libtorch's side at these sizes.
//!
//! Each round times libtorch's forward, the kernel's forward, libtorch's forward and backward,
//! the kernels' forward and backward and the copy in turn (interleaved), K calls each, and takes
//! each one's median; the table gives the median of the rounds with min and max.

use stoke_train::{layer_norm_bf16, layer_norm_bf16_backward};
use tch::{Device, Kind, Tensor};

mod support;
use support::{median, restart_with_retained_memory, rounds_iters_threads, time_ms};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (rounds, iters, n_threads) = rounds_iters_threads(&args, 15);
    if !args.iter().any(|a| a == "--system-memory") {
        restart_with_retained_memory();
    }
    println!("threads: kernel {n_threads}, libtorch {}", tch::get_num_threads());
    println!("| rows x d | libtorch fwd ms | fused fwd ms | libtorch fwd+bwd ms (seed subtracted) | fused fwd+bwd ms | fused / libtorch (fwd+bwd) | copy of x ms |");
    println!("|---|---|---|---|---|---|---|");
    // tiny, small and gpt2-124m at micro-batch 16, 16 and 1.
    for (rows, d) in [(2048i64, 256i64), (4096, 384), (1024, 768)] {
        tch::manual_seed(1);
        let opts = (Kind::Float, Device::Cpu);
        let x = Tensor::randn([rows, d], opts);
        let (w, b) = (Tensor::randn([d], opts) * 0.1 + 1.0, Tensor::randn([d], opts) * 0.1);
        let grad = Tensor::randn([rows, d], opts).to_kind(Kind::BFloat16);
        let grad_f32 = grad.to_kind(Kind::Float);
        let residual = Tensor::randn([rows, d], opts);
        let (wg, bg) = (Tensor::zeros([d], opts), Tensor::zeros([d], opts));
        let mut copy_target = x.copy();
        let mut accumulated = residual.copy();
        let mut cells: [Vec<f64>; 6] = Default::default();
        for _ in 0..rounds {
            let lf = time_ms(iters, || {
                let _g = tch::no_grad_guard();
                let _ = std::hint::black_box(x.layer_norm([d], Some(&w), Some(&b), 1e-5, true).to_kind(Kind::BFloat16));
            });
            let ff = time_ms(iters, || {
                std::hint::black_box(layer_norm_bf16(&x, &w, &b, 1e-5, n_threads));
            });
            let lb = time_ms(iters, || {
                let (xl, wl, bl) = (
                    x.detach().set_requires_grad(true),
                    w.detach().set_requires_grad(true),
                    b.detach().set_requires_grad(true),
                );
                let out = xl.layer_norm([d], Some(&wl), Some(&bl), 1e-5, true).to_kind(Kind::BFloat16);
                out.to_kind(Kind::Float).view([-1]).dot(&grad_f32.view([-1])).backward();
                let _ = std::hint::black_box((xl.grad() + &residual, wl.grad(), bl.grad()));
            });
            let seed = time_ms(iters, || {
                let leaf = grad.detach().set_requires_grad(true);
                leaf.to_kind(Kind::Float).view([-1]).dot(&grad_f32.view([-1])).backward();
                let _ = std::hint::black_box(leaf.grad());
            });
            let lb = lb - seed;
            let fb = time_ms(iters, || {
                let (out, stats) = layer_norm_bf16(&x, &w, &b, 1e-5, n_threads).unwrap();
                let _ = std::hint::black_box(out);
                let acc = layer_norm_bf16_backward(
                    &grad,
                    &x,
                    &stats,
                    &w,
                    Some(accumulated.shallow_clone()),
                    &wg,
                    &bg,
                    None,
                    n_threads,
                );
                let _ = std::hint::black_box(acc);
            });
            let c = time_ms(iters, || {
                copy_target.copy_(&x);
            });
            for (cell, v) in cells.iter_mut().zip([lf, ff, lb, fb, fb / lb, c]) {
                cell.push(v);
            }
        }
        let _ = accumulated.zero_();
        let spread = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            let m = median(v);
            format!("{m:.3} ({:.3}-{:.3})", v[0], v[v.len() - 1])
        };
        let [a, b2, c, e, f, g] = &mut cells;
        println!(
            "| {rows} x {d} | {} | {} | {} | {} | {} | {} |",
            spread(a),
            spread(b2),
            spread(c),
            spread(e),
            spread(f),
            spread(g)
        );
    }
}
