//! A worker process for stoke-comm's multi-process tests and benchmark; started N times by a
//! test (over loopback), by `mpirun`, or by `srun`. It reads its rank from the launcher's
//! environment like any stoke worker.
//!
//! - `check [--backend B] [--timeout S] [--expect-backend NAME]`: every operation, every element
//!   type, odd sizes, batches of sends and receives, sub-groups and overlapping async operations,
//!   each result compared with its exact value (and the world's `backend()` with NAME).
//!   Exit 0 when all agree, 1 on a wrong value, 3 on a communication error.
//! - `nodes [--backend tcp]`: with two ranks per node, sub-groups inside a node must run on
//!   shared memory and sub-groups across nodes on TCP; every operation is checked on each.
//! - `victim --victim R [--op all_to_all] [--backend B] [--timeout S]`: all ranks join and print
//!   `ready`; rank R then sleeps (for a test to kill or stop it) while the others all-reduce (or
//!   all-to-all) and report what happened.
//! - `leave`: every rank but 0 sends rank 0 a message, rank 1 only after a pause, and exits at
//!   once; rank 0 receives from rank 1 first, while the others have already left, then from the
//!   rest. A rank that sent its last message and left is no lost rank.
//! - `bench --sizes BYTES,.. [--iters K] [--op all_to_all] [--backend B]`: times f32 all-reduces (or
//!   all-to-alls); rank 0 prints one JSON line per size with the median and minimum seconds of K
//!   iterations.

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use stoke_comm::{
    bf16, connect, f16, shard_range, Backend, CommConfig, Communicator, CommunicatorExt, DistEnv, Element, ReduceOp,
    Region,
};

trait TestElem: Element + PartialEq + std::fmt::Debug {
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
}
impl TestElem for f32 {
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
}
impl TestElem for bf16 {
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}
impl TestElem for f16 {
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}
impl TestElem for u8 {
    fn from_f32(v: f32) -> Self {
        v as u8
    }
    fn to_f32(self) -> f32 {
        f32::from(self)
    }
}

/// Rank r's value at index i: small integers, so every sum is exact in bf16, f16 and u8.
fn value(rank: usize, i: usize) -> f32 {
    ((rank + 1) * (i % 7 + 1)) as f32
}

struct Checker<'a> {
    comm: &'a dyn Communicator,
    failures: usize,
}

