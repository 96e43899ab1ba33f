//! NCCL through cudarc, with the CUDA driver and NCCL loaded at run time. cudarc panics when a
//! library is missing, so `connect` probes both first and returns
//! [`CommError::Unavailable`] naming the missing one.
//!
//! Regions are device pointers on this rank's GPU (`LOCAL_RANK` modulo the device count); a region
//! in host memory is staged through a device buffer (copied in, reduced, copied back), so the safe
//! slice helpers work too, at the cost of two copies. Each
//! operation is enqueued on one stream and the communication thread polls the stream until it is
//! done, `timeout_s` at most (then the NCCL communicator is aborted and the call fails). The
//! unique id travels through the TCP store on MASTER_ADDR/MASTER_PORT. NCCL's shards must be
//! equal, so reduce-scatter and all-gather need a count divisible by the group size.

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys as driver;
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::sys as nccl;

type CuPtr = driver::CUdeviceptr;

fn check_cu(status: driver::CUresult, op: &'static str, rank: usize) -> Result<()> {
    if status == driver::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(failed(op, rank, status))
    }
}

fn device_alloc(bytes: usize) -> std::result::Result<CuPtr, driver::CUresult> {
    let mut ptr: CuPtr = 0;
    // SAFETY: ptr is an out pointer; the current context is bound to this thread.
    let status = unsafe { driver::cuMemAlloc_v2(&mut ptr, bytes) };
    if status == driver::CUresult::CUDA_SUCCESS {
        Ok(ptr)
    } else {
        Err(status)
    }
}

/// Whether `ptr` is device memory of the current context (host memory answers otherwise).
fn is_device_memory(ptr: *mut u8) -> bool {
    let mut kind: u32 = 0;
    // SAFETY: kind is a 4-byte out value for CU_POINTER_ATTRIBUTE_MEMORY_TYPE.
    let status = unsafe {
        driver::cuPointerGetAttribute(
            &mut kind as *mut u32 as *mut c_void,
            driver::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            ptr as CuPtr,
        )
    };
    status == driver::CUresult::CUDA_SUCCESS && kind == driver::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
}

use crate::config::{CommConfig, DistEnv};
use crate::dtype::{DType, ReduceOp};
use crate::error::{CommError, Result};
use crate::store::StoreClient;
use crate::work::{Engine, GroupInfo, Op, P2p, Region, Worker};
use crate::Communicator;

fn unavailable(reason: impl Into<String>) -> CommError {
    CommError::Unavailable { backend: "nccl", reason: reason.into() }
}

fn can_dlopen(name: &str) -> bool {
    let c = std::ffi::CString::new(name).expect("library names contain no NUL");
    // SAFETY: dlopen/dlclose of a library name; loading runs its initializers, which is what
    // using it would do anyway.
    unsafe {
        let handle = libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            return false;
        }
        libc::dlclose(handle);
    }
    true
}

/// Fails with a message naming the missing library instead of letting cudarc panic.
fn probe() -> Result<()> {
    // SAFETY: is_culib_present only tries to load the library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(unavailable(
            "libcuda.so (the NVIDIA driver's CUDA library) was not found on the library path; this machine has no \
             usable NVIDIA driver",
        ));
    }
    // SAFETY: as above.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        let hint = if can_dlopen("libnccl.so.2") {
            "libnccl.so.2 is installed but not under the name libnccl.so that is looked up: put a libnccl.so symlink \
             to it in a folder on LD_LIBRARY_PATH"
        } else {
            "install NCCL (Debian/Ubuntu: libnccl2, or the nvidia-nccl wheel) and put it on LD_LIBRARY_PATH"
        };
        return Err(unavailable(format!("libnccl.so (NCCL) was not found: {hint}")));
    }
    Ok(())
}

struct NcclGroup {
    comm: nccl::ncclComm_t,
    rank: usize,
    size: usize,
}

struct NcclEngine {
    _ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    groups: Vec<NcclGroup>,
    /// 4 bytes of device memory for the barrier's all-reduce.
    barrier_buf: CuPtr,
    /// Grow-only device buffer for host regions.
    staging: CuPtr,
    staging_bytes: usize,
    timeout: Duration,
    world_rank: usize,
}

