//! The shared-memory backend: processes of one machine exchange chunks through per-pair
//! channels in one segment per group.
//!
//! Algorithms, all built on `send_chunk`/`recv_chunk` over channel (src, dst):
//! - all-reduce up to `direct_max_bytes`: direct. Every rank posts its whole buffer to every
//!   other rank and sums all inputs in rank order (f32 accumulation, one rounding): one round trip.
//! - larger all-reduce, reduce-scatter, all-gather: a ring, chunk by chunk. Each chunk of each of
//!   the `n` shards travels `n - 1` hops being reduced, then `n - 1` hops being copied; a sender
//!   runs up to `slots` chunks ahead of its receiver.
//! - broadcast: a chain from the root, chunk by chunk. Send/recv: the pair's channel. A batch
//!   of sends and receives: every channel's chunks moved as their slots allow, in passes; when
//!   none could move, a sleep on the first blocked channel's futex (1 ms at most, then the others
//!   are looked at again).
//! - all-to-all: `n - 1` pairwise exchanges per chunk; at step `s` every rank sends to
//!   `rank + s` and receives from `rank - s`, chunk by chunk, so no rank ever waits on a channel
//!   whose receiver is not also making progress (any message size, any slot count).
//!
//! Receivers reduce straight out of the sender's slot, so each byte is copied into shared memory
//! once per hop and read from there once.

mod segment;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::api::shard_range;
use crate::config::CommConfig;
use crate::dtype::{self, DType, ReduceOp};
use crate::error::{CommError, Result};
use crate::store::StoreClient;
use crate::work::{Engine, GroupInfo, Kind, Op, P2p, Region};
use segment::{Segment, WaitFor};

/// Where the members of a group find its segment.
pub(crate) enum Rendezvous {
    /// Through the TCP store: the group's rank 0 publishes the segment's path under a key.
    Store(StoreClient),
    /// At a fixed path (sub-groups append `.g<key>`).
    Path(PathBuf),
}

struct Group {
    /// Group rank -> world rank.
    world_ranks: Vec<usize>,
    rank: usize,
    size: usize,
    key: String,
    children: u32,
    /// `None` for a group of one.
    segment: Option<Segment>,
    /// Chunks this rank has posted to each destination.
    sent: Vec<u32>,
    /// Chunks this rank has consumed from each source.
    received: Vec<u32>,
}

pub(crate) struct ShmEngine {
    config: CommConfig,
    rendezvous: Rendezvous,
    groups: Vec<Group>,
}

impl ShmEngine {
    /// Joins the world group: rank 0 creates the segment, the others open it, all wait for all.
    pub(crate) fn new(config: CommConfig, rank: usize, size: usize, rendezvous: Rendezvous) -> Result<ShmEngine> {
        let mut engine = ShmEngine { config, rendezvous, groups: Vec::new() };
        let world = engine.make_group((0..size).collect(), rank, "world".into())?;
        engine.groups.push(world);
        Ok(engine)
    }

    /// An engine with no group yet, for the `tcp` backend, which adds one shm group per group
    /// whose members share a node ([`ShmEngine::add_group`]).
    pub(crate) fn without_groups(config: CommConfig, rendezvous: Rendezvous) -> ShmEngine {
        ShmEngine { config, rendezvous, groups: Vec::new() }
    }

    /// Builds a group of `world_ranks` (ascending) in which this process is `rank`, and returns
    /// its id for [`Engine::execute`]. Every member calls it with the same `key`, which must be
    /// unique among the job's groups (it names the store key and the segment). Collective over
    /// the members only.
    pub(crate) fn add_group(&mut self, world_ranks: Vec<usize>, rank: usize, key: String) -> Result<usize> {
        let group = self.make_group(world_ranks, rank, key)?;
        self.groups.push(group);
        Ok(self.groups.len() - 1)
    }

    fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.config.timeout_s)
    }

    /// Aborts every group's segment naming world rank `lost_rank`, lost outside them (see
    /// `Segment::abort_outside`).
    pub(crate) fn abort_outside(&self, lost_rank: usize) {
        for segment in self.groups.iter().filter_map(|g| g.segment.as_ref()) {
            segment.abort_outside(lost_rank);
        }
    }

    fn make_group(&mut self, world_ranks: Vec<usize>, rank: usize, key: String) -> Result<Group> {
        let size = world_ranks.len();
        let timeout = self.timeout();
        let segment = if size == 1 {
            None
        } else {
            let (slots, slot_bytes) = (self.config.slots, self.config.slot_bytes);
            let world_rank = world_ranks[rank];
            let mut segment = match &mut self.rendezvous {
                Rendezvous::Store(store) => {
                    let store_key = format!("shm/{key}");
                    let place = store.place.clone();
                    let failed = |reason| CommError::Rendezvous { rank: world_rank, place: place.clone(), reason };
                    if rank == 0 {
                        let nanos = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map(|d| d.as_nanos())
                            .unwrap_or(0);
                        let name = format!("stoke-comm-{}-{nanos}-{}", std::process::id(), key.replace('/', "."));
                        let path = self.config.shm_dir.join(name);
                        let segment = Segment::create(&path, size, slots, slot_bytes, timeout)?;
                        // Which machine the segment is on, before where: a rank that reads the
                        // path can read the machine.
                        store.set(&format!("{store_key}/boot"), boot_id().as_bytes()).map_err(failed)?;
                        store.set(&store_key, path.as_os_str().as_encoded_bytes()).map_err(failed)?;
                        segment
                    } else {
                        let path = store.get(&store_key, timeout).map_err(failed)?;
                        let boot = store.get(&format!("{store_key}/boot"), timeout).map_err(failed)?;
                        if boot != boot_id().as_bytes() {
                            return Err(failed(format!(
                                "this rank runs on another machine than rank {} (another boot id): the shm \
                                 backend needs every rank of a group on one machine; across machines use \
                                 dist.backend \"mpi\" or \"nccl\"",
                                world_ranks[0]
                            )));
                        }
                        let path = PathBuf::from(String::from_utf8_lossy(&path).into_owned());
                        Segment::open(&path, rank, size, timeout)?
                    }
                }
                Rendezvous::Path(base) => {
                    let path = if key == "world" {
                        base.clone()
                    } else {
                        PathBuf::from(format!("{}.g{}", base.display(), key.replace('/', ".")))
                    };
                    if rank == 0 {
                        Segment::create(&path, size, slots, slot_bytes, timeout)?
                    } else {
                        Segment::open(&path, rank, size, timeout)?
                    }
                }
            };
            segment.join(rank, &world_ranks)?;
            Some(segment)
        };
        Ok(Group { world_ranks, rank, size, key, children: 0, segment, sent: vec![0; size], received: vec![0; size] })
    }
}

impl Engine for ShmEngine {
    fn any_thread(&self) -> bool {
        true
    }

