//! Data-loader throughput against this machine's memcpy bandwidth, and time to first batch on a
//! large dataset. `harness = false`; run through `benches/data_vs_peers.sh`, or alone:
//!
//! ```text
//! cargo bench -p stoke-data --bench loader -- --data <prepared dir> --batch 16 --seq 1024 \
//!     --steps 3000 --scratch <dir for the 10^9-token set> --json <out.json>
//! ```
//!
//! Every batch is checked inside the loop (its length and a checksum of its tokens folded into the
//! output), so nothing is optimized away.

use std::path::{Path, PathBuf};
use std::time::Instant;

use stoke_data::{
    encode_token_index, BatchSource, Dtype, Loader, LoaderConfig, TokenManifest, TokenShardEntry, TokenStore,
    TOKEN_MANIFEST,
};

struct Args {
    data: Option<PathBuf>,
    batch: usize,
    seq: usize,
    steps: usize,
    scratch: Option<PathBuf>,
    first_batch_tokens: u64,
    json: Option<PathBuf>,
    text: Option<PathBuf>,
    corpus_bytes: usize,
    rounds: usize,
}

fn parse_args() -> Args {
    let mut args = Args {
        data: None,
        batch: 16,
        seq: 1024,
        steps: 3000,
        scratch: None,
        first_batch_tokens: 1_000_000_000,
        json: None,
        text: None,
        corpus_bytes: 64 << 20,
        rounds: 5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--data" => args.data = Some(value().into()),
            "--batch" => args.batch = value().parse().expect("--batch"),
            "--seq" => args.seq = value().parse().expect("--seq"),
            "--steps" => args.steps = value().parse().expect("--steps"),
            "--scratch" => args.scratch = Some(value().into()),
            "--first-batch-tokens" => args.first_batch_tokens = value().parse().expect("--first-batch-tokens"),
            "--json" => args.json = Some(value().into()),
            "--text" => args.text = Some(value().into()),
            "--rounds" => args.rounds = value().parse().expect("--rounds"),
            "--corpus-bytes" => args.corpus_bytes = value().parse().expect("--corpus-bytes"),
            _ => {} // cargo bench passes --bench
        }
    }
    args
}

/// CPU time of the calling thread, in seconds: on a shared machine, single-thread rates measured in
/// CPU time do not count the time other processes held the core.
fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec that we own.
    let status = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(status, 0, "clock_gettime");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// memcpy bandwidth of the calling thread, bytes moved (read + write) per CPU second.
fn memcpy_bandwidth_cpu() -> f64 {
    let len = 256 << 20;
    let repeats = 8;
    let src = huge_buffer(len, 1);
    let mut dst = huge_buffer(len, 0);
    let start = thread_cpu_seconds();
    for _ in 0..repeats {
        dst.copy_from_slice(std::hint::black_box(&src[..]));
        std::hint::black_box(&dst);
    }
    (2 * len * repeats) as f64 / (thread_cpu_seconds() - start)
}

/// A buffer of `len` bytes filled with `value`, on transparent huge pages where the kernel allows
/// (as numpy and PyTorch allocate large arrays); on 4 KiB pages a VM's copies run several times slower.
fn huge_buffer(len: usize, value: u8) -> memmap2::MmapMut {
    let mut map = memmap2::MmapMut::map_anon(len).expect("anonymous map");
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    map.fill(value);
    map
}

/// memcpy bandwidth in bytes moved (read + write) per second, on `n_threads` threads.
fn memcpy_bandwidth(n_threads: usize) -> f64 {
    let bytes_per_thread = 256 << 20;
    let repeats = 8;
    let mut buffers: Vec<(memmap2::MmapMut, memmap2::MmapMut)> = (0..n_threads)
        .map(|t| (huge_buffer(bytes_per_thread, t as u8 + 1), huge_buffer(bytes_per_thread, 0)))
        .collect();
    let start = Instant::now();
    std::thread::scope(|scope| {
        for (src, dst) in buffers.iter_mut() {
            scope.spawn(move || {
                for _ in 0..repeats {
                    dst.copy_from_slice(std::hint::black_box(&src[..]));
                    std::hint::black_box(&dst);
                }
            });
        }
    });
    let seconds = start.elapsed().as_secs_f64();
    (2 * bytes_per_thread * repeats * n_threads) as f64 / seconds
}

