//! A background checkpoint's copy into host memory, beside the next step.
//!
//! The state a checkpoint holds (parameters and optimizer state) is written only by the
//! optimizer. So the copy of step N's state does not have to finish within step N: it can run
//! while step N+1 loads its batch and runs its forward and backward, which only read it, and
//! must be done before step N+1's optimizer writes it. `PendingCopy::start` hands the copy to a
//! thread of the lowest priority (it takes the cores when the step leaves them idle);
//! `PendingCopy::finish`, called before the next optimizer step, copies what is left on the
//! calling thread with the intra-op threads and waits for the worker's last piece. Only that
//! wait is the step's stall; the rest shows as the copy's share of the cores, which the
//! checkpoint benchmark measures from whole steps' wall time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use stoke_ckpt::Snapshot;
use tch::{Device, Kind, Tensor};

/// Pieces the copy is cut into: small enough that the finishing thread rarely waits long for
/// the worker's piece in flight, large enough that claiming one costs nothing.
const PIECE: usize = 4 << 20;

/// The pieces to copy, claimed in order by whichever thread comes first.
struct CopyJob {
    /// (source address, destination address, bytes).
    pieces: Vec<(usize, usize, usize)>,
    next: AtomicUsize,
}

impl CopyJob {
    /// Copies pieces until none is left, each with `threads` threads.
    fn drain(&self, threads: usize) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(&(src, dst, len)) = self.pieces.get(i) else { return };
            // SAFETY: `PendingCopy::start` built each piece inside one source tensor's storage
            // (contiguous, CPU, `len` bytes in range) and inside the snapshot's room for it;
            // `PendingCopy` keeps both alive until the worker has been joined, no two pieces
            // overlap, and each piece is claimed by exactly one thread (the counter). The
            // caller of `start` promised that nothing writes the sources until `finish`.
            let (src, dst) = unsafe {
                (std::slice::from_raw_parts(src as *const u8, len), std::slice::from_raw_parts_mut(dst as *mut u8, len))
            };
            stoke_ckpt::stream_copy(dst, src, threads);
        }
    }
}

/// Whether `t` can be copied from another thread: a contiguous CPU fp32 tensor.
pub(crate) fn can_defer(t: &Tensor) -> bool {
    t.device() == Device::Cpu && t.kind() == Kind::Float && t.is_contiguous()
}

/// A snapshot whose tensors are being copied beside the step.
pub(crate) struct PendingCopy {
    snapshot: Option<Snapshot>,
    job: Arc<CopyJob>,
    worker: Option<JoinHandle<()>>,
    /// The sources, held so their storage outlives the copy.
    _sources: Vec<Tensor>,
    /// The checkpoint is the best evaluation so far (the writer protects it once submitted).
    pub best_eval: bool,
}

impl PendingCopy {
    /// Starts copying `sources` ((stem, name, tensor), each `can_defer`, whose rooms `snapshot`
    /// already holds) into the snapshot on a background thread. The caller must not write the
    /// sources until `finish` returns (or this is dropped).
    pub(crate) fn start(
        mut snapshot: Snapshot,
        sources: Vec<(String, String, Tensor)>,
        best_eval: bool,
    ) -> PendingCopy {
        let mut rooms: std::collections::HashMap<(String, String), (usize, usize)> = snapshot
            .rooms_mut()
            .into_iter()
            .map(|(stem, name, room)| ((stem.to_string(), name.to_string()), (room.as_mut_ptr() as usize, room.len())))
            .collect();
        let mut pieces = Vec::new();
        let mut held = Vec::with_capacity(sources.len());
        for (stem, name, tensor) in sources {
            let (dst, len) = rooms.remove(&(stem.clone(), name.clone())).expect("the snapshot holds a room per source");
            assert!(can_defer(&tensor), "{stem}/{name}: only contiguous CPU fp32 tensors are copied beside the step");
            assert_eq!(len, tensor.numel() * 4, "{stem}/{name}: the room fits the tensor");
            let src = tensor.data_ptr() as usize;
            let mut at = 0;
            while at < len {
                let n = PIECE.min(len - at);
                pieces.push((src + at, dst + at, n));
                at += n;
            }
            held.push(tensor);
        }
        let job = Arc::new(CopyJob { pieces, next: AtomicUsize::new(0) });
        let worker_job = Arc::clone(&job);
        // Without a thread the copy is done by `finish`: the same result, later.
        let worker = std::thread::Builder::new()
            .name("stoke-snapshot-copy".into())
            .spawn(move || {
                lowest_priority();
                worker_job.drain(1);
            })
            .ok();
        PendingCopy { snapshot: Some(snapshot), job, worker, _sources: held, best_eval }
    }

