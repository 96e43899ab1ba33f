//! The leaf of tensor parallelism (see `tensor_parallel`): how a parameter is cut ([`Split`]) and
//! the group of ranks one model is cut over, with the collectives its forward and backward need
//! ([`TensorGroup`]). It imports nothing of the model seam, which names both.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Instant;

use stoke_comm::{shard_range, CommError, Communicator, CommunicatorExt, DType, ReduceOp, Region};
use tch::{Kind, Tensor};

/// How a parameter is cut over the ranks of a tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Dimension 0 is `blocks` equal blocks (a fused q, k, v weight has 3), each cut into the
    /// ranks' shards by [`shard_range`]; a rank holds its shard of every block, in block order.
    Rows { blocks: i64 },
    /// The same along dimension 1 (a row-parallel matrix: its input columns).
    Cols { blocks: i64 },
}

impl Split {
    /// The dimension cut and its number of blocks; None when replicated.
    fn axis(self) -> Option<(usize, i64)> {
        match self {
            Split::Replicated => None,
            Split::Rows { blocks } => Some((0, blocks)),
            Split::Cols { blocks } => Some((1, blocks)),
        }
    }

    /// Rank `rank`'s part of `whole` (a new tensor, or `whole` itself when replicated).
    pub fn cut(self, whole: &Tensor, rank: usize, size: usize) -> Tensor {
        let Some((dim, blocks)) = self.axis() else { return whole.shallow_clone() };
        let block = whole.size()[dim] / blocks;
        let part = shard_range(block as usize, size, rank);
        let pieces: Vec<Tensor> =
            (0..blocks).map(|b| whole.narrow(dim as i64, b * block + part.start as i64, part.len() as i64)).collect();
        Tensor::cat(&pieces, dim as i64).contiguous()
    }

    /// The shape of rank `rank`'s part of a tensor of shape `whole`.
    pub fn local_shape(self, whole: &[i64], rank: usize, size: usize) -> Vec<i64> {
        let mut shape = whole.to_vec();
        let Some((dim, blocks)) = self.axis() else { return shape };
        shape[dim] = blocks * shard_range((whole[dim] / blocks) as usize, size, rank).len() as i64;
        shape
    }

    /// Whether the parameter is cut (its gradients are partial sums of the model's).
    pub fn is_split(self) -> bool {
        self != Split::Replicated
    }
}

/// The ranks one model is cut over, and the collectives its forward and backward need.
pub struct TensorGroup {
    comm: Box<dyn Communicator>,
    /// The first collective that failed inside a forward or backward, for the step hooks.
    failure: Mutex<Option<CommError>>,
    /// Nanoseconds spent in the group's collectives since `take_comm_ms` (all exposed: the
    /// model waits for each).
    comm_ns: AtomicU64,
    /// Sequence parallelism on: the model's blocks pass pieces of the sequence.
    sequence: AtomicBool,
}

impl std::fmt::Debug for TensorGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TensorGroup(rank {} of {})", self.rank(), self.size())
    }
}

impl TensorGroup {
    /// The group over `comm`'s ranks (a sub-group of the job: ranks that hold one model's parts).
    pub fn new(comm: Box<dyn Communicator>) -> Arc<TensorGroup> {
        Arc::new(TensorGroup {
            comm,
            failure: Mutex::new(None),
            comm_ns: AtomicU64::new(0),
            sequence: AtomicBool::new(false),
        })
    }

