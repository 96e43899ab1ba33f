//! Asynchronous saves: the caller copies its state into a host buffer (the only part a training
//! step waits for), and a long-lived writer thread commits it through the store and applies
//! retention.
//!
//! There are `buffers` host buffers (two by default): one can be written while the next snapshot
//! is taken into the other. When every buffer is taken (a snapshot is due while the previous two
//! are still being written), `begin` blocks until one comes back: back-pressure, reported as the
//! snapshot's `waited` time. Buffers are kept and reused, so their memory is bounded by
//! `buffers` x the largest snapshot, faulted in once, and reported by `stats`.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::format::{check_size, FileSource, TensorRef};
use crate::hostbuf::HostBuf;
use crate::shards::PieceRecord;
use crate::store::Prepared;
use crate::{steps_to_delete_protecting, CheckpointStore, CkptError, DType, Mirror};

/// How a `CheckpointWriter` persists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WriterConfig {
    /// Persist on the writer thread (true) or inside `submit` (false: a synchronous save).
    pub background: bool,
    /// Host buffers for snapshots; at least 1. With `background`, 2 lets a snapshot be taken
    /// while the previous one is written.
    pub buffers: usize,
    /// Keep this many newest checkpoints after each commit; 0 keeps all.
    pub keep: usize,
    /// Also keep every checkpoint whose step is a multiple of this (0: none), outside `keep`.
    pub keep_every: u64,
}

impl Default for WriterConfig {
    fn default() -> Self {
        WriterConfig { background: true, buffers: 2, keep: 3, keep_every: 0 }
    }
}

struct Slot {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    start: usize,
    len: usize,
}

struct HostFile {
    stem: String,
    slots: Vec<Slot>,
    /// Grows to the largest snapshot and stays (page-aligned, faulted in once); `used` bytes of
    /// it are this snapshot's, its tensors back to back: the file's body as written.
    arena: HostBuf,
    used: usize,
    /// CRC-32s of pieces of the rooms that their filler computed (`Snapshot::add_checksums`):
    /// (offset in `arena`, bytes, CRC-32).
    known: Vec<(usize, usize, u32)>,
}

/// One checkpoint's state in a host buffer. Fill it with `tensor`, then hand it to
/// `CheckpointWriter::submit`.
pub struct Snapshot {
    id: usize,
    step: u64,
    meta: serde_json::Value,
    files: Vec<HostFile>,
    /// Pieces of logical tensors (a sharded checkpoint), in the order they were added.
    pieces: Vec<PieceRecord>,
    waited: Duration,
    /// Rooms taken now are not faulted in when taken (`fault_in_when_filled`).
    lazy: bool,
}

impl Snapshot {
    fn empty(id: usize) -> Snapshot {
        Snapshot {
            id,
            step: 0,
            meta: serde_json::Value::Null,
            files: Vec::new(),
            pieces: Vec::new(),
            waited: Duration::ZERO,
            lazy: false,
        }
    }

    fn reset(&mut self, step: u64) {
        self.step = step;
        self.lazy = false;
        self.meta = serde_json::Value::Null;
        self.pieces.clear();
        for file in &mut self.files {
            file.slots.clear();
            file.used = 0;
            file.known.clear();
        }
    }

    pub fn step(&self) -> u64 {
        self.step
    }

    /// How long `begin` waited for this buffer to come back from the writer (back-pressure).
    pub fn waited(&self) -> Duration {
        self.waited
    }

    pub fn set_meta(&mut self, meta: serde_json::Value) {
        self.meta = meta;
    }

    /// Rooms taken from now on that grow the buffer leave their new pages to be faulted in by
    /// whoever fills them (a copy beside the next step), instead of faulting them in when taken.
    pub fn fault_in_when_filled(&mut self) {
        self.lazy = true;
    }

