//! Compressed gradient averaging on 2 processes: bytes on the wire and time of one all-reduce
//! (average) of a gradient-sized fp32 buffer, for the communicator's own fp32 all-reduce and the
//! compressor's fp32, bf16 and int8 payloads, with a memcpy of the same buffer as the physical
//! limit alongside, and the codec's own speed (encode with error feedback, decode-and-add) on one
//! thread against that memcpy.
//!
//! ```text
//! cargo run --release -p stoke-train --example compress_bench -- [--values N] [--rounds R] [--iters K]
//! mpirun -np 2 --mca pml ob1 --mca btl tcp,self target/release/examples/compress_bench --backend mpi ...
//! ```
//!
//! Both processes run every variant in turn within each round (fp32, int8, bf16, ..., then the
//! next round: interleaved); a round's figure is the median of K timed calls (each after a
//! barrier), and the table gives the median of the rounds' figures with their min and max. Wire
//! bytes are per rank per call: the compressor counts what it sends to the other ranks, and the
//! fp32 all-reduce's figure is a ring's 2 (n - 1) / n x 4 bytes per value. After the
//! collectives of a round, rank 0 alone (the others wait in a barrier) times the memcpy and the
//! codec's kernels on the buffer; their GB/s count the buffer's fp32 bytes once, as the memcpy's
//! do. With `--backend mpi` the example runs under `mpirun` (each process is a rank); otherwise it
//! starts its 2 ranks itself over the shm backend.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::Instant;

use stoke_comm::{connect, Backend, CommConfig, CommunicatorExt, DistEnv, ReduceOp};
use stoke_train::{CompressConfig, Compression, Compressor};

const NPROC: usize = 2;
const ROLE_VAR: &str = "STOKE_COMPRESS_BENCH_WORKER";

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

