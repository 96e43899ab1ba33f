//! The communication thread, its queue, and the [`Work`] handles it completes.
//!
//! Every process group of one communicator (the world and its sub-groups) shares one thread, which
//! runs operations strictly in submission order. Callers enqueue and get a [`Work`]; the thread
//! runs the backend's [`Engine`] and completes the handle. After the first failure the thread
//! refuses every later operation with [`CommError::Poisoned`], because the peers' message streams
//! are no longer in step.

use std::collections::VecDeque;
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

/// One transfer of a batch of point-to-point operations ([`crate::Communicator::p2p_batch_async`]).
#[derive(Debug, Clone, Copy)]
pub enum P2p {
    /// Sends the region to `peer`.
    Send { region: Region, peer: usize },
    /// Receives from `peer` into the region.
    Recv { region: Region, peer: usize },
}

impl P2p {
    pub fn region(&self) -> &Region {
        match self {
            P2p::Send { region, .. } | P2p::Recv { region, .. } => region,
        }
    }
    pub fn peer(&self) -> usize {
        match self {
            P2p::Send { peer, .. } | P2p::Recv { peer, .. } => *peer,
        }
    }
    pub fn is_send(&self) -> bool {
        matches!(self, P2p::Send { .. })
    }
}

/// One queued operation, as the engines see it (`Batch`: sends and receives that progress
/// together).
#[derive(Debug, Clone)]
pub(crate) enum Op {
    AllReduce { region: Region, op: ReduceOp },
    ReduceScatter { region: Region, op: ReduceOp },
    AllGather { region: Region },
    Broadcast { region: Region, root: usize },
    AllToAll { send: Region, recv: Region },
    Send { region: Region, peer: usize },
    Recv { region: Region, peer: usize },
    Batch(Vec<P2p>),
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
            Op::AllToAll { .. } => "all_to_all",
            Op::Send { .. } => "send",
            Op::Recv { .. } => "recv",
            Op::Batch(_) => "p2p_batch",
            Op::Barrier => "barrier",
            Op::NewGroup { .. } => "new_group",
        }
    }
}

/// A message's kind, in the header of every shm slot and tcp message, so ranks that disagree on
/// the call sequence get an error instead of garbage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
    Broadcast = 4,
    Send = 5,
    Barrier = 6,
    AllToAll = 7,
    /// tcp only: the sender gave up because the rank in the byte count was lost.
    Abort = 0xAB,
}

/// A new sub-group as the engine registered it: its id on the thread, this rank in it, its size.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupInfo {
    pub id: usize,
    pub rank: usize,
    pub size: usize,
    /// What moves the new group's bytes when that differs from the parent's (`tcp` gives a group
    /// inside one node to `shm`); `None` keeps the parent's name.
    pub backend: Option<&'static str>,
}

/// A backend's executor. It lives on the communication thread; engines whose `any_thread` is
/// true may also be run by a caller that waits on a `Work` (see [`Work::wait`]).
pub(crate) trait Engine: Send {
    /// Runs one operation on group `group` (0 is the world). `NewGroup` returns the new group, or
    /// `None` on a rank that is not a member; every other operation returns `None`.
    fn execute(&mut self, group: usize, op: &Op) -> Result<Option<GroupInfo>>;

    /// Whether any thread may run operations (shm), or only the communication thread (MPI and
    /// CUDA tie their state to one thread).
    fn any_thread(&self) -> bool {
        false
    }
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

    fn is_done(&self) -> bool {
        self.outcome.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }
}

struct Job {
    group: usize,
    op: Op,
    state: Arc<WorkState>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// The engine and the first failure, behind the lock that whoever runs operations holds.
struct Exec {
    engine: Box<dyn Engine>,
    poisoned: Option<CommError>,
}

impl Exec {
    fn run(&mut self, job: Job) {
        let outcome = match &self.poisoned {
            Some(err) => Err(CommError::Poisoned(Box::new(err.clone()))),
            None => {
                let outcome = self.engine.execute(job.group, &job.op);
                if let Err(err) = &outcome {
                    // Argument errors are caught before queueing; anything failing here may leave
                    // the peers' streams out of step.
                    self.poisoned = Some(err.clone());
                }
                outcome
            }
        };
        job.state.complete(outcome);
    }
}

struct Shared {
    rank: usize,
    queue: Mutex<Queue>,
    queued: Condvar,
    exec: Mutex<Option<Exec>>,
    any_thread: bool,
}

impl Shared {
    fn lock_queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs queued jobs in order, holding `exec`, until the queue is empty or `until` is done.
    fn run_pending(&self, exec: &mut Exec, until: Option<&WorkState>) {
        loop {
            if until.is_some_and(WorkState::is_done) {
                return;
            }
            let Some(job) = self.lock_queue().jobs.pop_front() else { return };
            exec.run(job);
        }
    }
}

/// A handle on a submitted operation. Dropping it waits for the operation to finish, so a region
/// handed to an `*_async` call is never written after the handle is gone.
#[must_use = "an operation's failure is only reported by waiting on its Work"]
pub struct Work {
    state: Arc<WorkState>,
    shared: Arc<Shared>,
    op: &'static str,
}

impl Work {
    /// Blocks until the operation has finished and returns its outcome. Every wait inside the
    /// operation is bounded by the communicator's `timeout_s`, so this returns. With the `shm`
    /// backend a waiting caller runs its queued operation (and those before it) itself when the
    /// communication thread has not started it yet, which saves two thread wake-ups per call.
    pub fn wait(self) -> Result<()> {
        self.wait_outcome().map(|_| ())
    }