    /// Room for tensor `name` of file `<stem>.safetensors`, to be filled with its little-endian
    /// bytes. Tensors are stored in the order they are added.
    pub fn tensor(&mut self, stem: &str, name: &str, dtype: DType, shape: &[usize]) -> &mut [u8] {
        let len = shape.iter().product::<usize>() * dtype.size();
        let file_idx = match self.files.iter().position(|f| f.stem == stem) {
            Some(idx) => idx,
            None => {
                self.files.push(HostFile {
                    stem: stem.into(),
                    slots: Vec::new(),
                    arena: HostBuf::new(),
                    used: 0,
                    known: Vec::new(),
                });
                self.files.len() - 1
            }
        };
        let file = &mut self.files[file_idx];
        let start = file.used;
        if file.arena.len() < start + len {
            // Only the first snapshots grow the buffer; later ones reuse its pages.
            let grown =
                if self.lazy { file.arena.grow_to_lazily(start + len) } else { file.arena.grow_to(start + len) };
            if let Err(e) = grown {
                panic!("cannot map {} bytes of host memory for a checkpoint snapshot: {e}", start + len);
            }
        }
        file.used += len;
        file.slots.push(Slot { name: name.into(), dtype, shape: shape.to_vec(), start, len });
        &mut file.arena[start..start + len]
    }

    /// Room for this rank's piece of logical tensor `name` (of file `stem`, shape `shape`):
    /// elements `range` of the flattened tensor, stored as a 1-D tensor under `name` in this
    /// rank's `<stem>-rank<r>.safetensors`. Only a sharded writer takes pieces.
    pub fn piece(
        &mut self,
        stem: &str,
        name: &str,
        dtype: DType,
        shape: &[usize],
        range: std::ops::Range<usize>,
    ) -> &mut [u8] {
        self.pieces.push(PieceRecord {
            stem: stem.into(),
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            start: range.start as u64,
            end: range.end as u64,
        });
        self.tensor(stem, name, dtype, &[range.end - range.start])
    }

    /// Every tensor's room, per file in the order added: (stem, name, bytes). Taking a room may
    /// move the file's earlier ones (its buffer grows), so a caller that fills the rooms later,
    /// or from other threads, takes them all first and then asks for them here.
    pub fn rooms_mut(&mut self) -> Vec<(&str, &str, &mut [u8])> {
        let mut rooms = Vec::new();
        for HostFile { stem, slots, arena, used, .. } in &mut self.files {
            let mut rest = &mut arena[..*used];
            for slot in slots.iter() {
                // Rooms lie back to back from the file's start (see `tensor`).
                let (room, tail) = std::mem::take(&mut rest).split_at_mut(slot.len);
                rest = tail;
                rooms.push((stem.as_str(), slot.name.as_str(), room));
            }
        }
        rooms
    }

    /// Records CRC-32s of bytes of the rooms that whoever filled them computed on the way
    /// (`stream_copy_checksummed`, or an optimizer update that saved into the rooms), so that the
    /// writer hashes only the bytes no piece covers. A piece is (the address of its first byte in
    /// a room, as `tensor`, `piece` or `rooms_mut` gave it, its length, its CRC-32). A room's
    /// address holds until a later room grows (and may move) the buffer, so record a piece right
    /// after filling it, or once every room is taken; the piece's bytes must not change after it.
    /// A piece outside this snapshot's rooms is ignored; of overlapping pieces the writer takes
    /// the first by address.
    pub fn add_checksums(&mut self, pieces: impl IntoIterator<Item = (usize, usize, u32)>) {
        for (address, len, crc) in pieces {
            let file = self.files.iter_mut().find(|f| {
                let base = f.arena.as_ptr() as usize;
                base <= address && address + len <= base + f.used
            });
            if let Some(file) = file {
                let offset = address - file.arena.as_ptr() as usize;
                file.known.push((offset, len, crc));
            }
        }
    }

    /// Bytes of tensor data in this snapshot.
    pub fn bytes(&self) -> usize {
        self.files.iter().map(|f| f.used).sum()
    }

    fn capacity(&self) -> usize {
        self.files.iter().map(|f| f.arena.resident()).sum()
    }

    fn sources(&self) -> Result<Vec<FileSource<'_>>, CkptError> {
        let mut out = Vec::with_capacity(self.files.len());
        for file in self.files.iter().filter(|f| !f.slots.is_empty()) {
            let mut tensors = Vec::with_capacity(file.slots.len());
            for slot in &file.slots {
                check_size(&slot.name, slot.dtype, &slot.shape, slot.len)?;
                tensors.push(TensorRef {
                    name: &slot.name,
                    dtype: slot.dtype,
                    shape: &slot.shape,
                    data: &file.arena[slot.start..slot.start + slot.len],
                });
            }
            let mut known = file.known.clone();
            known.sort_unstable();
            let mut end = 0;
            known.retain(|&(offset, len, _)| {
                let apart = offset >= end && len > 0;
                if apart {
                    end = offset + len;
                }
                apart
            });
            out.push(FileSource { stem: &file.stem, tensors, body: Some(&file.arena[..file.used]), known });
        }
        Ok(out)
    }
}