impl Checker<'_> {
    fn expect<T: TestElem>(
        &mut self,
        what: &str,
        got: &[T],
        range: std::ops::Range<usize>,
        want: impl Fn(usize) -> f32,
    ) {
        for i in range {
            if got[i].to_f32() != want(i) {
                eprintln!(
                    "rank {}: {what} of {} {}: element {i} is {}, expected {}",
                    self.comm.rank(),
                    got.len(),
                    T::DTYPE.name(),
                    got[i].to_f32(),
                    want(i)
                );
                self.failures += 1;
                return;
            }
        }
    }

    fn all_ops<T: TestElem>(&mut self, len: usize) -> stoke_comm::Result<()> {
        let (rank, n) = (self.comm.rank(), self.comm.world_size());
        let mine = |i| T::from_f32(value(rank, i));
        let total = |i: usize| ((i % 7 + 1) * n * (n + 1) / 2) as f32;

        let mut buf: Vec<T> = (0..len).map(mine).collect();
        self.comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        self.expect("all_reduce sum", &buf, 0..len, total);

        if T::DTYPE != stoke_comm::DType::U8 {
            let mut buf: Vec<T> = (0..len).map(mine).collect();
            self.comm.all_reduce(&mut buf, ReduceOp::Avg)?;
            self.expect("all_reduce avg", &buf, 0..len, |i| total(i) / n as f32);
            let mut buf: Vec<T> = (0..len).map(mine).collect();
            self.comm.reduce_scatter(&mut buf, ReduceOp::Avg)?;
            self.expect("reduce_scatter avg", &buf, shard_range(len, n, rank), |i| total(i) / n as f32);
        }

        let mut buf: Vec<T> = (0..len).map(mine).collect();
        self.comm.reduce_scatter(&mut buf, ReduceOp::Sum)?;
        self.expect("reduce_scatter sum", &buf, shard_range(len, n, rank), total);

        let shard_of = |i: usize| (0..n).find(|&s| shard_range(len, n, s).contains(&i)).unwrap();
        let mut buf: Vec<T> = (0..len).map(|_| T::from_f32(99.0)).collect();
        for i in shard_range(len, n, rank) {
            buf[i] = mine(i);
        }
        self.comm.all_gather(&mut buf)?;
        self.expect("all_gather", &buf, 0..len, |i| value(shard_of(i), i));

        let root = n - 1;
        let mut buf: Vec<T> = (0..len).map(|i| if rank == root { mine(i) } else { T::from_f32(99.0) }).collect();
        self.comm.broadcast(&mut buf, root)?;
        self.expect("broadcast", &buf, 0..len, |i| value(root, i));

        self.all_to_all::<T>(len)?;

        // Pairs (0,1), (2,3): the even rank sends first, the odd one receives first.
        if n >= 2 && rank < n / 2 * 2 {
            let peer = rank ^ 1;
            let mut got: Vec<T> = vec![T::from_f32(0.0); len];
            let own: Vec<T> = (0..len).map(mine).collect();
            if rank % 2 == 0 {
                self.comm.send(&own, peer)?;
                self.comm.recv(&mut got, peer)?;
            } else {
                self.comm.recv(&mut got, peer)?;
                self.comm.send(&own, peer)?;
            }
            self.expect("send/recv", &got, 0..len, |i| value(peer, i));
        }
        Ok(())
    }

    /// A batch of sends and receives that would deadlock as blocking calls of this size (every rank
    /// sends first): two messages to the next rank and one to the previous, the matching three
    /// received, each a different value; between one pair the messages must arrive in order.
    fn p2p_batch(&mut self, len: usize) -> stoke_comm::Result<()> {
        let (rank, n) = (self.comm.rank(), self.comm.world_size());
        if n < 2 {
            return Ok(());
        }
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        let message = |from: usize, tag: usize, i: usize| value(from, i) + (1000 * tag) as f32;
        let out: Vec<Vec<f32>> = (0..3).map(|tag| (0..len).map(|i| message(rank, tag, i)).collect()).collect();
        let mut got = vec![vec![-1.0f32; len]; 3];
        let send = |tag: usize, peer: usize| {
            let region = Region::new(out[tag].as_ptr() as *mut u8, len, stoke_comm::DType::F32);
            stoke_comm::P2p::Send { region, peer }
        };
        let [a, b, c] = &mut got[..] else { unreachable!() };
        let ops = [
            stoke_comm::P2p::Recv { region: Region::of(a), peer: prev },
            send(0, next),
            send(1, next),
            stoke_comm::P2p::Recv { region: Region::of(b), peer: prev },
            send(2, prev),
            stoke_comm::P2p::Recv { region: Region::of(c), peer: next },
        ];
        // SAFETY: every region lives until `wait` returns; the sends' are only read.
        unsafe { self.comm.p2p_batch_async(&ops) }?.wait()?;
        // With two ranks next and prev are one peer, whose three messages come in the order sent.
        self.expect("p2p_batch first to next", &got[0], 0..len, |i| message(prev, 0, i));
        self.expect("p2p_batch second to next", &got[1], 0..len, |i| message(prev, 1, i));
        self.expect("p2p_batch to prev", &got[2], 0..len, |i| message(next, 2, i));
        Ok(())
    }

    /// All-to-all with `per_rank` elements per chunk: chunk `j` of rank `r`'s send buffer holds
    /// `value(r, j * per_rank + k)`, so chunk `i` of the receive buffer must hold rank `i`'s chunk
    /// for this rank.
    fn all_to_all<T: TestElem>(&mut self, per_rank: usize) -> stoke_comm::Result<()> {
        let (rank, n) = (self.comm.rank(), self.comm.world_size());
        let send: Vec<T> = (0..per_rank * n).map(|i| T::from_f32(value(rank, i))).collect();
        let mut recv: Vec<T> = vec![T::from_f32(99.0); per_rank * n];
        self.comm.all_to_all(&send, &mut recv)?;
        self.expect("all_to_all", &recv, 0..per_rank * n, |i| {
            let (from, k) = (i / per_rank.max(1), i % per_rank.max(1));
            value(from, rank * per_rank + k)
        });
        Ok(())
    }
}