/// An NCCL failure with NCCL's own words: the result code and its last error message.
fn nccl_failed(op: &'static str, rank: usize, error: cudarc::nccl::result::NcclError) -> CommError {
    // SAFETY: ncclGetLastError(NULL) returns a NUL-terminated string owned by NCCL (or null).
    let last = unsafe {
        let text = nccl::ncclGetLastError(std::ptr::null_mut());
        if text.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(text).to_string_lossy().into_owned()
        }
    };
    CommError::Backend { backend: "nccl", op, rank, reason: format!("{:?}: {last}", error.0) }
}

// SAFETY: NCCL communicators and the CUDA context are bound to the communication thread;
// `any_thread` is false, so only that thread ever runs or drops the engine.
unsafe impl Send for NcclEngine {}

fn failed(op: &'static str, rank: usize, reason: impl std::fmt::Debug) -> CommError {
    CommError::Backend { backend: "nccl", op, rank, reason: format!("{reason:?}") }
}

impl NcclEngine {
    fn new(config: &CommConfig, env: &DistEnv, mut store: Option<StoreClient>) -> Result<NcclEngine> {
        let rank = env.rank;
        let devices = CudaContext::device_count().map_err(|e| failed("init", rank, e))?;
        if devices <= 0 {
            return Err(unavailable("the CUDA driver reports no GPU"));
        }
        let device = env.local_rank % devices as usize;
        let ctx = CudaContext::new(device).map_err(|e| failed("init", rank, e))?;
        ctx.bind_to_thread().map_err(|e| failed("init", rank, e))?;
        let stream = ctx.new_stream().map_err(|e| failed("init", rank, e))?;
        let timeout = Duration::from_secs_f64(config.timeout_s);
        let id = if rank == 0 || env.world_size == 1 {
            let id = cudarc::nccl::result::get_uniqueid().map_err(|e| nccl_failed("init", rank, e))?;
            if let Some(store) = store.as_mut() {
                let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
                store.set("nccl/world", &bytes).map_err(|reason| CommError::Rendezvous {
                    rank,
                    place: store.place.clone(),
                    reason,
                })?;
            }
            id
        } else {
            let store = store.as_mut().expect("ranks of a group larger than one have a store");
            let bytes = store.get("nccl/world", timeout).map_err(|reason| CommError::Rendezvous {
                rank,
                place: store.place.clone(),
                reason,
            })?;
            let mut id = nccl::ncclUniqueId { internal: [0; 128] };
            for (dst, src) in id.internal.iter_mut().zip(&bytes) {
                *dst = *src as std::ffi::c_char;
            }
            id
        };
        let mut comm: nccl::ncclComm_t = std::ptr::null_mut();
        // SAFETY: comm is an out pointer; every rank passes the same id and world size.
        unsafe { cudarc::nccl::result::comm_init_rank(&mut comm, env.world_size as i32, id, rank as i32) }
            .map_err(|e| nccl_failed("init", rank, e))?;
        let barrier_buf = device_alloc(4).map_err(|e| failed("init", rank, e))?;
        Ok(NcclEngine {
            _ctx: ctx,
            stream,
            groups: vec![NcclGroup { comm, rank, size: env.world_size }],
            barrier_buf,
            staging: 0,
            staging_bytes: 0,
            timeout,
            world_rank: rank,
        })
    }

    /// The device region to run on: `region` itself when it is device memory, else the staging
    /// buffer with the region's bytes copied in (enqueued on the stream). Returns the host
    /// pointer to copy the result back to, if staged.
    fn stage_in(&mut self, region: &Region) -> Result<(Region, Option<*mut u8>)> {
        if is_device_memory(region.ptr()) {
            return Ok((*region, None));
        }
        self.ensure_staging(region.bytes())?;
        // SAFETY: the host region holds region.bytes() (the async contract), staging at least as many.
        let status = unsafe {
            driver::cuMemcpyHtoDAsync_v2(
                self.staging,
                region.ptr() as *const c_void,
                region.bytes(),
                self.stream.cu_stream(),
            )
        };
        check_cu(status, "stage", self.world_rank)?;
        Ok((Region::new(self.staging as *mut u8, region.count(), region.dtype()), Some(region.ptr())))
    }