/// A committed checkpoint, as the writer reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct Committed {
    pub step: u64,
    pub path: PathBuf,
    /// Bytes of the files written (manifest excluded).
    pub bytes: u64,
    /// Seconds from the start of the write to the durable rename (retention excluded).
    pub write_s: f64,
    /// Steps deleted by retention after this commit.
    pub deleted: Vec<u64>,
}

/// Totals since the writer was created.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct WriterStats {
    /// Host buffers allocated so far (at most `WriterConfig::buffers`).
    pub buffers: usize,
    /// Host memory those buffers hold, in bytes: the bound on snapshot memory.
    pub host_bytes: usize,
    pub snapshots: u64,
    pub commits: u64,
    pub bytes_written: u64,
    /// Seconds `begin` waited for a free buffer (back-pressure).
    pub wait_s: f64,
    /// Seconds spent writing and committing (on the writer thread when in the background).
    pub write_s: f64,
    /// Host memory page-locked for a GPU's copies (`pin_host_buffers`), in bytes.
    pub pinned_bytes: usize,
}

/// A snapshot's buffer back from the writer, with its checkpoint (None: a rank's part of a sharded
/// one, which rank 0 commits).
type Returned = (Snapshot, Result<Option<Committed>, CkptError>);

/// Which prepared checkpoints may be published: those of steps up to `released`.
#[derive(Default)]
struct Gate {
    released: u64,
    closing: bool,
}

type SharedGate = std::sync::Arc<(Mutex<Gate>, Condvar)>;

/// Waits until `step` is released (true) or the writer closes without releasing it (false).
fn wait_released(gate: &SharedGate, step: u64) -> bool {
    let (lock, cvar) = &**gate;
    let mut state = lock.lock().expect("the gate's lock is never poisoned");
    while state.released < step && !state.closing {
        state = cvar.wait(state).expect("the gate's lock is never poisoned");
    }
    state.released >= step
}

/// Persists snapshots through a `CheckpointStore`, on a long-lived thread or inline.
///
/// A submitted snapshot is written and synced under a temporary name at once, but published as
/// `step-<n>` only after `release(n)`: the caller releases a step once everything it reports
/// about that step (its metrics line) is written, so a kill can never leave a checkpoint of a
/// step whose record is missing.
pub struct CheckpointWriter {
    store: CheckpointStore,
    config: WriterConfig,
    jobs: Option<mpsc::Sender<Snapshot>>,
    returns: mpsc::Receiver<Returned>,
    returns_tx: mpsc::Sender<Returned>,
    thread: Option<std::thread::JoinHandle<()>>,
    gate: SharedGate,
    /// Inline mode: snapshots written but not yet published.
    unpublished: VecDeque<(Snapshot, Prepared, f64)>,
    free: Vec<Snapshot>,
    capacities: Vec<usize>,
    /// Bytes pinned per host buffer.
    pinned: Vec<usize>,
    in_flight: usize,
    done: VecDeque<Committed>,
    failed: bool,
    stats: WriterStats,
    mirror: Option<Arc<Mirror>>,
    /// A step retention never deletes (0: none), shared with the writer thread.
    protected: Arc<AtomicU64>,
    /// Set by `pin_host_buffers`: every host buffer is page-locked through the CUDA runtime.
    pinner: Option<Arc<crate::pin::Pinner>>,
}

/// The retention policy the writer applies after each commit: the newest `keep`, the multiples
/// of `keep_every`, and the protected step.
#[derive(Clone)]
struct Retention {
    keep: usize,
    keep_every: u64,
    protected: Arc<AtomicU64>,
}

impl Retention {
    fn of(config: &WriterConfig, protected: &Arc<AtomicU64>) -> Retention {
        Retention { keep: config.keep, keep_every: config.keep_every, protected: Arc::clone(protected) }
    }

