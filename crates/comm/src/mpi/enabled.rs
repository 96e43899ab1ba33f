//! Open MPI through the `mpi` crate's raw bindings. MPI is initialized on the communication
//! thread (thread level `funneled`: every MPI call happens there) and finalized when the last
//! handle is dropped. Sub-groups are `MPI_Comm_split`s of their parent.
//!
//! Failure handling is MPI's: communicators return errors instead of aborting
//! (`MPI_ERRORS_RETURN`), and a dead peer makes `mpirun` end the job; MPI has no per-call
//! timeout, so `timeout_s` does not apply here.

use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex};

use mpi::ffi;

use crate::api::shard_range;
use crate::config::{CommConfig, DistEnv};
use crate::dtype::{self, DType, ReduceOp};
use crate::error::{CommError, Result};
use crate::work::{Engine, GroupInfo, Op, P2p, Region, Worker};
use crate::Communicator;

/// The largest element count one MPI call takes (its counts are C ints).
const MAX_CALL_ELEMS: usize = 1 << 30;

struct MpiGroup {
    comm: ffi::MPI_Comm,
    rank: usize,
    size: usize,
}

struct MpiEngine {
    _universe: mpi::environment::Universe,
    groups: Vec<MpiGroup>,
    world_rank: usize,
    /// Open MPI's `MPI_IN_PLACE` (`(void *) 1`); other MPIs get a scratch copy instead.
    in_place: Option<*mut c_void>,
    scratch: Vec<u8>,
    add_bf16: ffi::MPI_Op,
    add_f16: ffi::MPI_Op,
}

// SAFETY: the engine holds MPI handles (raw pointers) that must only be used on the thread that
// initialized MPI; `any_thread` is false, so only the communication thread ever runs or drops it,
// and moving it into the shared slot there does not use it elsewhere.
unsafe impl Send for MpiEngine {}

unsafe extern "C" fn add_bf16(invec: *mut c_void, inout: *mut c_void, len: *mut c_int, _dt: *mut ffi::MPI_Datatype) {
    // SAFETY: MPI hands two buffers of `*len` u16 elements (the datatype this op is used with).
    unsafe { dtype::add_into(DType::BF16, inout as *mut u8, invec as *const u8, *len as usize) }
}

unsafe extern "C" fn add_f16(invec: *mut c_void, inout: *mut c_void, len: *mut c_int, _dt: *mut ffi::MPI_Datatype) {
    // SAFETY: as add_bf16.
    unsafe { dtype::add_into(DType::F16, inout as *mut u8, invec as *const u8, *len as usize) }
}

fn check(code: c_int, op: &'static str, rank: usize) -> Result<()> {
    if code == ffi::MPI_SUCCESS as c_int {
        return Ok(());
    }
    let mut text = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: the buffer has MPI_MAX_ERROR_STRING (256) bytes and more.
    unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr() as *mut _, &mut len) };
    text.truncate(len.max(0) as usize);
    Err(CommError::Backend { backend: "mpi", op, rank, reason: String::from_utf8_lossy(&text).into_owned() })
}

