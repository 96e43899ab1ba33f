//! The [`Communicator`] trait, the process-group handle every backend returns, and the safe
//! blocking helpers of [`CommunicatorExt`].

use std::sync::Arc;

use crate::dtype::{DType, Element, ReduceOp};
use crate::error::{CommError, Result};
use crate::work::{Op, P2p, Region, Work, Worker};

/// Collective and point-to-point communication within one group of processes.
///
/// The `*_async` functions enqueue an operation on the communicator's communication thread and
/// return at once; operations run strictly in submission order, and every rank of the group must
/// submit the same collectives in the same order with the same element counts.
///
/// # The contract of the `*_async` functions (why they are `unsafe`)
/// The memory of `region` must stay valid, and must not be read or written by anyone else, from
/// the call until the returned [`Work`] has completed: [`Work::wait`] returned, or the `Work` was
/// dropped (dropping waits). Leaking the `Work` (`mem::forget`) while the memory is freed is
/// undefined behaviour. For the `nccl` backend the region is device memory.
pub trait Communicator: Send + Sync {
    /// This process's rank in the group, `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of processes in the group.
    fn world_size(&self) -> usize;
    /// The backend's name: `shm`, `mpi`, `nccl` or `tcp`. With the `tcp` backend it names what
    /// moves this group's bytes: `shm` for a group whose members share one node.
    fn backend(&self) -> &'static str;

    /// All-reduce in place: afterwards every rank holds the reduction of all ranks' regions.
    ///
    /// # Safety
    /// See the trait's contract.
    unsafe fn all_reduce_async(&self, region: Region, op: ReduceOp) -> Result<Work>;

    /// Reduce-scatter in place: the region is cut into `world_size` shards by [`shard_range`];
    /// afterwards rank `r`'s shard holds the reduction of every rank's shard `r`. The other shards
    /// are scratch.
    ///
    /// # Safety
    /// See the trait's contract.
    unsafe fn reduce_scatter_async(&self, region: Region, op: ReduceOp) -> Result<Work>;

    /// All-gather in place: rank `r` provides its shard ([`shard_range`]) of the region and
    /// afterwards every rank holds every shard.
    ///
    /// # Safety
    /// See the trait's contract.
    unsafe fn all_gather_async(&self, region: Region) -> Result<Work>;

    /// Broadcast in place from `root`.
    ///
    /// # Safety
    /// See the trait's contract.
    unsafe fn broadcast_async(&self, region: Region, root: usize) -> Result<Work>;

    /// All-to-all: `send` and `recv` each hold `world_size` equal chunks of `count / world_size`
    /// elements; chunk `j` of this rank's `send` goes to rank `j`, and chunk `i` of `recv` comes
    /// from rank `i` (chunk `rank` is copied locally). Both regions have the same element type
    /// (any, u8 included) and count, the count is divisible by the group size, and the regions do
    /// not overlap. `send` is only read.
    ///
    /// # Safety
    /// See the trait's contract; it applies to both regions.
    unsafe fn all_to_all_async(&self, send: Region, recv: Region) -> Result<Work>;

    /// Sends the region to `peer` (which receives with a region of the same size).
    ///
    /// # Safety
    /// See the trait's contract (the region is only read).
    unsafe fn send_async(&self, region: Region, peer: usize) -> Result<Work>;

    /// Receives from `peer` into the region.
    ///
    /// # Safety
    /// See the trait's contract.
    unsafe fn recv_async(&self, region: Region, peer: usize) -> Result<Work>;

    /// Runs the sends and receives of `ops` together and completes when all are done, so
    /// transfers that would wait on each other as blocking calls (a ring, two ranks sending to
    /// each other) cannot deadlock (`torch.distributed.batch_isend_irecv`, an NCCL group). Between
    /// one pair of ranks, messages match in the order they are sent and received, within the
    /// batch and across plain `send`/`recv`; a batch's send may meet a plain `recv` on the peer.
    ///
    /// # Safety
    /// See the trait's contract; it applies to every region (sends' are only read). No region
    /// may overlap a receive's.
    unsafe fn p2p_batch_async(&self, ops: &[P2p]) -> Result<Work>;

    /// Completes once every rank of the group has submitted its barrier.
    fn barrier_async(&self) -> Result<Work>;

