//! The collectives of a group that spans nodes, over one TCP link per pair of members.
//!
//! - all-reduce: up to 16 KiB, every rank sends its buffer to every other and sums them in rank
//!   order; above, a reduce-scatter ring then an all-gather ring, one message per shard and step;
//!   the receiver reduces the payload as it arrives, a scratch buffer at a time.
//! - reduce-scatter and all-gather: one half of that ring, with the shards of `shard_range`.
//! - broadcast: the root writes to every other member. All-to-all: at step `s` every rank sends
//!   to `rank + s` while it receives from `rank - s`. A batch of sends and receives: a thread per
//!   destination sends while the caller's thread receives.
//!
//! Whenever a rank sends a message of more than `INLINE_BYTES` while it receives one, the send
//! runs on a scoped thread: both sides of a pair may write at once, and a message larger than the
//! socket buffers would otherwise leave both blocked in `write`.

use std::time::Duration;

use crate::api::shard_range;
use crate::dtype::{self, ReduceOp};
use crate::error::{CommError, Result};
use crate::work::{Kind, P2p, Region};

use super::wire::{Ctx, Inbound, Link};

/// Messages up to this size are written before the matching receive starts: the peer's socket
/// buffers (far larger on any Linux) take them without the peer reading.
const INLINE_BYTES: usize = 16 << 10;

pub(super) struct Mesh {
    /// By group rank; `None` at this rank's own place.
    links: Vec<Option<Link>>,
    /// Group rank -> world rank.
    pub world_ranks: Vec<usize>,
    pub rank: usize,
    pub size: usize,
    timeout_s: f64,
    scratch: Vec<u8>,
}

impl Mesh {
    pub(super) fn new(links: Vec<Option<Link>>, world_ranks: Vec<usize>, rank: usize, timeout: Duration) -> Mesh {
        let size = world_ranks.len();
        debug_assert_eq!(links.len(), size);
        Mesh { links, world_ranks, rank, size, timeout_s: timeout.as_secs_f64(), scratch: Vec::new() }
    }

    pub(super) fn links(&self) -> impl Iterator<Item = &Link> {
        self.links.iter().flatten()
    }

    fn ctx(&self, op: &'static str) -> Ctx {
        Ctx { rank: self.world_ranks[self.rank], op, timeout_s: self.timeout_s }
    }

    fn link(&self, peer: usize) -> &Link {
        self.links[peer].as_ref().expect("every other member has a link")
    }

    /// Sends `out` to `dst` while receiving the next message from `src` into `inbound`.
    fn exchange(
        &mut self,
        op: &'static str,
        kind: Kind,
        dst: usize,
        out: &[u8],
        src: usize,
        inbound: Inbound<'_>,
    ) -> Result<()> {
        let ctx = self.ctx(op);
        let Mesh { links, scratch, .. } = self;
        let to = links[dst].as_ref().expect("every other member has a link");
        let from = links[src].as_ref().expect("every other member has a link");
        let header = to.next_header(kind, out.len());
        if out.len() <= INLINE_BYTES {
            to.write_message(ctx, &header, out)?;
            return from.recv(ctx, kind, inbound, scratch);
        }
        std::thread::scope(|scope| {
            let sender = scope.spawn(|| to.write_message(ctx, &header, out));
            let received = from.recv(ctx, kind, inbound, scratch);
            let sent = sender.join().unwrap_or_else(|_| {
                Err(CommError::Backend {
                    backend: "tcp",
                    op,
                    rank: ctx.rank,
                    reason: format!("the thread sending to rank {} panicked", to.peer),
                })
            });
            received.and(sent)
        })
    }

    /// All-reduce: `all_reduce_direct` up to `INLINE_BYTES`, the ring above.
    pub(super) fn all_reduce(&mut self, op: &'static str, region: &Region, reduce: ReduceOp) -> Result<()> {
        if region.bytes() <= INLINE_BYTES {
            self.all_reduce_direct(op, region, reduce)
        } else {
            self.ring(op, region, Some(reduce), true)
        }
    }

    /// Small buffers: every rank sends its whole region to every other member and sums them all
    /// in rank order (`sum_inputs`), so every rank ends with the same bits: one round of messages
    /// where the ring takes 2(n - 1) (a 4 KiB all-reduce is latency, not bandwidth).
    fn all_reduce_direct(&mut self, op: &'static str, region: &Region, reduce: ReduceOp) -> Result<()> {
        let (n, rank, bytes, ptr) = (self.size, self.rank, region.bytes(), region.ptr());
        // SAFETY: the caller keeps the region valid and untouched until the operation completes;
        // it is only read until every message is in.
        let own = unsafe { std::slice::from_raw_parts(ptr as *const u8, bytes) };
        let mut inbox = vec![0u8; bytes * n];
        for step in 1..n {
            let (dst, src) = ((rank + step) % n, (rank + n - step) % n);
            let into = &mut inbox[src * bytes..(src + 1) * bytes];
            self.exchange(op, Kind::AllReduce, dst, own, src, Inbound::Copy(into))?;
        }
        let inputs: Vec<*const u8> =
            (0..n).map(|r| if r == rank { ptr as *const u8 } else { inbox[r * bytes..].as_ptr() }).collect();
        let divisor = (reduce == ReduceOp::Avg).then_some(n as f32);
        // SAFETY: every input holds `count` elements (the region, or a received copy of one of the
        // same size); the output aliases only our own input, which sum_inputs allows.
        unsafe { dtype::sum_inputs(region.dtype(), ptr, &inputs, region.count(), divisor) };
        Ok(())
    }

