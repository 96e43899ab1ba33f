//! The fused cross-entropy head against libtorch's, on the model's shapes: from the head's bf16
//! input `h` `[rows, d]` and the fp32 tied embedding `W` `[vocab, d]` to the loss, the gradient of
//! `h` and `W`'s gradient accumulated in fp32, as the block executor runs them. libtorch: the
//! cast of `W`, `h @ W^T`, the cast of the logits to fp32, cross-entropy, and autograd's backward
//! from the loss. Fused: the same cast and logits outside the graph, the kernel (loss and the
//! logits' gradient `G` in one pass), then `G @ W` and `G^T @ h` added to `W`'s gradient by hand.
//! The head's three matrix multiplies alone are the floor beside.
//!
//! ```text
//! cargo run --release -p stoke-train --example fused_ce_bench -- [--rounds R] [--iters K]
//! ```
//!
//! Each round times libtorch, fused, the kernel alone and the matrix multiplies in turn
//! (interleaved), K calls each, and takes each one's median; the table gives the median of the
//! rounds with min and max, and the median of the per-round ratios fused / libtorch.

use stoke_train::cross_entropy_bf16;
use tch::{Device, Kind, Tensor};

mod support;
use support::{arg, median, time_ms};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (rounds, iters) = (arg(&args, "--rounds", 5), arg(&args, "--iters", 9));
    let n_threads = tch::get_num_threads().max(1) as usize;
    println!("| head (rows x d x vocab) | libtorch ms | fused ms | of which the kernel ms | fused / libtorch | the three matmuls alone ms |");
    println!("|---|---|---|---|---|---|");
    // tiny and small at micro-batch 16, and gpt2-124m at one sequence of 1024.
    for (rows, d, vocab) in [(2048i64, 256i64, 256i64), (4096, 384, 256), (1024, 768, 50304)] {
        tch::manual_seed(1);
        let h = Tensor::randn([rows, d], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
        let w = (Tensor::randn([vocab, d], (Kind::Float, Device::Cpu)) * 0.05).set_requires_grad(true);
        let targets = Tensor::randint(vocab, [rows], (Kind::Int64, Device::Cpu));
        // `W`'s gradient defined, as the trainer's flat buffer makes it.
        w.to_kind(Kind::Float).sum(Kind::Float).backward();
        let (mut libtorch, mut fused, mut kernel, mut matmuls, mut ratios) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let a = time_ms(iters, || {
                let leaf = h.detach().set_requires_grad(true);
                let logits = leaf.matmul(&w.to_kind(Kind::BFloat16).tr());
                let loss = logits.to_kind(Kind::Float).cross_entropy_for_logits(&targets);
                loss.backward();
                let _ = std::hint::black_box((leaf.grad(), loss));
            });
            let b = time_ms(iters, || {
                let w16 = tch::no_grad(|| w.to_kind(Kind::BFloat16));
                let logits = h.matmul(&w16.tr());
                let out = cross_entropy_bf16(&logits, &targets, 1.0, n_threads).expect("bf16 CPU logits");
                drop(logits);
                let grad_h = out.grad.mm(&w16);
                let grad_w = out.grad.tr().mm(&h);
                tch::no_grad(|| {
                    let mut grad = w.grad();
                    grad += &grad_w;
                });
                let _ = std::hint::black_box((grad_h, out.loss));
            });
            let logits = tch::no_grad(|| h.matmul(&w.to_kind(Kind::BFloat16).tr()));
            let k = time_ms(iters, || {
                std::hint::black_box(cross_entropy_bf16(&logits, &targets, 1.0, n_threads));
            });
            let w16 = tch::no_grad(|| w.to_kind(Kind::BFloat16));
            let m = time_ms(iters, || {
                let logits = h.matmul(&w16.tr());
                let grad_h = logits.mm(&w16);
                let grad_w = logits.tr().mm(&h);
                let _ = std::hint::black_box((grad_h, grad_w));
            });
            ratios.push(b / a);
            libtorch.push(a);
            fused.push(b);
            kernel.push(k);
            matmuls.push(m);
        }
        let spread = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            let m = median(v);
            format!("{m:.3} ({:.3}-{:.3})", v[0], v[v.len() - 1])
        };
        println!(
            "| {rows} x {d} x {vocab} | {} | {} | {} | {} | {} |",
            spread(&mut libtorch),
            spread(&mut fused),
            spread(&mut kernel),
            spread(&mut ratios),
            spread(&mut matmuls)
        );
    }
}