fn check(comm: &dyn Communicator) -> stoke_comm::Result<usize> {
    let n = comm.world_size();
    let mut checker = Checker { comm, failures: 0 };
    // Odd sizes: one element, fewer elements than ranks, not divisible by the world size, just
    // over the direct algorithm's limit, and several ring chunks.
    let sizes = [1usize, 2, n.saturating_sub(1).max(1), 7, 1001, 16_411, 70_001, 300_007];
    for &len in &sizes {
        checker.all_ops::<f32>(len)?;
        checker.all_ops::<bf16>(len)?;
        checker.all_ops::<f16>(len)?;
        checker.all_ops::<u8>(len)?;
    }
    // Batches of sends and receives, up to 8 MiB a message (many slots per pair).
    for len in [1usize, 70_001, 2_000_003] {
        checker.p2p_batch(len)?;
    }
    // Large all-to-alls: 4 MiB of f32 and 3 MiB + 1 byte of u8 per chunk (many slots per pair).
    checker.all_to_all::<f32>(1 << 20)?;
    checker.all_to_all::<u8>((3 << 20) + 1)?;
    // Refused before queueing: a count that does not cut into equal chunks, overlapping regions.
    if n > 1 {
        let send = vec![0f32; n + 1];
        let mut recv = vec![0f32; n + 1];
        match comm.all_to_all(&send, &mut recv) {
            Err(stoke_comm::CommError::InvalidArgument { .. }) => {}
            other => {
                eprintln!(
                    "rank {rank}: all_to_all of {} elements on {n} ranks gave {other:?}",
                    n + 1,
                    rank = comm.rank()
                );
                checker.failures += 1;
            }
        }
    }
    let mut both = vec![0f32; 4 * n];
    let whole = Region::of(&mut both);
    // SAFETY: refused before anything is queued (the regions overlap), so nothing touches `both`.
    match unsafe { comm.all_to_all_async(whole.slice(0, 2 * n), whole.slice(n, 3 * n)) } {
        Err(stoke_comm::CommError::InvalidArgument { .. }) => {}
        other => {
            eprintln!("rank {}: overlapping all_to_all regions gave {other:?}", comm.rank());
            checker.failures += 1;
        }
    }
    comm.barrier()?;

    // Overlapping async all-reduces over disjoint buckets of one flat buffer, as a trainer does.
    let len = 200_003;
    let rank = comm.rank();
    let mut flat: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
    let region = Region::of(&mut flat);
    let bounds = [0, 10, 50_000, 150_000, len];
    let mut works = Vec::new();
    for w in bounds.windows(2) {
        // SAFETY: `flat` outlives every Work (all are waited below) and nothing touches it meanwhile.
        works.push(unsafe { comm.all_reduce_async(region.slice(w[0], w[1]), ReduceOp::Sum)? });
    }
    for work in works {
        work.wait()?;
    }
    checker.expect("async bucketed all_reduce", &flat, 0..len, |i| ((i % 7 + 1) * n * (n + 1) / 2) as f32);

    // Sub-groups: the first and last rank; and everyone but rank 0.
    if n >= 2 {
        let members = [0, n - 1];
        let sub = comm.new_group(&members)?;
        match (&sub, members.contains(&rank)) {
            (Some(sub), true) => {
                let mut buf = vec![rank as f32 + 1.0; 33];
                sub.all_reduce(&mut buf, ReduceOp::Sum)?;
                checker.expect("sub-group all_reduce", &buf, 0..33, |_| 1.0 + n as f32);
                let mut big: Vec<f32> = (0..100_001).map(|i| value(rank, i)).collect();
                sub.all_reduce(&mut big, ReduceOp::Sum)?;
                checker.expect("sub-group ring all_reduce", &big, 0..100_001, |i| ((i % 7 + 1) * (n + 1)) as f32);
            }
            (None, false) => {}
            _ => {
                eprintln!("rank {rank}: new_group({members:?}) returned the wrong membership");
                checker.failures += 1;
            }
        }
    }
    if n >= 3 {
        let members: Vec<usize> = (1..n).collect();
        if let Some(sub) = comm.new_group(&members)? {
            let mut buf = vec![1.0f32; 5];
            sub.all_reduce(&mut buf, ReduceOp::Sum)?;
            checker.expect("sub-group without rank 0", &buf, 0..5, |_| (n - 1) as f32);
            if sub.rank() != rank - 1 {
                eprintln!("rank {rank}: sub-group rank is {}, expected {}", sub.rank(), rank - 1);
                checker.failures += 1;
            }
        }
    }
    comm.barrier()?;
    Ok(checker.failures)
}

