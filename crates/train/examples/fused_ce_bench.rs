//! The fused cross-entropy kernel against libtorch's ops it replaces, on the head's shapes: bf16
//! logits `[rows, vocab]` to the loss and the logits' gradient. libtorch: cast to fp32,
//! cross-entropy, backward from the loss (the model's path without the kernel). Fused: the kernel,
//! then the block executor's backward seed from the logits (`<logits, grad>` backward), so both
//! sides end with the gradient on the logits. A copy of the logits is the physical limit beside.
//!
//! ```text
//! cargo run --release -p stoke-train --example fused_ce_bench -- [--rounds R] [--iters K]
//! ```
//!
//! Each round times libtorch, the kernel and the copy in turn (interleaved), K calls each, and
//! takes each one's median; the table gives the median of the rounds with min and max, and the
//! median of the per-round ratios fused / libtorch.

use stoke_train::cross_entropy_bf16;
use tch::{Device, Kind, Tensor};

mod support;
use support::{arg, median, time_ms};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (rounds, iters) = (arg(&args, "--rounds", 5), arg(&args, "--iters", 9));
    let n_threads = tch::get_num_threads().max(1) as usize;
    println!("| shape (rows x vocab) | libtorch ms | fused ms | of which the kernel ms | fused / libtorch | copy of the logits ms |");
    println!("|---|---|---|---|---|---|");
    // tiny and small at micro-batch 16, and a GPT-2 vocabulary at 1024 rows.
    for (rows, vocab) in [(2048i64, 256i64), (4096, 256), (1024, 50304)] {
        tch::manual_seed(1);
        let logits = (Tensor::randn([rows, vocab], (Kind::Float, Device::Cpu)) * 2.0).to_kind(Kind::BFloat16);
        let targets = Tensor::randint(vocab, [rows], (Kind::Int64, Device::Cpu));
        let mut copy_target = logits.copy();
        let (mut libtorch, mut fused, mut copy, mut ratios, mut kernel) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let a = time_ms(iters, || {
                let leaf = logits.detach().set_requires_grad(true);
                let loss = leaf.to_kind(Kind::Float).cross_entropy_for_logits(&targets);
                loss.backward();
                let _ = std::hint::black_box(leaf.grad());
            });
            let b = time_ms(iters, || {
                let leaf = logits.detach().set_requires_grad(true);
                let out = cross_entropy_bf16(&leaf.detach(), &targets, 1.0, n_threads).expect("bf16 CPU logits");
                leaf.view([-1]).dot(&out.grad.view([-1])).backward();
                let _ = std::hint::black_box((leaf.grad(), out.loss));
            });
            let c = time_ms(iters, || {
                copy_target.copy_(&logits);
            });
            let k = time_ms(iters, || {
                std::hint::black_box(cross_entropy_bf16(&logits, &targets, 1.0, n_threads));
            });
            kernel.push(k);

            ratios.push(b / a);
            libtorch.push(a);
            fused.push(b);
            copy.push(c);
        }
        let spread = |v: &mut Vec<f64>| {
            let m = median(v);
            format!("{m:.3} ({:.3}-{:.3})", v[0], v[v.len() - 1])
        };
        println!(
            "| {rows} x {vocab} | {} | {} | {} | {} | {} |",
            spread(&mut libtorch),
            spread(&mut fused),
            spread(&mut kernel),
            spread(&mut ratios),
            spread(&mut copy)
        );
    }
}