impl MpiEngine {
    fn new() -> Result<MpiEngine> {
        let unavailable = |reason: String| CommError::Unavailable { backend: "mpi", reason };
        let (universe, _level) = mpi::initialize_with_threading(mpi::Threading::Funneled)
            .ok_or_else(|| unavailable("MPI was already initialized in this process".into()))?;
        // SAFETY: MPI is initialized; these are its predefined handles.
        let world = unsafe { ffi::RSMPI_COMM_WORLD };
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: world is valid; out pointers are locals.
        unsafe {
            ffi::MPI_Comm_set_errhandler(world, ffi::RSMPI_ERRORS_RETURN);
            ffi::MPI_Comm_rank(world, &mut rank);
            ffi::MPI_Comm_size(world, &mut size);
        }
        let mut version = vec![0u8; 8192];
        let mut len: c_int = 0;
        // SAFETY: the buffer is larger than MPI_MAX_LIBRARY_VERSION_STRING.
        unsafe { ffi::MPI_Get_library_version(version.as_mut_ptr() as *mut _, &mut len) };
        let is_open_mpi = String::from_utf8_lossy(&version[..len.max(0) as usize]).contains("Open MPI");
        let (mut add_bf16_op, mut add_f16_op): (ffi::MPI_Op, ffi::MPI_Op) =
            // SAFETY: placeholders overwritten by MPI_Op_create below.
            unsafe { (ffi::RSMPI_SUM, ffi::RSMPI_SUM) };
        // SAFETY: the callbacks match MPI_User_function; commutative.
        unsafe {
            check(ffi::MPI_Op_create(Some(add_bf16), 1, &mut add_bf16_op), "init", rank as usize)?;
            check(ffi::MPI_Op_create(Some(add_f16), 1, &mut add_f16_op), "init", rank as usize)?;
        }
        // Open MPI's mpi.h: `#define MPI_IN_PLACE ((void *) 1)`; a sentinel, never dereferenced.
        #[allow(clippy::manual_dangling_ptr)]
        let open_mpi_in_place = 1usize as *mut c_void;
        Ok(MpiEngine {
            _universe: universe,
            groups: vec![MpiGroup { comm: world, rank: rank as usize, size: size as usize }],
            world_rank: rank as usize,
            in_place: is_open_mpi.then_some(open_mpi_in_place),
            scratch: Vec::new(),
            add_bf16: add_bf16_op,
            add_f16: add_f16_op,
        })
    }

    /// MPI datatype and reduction op for `dtype` (bf16/f16 travel as u16 with our f32-add op).
    fn types(&self, dtype: DType) -> (ffi::MPI_Datatype, ffi::MPI_Op) {
        // SAFETY: predefined handles, valid while MPI is initialized.
        unsafe {
            match dtype {
                DType::F32 => (ffi::RSMPI_FLOAT, ffi::RSMPI_SUM),
                DType::BF16 => (ffi::RSMPI_UINT16_T, self.add_bf16),
                DType::F16 => (ffi::RSMPI_UINT16_T, self.add_f16),
                DType::U8 => (ffi::RSMPI_UINT8_T, ffi::RSMPI_SUM),
            }
        }
    }

    fn all_reduce(&mut self, g: usize, ptr: *mut u8, count: usize, dtype: DType, op: ReduceOp) -> Result<()> {
        let (datatype, mpi_op) = self.types(dtype);
        let group = &self.groups[g];
        let size = dtype.size();
        let mut start = 0;
        while start < count {
            let n = (count - start).min(MAX_CALL_ELEMS);
            // SAFETY: start < count, so the piece lies in the caller's region.
            let piece = unsafe { ptr.add(start * size) };
            let code = match self.in_place {
                // SAFETY: MPI_IN_PLACE with the region as receive buffer: in-place all-reduce.
                Some(in_place) => unsafe {
                    ffi::MPI_Allreduce(in_place, piece as *mut c_void, n as c_int, datatype, mpi_op, group.comm)
                },
                None => {
                    self.scratch.clear();
                    // SAFETY: the piece holds n * size bytes.
                    self.scratch.extend_from_slice(unsafe { std::slice::from_raw_parts(piece, n * size) });
                    // SAFETY: distinct send (scratch) and receive (region) buffers of n elements.
                    unsafe {
                        ffi::MPI_Allreduce(
                            self.scratch.as_ptr() as *const c_void,
                            piece as *mut c_void,
                            n as c_int,
                            datatype,
                            mpi_op,
                            group.comm,
                        )
                    }
                }
            };
            check(code, "all_reduce", self.world_rank)?;
            start += n;
        }
        if op == ReduceOp::Avg {
            // SAFETY: the region holds count elements.
            unsafe { dtype::divide(dtype, ptr, count, group.size as f32) };
        }
        Ok(())
    }