    fn to_delete(&self, steps: &[u64]) -> Vec<u64> {
        let protected = self.protected.load(Ordering::SeqCst);
        steps_to_delete_protecting(steps, self.keep, self.keep_every, (protected > 0).then_some(protected))
    }
}

impl CheckpointWriter {
    /// A writer into `store`; removes what a killed predecessor with the same writer id left.
    pub fn new(store: CheckpointStore, config: WriterConfig) -> Result<CheckpointWriter, CkptError> {
        CheckpointWriter::with_mirror(store, config, None)
    }

    /// A writer that also hands every checkpoint it commits to `mirror` (the second tier), right
    /// after publishing it and before retention may delete it.
    pub fn with_mirror(
        store: CheckpointStore,
        config: WriterConfig,
        mirror: Option<Arc<Mirror>>,
    ) -> Result<CheckpointWriter, CkptError> {
        if config.buffers == 0 {
            return Err(CkptError::Writer { message: "needs at least one host buffer".into() });
        }
        store.remove_own_leftovers()?;
        if store.shard_role().is_some_and(|role| role.rank == 0) {
            // Before any rank of this run can hand over a part (that needs a step, so rank 0).
            store.remove_all_parts()?;
        }
        let gate: SharedGate = std::sync::Arc::new((Mutex::new(Gate::default()), Condvar::new()));
        let (returns_tx, returns) = mpsc::channel::<Returned>();
        let protected = Arc::new(AtomicU64::new(0));
        let (jobs, thread) = if config.background {
            let (jobs_tx, jobs_rx) = mpsc::channel::<Snapshot>();
            let keep = Retention::of(&config, &protected);
            let (store, tx, gate) = (store.clone(), returns_tx.clone(), gate.clone());
            let mirror = mirror.clone();
            let thread = std::thread::Builder::new()
                .name("ckpt-writer".into())
                .spawn(move || {
                    lower_priority();
                    for snapshot in jobs_rx {
                        let result = persist_when_released(&store, &snapshot, &keep, &gate, mirror.as_deref());
                        if tx.send((snapshot, result)).is_err() {
                            break;
                        }
                    }
                })
                .map_err(|e| CkptError::Writer { message: format!("cannot start the writer thread: {e}") })?;
            (Some(jobs_tx), Some(thread))
        } else {
            (None, None)
        };
        Ok(CheckpointWriter {
            store,
            config,
            jobs,
            returns,
            returns_tx,
            thread,
            gate,
            unpublished: VecDeque::new(),
            free: Vec::new(),
            capacities: Vec::new(),
            pinned: Vec::new(),
            in_flight: 0,
            done: VecDeque::new(),
            failed: false,
            stats: WriterStats::default(),
            mirror,
            protected,
            pinner: None,
        })
    }

    /// Keeps `step`'s checkpoint through retention (for example the best by evaluation loss)
    /// until another step is protected; None protects nothing.
    pub fn protect(&mut self, step: Option<u64>) {
        self.protected.store(step.unwrap_or(0), Ordering::SeqCst);
    }

    /// Page-locks the host buffers (for a state on a CUDA device, so the copy into them is a
    /// DMA), through the CUDA runtime loaded now; an error when it cannot be loaded. A buffer is
    /// pinned when its snapshot is submitted (it grows only during the first snapshots), so
    /// every snapshot from the buffer's second use on is copied into pinned memory.
    pub fn pin_host_buffers(&mut self) -> Result<(), CkptError> {
        let pinner = crate::pin::Pinner::load()
            .map_err(|message| CkptError::Writer { message: format!("cannot pin the host buffers: {message}") })?;
        self.pinner = Some(pinner);
        Ok(())
    }

    pub fn store(&self) -> &CheckpointStore {
        &self.store
    }

    pub fn config(&self) -> &WriterConfig {
        &self.config
    }