/// For the `tcp` backend with two ranks per node (node = rank / 2, four or more ranks): a group
/// inside a node must run on shared memory, one across nodes on TCP, and both must be right.
fn nodes(comm: &dyn Communicator) -> stoke_comm::Result<usize> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let mut checker = Checker { comm, failures: 0 };
    let expect_backend = |what: &str, got: &str, want: &str| {
        if got != want {
            eprintln!("rank {rank}: {what} runs on `{got}`, expected `{want}`");
            1
        } else {
            0
        }
    };
    checker.failures += expect_backend("the world", comm.backend(), "tcp");
    // Inside node 0, inside the last node, across two nodes, and two ranks of node 0 with one of
    // node 1 (the hierarchical all-reduce).
    let last_node = [n / 2 * 2 - 2, n / 2 * 2 - 1];
    let groups: [(&[usize], &str); 4] = [(&[0, 1], "shm"), (&last_node, "shm"), (&[1, 2], "tcp"), (&[0, 1, 2], "tcp")];
    for (members, want) in groups {
        let sub = comm.new_group(members)?;
        match (sub, members.contains(&rank)) {
            (Some(sub), true) => {
                checker.failures += expect_backend(&format!("group {members:?}"), sub.backend(), want);
                let mut inner = Checker { comm: sub.as_ref(), failures: 0 };
                for len in [1usize, 7, 1001, 70_001] {
                    inner.all_ops::<f32>(len)?;
                    inner.all_ops::<bf16>(len)?;
                    inner.all_ops::<u8>(len)?;
                }
                sub.barrier()?;
                checker.failures += inner.failures;
            }
            (None, false) => {}
            _ => {
                eprintln!("rank {rank}: new_group({members:?}) returned the wrong membership");
                checker.failures += 1;
            }
        }
    }
    comm.barrier()?;
    Ok(checker.failures)
}

/// Iterations per size when not given: about 256 MiB moved, 5..200 iterations (the gloo peer
/// script uses the same rule).
fn iterations(bytes: usize) -> usize {
    ((256usize << 20) / bytes.max(1)).clamp(5, 200)
}