    fn reduce_scatter(&mut self, g: usize, ptr: *mut u8, count: usize, dtype: DType, op: ReduceOp) -> Result<()> {
        let (datatype, mpi_op) = self.types(dtype);
        let group = &self.groups[g];
        let (n, rank, size) = (group.size, group.rank, dtype.size());
        if count > MAX_CALL_ELEMS {
            return Err(CommError::InvalidArgument {
                rank: self.world_rank,
                op: "reduce_scatter",
                reason: format!("the mpi backend takes at most {MAX_CALL_ELEMS} elements per reduce_scatter"),
            });
        }
        let counts: Vec<c_int> = (0..n).map(|s| shard_range(count, n, s).len() as c_int).collect();
        let mine = shard_range(count, n, rank);
        self.scratch.resize(mine.len() * size + 1, 0);
        // SAFETY: send = the whole region (count elements), receive = scratch with room for this
        // rank's shard; counts sum to count.
        let code = unsafe {
            ffi::MPI_Reduce_scatter(
                ptr as *const c_void,
                self.scratch.as_mut_ptr() as *mut c_void,
                counts.as_ptr(),
                datatype,
                mpi_op,
                group.comm,
            )
        };
        check(code, "reduce_scatter", self.world_rank)?;
        // SAFETY: the shard lies in the region; scratch holds mine.len() elements.
        unsafe { std::ptr::copy_nonoverlapping(self.scratch.as_ptr(), ptr.add(mine.start * size), mine.len() * size) };
        if op == ReduceOp::Avg {
            // SAFETY: as above.
            unsafe { dtype::divide(dtype, ptr.add(mine.start * size), mine.len(), n as f32) };
        }
        Ok(())
    }

