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
//!
//! When the next step's optimizer is the fused CPU AdamW over the same buffers, no thread copies:
//! `PendingCopy::for_optimizer` hands the rooms to that update as a `SaveMap`, and the update
//! streams each block's old values into its room just before it overwrites them. The update reads
//! those values anyway, so the checkpoint costs only the streaming stores and the CRC-32s folded
//! from the same registers (the README's checkpoint table has the figures).
//!
//! Whichever way the rooms are filled, their CRC-32s are computed on the way (`Checksums`) and
//! handed to the snapshot when it is finished, so the writer does not read the state again.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
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
    /// Each copied piece's (destination address, bytes, CRC-32), for the writer.
    checksums: Checksums,
}

/// CRC-32s of pieces of a snapshot's rooms, gathered from the threads that filled them:
/// (destination address, bytes, CRC-32), handed to `Snapshot::add_checksums`.
#[derive(Default)]
pub(crate) struct Checksums(Mutex<Vec<(usize, usize, u32)>>);

impl Checksums {
    /// Adds one thread's pieces (one lock for all of them).
    pub(crate) fn extend(&self, pieces: Vec<(usize, usize, u32)>) {
        if !pieces.is_empty() {
            self.0.lock().expect("a checksum list's lock is never poisoned").extend(pieces);
        }
    }

    fn take(&self) -> Vec<(usize, usize, u32)> {
        std::mem::take(&mut *self.0.lock().expect("a checksum list's lock is never poisoned"))
    }
}

impl CopyJob {
    /// Copies pieces until none is left, each with `threads` threads.
    fn drain(&self, threads: usize) {
        let mut checksums = Vec::new();
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(&(src, dst, len)) = self.pieces.get(i) else { break };
            // SAFETY: `PendingCopy::start` built each piece inside one source tensor's storage
            // (contiguous, CPU, `len` bytes in range) and inside the snapshot's room for it;
            // `PendingCopy` keeps both alive until the worker has been joined, no two pieces
            // overlap, and each piece is claimed by exactly one thread (the counter). The
            // caller of `start` promised that nothing writes the sources until `finish`.
            let (src, dst) = unsafe {
                (std::slice::from_raw_parts(src as *const u8, len), std::slice::from_raw_parts_mut(dst as *mut u8, len))
            };
            checksums.push((dst.as_ptr() as usize, len, stoke_ckpt::stream_copy_checksummed(dst, src, threads)));
        }
        self.checksums.extend(checksums);
    }
}

/// Whether `t` can be copied from another thread: a contiguous CPU fp32 tensor.
pub(crate) fn can_defer(t: &Tensor) -> bool {
    t.device() == Device::Cpu && t.kind() == Kind::Float && t.is_contiguous()
}

/// Where an update saves the values it is about to overwrite: the rooms of a pending snapshot by
/// the address of their source tensors.
pub(crate) struct SaveMap {
    /// (source address, bytes, destination address), sorted by source, never overlapping.
    segments: Vec<(usize, usize, usize)>,
    /// Bytes saved so far (by any thread).
    saved: AtomicUsize,
    /// Set once an update has saved every segment.
    complete: AtomicBool,
    /// CRC-32s of what was saved, for the writer.
    checksums: Checksums,
}

impl SaveMap {
    pub(crate) fn new(mut segments: Vec<(usize, usize, usize)>) -> SaveMap {
        segments.retain(|&(_, len, _)| len > 0);
        segments.sort_unstable();
        for pair in segments.windows(2) {
            assert!(pair[0].0 + pair[0].1 <= pair[1].0, "snapshot sources overlap");
        }
        SaveMap {
            segments,
            saved: AtomicUsize::new(0),
            complete: AtomicBool::new(false),
            checksums: Checksums::default(),
        }
    }

    fn total(&self) -> usize {
        self.segments.iter().map(|s| s.1).sum()
    }

    /// Streams the part of `[src, src + len)` that a segment covers into its room.
    ///
    /// # Safety
    /// `[src, src + len)` must be readable and nothing may write it during the call; no other
    /// thread may save the same bytes (the rooms are written without synchronization).
    pub(crate) unsafe fn save(&self, src: *const f32, len: usize) {
        let mut checksums = Vec::new();
        let (mut at, end) = (src as usize, src as usize + len * 4);
        while at < end {
            // The last segment starting at or before `at`.
            let i = self.segments.partition_point(|s| s.0 <= at);
            let covering = i.checked_sub(1).map(|i| self.segments[i]).filter(|s| at < s.0 + s.1);
            let Some((seg_src, seg_len, seg_dst)) = covering else {
                // Not a snapshot's byte: skip to the next segment.
                at = self.segments.get(i).map_or(end, |s| s.0.min(end));
                continue;
            };
            let n = (seg_src + seg_len).min(end) - at;
            // SAFETY: `[at, at + n)` lies in the caller's readable range and in one segment,
            // whose room (`PendingCopy` keeps the snapshot alive) is `seg_len` bytes from
            // `seg_dst`; the caller promised no other thread writes these bytes of the room.
            let (from, to) = unsafe {
                (
                    std::slice::from_raw_parts(at as *const u8, n),
                    std::slice::from_raw_parts_mut((seg_dst + (at - seg_src)) as *mut u8, n),
                )
            };
            checksums.push((to.as_ptr() as usize, n, stoke_ckpt::stream_copy_checksummed(to, from, 1)));
            self.saved.fetch_add(n, Ordering::Relaxed);
            at += n;
        }
        self.checksums.extend(checksums);
    }