    /// A host buffer for the snapshot of `step`; blocks while every buffer is being written.
    /// An error of an earlier background write is returned here (or by `committed`/`finish`).
    pub fn begin(&mut self, step: u64) -> Result<Snapshot, CkptError> {
        self.check()?;
        let start = Instant::now();
        self.collect(false)?;
        let mut snapshot = match self.free.pop() {
            Some(snapshot) => snapshot,
            None if self.capacities.len() < self.config.buffers => {
                self.capacities.push(0);
                self.pinned.push(0);
                self.stats.buffers = self.capacities.len();
                Snapshot::empty(self.capacities.len() - 1)
            }
            None if self.jobs.is_none() => {
                return Err(CkptError::Writer {
                    message: format!(
                        "every host buffer holds an unreleased snapshot (release step {step}'s predecessors first)"
                    ),
                })
            }
            None => {
                self.collect(true)?;
                self.free.pop().expect("a write came back with its buffer")
            }
        };
        snapshot.reset(step);
        snapshot.waited = start.elapsed();
        self.stats.wait_s += snapshot.waited.as_secs_f64();
        Ok(snapshot)
    }

    /// Persists `snapshot`: queued for the writer thread, or (not `background`) written and synced
    /// now. Either way it is published by `release` of its step.
    pub fn submit(&mut self, mut snapshot: Snapshot) -> Result<(), CkptError> {
        self.check()?;
        if let Some(pinner) = &self.pinner {
            for file in &mut snapshot.files {
                file.arena.pin_with(pinner).map_err(|message| CkptError::Writer {
                    message: format!("cannot pin the host buffer of {}.safetensors: {message}", file.stem),
                })?;
            }
            let pinned: usize = snapshot.files.iter().map(|f| f.arena.pinned_bytes()).sum();
            self.pinned[snapshot.id] = pinned;
            self.stats.pinned_bytes = self.pinned.iter().sum();
        }
        self.capacities[snapshot.id] = snapshot.capacity();
        self.stats.host_bytes = self.capacities.iter().sum();
        self.stats.snapshots += 1;
        self.in_flight += 1;
        match &self.jobs {
            Some(jobs) => jobs.send(snapshot).map_err(|_| self.gone()),
            None => {
                let start = Instant::now();
                match snapshot.sources().and_then(|sources| {
                    self.store.prepare(snapshot.step, &sources, &snapshot.pieces, snapshot.meta.clone(), &|| false)
                }) {
                    Ok(prepared) if prepared.part => {
                        self.returns_tx.send((snapshot, Ok(None))).expect("the receiver is ours");
                        self.collect(false)
                    }
                    Ok(prepared) => {
                        self.unpublished.push_back((snapshot, prepared, start.elapsed().as_secs_f64()));
                        Ok(())
                    }
                    Err(e) => {
                        self.returns_tx.send((snapshot, Err(e))).expect("the receiver is ours");
                        self.collect(false)
                    }
                }
            }
        }
    }

    /// Lets snapshots of steps up to `step` be published (the caller has recorded those steps).
    pub fn release(&mut self, step: u64) -> Result<(), CkptError> {
        self.check()?;
        {
            let (lock, cvar) = &*self.gate;
            let mut state = lock.lock().expect("the gate's lock is never poisoned");
            state.released = state.released.max(step);
            cvar.notify_all();
        }
        while self.unpublished.front().is_some_and(|(snapshot, _, _)| snapshot.step <= step) {
            let (snapshot, prepared, prepare_s) = self.unpublished.pop_front().expect("checked");
            let retention = Retention::of(&self.config, &self.protected);
            let result =
                publish(&self.store, &snapshot, prepared, prepare_s, &retention, self.mirror.as_deref()).map(Some);
            self.returns_tx.send((snapshot, result)).expect("the receiver is ours");
        }
        self.collect(false)
    }

    /// Checkpoints committed since the last call, oldest first; does not block.
    pub fn committed(&mut self) -> Result<Vec<Committed>, CkptError> {
        self.check()?;
        self.collect(false)?;
        Ok(self.done.drain(..).collect())
    }

    /// Releases every submitted snapshot and waits until all are committed; returns those not
    /// reported yet.
    pub fn finish(&mut self) -> Result<Vec<Committed>, CkptError> {
        self.release(u64::MAX)?;
        while self.in_flight > 0 {
            self.collect(true)?;
        }
        Ok(self.done.drain(..).collect())
    }

    pub fn stats(&self) -> WriterStats {
        self.stats
    }

    fn check(&self) -> Result<(), CkptError> {
        if self.failed {
            Err(CkptError::WriterFailed)
        } else {
            Ok(())
        }
    }

    fn gone(&self) -> CkptError {
        CkptError::Writer { message: "the writer thread ended unexpectedly".into() }
    }