    /// Grows the staging buffer to at least `bytes` (one byte at least).
    fn ensure_staging(&mut self, bytes: usize) -> Result<()> {
        let bytes = bytes.max(1);
        if bytes > self.staging_bytes {
            if self.staging != 0 {
                // SAFETY: our allocation; the stream is idle between operations.
                unsafe { driver::cuMemFree_v2(self.staging) };
                self.staging = 0;
                self.staging_bytes = 0;
            }
            self.staging = device_alloc(bytes).map_err(|e| failed("stage", self.world_rank, e))?;
            self.staging_bytes = bytes;
        }
        Ok(())
    }

    /// All-to-all as one NCCL group of sends and receives (one pair per peer); the own chunk is a
    /// device copy. Host regions are staged: `send` in the first half of the staging buffer,
    /// `recv` in the second, copied back after the exchange.
    fn all_to_all(&mut self, g: usize, send: &Region, recv: &Region) -> Result<()> {
        let name = "all_to_all";
        let rank = self.world_rank;
        let (comm, group_rank, n) = (self.groups[g].comm, self.groups[g].rank, self.groups[g].size);
        let bytes = send.bytes();
        let (send_host, recv_host) = (!is_device_memory(send.ptr()), !is_device_memory(recv.ptr()));
        if send_host || recv_host {
            self.ensure_staging(2 * bytes)?;
        }
        let cu_stream = self.stream.cu_stream();
        let send_dev: CuPtr = if send_host {
            // SAFETY: the host region holds `bytes`, the staging buffer at least 2 * bytes.
            check_cu(
                unsafe { driver::cuMemcpyHtoDAsync_v2(self.staging, send.ptr() as *const c_void, bytes, cu_stream) },
                name,
                rank,
            )?;
            self.staging
        } else {
            send.ptr() as CuPtr
        };
        let recv_dev: CuPtr = if recv_host { self.staging + bytes as CuPtr } else { recv.ptr() as CuPtr };
        let per_rank = send.count() / n;
        let chunk_bytes = per_rank * send.dtype().size();
        let (datatype, _) = Self::types(send.dtype(), ReduceOp::Sum);
        let stream = self.cu_stream();
        if chunk_bytes > 0 {
            let own = group_rank as CuPtr * chunk_bytes as CuPtr;
            // SAFETY: chunk `group_rank` lies in both device buffers.
            check_cu(
                unsafe { driver::cuMemcpyDtoDAsync_v2(recv_dev + own, send_dev + own, chunk_bytes, cu_stream) },
                name,
                rank,
            )?;
            cudarc::nccl::result::group_start().map_err(|e| nccl_failed(name, rank, e))?;
            for peer in (0..n).filter(|&p| p != group_rank) {
                let offset = peer as CuPtr * chunk_bytes as CuPtr;
                // SAFETY: chunk `peer` of each buffer lies within it (n * chunk_bytes = bytes);
                // comm and stream are live; the group is ended below and the stream waited on.
                unsafe {
                    cudarc::nccl::result::send(
                        (send_dev + offset) as *const c_void,
                        per_rank,
                        datatype,
                        peer as i32,
                        comm,
                        stream,
                    )
                    .map_err(|e| nccl_failed(name, rank, e))?;
                    cudarc::nccl::result::recv(
                        (recv_dev + offset) as *mut c_void,
                        per_rank,
                        datatype,
                        peer as i32,
                        comm,
                        stream,
                    )
                    .map_err(|e| nccl_failed(name, rank, e))?;
                }
            }
            cudarc::nccl::result::group_end().map_err(|e| nccl_failed(name, rank, e))?;
        }
        if recv_host {
            // SAFETY: copies the received bytes into the caller's host region, after the exchange
            // on the same stream.
            check_cu(
                unsafe { driver::cuMemcpyDtoHAsync_v2(recv.ptr() as *mut c_void, recv_dev, bytes, cu_stream) },
                name,
                rank,
            )?;
        }
        self.finish(g, name)
    }