/// A gradient-like value: mostly small, a few large, signs mixed.
fn sample(rank: usize, i: usize) -> f32 {
    let mut z = (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    z ^= z >> 31;
    z = z.wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 29;
    let unit = (z >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
    unit * if i % 97 == 0 { 0.1 } else { 1e-3 }
}

#[derive(Clone, Copy)]
enum Variant {
    /// The communicator's in-place fp32 all-reduce (average).
    Plain,
    Compressed(Compression, bool),
}

impl Variant {
    fn name(self) -> String {
        match self {
            Variant::Plain => "fp32 all_reduce (communicator)".into(),
            Variant::Compressed(Compression::None, _) => "fp32 payloads (compressor)".into(),
            Variant::Compressed(Compression::Bf16, _) => "bf16".into(),
            Variant::Compressed(Compression::Int8 { block }, ef) => {
                format!("int8, block {block}{}", if ef { ", error feedback" } else { "" })
            }
        }
    }
}

/// A codec kernel timed on its own.
#[derive(Clone, Copy)]
enum Kernel {
    /// Encode with error feedback (the residual read and rewritten).
    Encode(Compression),
    /// Decode and add into an fp32 buffer.
    DecodeAdd(Compression),
}

impl Kernel {
    fn name(self) -> String {
        let codec = |c: Compression| match c {
            Compression::None => "fp32".to_string(),
            Compression::Bf16 => "bf16".to_string(),
            Compression::Int8 { block } => format!("int8 block {block}"),
        };
        match self {
            Kernel::Encode(c) => format!("{} encode, error feedback", codec(c)),
            Kernel::DecodeAdd(c) => format!("{} decode and add", codec(c)),
        }
    }
}

fn median_min_max(values: &[f64]) -> (f64, f64, f64) {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (stoke_stats::median(values), min, max)
}

fn worker(args: &[String]) -> Result<(), String> {
    let vars: HashMap<String, String> = std::env::vars().collect();
    let env = DistEnv::from_vars(&vars).map_err(|e| e.to_string())?;
    let backend = match arg(args, "--backend").as_deref() {
        None | Some("shm") => Backend::Shm,
        Some("mpi") => Backend::Mpi,
        Some(other) => return Err(format!("--backend {other}: expected shm or mpi")),
    };
    let comm = connect(&CommConfig { backend, ..CommConfig::default() }, &env).map_err(|e| e.to_string())?;
    let (n, rank) = (comm.world_size(), comm.rank());
    let len: usize = arg(args, "--values").map_or(6_553_600, |v| v.parse().expect("--values N"));
    let rounds: usize = arg(args, "--rounds").map_or(5, |v| v.parse().expect("--rounds R"));
    let iters: usize = arg(args, "--iters").map_or(9, |v| v.parse().expect("--iters K"));
    let variants = [
        Variant::Plain,
        Variant::Compressed(Compression::Int8 { block: 256 }, true),
        Variant::Compressed(Compression::Bf16, false),
        Variant::Compressed(Compression::Int8 { block: 64 }, true),
        Variant::Compressed(Compression::None, false),
    ];
    let input: Vec<f32> = (0..len).map(|i| sample(rank, i)).collect();
    let mut buf = input.clone();
    let mut compressors: Vec<Option<Compressor>> = variants
        .iter()
        .map(|v| match v {
            Variant::Plain => None,
            Variant::Compressed(compression, error_feedback) => Some(
                Compressor::new(CompressConfig { compression: *compression, error_feedback: *error_feedback })
                    .expect("valid block"),
            ),
        })
        .collect();
    let mut seconds: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut wire: Vec<f64> = vec![0.0; variants.len()];
    let mut memcpy_gbps = Vec::new();
    let mut copy_target = vec![0f32; len];
    let kernels = [
        Kernel::Encode(Compression::Int8 { block: 256 }),
        Kernel::DecodeAdd(Compression::Int8 { block: 256 }),
        Kernel::Encode(Compression::Bf16),
        Kernel::DecodeAdd(Compression::Bf16),
    ];
    let mut kernel_gbps: Vec<Vec<f64>> = vec![Vec::new(); kernels.len()];
    let mut payload = vec![0u8; Compression::None.payload_bytes(len)];
    let mut residual = vec![0f32; len];
    for round in 0..rounds {
        for v in 0..variants.len() {
            let mut times = Vec::with_capacity(iters);
            let before = compressors[v].as_ref().map_or(0, Compressor::wire_bytes);
            // One untimed call first (page faults, first residual).
            for call in 0..=iters {
                buf.copy_from_slice(&input);
                comm.barrier().map_err(|e| e.to_string())?;
                let start = Instant::now();
                match &mut compressors[v] {
                    None => comm.all_reduce(&mut buf, ReduceOp::Avg).map_err(|e| e.to_string())?,
                    Some(compressor) => compressor.all_reduce(comm.as_ref(), 0, &mut buf).map_err(|e| e.to_string())?,
                }
                if call > 0 {
                    times.push(start.elapsed().as_secs_f64());
                }
            }
            wire[v] = match &compressors[v] {
                None => 2.0 * (n - 1) as f64 / n as f64 * 4.0 * len as f64,
                Some(c) => (c.wire_bytes() - before) as f64 / (iters + 1) as f64,
            };
            seconds[v].push(median_min_max(&times).0);
        }
        comm.barrier().map_err(|e| e.to_string())?;
        if rank == 0 {
            let mut copies = Vec::with_capacity(iters);
            for _ in 0..iters {
                let start = Instant::now();
                copy_target.copy_from_slice(std::hint::black_box(&input));
                std::hint::black_box(&copy_target);
                copies.push((4 * len) as f64 / start.elapsed().as_secs_f64() / 1e9);
            }
            memcpy_gbps.push(median_min_max(&copies).0);
            for (k, kernel) in kernels.iter().enumerate() {
                let mut rates = Vec::with_capacity(iters);
                // One untimed call first, as for the collectives. A decode reads the payload the
                // encode before it wrote.
                for call in 0..=iters {
                    if let Kernel::DecodeAdd(_) = kernel {
                        copy_target.copy_from_slice(&input);
                    }
                    let start = Instant::now();
                    match *kernel {
                        Kernel::Encode(codec) => {
                            codec.encode(&input, &mut payload[..codec.payload_bytes(len)], Some(&mut residual))
                        }
                        Kernel::DecodeAdd(codec) => {
                            codec.decode_add(&payload[..codec.payload_bytes(len)], &mut copy_target)
                        }
                    }
                    let seconds = start.elapsed().as_secs_f64();
                    std::hint::black_box((&payload, &copy_target));
                    if call > 0 {
                        rates.push((4 * len) as f64 / seconds / 1e9);
                    }
                }
                kernel_gbps[k].push(median_min_max(&rates).0);
            }
        }
        comm.barrier().map_err(|e| e.to_string())?;
        if rank == 0 {
            eprintln!("round {} of {rounds} done", round + 1);
        }
    }
    if rank == 0 {
        let mib = (4 * len) as f64 / (1 << 20) as f64;
        let (mc, mc_lo, mc_hi) = median_min_max(&memcpy_gbps);
        let transport = match backend {
            Backend::Mpi => "mpi backend (the transport mpirun's MCA parameters chose)",
            _ => "shm backend",
        };
        println!("{n} processes, {len} fp32 values ({mib:.1} MiB), all-reduce (average); {transport}");
        println!(
            "memcpy of the buffer, one thread, bytes counted once: {mc:.1} GB/s [{mc_lo:.1}, {mc_hi:.1}], \
             {:.2} ms",
            (4 * len) as f64 / mc / 1e6
        );
        println!();
        println!("| variant | wire bytes per rank | fp32 / this | ms per all-reduce, median [min, max] |");
        println!("|---|---|---|---|");
        for (v, variant) in variants.iter().enumerate() {
            let (m, lo, hi) = median_min_max(&seconds[v]);
            println!(
                "| {} | {:.0} | {:.2}x | {:.2} [{:.2}, {:.2}] |",
                variant.name(),
                wire[v],
                wire[0] / wire[v],
                m * 1e3,
                lo * 1e3,
                hi * 1e3
            );
        }
        println!();
        println!("| codec kernel, rank 0, one thread | GB/s of fp32, median [min, max] | / memcpy |");
        println!("|---|---|---|");
        for (k, kernel) in kernels.iter().enumerate() {
            let (m, lo, hi) = median_min_max(&kernel_gbps[k]);
            println!("| {} | {m:.1} [{lo:.1}, {hi:.1}] | {:.2} |", kernel.name(), m / mc);
        }
        println!();
        println!("{rounds} interleaved rounds of {iters} timed calls; each round's figure is its median.");
    }
    Ok(())
}

fn driver(args: &[String]) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let port =
        std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map_err(|e| e.to_string())?.port();
    let children: Vec<_> = (0..NPROC)
        .map(|rank| {
            Command::new(&exe)
                .args(args)
                .env(ROLE_VAR, "1")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", NPROC.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("LOCAL_WORLD_SIZE", NPROC.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(if rank == 0 { Stdio::inherit() } else { Stdio::null() })
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| format!("cannot start rank {rank}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    for (rank, mut child) in children.into_iter().enumerate() {
        let status = child.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("rank {rank} failed: {status}"));
        }
    }
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let is_rank = std::env::var_os(ROLE_VAR).is_some() || std::env::var_os("OMPI_COMM_WORLD_RANK").is_some();
    let outcome = if is_rank { worker(&args) } else { driver(&args) };
    if let Err(err) = outcome {
        eprintln!("compress_bench: {err}");
        std::process::exit(1);
    }
}