    /// The room of `[src, src + len)` (f32 elements) when one segment holds all of it; the caller
    /// that fills it itself counts it with `count_saved`.
    pub(crate) fn room_of(&self, src: *const f32, len: usize) -> Option<*mut f32> {
        let (at, end) = (src as usize, src as usize + len * 4);
        let i = self.segments.partition_point(|s| s.0 <= at).checked_sub(1)?;
        let (seg_src, seg_len, seg_dst) = self.segments[i];
        (end <= seg_src + seg_len).then_some((seg_dst + (at - seg_src)) as *mut f32)
    }

    /// Counts bytes a caller saved through `room_of`.
    pub(crate) fn count_saved(&self, bytes: usize) {
        self.saved.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The CRC-32s of bytes a caller saved through `room_of`, (room address, bytes, CRC-32) each,
    /// computed from the values it saved.
    pub(crate) fn add_checksums(&self, checksums: Vec<(usize, usize, u32)>) {
        self.checksums.extend(checksums);
    }

    /// Called once the update that saved has finished on every thread: every room must then be
    /// filled (the update covered every source).
    pub(crate) fn mark_complete(&self) {
        let (saved, total) = (self.saved.load(Ordering::Relaxed), self.total());
        assert_eq!(saved, total, "the update saved {saved} of the snapshot's {total} bytes");
        self.complete.store(true, Ordering::Release);
    }

    /// The CRC-32s of what was saved: (room address, bytes, CRC-32) each, in no order.
    pub(crate) fn take_checksums(&self) -> Vec<(usize, usize, u32)> {
        self.checksums.take()
    }

    pub(crate) fn is_complete(&self) -> bool {
        self.complete.load(Ordering::Acquire)
    }
}

/// A snapshot whose tensors are being copied beside the step.
pub(crate) struct PendingCopy {
    snapshot: Option<Snapshot>,
    job: Arc<CopyJob>,
    worker: Option<JoinHandle<()>>,
    /// Set when the next optimizer update saves the sources itself (no worker then).
    save: Option<Arc<SaveMap>>,
    /// The sources, held so their storage outlives the copy.
    _sources: Vec<Tensor>,
    /// The checkpoint is the best evaluation so far (the writer protects it once submitted).
    pub best_eval: bool,
}

impl PendingCopy {
    /// Starts copying `sources` ((stem, name, tensor), each `can_defer`, whose rooms `snapshot`
    /// already holds) into the snapshot on a background thread. The caller must not write the
    /// sources until `finish` returns (or this is dropped).
    pub(crate) fn start(snapshot: Snapshot, sources: Vec<(String, String, Tensor)>, best_eval: bool) -> PendingCopy {
        PendingCopy::new(snapshot, sources, best_eval, false)
    }

    /// As `start`, but no thread copies: the next optimizer update saves the sources through
    /// `save_map` (or, when it does not run, `finish` copies them).
    pub(crate) fn for_optimizer(
        snapshot: Snapshot,
        sources: Vec<(String, String, Tensor)>,
        best_eval: bool,
    ) -> PendingCopy {
        PendingCopy::new(snapshot, sources, best_eval, true)
    }

    fn new(
        mut snapshot: Snapshot,
        sources: Vec<(String, String, Tensor)>,
        best_eval: bool,
        by_optimizer: bool,
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
        let job = Arc::new(CopyJob { pieces, next: AtomicUsize::new(0), checksums: Checksums::default() });
        if by_optimizer {
            let save = SaveMap::new(job.pieces.iter().map(|&(src, dst, len)| (src, len, dst)).collect());
            return PendingCopy {
                snapshot: Some(snapshot),
                job,
                worker: None,
                save: Some(Arc::new(save)),
                _sources: held,
                best_eval,
            };
        }
        let worker_job = Arc::clone(&job);
        // Without a thread the copy is done by `finish`: the same result, later.
        let worker = std::thread::Builder::new()
            .name("stoke-snapshot-copy".into())
            .spawn(move || {
                lowest_priority();
                worker_job.drain(1);
            })
            .ok();
        PendingCopy { snapshot: Some(snapshot), job, worker, save: None, _sources: held, best_eval }
    }

    /// The rooms for the next optimizer update to save into, when this copy waits for one.
    pub(crate) fn save_map(&self) -> Option<Arc<SaveMap>> {
        self.save.clone()
    }

    /// Copies what the worker has not, with `threads` threads, waits for the worker, and returns
    /// the filled snapshot.
    pub(crate) fn finish(mut self, threads: usize) -> Snapshot {
        let saved_by_update = self.save.as_ref().filter(|save| save.is_complete()).cloned();
        if saved_by_update.is_none() {
            self.job.drain(threads);
        }
        if let Some(worker) = self.worker.take() {
            // The worker only copies; a panic there is a bug worth surfacing.
            worker.join().expect("the snapshot copy thread panicked");
        }
        let mut snapshot = self.snapshot.take().expect("a pending copy holds its snapshot until finished");
        // The rooms were all taken before the copy began, so their addresses still hold; the
        // CRC-32s are those of whichever filled the rooms.
        match saved_by_update {
            Some(save) => snapshot.add_checksums(save.take_checksums()),
            None => snapshot.add_checksums(self.job.checksums.take()),
        }
        snapshot
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