    /// Turns sequence parallelism on for sequences of `seq_len` tokens (a multiple of the size).
    pub fn enable_sequence(&self, seq_len: usize) -> Result<(), String> {
        if seq_len % self.size() != 0 {
            return Err(format!("model.seq_len = {seq_len} does not cut into dist.tensor = {} pieces", self.size()));
        }
        self.sequence.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Whether sequence parallelism is on.
    pub fn sequence(&self) -> bool {
        self.sequence.load(Ordering::Relaxed)
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn size(&self) -> usize {
        self.comm.world_size()
    }

    pub fn communicator(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    /// The first failure of a collective run inside the model, taken (None: none failed).
    pub fn take_failure(&self) -> Option<CommError> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Milliseconds the model waited on the group's collectives since the last call.
    pub fn take_comm_ms(&self) -> f64 {
        self.comm_ns.swap(0, Ordering::Relaxed) as f64 / 1e6
    }

    fn timed<T>(&self, op: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = op();
        self.comm_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        out
    }

    /// Submits a collective and waits for it, timed; a failure is kept (see the module doc).
    fn run(&self, submit: impl FnOnce() -> Result<stoke_comm::Work, CommError>) {
        if let Err(error) = self.timed(|| submit().and_then(|work| work.wait())) {
            self.fail(error);
        }
    }

    fn fail(&self, error: CommError) {
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        failure.get_or_insert(error);
    }

    /// The sum of `t` over the group, as a new tensor outside any graph (fp32, bf16 or fp16).
    /// After a failure the tensor is returned unreduced (see the module doc).
    pub fn all_reduce(&self, t: &Tensor) -> Tensor {
        let mut out = Tensor::empty(t.size(), (t.kind(), t.device()));
        tch::no_grad(|| out.copy_(t));
        if self.size() == 1 {
            return out;
        }
        let region = Region::new(out.data_ptr() as *mut u8, out.numel(), dtype_of(t.kind()));
        // SAFETY: `out` is a new contiguous tensor that nothing else can see until this returns,
        // and the work is waited for before it does.
        self.run(|| unsafe { self.comm.all_reduce_async(region, ReduceOp::Sum) });
        out
    }

    /// This rank's piece of `[batch, seq, ..]` `whole` (the same on every rank), detached.
    pub fn piece(&self, whole: &Tensor) -> Tensor {
        let n = self.size() as i64;
        let len = whole.size()[1] / n;
        whole.detach().narrow(1, self.rank() as i64 * len, len).contiguous()
    }

    /// Sequence parallelism's gather: every rank's `[batch, seq / n, ..]` piece joined along the
    /// sequence in rank order, as a new tensor outside any graph. After a failure the pieces not
    /// received read as zero (see the module doc).
    pub fn all_gather_seq(&self, piece: &Tensor) -> Tensor {
        let n = self.size() as i64;
        if n == 1 {
            return piece.detach().copy();
        }
        let piece = piece.detach().contiguous();
        let mut shape = piece.size();
        shape.insert(0, n);
        let all = Tensor::zeros(shape.as_slice(), (piece.kind(), piece.device()));
        tch::no_grad(|| all.get(self.rank() as i64).copy_(&piece));
        let region = Region::new(all.data_ptr() as *mut u8, all.numel(), dtype_of(all.kind()));
        // SAFETY: `all` is a new contiguous tensor that nothing else can see until this returns,
        // and the work is waited for before it does; its n equal pieces are the shards.
        self.run(|| unsafe { self.comm.all_gather_async(region) });
        // [n, batch, piece, ..] -> [batch, n x piece, ..]
        let mut whole = piece.size();
        whole[1] *= n;
        all.transpose(0, 1).contiguous().view(whole.as_slice())
    }

    /// Sequence parallelism's reduce-scatter: `[batch, seq, ..]` summed over the group, this
    /// rank's `[batch, seq / n, ..]` piece, as a new tensor outside any graph (unreduced after a
    /// failure).
    pub fn reduce_scatter_seq(&self, whole: &Tensor) -> Tensor {
        let n = self.size() as i64;
        let size = whole.size();
        let piece = size[1] / n;
        let mut split = vec![size[0], n, piece];
        split.extend_from_slice(&size[2..]);
        // [batch, n, piece, ..] -> [n, batch, piece, ..]: each rank's piece contiguous, in rank order.
        let all = whole.detach().reshape(split.as_slice()).transpose(0, 1).contiguous();
        if n > 1 {
            let region = Region::new(all.data_ptr() as *mut u8, all.numel(), dtype_of(all.kind()));
            // SAFETY: as in `all_gather_seq`; the other pieces are scratch afterwards.
            self.run(|| unsafe { self.comm.reduce_scatter_async(region, ReduceOp::Sum) });
        }
        // A copy: a view would keep the whole buffer alive as long as the piece.
        all.get(self.rank() as i64).copy()
    }

    /// `g`: the sum of `t` over the group forward, `t`'s own gradient backward.
    pub fn reduce_from_ranks(&self, t: &Tensor) -> Tensor {
        let sum = self.all_reduce(t);
        let detached = t.detach();
        sum + (t - detached)
    }

    /// The whole tensor from every rank's fp32 part `local`, cut by `split` (a checkpoint's
    /// tensor). Collective over the group; the result is in host memory.
    pub fn gather_whole(&self, split: Split, local: &Tensor) -> Result<Tensor, CommError> {
        let Some((dim, blocks)) = split.axis() else { return Ok(local.shallow_clone()) };
        let (n, rank) = (self.size(), self.rank());
        let local = local.detach().to_device(tch::Device::Cpu).to_kind(Kind::Float).contiguous();
        let shape = local.size();
        let mut extents = vec![0u8; 8 * n];
        extents[8 * rank..8 * rank + 8].copy_from_slice(&(shape[dim] as u64).to_le_bytes());
        self.comm.all_gather(&mut extents)?;
        let extents: Vec<i64> =
            extents.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as i64).collect();
        let across = local.numel() as i64 / shape[dim].max(1);
        let room = (extents.iter().copied().max().unwrap_or(0) * across) as usize;
        let mut all = vec![0f32; room * n];
        let mine = Vec::<f32>::try_from(local.view([-1])).expect("an fp32 part converts");
        all[room * rank..room * rank + mine.len()].copy_from_slice(&mine);
        self.comm.all_gather(&mut all)?;
        let parts: Vec<Tensor> = (0..n)
            .map(|r| {
                let mut part_shape = shape.clone();
                part_shape[dim] = extents[r];
                Tensor::from_slice(&all[room * r..room * r + (extents[r] * across) as usize])
                    .view(part_shape.as_slice())
            })
            .collect();
        // Block b of the whole is every rank's block b in rank order.
        let whole_blocks: Vec<Tensor> = (0..blocks)
            .flat_map(|b| {
                parts.iter().zip(&extents).map(move |(part, &extent)| {
                    let per_block = extent / blocks;
                    part.narrow(dim as i64, b * per_block, per_block)
                })
            })
            .collect();
        Ok(Tensor::cat(&whole_blocks, dim as i64))
    }

    /// The row-wise maximum over the group of `[rows]` fp32 values (no graph).
    pub(crate) fn all_max(&self, t: &Tensor) -> Tensor {
        let n = t.numel();
        if self.size() == 1 {
            return t.detach();
        }
        let mut gathered = vec![0f32; n * self.size()];
        let mine = Vec::<f32>::try_from(t.detach().to_kind(Kind::Float).to_device(tch::Device::Cpu).view([-1]))
            .expect("a row maximum converts to f32");
        gathered[n * self.rank()..n * (self.rank() + 1)].copy_from_slice(&mine);
        if let Err(error) = self.timed(|| self.comm.all_gather(&mut gathered)) {
            self.fail(error);
        }
        Tensor::from_slice(&gathered)
            .view([self.size() as i64, n as i64])
            .amax([0i64].as_slice(), false)
            .to_device(t.device())
    }
}

/// The element type of a tensor the group's collectives carry.
fn dtype_of(kind: Kind) -> DType {
    match kind {
        Kind::Float => DType::F32,
        Kind::BFloat16 => DType::BF16,
        Kind::Half => DType::F16,
        other => panic!("tensor-parallel collectives take fp32, bf16 or fp16, not {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_cut_blocks_by_rank_and_join_back_whole() {
        // A fused q, k, v weight of 3 blocks of 4 rows over 2 ranks: each rank holds rows 0-1 or
        // 2-3 of each block.
        let whole = Tensor::arange(24, (Kind::Float, tch::Device::Cpu)).view([12, 2]);
        let split = Split::Rows { blocks: 3 };
        let parts: Vec<Tensor> = (0..2).map(|r| split.cut(&whole, r, 2)).collect();
        assert_eq!(parts[0].size(), split.local_shape(&[12, 2], 0, 2));
        let rows = |t: &Tensor| Vec::<f32>::try_from(t.select(1, 0)).unwrap();
        assert_eq!(rows(&parts[0]), [0.0, 2.0, 8.0, 10.0, 16.0, 18.0]);
        assert_eq!(rows(&parts[1]), [4.0, 6.0, 12.0, 14.0, 20.0, 22.0]);
        let cols = Split::Cols { blocks: 1 };
        let joined = Tensor::cat(&[cols.cut(&whole.tr(), 0, 2), cols.cut(&whole.tr(), 1, 2)], 1);
        assert_eq!(joined.size(), [2, 12]);
        assert!(Split::Replicated.cut(&whole, 1, 2).equal(&whole));
        // Uneven vocabularies: the longer shard last, as everywhere shards are cut.
        let vocab = Tensor::arange(5, (Kind::Float, tch::Device::Cpu)).view([5, 1]);
        let rows = Split::Rows { blocks: 1 };
        assert_eq!((rows.cut(&vocab, 0, 2).size()[0], rows.cut(&vocab, 1, 2).size()[0]), (2, 3));
    }
}