fn bench(comm: &dyn Communicator, sizes: &[usize], iters: Option<usize>, all_to_all: bool) -> stoke_comm::Result<()> {
    for &bytes in sizes {
        let iters = iters.unwrap_or_else(|| iterations(bytes));
        let count = bytes / 4 / comm.world_size() * comm.world_size();
        let mut buf = vec![1.0f32; count];
        let send = vec![1.0f32; if all_to_all { count } else { 0 }];
        let run = |buf: &mut [f32]| {
            if all_to_all {
                comm.all_to_all(&send, buf)
            } else {
                comm.all_reduce(buf, ReduceOp::Sum)
            }
        };
        // Warm-up: page faults and caches.
        for _ in 0..3 {
            run(&mut buf)?;
        }
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            comm.barrier()?;
            let start = Instant::now();
            run(&mut buf)?;
            times.push(start.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        if comm.rank() == 0 {
            println!("{{\"bytes\":{bytes},\"median_s\":{:.9},\"min_s\":{:.9}}}", times[iters / 2], times[0]);
        }
    }
    Ok(())
}

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let vars: HashMap<String, String> = std::env::vars().collect();
    let env = match DistEnv::from_vars(&vars) {
        Ok(env) => env,
        Err(err) => {
            eprintln!("{err}");
            return ExitCode::from(2);
        }
    };
    let mut config = CommConfig::default();
    if let Some(backend) = arg(&args, "--backend") {
        config.backend = Backend::parse(&backend).expect("backend is shm, mpi, nccl or tcp");
    }
    if let Some(timeout) = arg(&args, "--timeout") {
        config.timeout_s = timeout.parse().expect("--timeout takes seconds");
    }
    if let Some(slot) = arg(&args, "--slot-bytes") {
        config.slot_bytes = slot.parse().expect("--slot-bytes takes bytes");
    }
    let comm = match connect(&config, &env) {
        Ok(comm) => comm,
        Err(err) => {
            eprintln!("rank {}: {err}", env.rank);
            return ExitCode::from(3);
        }
    };
    let outcome = match args.first().map(String::as_str) {
        Some(what @ ("check" | "nodes")) => {
            let run = if what == "check" { check } else { nodes };
            run(comm.as_ref()).map(|mut failures| {
                let backend = arg(&args, "--expect-backend");
                if let Some(want) = backend.as_deref().filter(|&want| want != comm.backend()) {
                    eprintln!("rank {}: the world runs on `{}`, expected `{want}`", comm.rank(), comm.backend());
                    failures += 1;
                }
                if failures == 0 {
                    println!("rank {} of {}: all checks passed", comm.rank(), comm.world_size());
                    0
                } else {
                    1
                }
            })
        }
        Some("victim") => {
            let victim: usize = arg(&args, "--victim").and_then(|v| v.parse().ok()).expect("--victim RANK");
            comm.barrier().map(|_| {
                println!("ready {}", comm.rank());
                if comm.rank() == victim {
                    std::thread::sleep(Duration::from_secs(3600));
                }
                let mut buf = vec![1.0f32; 1 << 20];
                let result = match arg(&args, "--op").as_deref() {
                    Some("all_to_all") => {
                        let count = (1 << 20) * comm.world_size();
                        let send = vec![1.0f32; count];
                        buf.resize(count, 0.0);
                        comm.all_to_all(&send, &mut buf)
                    }
                    _ => comm.all_reduce(&mut buf, ReduceOp::Sum),
                };
                match result {
                    Ok(()) => 0,
                    Err(err) => {
                        eprintln!("rank {}: {err}", comm.rank());
                        3
                    }
                }
            })
        }
        Some("leave") => {
            let rank = comm.rank();
            let result = if rank == 0 {
                (1..comm.world_size()).try_for_each(|from| {
                    let mut got = [0u8; 4];
                    comm.recv(&mut got, from)?;
                    if got != [from as u8; 4] {
                        eprintln!("rank 0: rank {from} sent {got:?}");
                    }
                    Ok(())
                })
            } else {
                if rank == 1 {
                    std::thread::sleep(Duration::from_millis(500));
                }
                comm.send(&[rank as u8; 4], 0)
            };
            match result {
                Ok(()) => {
                    println!("rank {rank} of {}: all checks passed", comm.world_size());
                    Ok(0)
                }
                Err(err) => {
                    eprintln!("rank {rank}: {err}");
                    Ok(3)
                }
            }
        }
        Some("bench") => {
            let sizes: Vec<usize> = arg(&args, "--sizes")
                .expect("--sizes BYTES,..")
                .split(',')
                .map(|s| s.parse().expect("sizes are byte counts"))
                .collect();
            let iters = arg(&args, "--iters").and_then(|v| v.parse().ok());
            let all_to_all = arg(&args, "--op").as_deref() == Some("all_to_all");
            bench(comm.as_ref(), &sizes, iters, all_to_all).map(|_| 0)
        }
        _ => {
            eprintln!("usage: stoke-comm-worker check|nodes|victim|leave|bench [--backend B] [--timeout S]");
            Ok(2)
        }
    };
    match outcome {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            eprintln!("rank {}: {err}", comm.rank());
            ExitCode::from(3)
        }
    }
}
