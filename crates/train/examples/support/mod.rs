//! What the kernel benchmarks share: their arguments, medians and timing, and the C allocator's
//! settings. Each benchmark takes the part it needs.
#![allow(dead_code)]

use std::time::Instant;

pub fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map_or(default, |v| v.parse().expect(name))
}

pub use stoke_stats::median;

pub fn time_ms(iters: usize, mut work: impl FnMut()) -> f64 {
    let times: Vec<f64> = (0..iters)
        .map(|_| {
            let start = Instant::now();
            work();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    median(&times)
}

/// Sets the C allocator's settings of stoke's default `train.host_memory = "retain"` and starts
/// this process again with them (glibc reads its MALLOC_ variables at start), then exits with the
/// restarted process's status; in the restarted process it returns at once.
pub fn restart_with_retained_memory() {
    const CHILD: &str = "STOKE_KERNEL_BENCH_CHILD";
    if std::env::var_os(CHILD).is_some() {
        return;
    }
    let status = std::process::Command::new(std::env::current_exe().expect("own path"))
        .args(std::env::args().skip(1))
        .envs(stoke_train::retain_env())
        .env(CHILD, "1")
        .status()
        .expect("restart with the allocator's settings");
    std::process::exit(status.code().unwrap_or(1));
}

/// `--rounds` (default 5), `--iters` (default `iters`) and `--threads` (default libtorch's).
pub fn rounds_iters_threads(args: &[String], iters: usize) -> (usize, usize, usize) {
    let threads = arg(args, "--threads", tch::get_num_threads().max(1) as usize);
    (arg(args, "--rounds", 5), arg(args, "--iters", iters), threads)
}