    fn execute(&mut self, group: usize, op: &Op) -> Result<Option<GroupInfo>> {
        if let Op::NewGroup { ranks } = op {
            let parent = &mut self.groups[group];
            parent.children += 1;
            let key = format!("{}/{}", parent.key, parent.children);
            let Some(rank) = ranks.iter().position(|&r| r == parent.rank) else {
                return Ok(None);
            };
            let world_ranks: Vec<usize> = ranks.iter().map(|&r| parent.world_ranks[r]).collect();
            let size = world_ranks.len();
            let id = self.add_group(world_ranks, rank, key)?;
            return Ok(Some(GroupInfo { id, rank, size, backend: None }));
        }
        let direct_max = self.config.direct_max_bytes.min(self.config.slot_bytes);
        let g = &mut self.groups[group];
        if g.size == 1 {
            if let Op::AllToAll { send, recv } = op {
                // SAFETY: both regions hold count elements and do not overlap (checked before
                // queueing).
                unsafe { std::ptr::copy_nonoverlapping(send.ptr() as *const u8, recv.ptr(), send.bytes()) };
            }
            // Every other operation on a group of one is the identity (avg divides by 1).
            return Ok(None);
        }
        let name = op.name();
        match op {
            Op::AllReduce { region, op } if region.bytes() <= direct_max => g.all_reduce_direct(name, region, *op),
            Op::AllReduce { region, op } => g.ring(name, region, Some(*op), true),
            Op::ReduceScatter { region, op } => g.ring(name, region, Some(*op), false),
            Op::AllGather { region } => g.ring(name, region, None, true),
            Op::Broadcast { region, root } => g.broadcast(name, region, *root),
            Op::AllToAll { send, recv } => g.all_to_all(name, send, recv),
            Op::Send { region, peer } => g.send(name, region, *peer),
            Op::Recv { region, peer } => g.recv(name, region, *peer),
            Op::Batch(ops) => g.batch(name, ops),
            Op::Barrier => g.barrier(name),
            Op::NewGroup { .. } => unreachable!("handled above"),
        }?;
        Ok(None)
    }
}

impl Group {
    fn seg(&self) -> &Segment {
        self.segment.as_ref().expect("groups of more than one rank have a segment")
    }

