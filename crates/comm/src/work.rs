//! The communication thread, its queue, and the [`Work`] handles it completes.
//!
//! Every process group of one communicator (the world and its sub-groups) shares one thread, which
//! runs operations strictly in submission order. Callers enqueue and get a [`Work`]; the thread
//! runs the backend's [`Engine`] and completes the handle. After the first failure the thread
//! refuses every later operation with [`CommError::Poisoned`], because the peers' message streams
//! are no longer in step.

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::dtype::{DType, ReduceOp};
use crate::error::{CommError, Result};

/// A caller-owned region of memory that an operation reads or writes in place: `count` elements
/// of `dtype` at `ptr` (host memory for `shm` and `mpi`, device memory for `nccl`).
#[derive(Debug, Clone, Copy)]
pub struct Region {
    ptr: *mut u8,
    count: usize,
    dtype: DType,
}

// SAFETY: a Region is an address and a length; whoever dereferences it (the communication thread)
// does so under the contract of the unsafe submission functions, which make the caller keep the
// memory valid and untouched until the Work completes.
unsafe impl Send for Region {}

impl Region {
    /// A region of `count` elements of `dtype` at `ptr`. Creating one is safe; handing it to an
    /// `*_async` function is where the contract applies.
    pub fn new(ptr: *mut u8, count: usize, dtype: DType) -> Region {
        Region { ptr, count, dtype }
    }

    /// The region covering a mutable slice.
    pub fn of<T: crate::Element>(slice: &mut [T]) -> Region {
        Region { ptr: slice.as_mut_ptr() as *mut u8, count: slice.len(), dtype: T::DTYPE }
    }

    /// Elements `[start, end)` of this region.
    ///
    /// # Panics
    /// When the range is out of bounds (a bug in the caller's bucket arithmetic).
    pub fn slice(&self, start: usize, end: usize) -> Region {
        assert!(start <= end && end <= self.count, "region slice {start}..{end} out of 0..{}", self.count);
        // SAFETY: start <= count, so the offset stays within (or one past) the region.
        Region { ptr: unsafe { self.ptr.add(start * self.dtype.size()) }, count: end - start, dtype: self.dtype }
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
    pub fn count(&self) -> usize {
        self.count
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }
}

/// One queued operation, as the engines see it.
#[derive(Debug, Clone)]
pub(crate) enum Op {
    AllReduce { region: Region, op: ReduceOp },
    ReduceScatter { region: Region, op: ReduceOp },
    AllGather { region: Region },
    Broadcast { region: Region, root: usize },
    Send { region: Region, peer: usize },
    Recv { region: Region, peer: usize },
    Barrier,
    NewGroup { ranks: Vec<usize> },
}

impl Op {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Op::AllReduce { .. } => "all_reduce",
            Op::ReduceScatter { .. } => "reduce_scatter",
            Op::AllGather { .. } => "all_gather",
            Op::Broadcast { .. } => "broadcast",
            Op::Send { .. } => "send",
            Op::Recv { .. } => "recv",
            Op::Barrier => "barrier",
            Op::NewGroup { .. } => "new_group",
        }
    }
}

/// A new sub-group as the engine registered it: its id on the thread, this rank in it, its size.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupInfo {
    pub id: usize,
    pub rank: usize,
    pub size: usize,
}

/// A backend's executor, owned by the communication thread.
pub(crate) trait Engine {
    /// Runs one operation on group `group` (0 is the world). `NewGroup` returns the new group, or
    /// `None` on a rank that is not a member; every other operation returns `None`.
    fn execute(&mut self, group: usize, op: &Op) -> Result<Option<GroupInfo>>;
}

type Outcome = Result<Option<GroupInfo>>;

#[derive(Default)]
struct WorkState {
    outcome: Mutex<Option<Outcome>>,
    done: Condvar,
}

impl WorkState {
    fn complete(&self, outcome: Outcome) {
        *self.outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some(outcome);
        self.done.notify_all();
    }
}