    /// Copies what the worker has not, with `threads` threads, waits for the worker, and returns
    /// the filled snapshot.
    pub(crate) fn finish(mut self, threads: usize) -> Snapshot {
        self.job.drain(threads);
        if let Some(worker) = self.worker.take() {
            // The worker only copies; a panic there is a bug worth surfacing.
            worker.join().expect("the snapshot copy thread panicked");
        }
        self.snapshot.take().expect("a pending copy holds its snapshot until finished")
    }
}

impl Drop for PendingCopy {
    /// An abandoned copy (the run failed before the next optimizer step) still waits for the
    /// worker, which writes into the snapshot this owns.
    fn drop(&mut self) {
        if let Some(worker) = self.worker.take() {
            self.job.next.fetch_add(self.job.pieces.len(), Ordering::Relaxed);
            let _ = worker.join();
        }
    }
}

/// The calling thread at the lowest priority (Linux: `SCHED_IDLE`, which runs only on a core
/// nothing else wants); failing to is harmless, so it is not an error.
fn lowest_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: sched_setscheduler on the calling thread (pid 0) with a parameter struct that
    // lives for the call; it reads that struct and writes none of our memory.
    unsafe {
        let param = libc::sched_param { sched_priority: 0 };
        libc::sched_setscheduler(0, libc::SCHED_IDLE, &param);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stoke_ckpt::{CheckpointStore, CheckpointWriter, DType, WriterConfig};

    #[test]
    fn a_deferred_copy_fills_every_room_and_an_abandoned_one_is_joined() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        // Two buffers: the abandoned snapshot's never comes back.
        let mut writer =
            CheckpointWriter::new(store, WriterConfig { background: true, buffers: 2, keep: 0, keep_every: 0 })
                .unwrap();
        // Rooms of several pieces and of none; the later rooms grow (and may move) the buffer.
        let sizes = [3 * PIECE / 4 + 13, 0, 2 * PIECE + 5, 1];
        let tensors: Vec<Tensor> =
            sizes.iter().map(|&n| Tensor::randn([n as i64], (Kind::Float, Device::Cpu))).collect();
        for abandon in [true, false] {
            let mut snapshot = writer.begin(1).unwrap();
            let mut sources = Vec::new();
            for (i, t) in tensors.iter().enumerate() {
                let name = format!("t{i}");
                snapshot.tensor(if i % 2 == 0 { "model" } else { "optim" }, &name, DType::F32, &[sizes[i]]);
                sources.push((if i % 2 == 0 { "model" } else { "optim" }.to_string(), name, t.shallow_clone()));
            }
            let pending = PendingCopy::start(snapshot, sources, false);
            if abandon {
                drop(pending);
                continue;
            }
            let mut snapshot = pending.finish(2);
            for (i, (_, _, room)) in snapshot.rooms_mut().into_iter().enumerate() {
                let index = [0, 2, 1, 3][i]; // the model file's rooms, then the optim file's
                let expected: Vec<u8> =
                    Vec::<f32>::try_from(&tensors[index]).unwrap().iter().flat_map(|v| v.to_le_bytes()).collect();
                assert!(room == expected.as_slice(), "room of t{index} differs");
            }
            writer.submit(snapshot).unwrap();
            writer.release(1).unwrap();
            let committed = writer.finish().unwrap();
            assert_eq!(committed.len(), 1);
        }
    }
}