    /// A batch of sends and receives as one NCCL group. Host regions are staged one after another
    /// in the staging buffer (sends copied in first) and the receives copied back after the group.
    fn batch(&mut self, g: usize, ops: &[P2p]) -> Result<()> {
        let name = "p2p_batch";
        let rank = self.world_rank;
        let (comm, stream, cu_stream) = (self.groups[g].comm, self.cu_stream(), self.stream.cu_stream());
        let host = |p: &P2p| !is_device_memory(p.region().ptr());
        self.ensure_staging(ops.iter().filter(|p| host(p)).map(|p| p.region().bytes()).sum())?;
        let mut offset: CuPtr = 0;
        let mut places = Vec::with_capacity(ops.len());
        for p in ops {
            let region = p.region();
            if !host(p) {
                places.push(region.ptr() as CuPtr);
                continue;
            }
            let dev = self.staging + offset;
            offset += region.bytes() as CuPtr;
            if p.is_send() {
                // SAFETY: the host region holds its bytes; the staging buffer has room at `dev`.
                let status = unsafe {
                    driver::cuMemcpyHtoDAsync_v2(dev, region.ptr() as *const c_void, region.bytes(), cu_stream)
                };
                check_cu(status, name, rank)?;
            }
            places.push(dev);
        }
        cudarc::nccl::result::group_start().map_err(|e| nccl_failed(name, rank, e))?;
        for (p, &dev) in ops.iter().zip(&places) {
            let (region, peer) = (p.region(), p.peer() as i32);
            let (datatype, _) = Self::types(region.dtype(), ReduceOp::Sum);
            // SAFETY: `dev` is device memory of the region's size (the caller's or staged); comm
            // and stream are live; the group is ended below and the stream waited on.
            let status = unsafe {
                if p.is_send() {
                    let ptr = dev as *const c_void;
                    cudarc::nccl::result::send(ptr, region.count(), datatype, peer, comm, stream)
                } else {
                    cudarc::nccl::result::recv(dev as *mut c_void, region.count(), datatype, peer, comm, stream)
                }
            };
            status.map_err(|e| nccl_failed(name, rank, e))?;
        }
        cudarc::nccl::result::group_end().map_err(|e| nccl_failed(name, rank, e))?;
        for (p, &dev) in ops.iter().zip(&places) {
            if !p.is_send() && host(p) {
                let region = p.region();
                // SAFETY: copies the received bytes into the caller's host region, after the group
                // on the same stream.
                let status = unsafe {
                    driver::cuMemcpyDtoHAsync_v2(region.ptr() as *mut c_void, dev, region.bytes(), cu_stream)
                };
                check_cu(status, name, rank)?;
            }
        }
        self.finish(g, name)
    }

    fn cu_stream(&self) -> nccl::cudaStream_t {
        self.stream.cu_stream() as nccl::cudaStream_t
    }