/// A handle on a submitted operation. Dropping it waits for the operation to finish, so a region
/// handed to an `*_async` call is never written after the handle is gone.
#[must_use = "an operation's failure is only reported by waiting on its Work"]
pub struct Work {
    state: Arc<WorkState>,
    op: &'static str,
}

impl Work {
    /// Blocks until the operation has finished and returns its outcome. Every wait inside the
    /// operation is bounded by the communicator's `timeout_s`, so this returns.
    pub fn wait(self) -> Result<()> {
        self.wait_outcome().map(|_| ())
    }

    /// Waits at most `timeout`: `Ok(true)` when the operation finished well, `Ok(false)` when it
    /// is still running, `Err` when it failed.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        let mut guard = self.state.outcome.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(outcome) = guard.as_ref() {
                return outcome.clone().map(|_| true);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            guard = self.state.done.wait_timeout(guard, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    /// Whether the operation has finished (well or not).
    pub fn is_done(&self) -> bool {
        self.state.outcome.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    /// The operation's name (`all_reduce`, ...).
    pub fn op(&self) -> &'static str {
        self.op
    }

    pub(crate) fn wait_outcome(&self) -> Outcome {
        let mut guard = self.state.outcome.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(outcome) = guard.as_ref() {
                return outcome.clone();
            }
            guard = self.state.done.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // The region must not be written after the handle is gone: wait for the thread.
        let _ = self.wait_outcome();
    }
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work").field("op", &self.op).field("done", &self.is_done()).finish()
    }
}

struct Job {
    group: usize,
    op: Op,
    state: Arc<WorkState>,
}

/// The communication thread of one communicator and its queue.
pub(crate) struct Worker {
    rank: usize,
    queue: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Worker {
    /// Starts the thread and builds the engine on it (MPI wants its calls on the thread that
    /// initialized it). Returns once the engine is built, or its construction error.
    pub(crate) fn spawn<F>(rank: usize, name: &str, make_engine: F) -> Result<Arc<Worker>>
    where
        F: FnOnce() -> Result<Box<dyn Engine>> + Send + 'static,
    {
        let (job_tx, job_rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<()>>(1);
        let thread = std::thread::Builder::new()
            .name(format!("stoke-comm-{name}-{rank}"))
            .spawn(move || {
                let mut engine = match make_engine() {
                    Ok(engine) => {
                        let _ = ready_tx.send(Ok(()));
                        engine
                    }
                    Err(err) => {
                        let _ = ready_tx.send(Err(err));
                        return;
                    }
                };
                let mut poisoned: Option<CommError> = None;
                while let Ok(job) = job_rx.recv() {
                    let outcome = match &poisoned {
                        Some(err) => Err(CommError::Poisoned(Box::new(err.clone()))),
                        None => {
                            let outcome = engine.execute(job.group, &job.op);
                            if let Err(err) = &outcome {
                                // Argument errors are caught before queueing; anything failing
                                // here may leave peers' streams out of step.
                                poisoned = Some(err.clone());
                            }
                            outcome
                        }
                    };
                    job.state.complete(outcome);
                }
                drop(engine);
            })
            .map_err(|e| CommError::Backend { backend: "thread", op: "spawn", rank, reason: e.to_string() })?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(err)) => {
                let _ = thread.join();
                return Err(err);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(CommError::WorkerGone { rank });
            }
        }
        Ok(Arc::new(Worker { rank, queue: Mutex::new(Some(job_tx)), thread: Mutex::new(Some(thread)) }))
    }

    pub(crate) fn submit(&self, group: usize, op: Op) -> Result<Work> {
        let name = op.name();
        let state = Arc::new(WorkState::default());
        let job = Job { group, op, state: state.clone() };
        let queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        match queue.as_ref() {
            Some(tx) => tx.send(job).map_err(|_| CommError::WorkerGone { rank: self.rank })?,
            None => return Err(CommError::WorkerGone { rank: self.rank }),
        }
        Ok(Work { state, op: name })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the queue lets the thread finish what is queued (each wait is bounded) and exit.
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(thread) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = thread.join();
        }
    }
}