    /// Takes back returned buffers and results: all that are ready, or (when `block`) at least one.
    fn collect(&mut self, block: bool) -> Result<(), CkptError> {
        let mut first = block;
        loop {
            let returned = if first {
                first = false;
                match self.returns.recv() {
                    Ok(r) => r,
                    Err(_) => {
                        self.failed = true;
                        return Err(self.join_error());
                    }
                }
            } else {
                match self.returns.try_recv() {
                    Ok(r) => r,
                    Err(_) => return Ok(()),
                }
            };
            let (snapshot, result) = returned;
            self.in_flight -= 1;
            self.free.push(snapshot);
            match result {
                Ok(None) => {}
                Ok(Some(committed)) => {
                    self.stats.commits += 1;
                    self.stats.bytes_written += committed.bytes;
                    self.stats.write_s += committed.write_s;
                    self.done.push_back(committed);
                }
                Err(e) => {
                    self.failed = true;
                    return Err(e);
                }
            }
        }
    }

    /// The writer thread's panic, if it panicked; otherwise a plain "gone" error.
    fn join_error(&mut self) -> CkptError {
        if let Some(thread) = self.thread.take() {
            if let Err(panic) = thread.join() {
                std::panic::resume_unwind(panic);
            }
        }
        self.gone()
    }
}

impl Drop for CheckpointWriter {
    fn drop(&mut self) {
        // Dropped without `finish` (the run failed): snapshots not released are abandoned, never
        // published; the thread ends after the queue.
        {
            let (lock, cvar) = &*self.gate;
            if let Ok(mut state) = lock.lock() {
                state.closing = true;
                cvar.notify_all();
            }
        }
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        for (_, prepared, _) in self.unpublished.drain(..) {
            let _ = self.store.abandon(prepared);
        }
    }
}

/// Niceness of the writer thread: it gets the cores when the training step leaves them idle,
/// and about a tenth of a core when the step keeps them all busy.
const WRITER_NICE: i32 = 10;

/// Lowers the calling thread's scheduling priority (Linux: niceness is per thread), so the
/// writer never takes the step's cores; failing to is harmless, so it is not an error.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: gettid and setpriority on our own thread id read and write no memory of ours.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, WRITER_NICE);
    }
}

/// On the writer thread: write and sync the snapshot, wait for its release, publish it.
fn persist_when_released(
    store: &CheckpointStore,
    snapshot: &Snapshot,
    keep: &Retention,
    gate: &SharedGate,
    mirror: Option<&Mirror>,
) -> Result<Option<Committed>, CkptError> {
    let start = Instant::now();
    let sources = snapshot.sources()?;
    let closing = || gate.0.lock().map_or(true, |state| state.closing);
    let prepared = store.prepare(snapshot.step, &sources, &snapshot.pieces, snapshot.meta.clone(), &closing)?;
    if prepared.part {
        return Ok(None);
    }
    let prepare_s = start.elapsed().as_secs_f64();
    if !wait_released(gate, snapshot.step) {
        store.abandon(prepared)?;
        return Err(CkptError::Writer { message: format!("step {} was never released; not published", snapshot.step) });
    }
    publish(store, snapshot, prepared, prepare_s, keep, mirror).map(Some)
}

/// Publishes a prepared snapshot, then applies retention.
fn publish(
    store: &CheckpointStore,
    snapshot: &Snapshot,
    prepared: Prepared,
    prepare_s: f64,
    keep: &Retention,
    mirror: Option<&Mirror>,
) -> Result<Committed, CkptError> {
    let start = Instant::now();
    let bytes = prepared.bytes;
    let path = store.publish(prepared)?;
    if let Some(mirror) = mirror {
        // The second tier never fails the first: the checkpoint is committed locally either way.
        if let Err(e) = mirror.submit(snapshot.step, &path) {
            eprintln!("stoke: step {} is not mirrored to {}: {e}", snapshot.step, mirror.url());
        }
    }
    let write_s = prepare_s + start.elapsed().as_secs_f64();
    let deleted = keep.to_delete(&store.list()?);
    for &old in &deleted {
        store.delete(old)?;
    }
    Ok(Committed { step: snapshot.step, path, bytes, write_s, deleted })
}

#[cfg(test)]
mod tests;