    /// Polls the stream until the enqueued work is done, `timeout` at most.
    fn finish(&self, group: usize, op: &'static str) -> Result<()> {
        let start = Instant::now();
        loop {
            // SAFETY: the stream belongs to this engine's context, bound to this thread.
            let status = unsafe { driver::cuStreamQuery(self.stream.cu_stream()) };
            match status {
                driver::CUresult::CUDA_SUCCESS => return Ok(()),
                driver::CUresult::CUDA_ERROR_NOT_READY => {}
                other => return Err(failed(op, self.world_rank, other)),
            }
            let mut async_error = nccl::ncclResult_t::ncclSuccess;
            // SAFETY: a live communicator; async_error is an out pointer.
            unsafe { nccl::ncclCommGetAsyncError(self.groups[group].comm, &mut async_error) };
            if async_error != nccl::ncclResult_t::ncclSuccess && async_error != nccl::ncclResult_t::ncclInProgress {
                return Err(failed(op, self.world_rank, async_error));
            }
            if start.elapsed() >= self.timeout {
                // SAFETY: aborting makes the stuck kernels return; the communicator is unusable
                // afterwards, and the worker refuses further operations.
                unsafe { nccl::ncclCommAbort(self.groups[group].comm) };
                return Err(CommError::Timeout {
                    rank: self.world_rank,
                    peer: usize::MAX,
                    op,
                    timeout_s: self.timeout.as_secs_f64(),
                });
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn types(dtype: DType, op: ReduceOp) -> (nccl::ncclDataType_t, nccl::ncclRedOp_t) {
        let datatype = match dtype {
            DType::F32 => nccl::ncclDataType_t::ncclFloat32,
            DType::BF16 => nccl::ncclDataType_t::ncclBfloat16,
            DType::F16 => nccl::ncclDataType_t::ncclFloat16,
            DType::U8 => nccl::ncclDataType_t::ncclUint8,
        };
        let op = match op {
            ReduceOp::Sum => nccl::ncclRedOp_t::ncclSum,
            ReduceOp::Avg => nccl::ncclRedOp_t::ncclAvg,
        };
        (datatype, op)
    }

    fn equal_shards(&self, group: usize, region: &Region, op: &'static str) -> Result<usize> {
        let n = self.groups[group].size;
        if region.count() % n != 0 {
            return Err(CommError::InvalidArgument {
                rank: self.world_rank,
                op,
                reason: format!("nccl needs a count divisible by the group size {n}, got {}", region.count()),
            });
        }
        Ok(region.count() / n)
    }
}

impl Engine for NcclEngine {
    fn execute(&mut self, g: usize, op: &Op) -> Result<Option<GroupInfo>> {
        let name = op.name();
        let comm = self.groups[g].comm;
        let stream = self.cu_stream();
        let rank = self.world_rank;
        let group_rank = self.groups[g].rank;
        if let Op::AllToAll { send, recv } = op {
            self.all_to_all(g, send, recv)?;
            return Ok(None);
        }
        if let Op::Batch(ops) = op {
            self.batch(g, ops)?;
            return Ok(None);
        }
        let staged = match op {
            Op::AllReduce { region, .. }
            | Op::ReduceScatter { region, .. }
            | Op::AllGather { region }
            | Op::Broadcast { region, .. }
            | Op::Send { region, .. }
            | Op::Recv { region, .. } => Some((self.stage_in(region)?, region.bytes())),
            Op::Barrier | Op::NewGroup { .. } | Op::AllToAll { .. } | Op::Batch(_) => None,
        };
        let op = &match (op, staged.as_ref()) {
            (Op::AllReduce { op, .. }, Some(((dev, _), _))) => Op::AllReduce { region: *dev, op: *op },
            (Op::ReduceScatter { op, .. }, Some(((dev, _), _))) => Op::ReduceScatter { region: *dev, op: *op },
            (Op::AllGather { .. }, Some(((dev, _), _))) => Op::AllGather { region: *dev },
            (Op::Broadcast { root, .. }, Some(((dev, _), _))) => Op::Broadcast { region: *dev, root: *root },
            (Op::Send { peer, .. }, Some(((dev, _), _))) => Op::Send { region: *dev, peer: *peer },
            (Op::Recv { peer, .. }, Some(((dev, _), _))) => Op::Recv { region: *dev, peer: *peer },
            (other, _) => other.clone(),
        };
        // SAFETY (every call below): regions are device memory valid for their counts (the
        // contract of the async API), comm and stream are live, and the work is complete before
        // `finish` returns.
        let status = match op {
            Op::AllReduce { region, op } => {
                let (datatype, red) = Self::types(region.dtype(), *op);
                let p = region.ptr() as *mut c_void;
                unsafe { cudarc::nccl::result::all_reduce(p, p, region.count(), datatype, red, comm, stream) }
            }
            Op::ReduceScatter { region, op } => {
                let shard = self.equal_shards(g, region, name)?;
                let (datatype, red) = Self::types(region.dtype(), *op);
                let p = region.ptr() as *mut c_void;
                let out = unsafe { region.ptr().add(group_rank * shard * region.dtype().size()) } as *mut c_void;
                unsafe { cudarc::nccl::result::reduce_scatter(p, out, shard, datatype, red, comm, stream) }
            }
            Op::AllGather { region } => {
                let shard = self.equal_shards(g, region, name)?;
                let (datatype, _) = Self::types(region.dtype(), ReduceOp::Sum);
                let p = region.ptr() as *mut c_void;
                let mine = unsafe { region.ptr().add(group_rank * shard * region.dtype().size()) } as *const c_void;
                unsafe { cudarc::nccl::result::all_gather(mine, p, shard, datatype, comm, stream) }
            }
            Op::Broadcast { region, root } => {
                let (datatype, _) = Self::types(region.dtype(), ReduceOp::Sum);
                let p = region.ptr() as *mut c_void;
                unsafe { cudarc::nccl::result::broadcast(p, p, region.count(), datatype, *root as i32, comm, stream) }
            }
            Op::Send { region, peer } => {
                let (datatype, _) = Self::types(region.dtype(), ReduceOp::Sum);
                unsafe {
                    cudarc::nccl::result::send(
                        region.ptr() as *const c_void,
                        region.count(),
                        datatype,
                        *peer as i32,
                        comm,
                        stream,
                    )
                }
            }
            Op::Recv { region, peer } => {
                let (datatype, _) = Self::types(region.dtype(), ReduceOp::Sum);
                unsafe {
                    cudarc::nccl::result::recv(
                        region.ptr() as *mut c_void,
                        region.count(),
                        datatype,
                        *peer as i32,
                        comm,
                        stream,
                    )
                }
            }
            Op::AllToAll { .. } | Op::Batch(_) => unreachable!("handled above"),
            Op::Barrier => {
                let p = self.barrier_buf as *mut c_void;
                unsafe {
                    cudarc::nccl::result::all_reduce(
                        p,
                        p,
                        1,
                        nccl::ncclDataType_t::ncclFloat32,
                        nccl::ncclRedOp_t::ncclSum,
                        comm,
                        stream,
                    )
                }
            }
            Op::NewGroup { ranks } => {
                let member = ranks.iter().position(|&r| r == group_rank);
                let color = if member.is_some() { 0 } else { -1 }; // NCCL_SPLIT_NOCOLOR
                let mut child: nccl::ncclComm_t = std::ptr::null_mut();
                // SAFETY: collective over the parent; child is an out pointer; null config.
                unsafe { nccl::ncclCommSplit(comm, color, group_rank as i32, &mut child, std::ptr::null_mut()) }
                    .result()
                    .map_err(|e| nccl_failed(name, rank, e))?;
                let Some(sub_rank) = member else { return Ok(None) };
                self.groups.push(NcclGroup { comm: child, rank: sub_rank, size: ranks.len() });
                return Ok(Some(GroupInfo {
                    id: self.groups.len() - 1,
                    rank: sub_rank,
                    size: ranks.len(),
                    backend: None,
                }));
            }
        };
        status.map_err(|e| nccl_failed(name, rank, e))?;
        if let Some(((dev, Some(host)), bytes)) = staged {
            // SAFETY: copies the result back into the caller's host region (bytes long), after
            // the collective on the same stream.
            let status = unsafe {
                driver::cuMemcpyDtoHAsync_v2(host as *mut c_void, dev.ptr() as u64, bytes, self.stream.cu_stream())
            };
            check_cu(status, name, rank)?;
        }
        self.finish(g, name)?;
        Ok(None)
    }
}

impl Drop for NcclEngine {
    fn drop(&mut self) {
        // SAFETY: our allocations; nothing is in flight once the thread drops the engine.
        unsafe {
            driver::cuMemFree_v2(self.barrier_buf);
            if self.staging != 0 {
                driver::cuMemFree_v2(self.staging);
            }
        }
        for group in self.groups.drain(..).rev() {
            // SAFETY: communicators this engine created and no longer uses.
            unsafe { nccl::ncclCommDestroy(group.comm) };
        }
    }
}

pub(crate) fn connect(config: &CommConfig, env: &DistEnv) -> Result<Box<dyn Communicator>> {
    probe()?;
    let deadline = Instant::now() + Duration::from_secs_f64(config.timeout_s);
    let store = if env.world_size > 1 {
        let (Some(addr), Some(port)) = (env.master_addr.clone(), env.master_port) else {
            return Err(CommError::Environment("the nccl backend needs MASTER_ADDR and MASTER_PORT".into()));
        };
        Some(crate::store::rendezvous(&addr, port, env.rank, deadline)?)
    } else {
        None
    };
    let (config, env_moved) = (config.clone(), env.clone());
    let worker: Arc<Worker> = Worker::spawn(env.rank, "nccl", move || {
        Ok(Box::new(NcclEngine::new(&config, &env_moved, store)?) as Box<dyn Engine>)
    })?;
    Ok(crate::api::process_group(worker, env.rank, env.world_size, "nccl"))
}