    /// Creates a sub-group of `ranks` (ranks of this group). Every rank of this group must call
    /// it, in the same order relative to other `new_group` calls; members get the sub-group (its
    /// ranks numbered in ascending order of `ranks`), the others `None`. Sub-groups share this
    /// communicator's thread, so their operations are ordered with this group's.
    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn Communicator>>>;
}

/// Elements `[start, end)` of shard `shard` when `count` elements are cut into `n` shards: the
/// shards differ in length by at most one element, longer ones last.
pub fn shard_range(count: usize, n: usize, shard: usize) -> std::ops::Range<usize> {
    let start = (count as u128 * shard as u128 / n as u128) as usize;
    let end = (count as u128 * (shard as u128 + 1) / n as u128) as usize;
    start..end
}

/// Safe, blocking forms of the [`Communicator`] operations over slices; they wait before
/// returning, so the borrow covers the whole operation.
pub trait CommunicatorExt: Communicator {
    /// All-reduce `buf` in place.
    fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        // SAFETY: `buf` is borrowed mutably until `wait` returns.
        unsafe { self.all_reduce_async(Region::of(buf), op)? }.wait()
    }
    /// Reduce-scatter `buf` in place; this rank's shard is `shard_range(buf.len(), world, rank)`.
    fn reduce_scatter<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        // SAFETY: as above.
        unsafe { self.reduce_scatter_async(Region::of(buf), op)? }.wait()
    }
    /// All-gather `buf` in place from each rank's shard.
    fn all_gather<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        // SAFETY: as above.
        unsafe { self.all_gather_async(Region::of(buf))? }.wait()
    }
    /// Broadcast `buf` from `root`.
    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        // SAFETY: as above.
        unsafe { self.broadcast_async(Region::of(buf), root)? }.wait()
    }
    /// All-to-all from `send` into `recv` (see [`Communicator::all_to_all_async`]): chunk `j` of
    /// `send` goes to rank `j`, chunk `i` of `recv` comes from rank `i`.
    fn all_to_all<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        let send = Region::new(send.as_ptr() as *mut u8, send.len(), T::DTYPE);
        // SAFETY: both slices are borrowed until `wait` returns (`send` shared, and only read;
        // `recv` exclusively, so the two cannot overlap).
        unsafe { self.all_to_all_async(send, Region::of(recv))? }.wait()
    }
    /// Send `buf` to `peer`.
    fn send<T: Element>(&self, buf: &[T], peer: usize) -> Result<()> {
        let region = Region::new(buf.as_ptr() as *mut u8, buf.len(), T::DTYPE);
        // SAFETY: `buf` is borrowed until `wait` returns, and a send only reads its region.
        unsafe { self.send_async(region, peer)? }.wait()
    }
    /// Receive into `buf` from `peer`.
    fn recv<T: Element>(&self, buf: &mut [T], peer: usize) -> Result<()> {
        // SAFETY: as above.
        unsafe { self.recv_async(Region::of(buf), peer)? }.wait()
    }
    /// Wait for every rank of the group.
    fn barrier(&self) -> Result<()> {
        self.barrier_async()?.wait()
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}

/// The handle type backends return (exposed to the feature modules).
#[allow(dead_code)] // used by the `mpi` and `nccl` features
pub(crate) fn process_group(
    worker: Arc<Worker>,
    rank: usize,
    size: usize,
    backend: &'static str,
) -> Box<dyn Communicator> {
    Box::new(ProcessGroup { worker, group: 0, rank, size, backend })
}

/// The handle every backend returns: a group id on a shared communication thread.
pub(crate) struct ProcessGroup {
    pub(crate) worker: Arc<Worker>,
    pub(crate) group: usize,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) backend: &'static str,
}

impl ProcessGroup {
    fn invalid(&self, op: &'static str, reason: String) -> CommError {
        CommError::InvalidArgument { rank: self.rank, op, reason }
    }

    fn check_reduce(&self, name: &'static str, region: &Region, op: ReduceOp) -> Result<()> {
        if op == ReduceOp::Avg && region.dtype() == DType::U8 {
            return Err(self.invalid(name, "avg is defined for floating-point types only, not u8".into()));
        }
        Ok(())
    }

    fn check_peer(&self, name: &'static str, peer: usize) -> Result<()> {
        if peer >= self.size || peer == self.rank {
            return Err(self.invalid(name, format!("peer {peer} must be another rank in 0..{}", self.size)));
        }
        Ok(())
    }
}