    /// Waits at most `timeout`: `Ok(true)` when the operation finished well, `Ok(false)` when it
    /// is still running, `Err` when it failed. It never runs the operation itself.
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
        self.state.is_done()
    }

    /// The operation's name (`all_reduce`, ...).
    pub fn op(&self) -> &'static str {
        self.op
    }

    pub(crate) fn wait_outcome(&self) -> Outcome {
        loop {
            if self.shared.any_thread {
                // Run it here if nobody is running operations; order is kept because only the
                // queue's head is ever taken, under the same lock the thread takes.
                if let Ok(mut exec) = self.shared.exec.try_lock() {
                    if let Some(exec) = exec.as_mut() {
                        self.shared.run_pending(exec, Some(&self.state));
                    }
                }
            }
            let guard = self.state.outcome.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(outcome) = guard.as_ref() {
                return outcome.clone();
            }
            // Someone else runs operations: the thread notifies on completion; another caller
            // may stop before ours, so look again after a while.
            let slice = if self.shared.any_thread { Duration::from_millis(1) } else { Duration::from_secs(1) };
            let (guard, _) = self.state.done.wait_timeout(guard, slice).unwrap_or_else(|e| e.into_inner());
            if let Some(outcome) = guard.as_ref() {
                return outcome.clone();
            }
        }
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // The region must not be written after the handle is gone: wait for the operation.
        let _ = self.wait_outcome();
    }
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work").field("op", &self.op).field("done", &self.is_done()).finish()
    }
}

/// The communication thread of one communicator and its queue.
pub(crate) struct Worker {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Worker {
    /// Starts the thread and builds the engine on it (MPI wants its calls on the thread that
    /// initialized it). Returns once the engine is built, or its construction error.
    pub(crate) fn spawn<F>(rank: usize, name: &str, make_engine: F) -> Result<Arc<Worker>>
    where
        F: FnOnce() -> Result<Box<dyn Engine>> + Send + 'static,
    {
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<bool>>(1);
        let shared_slot: Arc<Mutex<Option<Arc<Shared>>>> = Arc::new(Mutex::new(None));
        let slot = shared_slot.clone();
        let thread = std::thread::Builder::new()
            .name(format!("stoke-comm-{name}-{rank}"))
            .spawn(move || {
                let engine = match make_engine() {
                    Ok(engine) => engine,
                    Err(err) => {
                        let _ = ready_tx.send(Err(err));
                        return;
                    }
                };
                let shared = Arc::new(Shared {
                    rank,
                    queue: Mutex::new(Queue::default()),
                    queued: Condvar::new(),
                    any_thread: engine.any_thread(),
                    exec: Mutex::new(Some(Exec { engine, poisoned: None })),
                });
                *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(shared.clone());
                let _ = ready_tx.send(Ok(true));
                loop {
                    {
                        let mut queue = shared.lock_queue();
                        while queue.jobs.is_empty() && !queue.closed {
                            queue = shared.queued.wait(queue).unwrap_or_else(|e| e.into_inner());
                        }
                        if queue.jobs.is_empty() && queue.closed {
                            break;
                        }
                    }
                    let mut exec = shared.exec.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(exec) = exec.as_mut() {
                        shared.run_pending(exec, None);
                    }
                }
                // Tear the engine down on this thread (MPI finalizes where it initialized).
                let exec = shared.exec.lock().unwrap_or_else(|e| e.into_inner()).take();
                drop(exec);
            })
            .map_err(|e| CommError::Backend { backend: "thread", op: "spawn", rank, reason: e.to_string() })?;
        match ready_rx.recv() {
            Ok(Ok(_)) => {}
            Ok(Err(err)) => {
                let _ = thread.join();
                return Err(err);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(CommError::WorkerGone { rank });
            }
        }
        let shared =
            shared_slot.lock().unwrap_or_else(|e| e.into_inner()).take().ok_or(CommError::WorkerGone { rank })?;
        Ok(Arc::new(Worker { shared, thread: Mutex::new(Some(thread)) }))
    }

    pub(crate) fn submit(&self, group: usize, op: Op) -> Result<Work> {
        let name = op.name();
        let state = Arc::new(WorkState::default());
        {
            let mut queue = self.shared.lock_queue();
            if queue.closed {
                return Err(CommError::WorkerGone { rank: self.shared.rank });
            }
            queue.jobs.push_back(Job { group, op, state: state.clone() });
        }
        self.shared.queued.notify_one();
        Ok(Work { state, shared: self.shared.clone(), op: name })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing the queue lets the thread finish what is queued (each wait is bounded) and exit.
        self.shared.lock_queue().closed = true;
        self.shared.queued.notify_all();
        if let Some(thread) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = thread.join();
        }
    }
}