/// Training tokens per CPU second that one thread assembles into a reused buffer (no hand-over).
fn assembly_rate(store: &TokenStore, config: &LoaderConfig, steps: usize) -> (f64, u64) {
    let loader =
        Loader::new(store.clone(), LoaderConfig { n_workers: 1, prefetch_depth: 1, ..config.clone() }).expect("loader");
    let global_batch = config.micro_batch as u64;
    let mut buffer = Vec::new();
    let mut checksum = 0u64;
    // Warm-up: map the pages of the rows the timed loop reads (as a long run has).
    for step in 0..steps as u64 {
        loader.assemble(step * global_batch, &mut buffer).unwrap();
    }
    let start = thread_cpu_seconds();
    for step in 0..steps as u64 {
        loader.assemble(step * global_batch, &mut buffer).unwrap();
        checksum = checksum.wrapping_add(buffer[0] as u64 ^ buffer[buffer.len() - 1] as u64);
    }
    let seconds = thread_cpu_seconds() - start;
    ((steps * config.micro_batch * config.seq_len) as f64 / seconds, checksum)
}

/// Training tokens (batch × seq) per second delivered by a loader, and the loader's stats.
fn loader_rate(store: &TokenStore, config: LoaderConfig, steps: usize) -> (f64, u64) {
    let mut loader = Loader::new(store.clone(), config.clone()).expect("loader");
    let mut checksum = 0u64;
    for _ in 0..20 {
        let batch = loader.next_batch().expect("batch");
        loader.recycle(batch);
    }
    let start = Instant::now();
    for _ in 0..steps {
        let batch = loader.next_batch().expect("batch");
        assert_eq!(batch.tokens.len(), config.micro_batch * (config.seq_len + 1));
        checksum = checksum.wrapping_add(batch.tokens[0] as u64 ^ batch.tokens[batch.tokens.len() - 1] as u64);
        loader.recycle(batch);
    }
    let seconds = start.elapsed().as_secs_f64();
    ((steps * config.micro_batch * config.seq_len) as f64 / seconds, checksum)
}

/// Writes a prepared directory of `n_tokens` pseudo-random u16 tokens (one shard, one document).
fn write_large_dataset(dir: &Path, n_tokens: u64) {
    use std::io::Write;
    if let Ok(bytes) = std::fs::read(dir.join(TOKEN_MANIFEST)) {
        if TokenManifest::parse(&dir.join(TOKEN_MANIFEST), &bytes).is_ok_and(|m| m.n_tokens == n_tokens) {
            return;
        }
    }
    std::fs::create_dir_all(dir).expect("scratch dir");
    let bin = dir.join("shard-00000.bin");
    let mut file = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&bin).expect("create"));
    let mut crc = crc32fast::Hasher::new();
    let mut state = 0x1234_5678_u64;
    let mut chunk = vec![0u8; 1 << 22];
    let mut written = 0u64;
    while written < n_tokens {
        let n = ((n_tokens - written) as usize).min(chunk.len() / 2);
        for pair in chunk[..2 * n].chunks_exact_mut(8).take(n / 4) {
            state = stoke_data::mix64(state);
            pair.copy_from_slice(&(state & 0x7fff_7fff_7fff_7fff).to_le_bytes());
        }
        crc.update(&chunk[..2 * n]);
        file.write_all(&chunk[..2 * n]).expect("write");
        written += n as u64;
    }
    file.flush().expect("flush");
    let index = encode_token_index(Dtype::U16, &[n_tokens]);
    std::fs::write(dir.join("shard-00000.idx"), &index).expect("idx");
    let manifest = TokenManifest {
        format: "stoke-tokens".into(),
        version: 1,
        dtype: Dtype::U16,
        vocab_size: 32768,
        tokenizer: "synthetic".into(),
        n_tokens,
        n_documents: 1,
        shards: vec![TokenShardEntry {
            bin: "shard-00000.bin".into(),
            idx: "shard-00000.idx".into(),
            n_tokens,
            n_documents: 1,
            bin_crc32: crc.finalize(),
            idx_crc32: crc32fast::hash(&index),
        }],
    };
    std::fs::write(dir.join(TOKEN_MANIFEST), serde_json::to_vec_pretty(&manifest).expect("json")).expect("manifest");
}

fn first_batch_seconds(dir: &Path, config: &LoaderConfig) -> f64 {
    let start = Instant::now();
    let store = TokenStore::open(dir).expect("open large dataset");
    let mut loader = Loader::new(store, config.clone()).expect("loader");
    let batch = loader.next_batch().expect("first batch");
    let seconds = start.elapsed().as_secs_f64();
    assert_eq!(batch.tokens.len(), config.micro_batch * (config.seq_len + 1));
    seconds
}