    fn all_gather(&mut self, g: usize, ptr: *mut u8, count: usize, dtype: DType) -> Result<()> {
        let group = &self.groups[g];
        let n = group.size;
        if count > MAX_CALL_ELEMS {
            return Err(CommError::InvalidArgument {
                rank: self.world_rank,
                op: "all_gather",
                reason: format!("the mpi backend takes at most {MAX_CALL_ELEMS} elements per all_gather"),
            });
        }
        let (datatype, _) = self.types(dtype);
        let counts: Vec<c_int> = (0..n).map(|s| shard_range(count, n, s).len() as c_int).collect();
        let displs: Vec<c_int> = (0..n).map(|s| shard_range(count, n, s).start as c_int).collect();
        let mine = shard_range(count, n, group.rank);
        let size = dtype.size();
        let code = match self.in_place {
            // SAFETY: in-place all-gather: this rank's block already sits at its displacement.
            Some(in_place) => unsafe {
                ffi::MPI_Allgatherv(
                    in_place,
                    0,
                    datatype,
                    ptr as *mut c_void,
                    counts.as_ptr(),
                    displs.as_ptr(),
                    datatype,
                    group.comm,
                )
            },
            None => {
                self.scratch.clear();
                // SAFETY: this rank's shard lies in the region.
                self.scratch.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(ptr.add(mine.start * size), mine.len() * size)
                });
                // SAFETY: distinct send (scratch, this rank's shard) and receive (region) buffers.
                unsafe {
                    ffi::MPI_Allgatherv(
                        self.scratch.as_ptr() as *const c_void,
                        mine.len() as c_int,
                        datatype,
                        ptr as *mut c_void,
                        counts.as_ptr(),
                        displs.as_ptr(),
                        datatype,
                        group.comm,
                    )
                }
            }
        };
        check(code, "all_gather", self.world_rank)
    }

    fn all_to_all(&mut self, g: usize, send: &Region, recv: &Region) -> Result<()> {
        let group = &self.groups[g];
        let per_rank = send.count() / group.size;
        if per_rank > MAX_CALL_ELEMS {
            return Err(CommError::InvalidArgument {
                rank: self.world_rank,
                op: "all_to_all",
                reason: format!("the mpi backend takes at most {MAX_CALL_ELEMS} elements per rank in an all_to_all"),
            });
        }
        let (datatype, _) = self.types(send.dtype());
        // SAFETY: send and recv hold size * per_rank elements each and do not overlap (checked
        // before queueing); MPI only reads `send`.
        let code = unsafe {
            ffi::MPI_Alltoall(
                send.ptr() as *const c_void,
                per_rank as c_int,
                datatype,
                recv.ptr() as *mut c_void,
                per_rank as c_int,
                datatype,
                group.comm,
            )
        };
        check(code, "all_to_all", self.world_rank)
    }

    /// Runs `call(piece_ptr, piece_count)` over pieces of at most MAX_CALL_ELEMS elements.
    fn pieces(
        &self,
        ptr: *mut u8,
        count: usize,
        dtype: DType,
        op: &'static str,
        mut call: impl FnMut(*mut c_void, c_int) -> c_int,
    ) -> Result<()> {
        let mut start = 0;
        loop {
            let n = (count - start).min(MAX_CALL_ELEMS);
            // SAFETY: start <= count.
            let piece = unsafe { ptr.add(start * dtype.size()) };
            check(call(piece as *mut c_void, n as c_int), op, self.world_rank)?;
            start += n;
            if start >= count {
                return Ok(());
            }
        }
    }

    /// A batch of sends and receives: `MPI_Isend`/`MPI_Irecv` for each (each piece of one), then
    /// `MPI_Waitall`. MPI keeps a pair's messages in order (same communicator and tag).
    fn batch(&self, comm: ffi::MPI_Comm, ops: &[P2p]) -> Result<()> {
        let name = "p2p_batch";
        let mut requests: Vec<ffi::MPI_Request> = Vec::new();
        for p in ops {
            let (region, peer) = (p.region(), p.peer() as c_int);
            let (datatype, _) = self.types(region.dtype());
            // SAFETY (closure): each piece lies in the region, valid until the requests complete
            // below (the batch's contract); the request is an out pointer.
            self.pieces(region.ptr(), region.count(), region.dtype(), name, |ptr, n| unsafe {
                let mut request = ffi::RSMPI_REQUEST_NULL;
                let code = if p.is_send() {
                    ffi::MPI_Isend(ptr, n, datatype, peer, 0, comm, &mut request)
                } else {
                    ffi::MPI_Irecv(ptr, n, datatype, peer, 0, comm, &mut request)
                };
                requests.push(request);
                code
            })?;
        }
        // SAFETY: the requests were started above; statuses are ignored.
        let code =
            unsafe { ffi::MPI_Waitall(requests.len() as c_int, requests.as_mut_ptr(), ffi::RSMPI_STATUSES_IGNORE) };
        check(code, name, self.world_rank)
    }
}