    fn why(&self, op: &'static str, peer: usize) -> WaitFor<'_> {
        WaitFor { op, peer, world_ranks: &self.world_ranks, rank: self.rank }
    }

    /// Elements per chunk: one slot.
    fn chunk_elems(&self, dtype: DType) -> usize {
        self.seg().slot_bytes / dtype.size()
    }

    /// Waits for a free slot towards `dst` and returns its data pointer.
    fn send_begin(&self, op: &'static str, dst: usize) -> Result<*mut u8> {
        let seg = self.seg();
        let sent = self.sent[dst];
        let slots = seg.slots as u32;
        let (freed, waiter) = seg.freed(self.rank, dst);
        seg.wait(freed, waiter, |f| sent.wrapping_sub(f) < slots, self.why(op, dst))?;
        Ok(seg.slot(self.rank, dst, (sent % slots) as usize).1)
    }

    /// Posts the slot filled after `send_begin`.
    fn send_end(&mut self, dst: usize, kind: Kind, bytes: usize) {
        let seg = self.seg();
        let sent = self.sent[dst];
        let (header, _) = seg.slot(self.rank, dst, (sent % seg.slots as u32) as usize);
        // SAFETY: the slot header is ours until we post it (the receiver reads it after `posted`
        // moves, with SeqCst ordering through `publish`).
        unsafe {
            (header as *mut u32).write(kind as u32);
            (header.add(8) as *mut u64).write(bytes as u64);
        }
        let (posted, waiter) = seg.posted(self.rank, dst);
        Segment::publish(posted, waiter, sent.wrapping_add(1));
        self.sent[dst] = sent.wrapping_add(1);
    }

    /// Copies `bytes` at `src` into the next slot towards `dst`.
    fn send_chunk(&mut self, op: &'static str, dst: usize, kind: Kind, src: *const u8, bytes: usize) -> Result<()> {
        let slot = self.send_begin(op, dst)?;
        // SAFETY: src is valid for `bytes` (the caller's region); the slot holds slot_bytes >= bytes
        // and is ours until send_end.
        unsafe { std::ptr::copy_nonoverlapping(src, slot, bytes) };
        self.send_end(dst, kind, bytes);
        Ok(())
    }

    /// Waits for the next chunk from `src`, checks its kind and size, and returns its data.
    fn recv_begin(&self, op: &'static str, src: usize, kind: Kind, bytes: usize) -> Result<*const u8> {
        let seg = self.seg();
        let received = self.received[src];
        let (posted, waiter) = seg.posted(src, self.rank);
        seg.wait(posted, waiter, |p| p != received, self.why(op, src))?;
        self.posted_chunk(op, src, kind, bytes)
    }

    /// `send_begin` without waiting: the free slot towards `dst`, if there is one.
    fn try_send_begin(&self, dst: usize) -> Option<*mut u8> {
        let seg = self.seg();
        let (sent, slots) = (self.sent[dst], seg.slots as u32);
        let freed = seg.freed(self.rank, dst).0.load(std::sync::atomic::Ordering::Acquire);
        (sent.wrapping_sub(freed) < slots).then(|| seg.slot(self.rank, dst, (sent % slots) as usize).1)
    }

    /// `recv_begin` without waiting: the next chunk from `src`, if it was posted.
    fn try_recv_begin(&self, op: &'static str, src: usize, kind: Kind, bytes: usize) -> Result<Option<*const u8>> {
        let posted = self.seg().posted(src, self.rank).0.load(std::sync::atomic::Ordering::Acquire);
        if posted == self.received[src] {
            return Ok(None);
        }
        self.posted_chunk(op, src, kind, bytes).map(Some)
    }

    /// The next chunk from `src`, posted: its data, once its kind and size are checked.
    fn posted_chunk(&self, op: &'static str, src: usize, kind: Kind, bytes: usize) -> Result<*const u8> {
        let seg = self.seg();
        let (header, data) = seg.slot(src, self.rank, (self.received[src] % seg.slots as u32) as usize);
        // SAFETY: the sender wrote the header before posting; it is ours until recv_end.
        let (got_kind, got_bytes) = unsafe { ((header as *const u32).read(), (header.add(8) as *const u64).read()) };
        if got_kind != kind as u32 || got_bytes != bytes as u64 {
            return Err(CommError::Mismatch {
                rank: self.world_ranks[self.rank],
                peer: self.world_ranks[src],
                op,
                reason: format!(
                    "expected a {kind:?} chunk of {bytes} bytes, got kind {got_kind} with {got_bytes} bytes \
                     (ranks called different operations or sizes)"
                ),
            });
        }
        Ok(data)
    }

    /// Frees the slot returned by `recv_begin`.
    fn recv_end(&mut self, src: usize) {
        let seg = self.seg();
        let next = self.received[src].wrapping_add(1);
        let (freed, waiter) = seg.freed(src, self.rank);
        Segment::publish(freed, waiter, next);
        self.received[src] = next;
    }

    fn all_reduce_direct(&mut self, op: &'static str, region: &Region, reduce: ReduceOp) -> Result<()> {
        let (ptr, bytes) = (region.ptr(), region.bytes());
        let me = self.rank;
        for peer in (0..self.size).filter(|&p| p != me) {
            self.send_chunk(op, peer, Kind::AllReduce, ptr, bytes)?;
        }
        let mut inputs = Vec::with_capacity(self.size);
        for peer in 0..self.size {
            if peer == self.rank {
                inputs.push(ptr as *const u8);
            } else {
                inputs.push(self.recv_begin(op, peer, Kind::AllReduce, bytes)?);
            }
        }
        let divisor = (reduce == ReduceOp::Avg).then_some(self.size as f32);
        // SAFETY: every input holds `count` elements (own region, or a slot checked for `bytes`);
        // the output aliases only our own input, which sum_inputs allows.
        unsafe { dtype::sum_inputs(region.dtype(), ptr, &inputs, region.count(), divisor) };
        let me = self.rank;
        for peer in (0..self.size).filter(|&p| p != me) {
            self.recv_end(peer);
        }
        Ok(())
    }

    /// The ring: with `reduce`, reduce-scatter steps; with `gather`, all-gather steps; both make
    /// an all-reduce. Chunk `c` of every shard moves before chunk `c + 1`.
    fn ring(&mut self, op: &'static str, region: &Region, reduce: Option<ReduceOp>, gather: bool) -> Result<()> {
        let (n, rank) = (self.size, self.rank);
        let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
        let dtype = region.dtype();
        let size = dtype.size();
        let chunk = self.chunk_elems(dtype);
        let count = region.count();
        let longest = (0..n).map(|s| shard_range(count, n, s).len()).max().unwrap_or(0);
        let n_chunks = longest.div_ceil(chunk).max(1);
        let kind = match (reduce.is_some(), gather) {
            (true, true) => Kind::AllReduce,
            (true, false) => Kind::ReduceScatter,
            _ => Kind::AllGather,
        };
        // Chunk c of shard s as (byte pointer, elements); possibly empty.
        let piece = |shard: usize, c: usize| -> (*mut u8, usize) {
            let range = shard_range(count, n, shard);
            let start = (range.start + c * chunk).min(range.end);
            let end = (start + chunk).min(range.end);
            // SAFETY: start <= count, within or one past the region.
            (unsafe { region.ptr().add(start * size) }, end - start)
        };
        for c in 0..n_chunks {
            if let Some(reduce_op) = reduce {
                for step in 0..n - 1 {
                    let (out_ptr, out_len) = piece((rank + 2 * n - step - 1) % n, c);
                    self.send_chunk(op, right, kind, out_ptr, out_len * size)?;
                    let shard = (rank + 2 * n - step - 2) % n;
                    let (in_ptr, in_len) = piece(shard, c);
                    let data = self.recv_begin(op, left, kind, in_len * size)?;
                    // SAFETY: in_ptr holds in_len elements of our region; the slot was checked to
                    // hold as many; they do not overlap (slot memory is not the caller's).
                    unsafe { dtype::add_into(dtype, in_ptr, data, in_len) };
                    self.recv_end(left);
                    if step == n - 2 && reduce_op == ReduceOp::Avg {
                        // SAFETY: as above; this is our final shard's chunk.
                        unsafe { dtype::divide(dtype, in_ptr, in_len, n as f32) };
                    }
                }
            }
            if gather {
                for step in 0..n - 1 {
                    let (out_ptr, out_len) = piece((rank + n - step) % n, c);
                    self.send_chunk(op, right, kind, out_ptr, out_len * size)?;
                    let (in_ptr, in_len) = piece((rank + 2 * n - step - 1) % n, c);
                    let data = self.recv_begin(op, left, kind, in_len * size)?;
                    // SAFETY: as in the reduce steps; a plain copy.
                    unsafe { std::ptr::copy_nonoverlapping(data, in_ptr, in_len * size) };
                    self.recv_end(left);
                }
            }
        }
        Ok(())
    }

    /// A chain from the root: each rank copies a chunk out of its predecessor's slot, then passes
    /// it on.
    fn broadcast(&mut self, op: &'static str, region: &Region, root: usize) -> Result<()> {
        let n = self.size;
        let position = (self.rank + n - root) % n;
        let (prev, next) = ((self.rank + n - 1) % n, (self.rank + 1) % n);
        let size = region.dtype().size();
        for (start, len) in chunk_spans(region.count(), self.chunk_elems(region.dtype())) {
            // SAFETY: start <= count.
            let ptr = unsafe { region.ptr().add(start * size) };
            if position > 0 {
                let data = self.recv_begin(op, prev, Kind::Broadcast, len * size)?;
                // SAFETY: the slot holds len elements (checked), ptr has room for them.
                unsafe { std::ptr::copy_nonoverlapping(data, ptr, len * size) };
                self.recv_end(prev);
            }
            if position < n - 1 {
                self.send_chunk(op, next, Kind::Broadcast, ptr, len * size)?;
            }
        }
        Ok(())
    }

    /// Pairwise exchanges: for each slot-sized piece of a chunk, step `s` sends this rank's piece
    /// for `rank + s` and then receives the piece from `rank - s`. Every rank walks the same
    /// (piece, step) sequence and each send is matched by a receive at the same position, so a
    /// rank waiting on a full channel waits on a peer that is behind it and can always move.
    fn all_to_all(&mut self, op: &'static str, send: &Region, recv: &Region) -> Result<()> {
        let (n, rank) = (self.size, self.rank);
        let size = send.dtype().size();
        let per_rank = send.count() / n;
        debug_assert_eq!(per_rank * n, send.count(), "checked before queueing");
        // SAFETY: chunk `rank` lies in both regions (per_rank elements each), which do not overlap
        // (checked before queueing).
        unsafe {
            std::ptr::copy_nonoverlapping(
                send.ptr().add(rank * per_rank * size),
                recv.ptr().add(rank * per_rank * size),
                per_rank * size,
            )
        };
        for (start, len) in chunk_spans(per_rank, self.chunk_elems(send.dtype())) {
            for step in 1..n {
                let (dst, src) = ((rank + step) % n, (rank + n - step) % n);
                // SAFETY: dst * per_rank + start + len <= count: the piece lies in `send`.
                let out = unsafe { send.ptr().add((dst * per_rank + start) * size) };
                self.send_chunk(op, dst, Kind::AllToAll, out, len * size)?;
                let data = self.recv_begin(op, src, Kind::AllToAll, len * size)?;
                // SAFETY: the slot holds len elements (checked); the piece of chunk `src` lies in
                // `recv`, which is not slot memory.
                unsafe {
                    std::ptr::copy_nonoverlapping(data, recv.ptr().add((src * per_rank + start) * size), len * size)
                };
                self.recv_end(src);
            }
        }
        Ok(())
    }

    fn send(&mut self, op: &'static str, region: &Region, peer: usize) -> Result<()> {
        let size = region.dtype().size();
        for (start, len) in chunk_spans(region.count(), self.chunk_elems(region.dtype())) {
            // SAFETY: start <= count; the region is valid for reads.
            let ptr = unsafe { region.ptr().add(start * size) };
            self.send_chunk(op, peer, Kind::Send, ptr, len * size)?;
        }
        Ok(())
    }

    fn recv(&mut self, op: &'static str, region: &Region, peer: usize) -> Result<()> {
        let size = region.dtype().size();
        for (start, len) in chunk_spans(region.count(), self.chunk_elems(region.dtype())) {
            let data = self.recv_begin(op, peer, Kind::Send, len * size)?;
            // SAFETY: the slot holds len elements (checked); the region has room for them.
            unsafe { std::ptr::copy_nonoverlapping(data, region.ptr().add(start * size), len * size) };
            self.recv_end(peer);
        }
        Ok(())
    }

    /// A batch of sends and receives (`Op::Batch`), each cut into slot-sized chunks as `send`
    /// and `recv` cut them (so either end may be a plain call). Every pass moves the chunks that
    /// can move without waiting, of the first unfinished transfer of each direction and peer only
    /// (a pair's messages keep their order), and pauses when none could; the timeout counts from
    /// the last chunk moved.
    fn batch(&mut self, op: &'static str, ops: &[P2p]) -> Result<()> {
        let spans: Vec<Vec<(usize, usize)>> = ops
            .iter()
            .map(|p| chunk_spans(p.region().count(), self.chunk_elems(p.region().dtype())).collect())
            .collect();
        let mut next = vec![0usize; ops.len()];
        let mut progress = Instant::now();
        loop {
            let (mut moved, mut waiting_on) = (false, None::<P2p>);
            for (i, p) in ops.iter().enumerate() {
                let unfinished = |j: usize| next[j] < spans[j].len();
                let behind = |j: usize| ops[j].is_send() == p.is_send() && ops[j].peer() == p.peer();
                if !unfinished(i) || (0..i).any(|j| unfinished(j) && behind(j)) {
                    continue;
                }
                let (region, size) = (p.region(), p.region().dtype().size());
                let (at, len) = spans[i][next[i]];
                // SAFETY: at <= count; the region is valid (the batch's contract).
                let ptr = unsafe { region.ptr().add(at * size) };
                let done = match *p {
                    P2p::Send { peer, .. } => self.try_send_begin(peer).map(|slot| {
                        // SAFETY: the slot holds slot_bytes >= len * size and is ours until send_end.
                        unsafe { std::ptr::copy_nonoverlapping(ptr as *const u8, slot, len * size) };
                        self.send_end(peer, Kind::Send, len * size);
                    }),
                    P2p::Recv { peer, .. } => self.try_recv_begin(op, peer, Kind::Send, len * size)?.map(|data| {
                        // SAFETY: the slot holds len elements (checked); the region has room for them.
                        unsafe { std::ptr::copy_nonoverlapping(data, ptr, len * size) };
                        self.recv_end(peer);
                    }),
                };
                if done.is_some() {
                    next[i] += 1;
                    moved = true;
                }
                if next[i] < spans[i].len() {
                    waiting_on.get_or_insert(*p);
                }
            }
            if moved {
                progress = Instant::now();
                continue;
            }
            // Nothing moved: sleep on the first blocked transfer's channel, which its peer wakes.
            let Some(blocked) = waiting_on else { return Ok(()) };
            let (seg, peer) = (self.seg(), blocked.peer());
            let (word, waiter, seen) = match blocked {
                P2p::Recv { .. } => {
                    let (posted, waiter) = seg.posted(peer, self.rank);
                    (posted, waiter, self.received[peer])
                }
                P2p::Send { .. } => {
                    let (freed, waiter) = seg.freed(self.rank, peer);
                    (freed, waiter, freed.load(std::sync::atomic::Ordering::SeqCst))
                }
            };
            seg.pause(word, waiter, seen, progress, self.why(op, peer))?;
        }
    }

    fn barrier(&mut self, op: &'static str) -> Result<()> {
        let me = self.rank;
        for peer in (0..self.size).filter(|&p| p != me) {
            self.send_begin(op, peer)?;
            self.send_end(peer, Kind::Barrier, 0);
        }
        let me = self.rank;
        for peer in (0..self.size).filter(|&p| p != me) {
            self.recv_begin(op, peer, Kind::Barrier, 0)?;
            self.recv_end(peer);
        }
        Ok(())
    }
}

/// This machine's boot id (the kernel's, shared by every process and network namespace here);
/// empty where it cannot be read, which then matches only another empty one.
pub(crate) fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// `(start, len)` of the chunks that cover `count` elements, `chunk` at a time; one empty chunk
/// for an empty buffer (the peers still exchange a message).
fn chunk_spans(count: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..count.div_ceil(chunk).max(1)).map(move |c| {
        let start = (c * chunk).min(count);
        (start, (count - start).min(chunk))
    })
}

/// Connects the shm backend: rank 0 serves the TCP store when the rendezvous is MASTER_ADDR/PORT.
pub(crate) fn rendezvous_for(
    config: &CommConfig,
    env: &crate::config::DistEnv,
    deadline: Instant,
) -> Result<Rendezvous> {
    if let (Some(addr), Some(port)) = (&env.master_addr, env.master_port) {
        let store = crate::store::rendezvous(addr, port, env.rank, deadline)?;
        return Ok(Rendezvous::Store(store));
    }
    if let Some(job) = &env.job_key {
        return Ok(Rendezvous::Path(config.shm_dir.join(format!("stoke-comm-{job}"))));
    }
    Err(CommError::Environment(format!(
        "rank {} of {} has no rendezvous: set MASTER_ADDR and MASTER_PORT (stoke launch and torchrun do), \
         or run under mpirun or srun",
        env.rank, env.world_size
    )))
}