    /// The ring: with `reduce`, reduce-scatter steps; with `gather`, all-gather steps; both make
    /// an all-reduce. Shard `s` of the region is `shard_range(count, size, s)`.
    pub(super) fn ring(
        &mut self,
        op: &'static str,
        region: &Region,
        reduce: Option<ReduceOp>,
        gather: bool,
    ) -> Result<()> {
        let (n, rank) = (self.size, self.rank);
        let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
        let (dtype, count) = (region.dtype(), region.count());
        let size = dtype.size();
        let kind = match (reduce.is_some(), gather) {
            (true, true) => Kind::AllReduce,
            (true, false) => Kind::ReduceScatter,
            _ => Kind::AllGather,
        };
        let span = |shard: usize| {
            let range = shard_range(count, n, shard);
            (range.start * size, range.len() * size)
        };
        let base = region.ptr();
        // Reduce steps move a different shard out than in (they differ by one place in the ring), so
        // the two slices of one step never overlap.
        let reduce_step = |out_shard: usize, in_shard: usize, this: &mut Mesh| -> Result<()> {
            let ((out_at, out_len), (in_at, in_len)) = (span(out_shard), span(in_shard));
            debug_assert_ne!(out_shard, in_shard);
            // SAFETY: both spans lie in the region (shard_range stays within count), which the
            // caller keeps valid and untouched until the operation completes; they are disjoint.
            let (out, into) = unsafe {
                (
                    std::slice::from_raw_parts(base.add(out_at), out_len),
                    std::slice::from_raw_parts_mut(base.add(in_at), in_len),
                )
            };
            this.exchange(op, kind, right, out, left, Inbound::Reduce(into, dtype))
        };
        if let Some(reduce_op) = reduce {
            for step in 0..n - 1 {
                reduce_step((rank + 2 * n - step - 1) % n, (rank + 2 * n - step - 2) % n, self)?;
            }
            if reduce_op == ReduceOp::Avg {
                let (at, len) = span(rank);
                // SAFETY: our own shard lies in the region; nothing else touches it now.
                unsafe { dtype::divide(dtype, base.add(at), len / size, n as f32) };
            }
        }
        if gather {
            for step in 0..n - 1 {
                let (out_shard, in_shard) = ((rank + n - step) % n, (rank + 2 * n - step - 1) % n);
                let ((out_at, out_len), (in_at, in_len)) = (span(out_shard), span(in_shard));
                // SAFETY: as in the reduce steps; a plain copy.
                let (out, into) = unsafe {
                    (
                        std::slice::from_raw_parts(base.add(out_at), out_len),
                        std::slice::from_raw_parts_mut(base.add(in_at), in_len),
                    )
                };
                self.exchange(op, kind, right, out, left, Inbound::Copy(into))?;
            }
        }
        Ok(())
    }

    /// The root writes the region to every other member.
    pub(super) fn broadcast(&mut self, op: &'static str, region: &Region, root: usize) -> Result<()> {
        let ctx = self.ctx(op);
        if self.rank == root {
            // SAFETY: the region is valid for reads until the operation completes.
            let data = unsafe { std::slice::from_raw_parts(region.ptr() as *const u8, region.bytes()) };
            for peer in (0..self.size).filter(|&p| p != root) {
                self.link(peer).send(ctx, Kind::Broadcast, data)?;
            }
            return Ok(());
        }
        // SAFETY: the region is valid for writes and untouched by anyone else until completion.
        let into = unsafe { std::slice::from_raw_parts_mut(region.ptr(), region.bytes()) };
        let Mesh { links, scratch, .. } = self;
        links[root].as_ref().expect("the root is another member").recv(
            ctx,
            Kind::Broadcast,
            Inbound::Copy(into),
            scratch,
        )
    }

