//! The fused bias + GELU kernels against libtorch's ops they replace, on the MLP's shapes
//! `[rows, 4d]` under bf16, with the first linear layer's product included on both sides.
//! libtorch: `addmm` with the bf16 bias, `gelu`; backward `gelu_backward`, the bias's gradient
//! as a sum over the rows, added into its fp32 buffer. Fused: `mm` without the bias,
//! `bias_gelu` with the fp32 bias; backward `bias_gelu_backward` (the bias's gradient
//! summed in the same pass). The product's own backward is the same on both sides and left out.
//!
//! ```text
//! cargo run --release -p stoke-train --example bias_gelu_bench -- [--rounds R] [--iters K] [--threads N]
//! ```
//!
//! Runs with the C allocator keeping freed memory (stoke's default `train.host_memory`). Each
//! round times the four in turn (interleaved), then libtorch's `gelu` and the kernel's forward
//! alone (without the product), K calls each, and takes each one's median; the table gives the
//! median of the rounds with min and max.

use stoke_train::{bias_gelu, bias_gelu_backward};
use tch::{Device, Kind, Tensor};

mod support;
use support::{median, restart_with_retained_memory, rounds_iters_threads, time_ms};

fn cell(values: &mut [f64]) -> String {
    let (min, max) = values.iter().fold((f64::MAX, f64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
    format!("{:.3} [{min:.3}, {max:.3}]", median(values))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (rounds, iters, n_threads) = rounds_iters_threads(&args, 15);
    restart_with_retained_memory();
    println!("threads: kernel {n_threads}, libtorch {}", tch::get_num_threads());
    println!(
        "| rows x 4d | libtorch fwd ms | fused fwd ms | libtorch bwd ms | fused bwd ms | fused / libtorch (fwd+bwd) \
         | gelu alone ms | kernel fwd alone ms |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    // tiny, small and gpt2-124m at micro-batch 16, 16 and 1.
    for (rows, d) in [(2048i64, 256i64), (4096, 384), (1024, 768)] {
        tch::manual_seed(1);
        let _guard = tch::no_grad_guard();
        let h = 4 * d;
        let bf16 = (Kind::BFloat16, Device::Cpu);
        let x = Tensor::randn([rows, d], bf16);
        let w = Tensor::randn([h, d], bf16) * 0.05;
        let bias = Tensor::randn([h], (Kind::Float, Device::Cpu)) * 0.1;
        let bias16 = bias.to_kind(Kind::BFloat16);
        let grad = Tensor::randn([rows, h], bf16);
        let pre_biased = x.linear(&w, Some(&bias16));
        let pre = x.linear(&w, None::<&Tensor>);
        let mut bias_grad = Tensor::zeros([h], (Kind::Float, Device::Cpu));
        let mut cells: [Vec<f64>; 6] = Default::default();
        for _ in 0..rounds {
            let lf = time_ms(iters, || {
                let _ = std::hint::black_box(x.linear(&w, Some(&bias16)).gelu("none"));
            });
            let ff = time_ms(iters, || {
                std::hint::black_box(bias_gelu(&x.linear(&w, None::<&Tensor>), &bias, n_threads));
            });
            let lb = time_ms(iters, || {
                let grad_pre = grad.gelu_backward(&pre_biased, "none");
                bias_grad += grad_pre.sum_dim_intlist([0i64].as_slice(), false, Kind::BFloat16);
                let _ = std::hint::black_box(grad_pre);
            });
            let fb = time_ms(iters, || {
                let _ = std::hint::black_box(bias_gelu_backward(&grad, &pre, &bias, &bias_grad, n_threads));
            });
            let gelu = time_ms(iters, || {
                let _ = std::hint::black_box(pre_biased.gelu("none"));
            });
            let kernel = time_ms(iters, || {
                std::hint::black_box(bias_gelu(&pre, &bias, n_threads));
            });
            for (cell, value) in cells.iter_mut().zip([lf, ff, lb, fb, gelu, kernel]) {
                cell.push(value);
            }
        }
        let mut ratio: Vec<f64> =
            (0..rounds).map(|r| (cells[1][r] + cells[3][r]) / (cells[0][r] + cells[2][r])).collect();
        let [lf, ff, lb, fb, gelu, kernel] = &mut cells;
        println!(
            "| {rows} x {h} | {} | {} | {} | {} | {} | {} | {} |",
            cell(lf),
            cell(ff),
            cell(lb),
            cell(fb),
            cell(&mut ratio),
            cell(gelu),
            cell(kernel)
        );
    }
}