fn main() {
    let args = parse_args();
    // With --text, make the shared inputs of the peers: the built-in corpus as text, and --data
    // prepared from it (byte-level tokens, u16, one shard: also a nanoGPT .bin).
    if let (Some(text), Some(dir)) = (&args.text, &args.data) {
        if !text.is_file() {
            std::fs::write(text, stoke_data::builtin_corpus(0, args.corpus_bytes)).expect("write --text");
        }
        if !dir.join(TOKEN_MANIFEST).is_file() {
            let config = stoke_data::PrepTextConfig::default();
            let start = Instant::now();
            let manifest = stoke_data::prepare_text(std::slice::from_ref(text), &config, dir).expect("prepare");
            println!("prepared {} tokens in {:.2} s", manifest.n_tokens, start.elapsed().as_secs_f64());
        }
    }
    let store = match &args.data {
        Some(dir) => TokenStore::open(dir).expect("open --data"),
        None => TokenStore::from_bytes(stoke_data::builtin_corpus(0, 64 << 20), "builtin"),
    };
    let config = LoaderConfig { seq_len: args.seq, micro_batch: args.batch, seed: 1, ..LoaderConfig::default() };
    let token_bytes = 2.0 + 8.0; // u16 read, i64 written per token
    let tokens_per_row = (args.seq + 1) as f64 / args.seq as f64;

    // The machine is shared: interleave the measurements in rounds and keep each one's best, so a
    // burst of someone else's work does not land on one side of a ratio only.
    let (mut memcpy_1, mut memcpy_2, mut assembly_1, mut loader_2) = (0f64, 0f64, 0f64, 0f64);
    let (mut c1, mut c2) = (0, 0);
    for _ in 0..args.rounds {
        memcpy_1 = memcpy_1.max(memcpy_bandwidth_cpu());
        let (rate, checksum) = assembly_rate(&store, &config, args.steps);
        (assembly_1, c1) = (assembly_1.max(rate), checksum);
        memcpy_2 = memcpy_2.max(memcpy_bandwidth(2));
        let (rate, checksum) = loader_rate(&store, config.clone(), args.steps);
        (loader_2, c2) = (loader_2.max(rate), checksum);
    }
    let assembly_1_bytes = assembly_1 * tokens_per_row * token_bytes;
    let loader_2_bytes = loader_2 * tokens_per_row * token_bytes;

    let first_batch = args.scratch.as_ref().map(|scratch| {
        let dir = scratch.join(format!("tokens-{}", args.first_batch_tokens));
        write_large_dataset(&dir, args.first_batch_tokens);
        first_batch_seconds(&dir, &config)
    });

    println!("checksums {c1:x} {c2:x}");
    println!(
        "memcpy (read+write bytes): 1 thread {:.1} GB per CPU-s, 2 threads {:.1} GB/s",
        memcpy_1 / 1e9,
        memcpy_2 / 1e9
    );
    println!(
        "batch assembly, 1 thread: {:.1} M tokens per CPU-s = {:.1} GB moved per CPU-s ({:.0}% of 1-thread memcpy)",
        assembly_1 / 1e6,
        assembly_1_bytes / 1e9,
        100.0 * assembly_1_bytes / memcpy_1
    );
    println!(
        "loader, 2 workers, prefetch 4: {:.1} M tokens/s = {:.1} GB/s moved ({:.0}% of 2-thread memcpy)",
        loader_2 / 1e6,
        loader_2_bytes / 1e9,
        100.0 * loader_2_bytes / memcpy_2
    );
    if let Some(seconds) = first_batch {
        println!("time to first batch on {} tokens: {:.2} ms", args.first_batch_tokens, seconds * 1e3);
    }
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "batch": args.batch,
            "rounds": args.rounds,
            "seq": args.seq,
            "tokens_per_s": loader_2,
            "assembly_1_worker_tokens_per_s": assembly_1,
            "memcpy_1_thread_bytes_per_s": memcpy_1,
            "memcpy_2_threads_bytes_per_s": memcpy_2,
            "assembly_share_of_memcpy_1_thread": assembly_1_bytes / memcpy_1,
            "loader_share_of_memcpy_2_threads": loader_2_bytes / memcpy_2,
            "first_batch_tokens": args.first_batch_tokens,
            "first_batch_s": first_batch,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&json).expect("json")).expect("write --json");
    }
}
