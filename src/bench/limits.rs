//! `stoke bench limits` and the machine's limits the other benchmarks measure beside their runs:
//! matmul peak, memory copy and disk bandwidth (through the page cache and with `O_DIRECT`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use serde_json::{json, Value};

/// What `stoke bench limits` measures.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Folder for the disk test file (deleted afterwards).
    pub dir: PathBuf,
    /// Bytes for the memcpy and disk tests.
    pub bytes: usize,
    /// Also write the figures as JSON here.
    pub json: Option<PathBuf>,
    /// Also time one training step's matrix multiplies alone for this preset.
    pub preset: Option<String>,
    /// Sequences per step for `preset`.
    pub micro_batch: usize,
}

/// Measures and prints the limits.
pub fn limits(args: &Limits) -> anyhow::Result<ExitCode> {
    let device = stoke_train::parse_device("auto")?;
    let mut out = serde_json::Map::new();
    for precision in [stoke_train::Precision::Fp32, stoke_train::Precision::Bf16] {
        let peak = stoke_train::measure_matmul_peak_flops(precision, device, 5);
        println!("matmul peak {precision:?}: {:.1} GFLOP/s", peak / 1e9);
        out.insert(format!("matmul_{precision:?}_flops").to_lowercase(), json!(peak));
    }
    if let Some(preset) = &args.preset {
        let model =
            stoke_train::plan_model(&stoke_train::ModelConfig { preset: preset.clone(), ..Default::default() })?;
        let reference =
            crate::gemm::GemmReference::new(&model, args.micro_batch, stoke_train::Precision::Bf16, false, device);
        // Fastest of five passes: the floor, not the typical time.
        let (mut forward, mut backward) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..5 {
            let t = reference.time();
            forward = forward.min(t.forward_ms);
            backward = backward.min(t.backward_ms);
        }
        println!(
            "{preset} micro-batch {} bf16, the step's matrix multiplies alone: {:.1} ms (forward {forward:.1}, backward {backward:.1})",
            args.micro_batch,
            forward + backward
        );
        out.insert("model_gemm_forward_ms".into(), json!(forward));
        out.insert("model_gemm_backward_ms".into(), json!(backward));
        out.insert("model_gemm_ms".into(), json!(forward + backward));
    }
    let memcpy = memcpy_bandwidth(args.bytes);
    println!("memcpy: {:.1} GB/s (bytes read + written, one thread)", memcpy / 1e9);
    out.insert("memcpy_bytes_per_s".into(), json!(memcpy));
    std::fs::create_dir_all(&args.dir)?;
    let (write, read) = disk_bandwidth(&args.dir, args.bytes)?;
    println!(
        "disk write with fsync: {:.2} GB/s; read back: {:.2} GB/s (page cache unless dropped)",
        write / 1e9,
        read / 1e9
    );
    out.insert("disk_write_bytes_per_s".into(), json!(write));
    out.insert("disk_read_bytes_per_s".into(), json!(read));
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&Value::Object(out))?)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Bytes moved per second (read + write) copying a buffer of `bytes`, best of five.
fn memcpy_bandwidth(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    // Fault the destination's pages in first, or the first copy measures the kernel's page faults.
    dst.fill(2);
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = std::time::Instant::now();
        dst.copy_from_slice(&src);
        std::hint::black_box(&dst);
        best = best.min(start.elapsed().as_secs_f64());
    }
    2.0 * bytes as f64 / best
}

/// Bytes per second written (with fsync) and read back through the page cache, in 4 MiB blocks.
pub fn disk_bandwidth(dir: &Path, bytes: usize) -> anyhow::Result<(f64, f64)> {
    use std::io::{Read, Write};
    let path = dir.join(".stoke-disk-test");
    let block = vec![7u8; 4 << 20];
    let start = std::time::Instant::now();
    {
        let mut f = std::fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut written = 0;
        while written < bytes {
            f.write_all(&block)?;
            written += block.len();
        }
        f.sync_all()?;
    }
    let write = bytes as f64 / start.elapsed().as_secs_f64();
    let start = std::time::Instant::now();
    let mut f = std::fs::File::open(&path)?;
    let mut buf = vec![0u8; 4 << 20];
    let mut total = 0usize;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        total += n;
    }
    let read = total as f64 / start.elapsed().as_secs_f64();
    std::fs::remove_file(&path)?;
    Ok((write, read))
}

/// The disk's limit without the page cache: `bytes` written with `O_DIRECT` from one page-aligned
/// buffer in 32 MiB blocks, then fsynced (the way the checkpoint writer writes). Bytes per second.
pub fn direct_write_bandwidth(dir: &Path, bytes: usize) -> anyhow::Result<f64> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    const BLOCK: usize = 32 << 20;
    let block = stoke_ckpt::AlignedBlock::zeroed(BLOCK);
    let path = dir.join(".stoke-disk-test-direct");
    let result = (|| -> anyhow::Result<f64> {
        let start = std::time::Instant::now();
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .with_context(|| format!("cannot create {} with O_DIRECT", path.display()))?;
        let mut written = 0;
        while written < bytes {
            f.write_all(&block)?;
            written += BLOCK;
        }
        f.sync_all()?;
        Ok(written as f64 / start.elapsed().as_secs_f64())
    })();
    let _ = std::fs::remove_file(&path);
    result
}

/// The memory limit on a snapshot's copy, measured beside the runs: `bytes` copied between two
/// warm buffers by `stream_copy` on the intra-op threads (what the trainer's snapshot uses), and
/// by one thread's memcpy. Returns (stream, memcpy) in copied bytes per second, best of three.
pub fn copy_bandwidth(bytes: usize) -> (f64, f64) {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let threads = tch::get_num_threads().max(1) as usize;
    let (mut stream, mut plain) = (0f64, 0f64);
    for _ in 0..3 {
        let start = std::time::Instant::now();
        stoke_ckpt::stream_copy(&mut dst, &src, threads);
        stream = stream.max(bytes as f64 / start.elapsed().as_secs_f64());
        let start = std::time::Instant::now();
        dst.copy_from_slice(&src);
        plain = plain.max(bytes as f64 / start.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    (stream, plain)
}