impl Communicator for ProcessGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.size
    }
    fn backend(&self) -> &'static str {
        self.backend
    }

    unsafe fn all_reduce_async(&self, region: Region, op: ReduceOp) -> Result<Work> {
        self.check_reduce("all_reduce", &region, op)?;
        self.worker.submit(self.group, Op::AllReduce { region, op })
    }

    unsafe fn reduce_scatter_async(&self, region: Region, op: ReduceOp) -> Result<Work> {
        self.check_reduce("reduce_scatter", &region, op)?;
        self.worker.submit(self.group, Op::ReduceScatter { region, op })
    }

    unsafe fn all_gather_async(&self, region: Region) -> Result<Work> {
        self.worker.submit(self.group, Op::AllGather { region })
    }

    unsafe fn broadcast_async(&self, region: Region, root: usize) -> Result<Work> {
        if root >= self.size {
            return Err(self.invalid("broadcast", format!("root {root} is not a rank in 0..{}", self.size)));
        }
        self.worker.submit(self.group, Op::Broadcast { region, root })
    }

    unsafe fn all_to_all_async(&self, send: Region, recv: Region) -> Result<Work> {
        let name = "all_to_all";
        if send.dtype() != recv.dtype() || send.count() != recv.count() {
            return Err(self.invalid(
                name,
                format!(
                    "send holds {} {} elements but recv holds {} {} elements; they must be alike",
                    send.count(),
                    send.dtype().name(),
                    recv.count(),
                    recv.dtype().name()
                ),
            ));
        }
        if !send.count().is_multiple_of(self.size) {
            return Err(
                self.invalid(name, format!("{} elements do not cut into {} equal chunks", send.count(), self.size))
            );
        }
        let (s, r) = (send.ptr() as usize, recv.ptr() as usize);
        if send.bytes() > 0 && s < r + recv.bytes() && r < s + send.bytes() {
            return Err(self.invalid(name, "the send and recv regions overlap".into()));
        }
        self.worker.submit(self.group, Op::AllToAll { send, recv })
    }

    unsafe fn send_async(&self, region: Region, peer: usize) -> Result<Work> {
        self.check_peer("send", peer)?;
        self.worker.submit(self.group, Op::Send { region, peer })
    }

    unsafe fn recv_async(&self, region: Region, peer: usize) -> Result<Work> {
        self.check_peer("recv", peer)?;
        self.worker.submit(self.group, Op::Recv { region, peer })
    }

    unsafe fn p2p_batch_async(&self, ops: &[P2p]) -> Result<Work> {
        let name = "p2p_batch";
        for op in ops {
            self.check_peer(name, op.peer())?;
        }
        for (i, a) in ops.iter().enumerate() {
            for b in ops.iter().skip(i + 1).filter(|b| !a.is_send() || !b.is_send()) {
                let (x, y) = (a.region(), b.region());
                let (p, q) = (x.ptr() as usize, y.ptr() as usize);
                if x.bytes() > 0 && y.bytes() > 0 && p < q + y.bytes() && q < p + x.bytes() {
                    return Err(self.invalid(name, "a receive's region overlaps another region of the batch".into()));
                }
            }
        }
        self.worker.submit(self.group, Op::Batch(ops.to_vec()))
    }

    fn barrier_async(&self) -> Result<Work> {
        self.worker.submit(self.group, Op::Barrier)
    }

    fn new_group(&self, ranks: &[usize]) -> Result<Option<Box<dyn Communicator>>> {
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.is_empty() || sorted.len() != ranks.len() || sorted.iter().any(|&r| r >= self.size) {
            return Err(
                self.invalid("new_group", format!("ranks {ranks:?} must be distinct ranks in 0..{}", self.size))
            );
        }
        let work = self.worker.submit(self.group, Op::NewGroup { ranks: sorted })?;
        let info = work.wait_outcome()?;
        Ok(info.map(|info| {
            Box::new(ProcessGroup {
                worker: self.worker.clone(),
                group: info.id,
                rank: info.rank,
                size: info.size,
                backend: info.backend.unwrap_or(self.backend),
            }) as Box<dyn Communicator>
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::shard_range;

    #[test]
    fn shards_cover_the_range_in_order() {
        for count in [0usize, 1, 2, 7, 10, 1001] {
            for n in 1..=5 {
                let mut next = 0;
                for shard in 0..n {
                    let range = shard_range(count, n, shard);
                    assert_eq!(range.start, next);
                    assert!(range.len() <= count / n + 1);
                    next = range.end;
                }
                assert_eq!(next, count);
            }
        }
    }
}
