//! All-reduce bus bandwidth of stoke-comm's `shm` backend against Open MPI (through the `mpi`
//! backend, when this binary was built with `--features mpi`) and PyTorch's gloo, osu_allreduce
//! style: f32, 2 processes, 4 KiB to 64 MiB. Rounds are interleaved (shm, MPI, gloo, memcpy,
//! shm, ...); each figure is the median of the rounds' medians with their min and max.
//!
//! With `--tcp`, the transport between machines instead: the `tcp` backend with each process a
//! node of its own (`GROUP_RANK`), against Open MPI restricted to TCP (`--mca btl tcp,self`) and
//! gloo, all over loopback.
//!
//! ```text
//! cargo run --release -p stoke-comm --features mpi --bin stoke-comm-bench -- --rounds 5 [--tcp]
//! ```
//!
//! Bus bandwidth = bytes * 2 (n - 1) / n / time (NCCL's and osu's definition); memcpy bandwidth
//! is one thread copying 64 MiB, bytes counted once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

const DEFAULT_SIZES: &str = "4096,1048576,4194304,26214400,67108864";
const NPROC: usize = 2;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("an address").port()
}

/// Runs NPROC copies of `program args` with torchrun's variables; returns rank 0's stdout.
fn run_torchrun(program: &Path, args: &[String], node_per_rank: bool) -> Result<String, String> {
    let port = free_port();
    let children: Vec<_> = (0..NPROC)
        .map(|rank| {
            let mut cmd = Command::new(program);
            if node_per_rank {
                cmd.env("GROUP_RANK", rank.to_string());
            }
            cmd.args(args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", NPROC.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", NPROC.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot start {}: {e}", program.display()))
        })
        .collect::<Result<_, _>>()?;
    let mut rank0 = String::new();
    for (rank, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "rank {rank} of {} failed: {}",
                program.display(),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        if rank == 0 {
            rank0 = String::from_utf8_lossy(&out.stdout).into_owned();
        }
    }
    Ok(rank0)
}

fn run_mpirun(worker: &Path, sizes: &str, tcp_only: bool) -> Result<String, String> {
    let mut cmd = Command::new("mpirun");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.arg("--allow-run-as-root");
    }
    if tcp_only {
        cmd.args(["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]);
    }
    let out = cmd
        .args(["-np", &NPROC.to_string()])
        .arg(worker)
        .args(["bench", "--backend", "mpi", "--sizes", sizes])
        .output()
        .map_err(|e| format!("cannot run mpirun: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "mpirun failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// (bytes, median seconds) from the JSON lines rank 0 printed.
fn parse(stdout: &str) -> Vec<(usize, f64)> {
    stdout
        .lines()
        .filter_map(|line| {
            let line = line.trim();
            let field = |name: &str| -> Option<&str> {
                let start = line.find(&format!("\"{name}\":"))? + name.len() + 3;
                let rest = &line[start..];
                Some(rest[..rest.find([',', '}'])?].trim())
            };
            Some((field("bytes")?.parse().ok()?, field("median_s")?.parse().ok()?))
        })
        .collect()
}

/// One thread copying 64 MiB between two touched buffers: GB/s, bytes counted once, median of 9.
fn memcpy_gbps() -> f64 {
    let bytes = 64 << 20;
    let src = vec![1u8; bytes];
    // Touch every page first, so the timing sees copies, not page faults.
    let mut dst = vec![2u8; bytes];
    let rates: Vec<f64> = (0..9)
        .map(|_| {
            let start = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            bytes as f64 / start.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    stoke_stats::median(&rates)
}

fn stats(values: &[f64]) -> (f64, f64, f64) {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (stoke_stats::median(values), min, max)
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rounds: usize = arg(&args, "--rounds").and_then(|v| v.parse().ok()).unwrap_or(5);
    let sizes = arg(&args, "--sizes").unwrap_or_else(|| DEFAULT_SIZES.to_string());
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let python = arg(&args, "--python").map(PathBuf::from).unwrap_or_else(|| root.join(".stoke/venv/bin/python"));
    let gloo_script =
        arg(&args, "--gloo-script").map(PathBuf::from).unwrap_or_else(|| root.join("benches/peers/comm_gloo.py"));
    let worker = std::env::current_exe().expect("own path").with_file_name("stoke-comm-worker");
    let tcp = args.iter().any(|a| a == "--tcp");
    let ours = if tcp { "tcp" } else { "shm" };
    let bench_args: Vec<String> =
        ["bench", "--backend", ours, "--sizes", &sizes].iter().map(|s| s.to_string()).collect();

    let mut peers: Vec<&str> = vec![ours, "mpi", "gloo"];
    let mut results: BTreeMap<(&str, usize), Vec<f64>> = BTreeMap::new();
    let mut memcpy = Vec::new();
    for round in 0..rounds {
        for peer in peers.clone() {
            let outcome = match peer {
                "shm" | "tcp" => run_torchrun(&worker, &bench_args, tcp),
                "mpi" => run_mpirun(&worker, &sizes, tcp),
                _ => {
                    run_torchrun(&python, &[gloo_script.display().to_string(), "--sizes".into(), sizes.clone()], false)
                }
            };
            match outcome {
                Ok(stdout) => {
                    for (bytes, seconds) in parse(&stdout) {
                        // n = 2: bus bandwidth = bytes * 2 (n-1)/n / t = bytes / t.
                        let busbw = bytes as f64 * 2.0 * (NPROC - 1) as f64 / NPROC as f64 / seconds / 1e9;
                        results.entry((peer, bytes)).or_default().push(busbw);
                    }
                }
                Err(err) => {
                    eprintln!("round {round}: {peer} skipped from now on: {err}");
                    peers.retain(|p| *p != peer);
                }
            }
        }
        memcpy.push(memcpy_gbps());
        eprintln!("round {} of {rounds} done", round + 1);
    }
    let (mc, mc_min, mc_max) = stats(&memcpy);
    println!("memcpy, one thread, 64 MiB, bytes counted once: {mc:.1} GB/s (min {mc_min:.1}, max {mc_max:.1})");
    println!();
    let mpi = if tcp { "Open MPI (TCP)" } else { "Open MPI" };
    println!("| size | {ours} GB/s | {mpi} GB/s | gloo GB/s | {ours} / MPI | {ours} / memcpy |");
    println!("|---|---|---|---|---|---|");
    for bytes in sizes.split(',').map(|s| s.parse::<usize>().expect("sizes are byte counts")) {
        let cell = |peer: &str| match results.get(&(peer, bytes)) {
            Some(v) => {
                let (m, lo, hi) = stats(v);
                format!("{m:.2} ({lo:.2}-{hi:.2})")
            }
            None => "-".into(),
        };
        let median = |peer: &str| results.get(&(peer, bytes)).map(|v| stats(v).0);
        let ratio = match (median(ours), median("mpi")) {
            (Some(s), Some(m)) => format!("{:.2}x", s / m),
            _ => "-".into(),
        };
        let vs_memcpy = median(ours).map_or("-".into(), |s| format!("{:.0}%", 100.0 * s / mc));
        println!("| {} | {} | {} | {} | {ratio} | {vs_memcpy} |", human(bytes), cell(ours), cell("mpi"), cell("gloo"));
    }
    println!();
    println!("{rounds} interleaved rounds; each cell: median of the rounds' medians (min-max over rounds).");
}