impl Engine for MpiEngine {
    fn execute(&mut self, g: usize, op: &Op) -> Result<Option<GroupInfo>> {
        let comm = self.groups[g].comm;
        match op {
            Op::AllReduce { region, op } => self.all_reduce(g, region.ptr(), region.count(), region.dtype(), *op)?,
            Op::ReduceScatter { region, op } => {
                self.reduce_scatter(g, region.ptr(), region.count(), region.dtype(), *op)?
            }
            Op::AllGather { region } => self.all_gather(g, region.ptr(), region.count(), region.dtype())?,
            Op::Broadcast { region, root } => {
                let (datatype, _) = self.types(region.dtype());
                // SAFETY (closure): each piece lies in the region.
                self.pieces(region.ptr(), region.count(), region.dtype(), "broadcast", |p, n| unsafe {
                    ffi::MPI_Bcast(p, n, datatype, *root as c_int, comm)
                })?
            }
            Op::AllToAll { send, recv } => self.all_to_all(g, send, recv)?,
            Op::Send { region, peer } => {
                let (datatype, _) = self.types(region.dtype());
                // SAFETY (closure): each piece lies in the region, which MPI only reads.
                self.pieces(region.ptr(), region.count(), region.dtype(), "send", |p, n| unsafe {
                    ffi::MPI_Send(p, n, datatype, *peer as c_int, 0, comm)
                })?
            }
            Op::Recv { region, peer } => {
                let (datatype, _) = self.types(region.dtype());
                // SAFETY (closure): each piece lies in the region.
                self.pieces(region.ptr(), region.count(), region.dtype(), "recv", |p, n| unsafe {
                    ffi::MPI_Recv(p, n, datatype, *peer as c_int, 0, comm, ffi::RSMPI_STATUS_IGNORE)
                })?
            }
            Op::Batch(ops) => self.batch(comm, ops)?,
            // SAFETY: comm is a valid communicator.
            Op::Barrier => check(unsafe { ffi::MPI_Barrier(comm) }, "barrier", self.world_rank)?,
            Op::NewGroup { ranks } => {
                let parent_rank = self.groups[g].rank;
                let member = ranks.iter().position(|&r| r == parent_rank);
                // SAFETY: a predefined constant.
                let color = if member.is_some() { 0 } else { unsafe { ffi::RSMPI_UNDEFINED } };
                // SAFETY: a valid handle; MPI writes the new communicator.
                let mut child: ffi::MPI_Comm = unsafe { ffi::RSMPI_COMM_NULL };
                // SAFETY: collective over the parent, which every parent rank calls in order.
                check(
                    unsafe { ffi::MPI_Comm_split(comm, color, parent_rank as c_int, &mut child) },
                    "new_group",
                    self.world_rank,
                )?;
                let Some(rank) = member else { return Ok(None) };
                // SAFETY: child is a valid communicator for members.
                unsafe { ffi::MPI_Comm_set_errhandler(child, ffi::RSMPI_ERRORS_RETURN) };
                self.groups.push(MpiGroup { comm: child, rank, size: ranks.len() });
                return Ok(Some(GroupInfo { id: self.groups.len() - 1, rank, size: ranks.len(), backend: None }));
            }
        }
        Ok(None)
    }
}

impl Drop for MpiEngine {
    fn drop(&mut self) {
        for group in self.groups.drain(1..) {
            let mut comm = group.comm;
            // SAFETY: a communicator this engine created and no longer uses.
            unsafe { ffi::MPI_Comm_free(&mut comm) };
        }
        // SAFETY: ops this engine created.
        unsafe {
            ffi::MPI_Op_free(&mut self.add_bf16);
            ffi::MPI_Op_free(&mut self.add_f16);
        }
        // `_universe` drops after this and finalizes MPI.
    }
}

pub(crate) fn connect(_config: &CommConfig, env: &DistEnv) -> Result<Box<dyn Communicator>> {
    let shape: Arc<Mutex<(usize, usize)>> = Arc::new(Mutex::new((0, 0)));
    let shape_out = shape.clone();
    let worker: Arc<Worker> = Worker::spawn(env.rank, "mpi", move || {
        let engine = MpiEngine::new()?;
        *shape_out.lock().unwrap_or_else(|e| e.into_inner()) = (engine.groups[0].rank, engine.groups[0].size);
        Ok(Box::new(engine) as Box<dyn Engine>)
    })?;
    let (rank, size) = *shape.lock().unwrap_or_else(|e| e.into_inner());
    if size != env.world_size || rank != env.rank {
        return Err(CommError::Environment(format!(
            "MPI says rank {rank} of {size} but the launcher's variables say rank {} of {} \
             (start the mpi backend with mpirun, or srun with PMI)",
            env.rank, env.world_size
        )));
    }
    Ok(crate::api::process_group(worker, rank, size, "mpi"))
}