    /// Pairwise exchanges: at step `s` this rank sends its chunk for `rank + s` and receives the
    /// chunk of `rank - s`, so every send is matched by a receive in the same step.
    pub(super) fn all_to_all(&mut self, op: &'static str, send: &Region, recv: &Region) -> Result<()> {
        let (n, rank) = (self.size, self.rank);
        let chunk = send.bytes() / n;
        debug_assert_eq!(chunk * n, send.bytes(), "checked before queueing");
        // SAFETY: send and recv hold n chunks each and do not overlap (checked before queueing);
        // send is only read.
        let (from, to) = unsafe {
            (
                std::slice::from_raw_parts(send.ptr() as *const u8, send.bytes()),
                std::slice::from_raw_parts_mut(recv.ptr(), recv.bytes()),
            )
        };
        to[rank * chunk..(rank + 1) * chunk].copy_from_slice(&from[rank * chunk..(rank + 1) * chunk]);
        for step in 1..n {
            let (dst, src) = ((rank + step) % n, (rank + n - step) % n);
            let out = &from[dst * chunk..(dst + 1) * chunk];
            self.exchange(op, Kind::AllToAll, dst, out, src, Inbound::Copy(&mut to[src * chunk..(src + 1) * chunk]))?;
        }
        Ok(())
    }

    pub(super) fn send(&mut self, op: &'static str, region: &Region, peer: usize) -> Result<()> {
        // SAFETY: the region is valid for reads until the operation completes.
        let data = unsafe { std::slice::from_raw_parts(region.ptr() as *const u8, region.bytes()) };
        self.link(peer).send(self.ctx(op), Kind::Send, data)
    }

    pub(super) fn recv(&mut self, op: &'static str, region: &Region, peer: usize) -> Result<()> {
        let ctx = self.ctx(op);
        // SAFETY: the region is valid for writes and untouched by anyone else until completion.
        let into = unsafe { std::slice::from_raw_parts_mut(region.ptr(), region.bytes()) };
        let Mesh { links, scratch, .. } = self;
        links[peer].as_ref().expect("the peer is another member").recv(ctx, Kind::Send, Inbound::Copy(into), scratch)
    }

    /// A batch of sends and receives: a thread per destination sends that destination's messages
    /// in order while this thread receives in the batch's order, so no send waits on a receive.
    pub(super) fn batch(&mut self, op: &'static str, ops: &[P2p]) -> Result<()> {
        let ctx = self.ctx(op);
        let Mesh { links, scratch, .. } = self;
        let links = &*links;
        let mut dests: Vec<usize> = ops.iter().filter(|p| p.is_send()).map(P2p::peer).collect();
        dests.sort_unstable();
        dests.dedup();
        // (address, bytes) of each destination's messages: plain numbers cross to the threads.
        let outbound = |dst: usize| -> Vec<(usize, usize)> {
            let sends = ops.iter().filter(|p| p.is_send() && p.peer() == dst);
            sends.map(|p| (p.region().ptr() as usize, p.region().bytes())).collect()
        };
        std::thread::scope(|scope| {
            let senders: Vec<_> = dests
                .iter()
                .map(|&dst| {
                    let (link, messages) = (links[dst].as_ref().expect("the peer is another member"), outbound(dst));
                    scope.spawn(move || -> Result<()> {
                        for (ptr, bytes) in messages {
                            // SAFETY: a send's region is valid for reads until the batch completes.
                            let data = unsafe { std::slice::from_raw_parts(ptr as *const u8, bytes) };
                            link.send(ctx, Kind::Send, data)?;
                        }
                        Ok(())
                    })
                })
                .collect();
            let mut received = Ok(());
            for p in ops.iter().filter(|p| !p.is_send()) {
                let region = p.region();
                // SAFETY: a receive's region is valid for writes and untouched by anyone else until
                // completion (and overlaps no other region of the batch).
                let into = unsafe { std::slice::from_raw_parts_mut(region.ptr(), region.bytes()) };
                let link = links[p.peer()].as_ref().expect("the peer is another member");
                received = link.recv(ctx, Kind::Send, Inbound::Copy(into), scratch);
                if received.is_err() {
                    break;
                }
            }
            let mut sent = Ok(());
            for (sender, dst) in senders.into_iter().zip(&dests) {
                let outcome = sender.join().unwrap_or_else(|_| {
                    Err(CommError::Backend {
                        backend: "tcp",
                        op,
                        rank: ctx.rank,
                        reason: format!("the thread sending to rank {dst} panicked"),
                    })
                });
                sent = sent.and(outcome);
            }
            received.and(sent)
        })
    }

    /// An empty message to every other member, then one from each.
    pub(super) fn barrier(&mut self, op: &'static str) -> Result<()> {
        let ctx = self.ctx(op);
        for link in self.links.iter().flatten() {
            link.send(ctx, Kind::Barrier, &[])?;
        }
        let Mesh { links, scratch, .. } = self;
        for link in links.iter().flatten() {
            link.recv(ctx, Kind::Barrier, Inbound::Copy(&mut []), scratch)?;
        }
        Ok(())
    }
}
