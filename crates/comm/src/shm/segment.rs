//! One shared-memory segment per group: header, channel control words, message slots; liveness
//! through byte-range locks; waiting that spins briefly, yields, then sleeps on a futex.
//!
//! Layout (offsets in bytes):
//! - `0..4096` header: magic, version, group size, slots, slot bytes, `ready`, `joined`, `abort`
//!   (and beside it the world rank of a rank lost outside the group), then from byte 256 one
//!   `departed` byte per rank.
//! - `4096..` one 256-byte control block per ordered pair (src, dst): `posted` (chunks src has
//!   written), `post_waiter`, `freed` (chunks dst has consumed), `free_waiter`, each on its own
//!   cache line.
//! - then, page-aligned, `slots` slots per ordered pair, each a 64-byte header (`kind`, `len`)
//!   followed by `slot_bytes` of data.
//!
//! Liveness: each member holds an open-file-description write lock on byte `LOCK_BASE + rank` of
//! the segment file for as long as its process lives; the kernel drops it when the process dies
//! (SIGKILL included), so `F_OFD_GETLK` tells a waiting rank that a peer is gone. A member that
//! leaves through `Drop` (its work done, or an error of its own) sets its `departed` byte first:
//! its exit then fails only the waits for it, not every wait in the group. A rank that sent its
//! last message and exited is no lost rank to a peer still waiting on someone else.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::{Duration, Instant};

use crate::error::{CommError, Result};

const MAGIC: u64 = 0x5354_4f4b_4543_4f4d; // "STOKECOM"
const VERSION: u32 = 1;
const HEADER_BYTES: usize = 4096;
const CONTROL_BYTES: usize = 256;
pub(crate) const SLOT_HEADER_BYTES: usize = 64;
const LOCK_BASE: i64 = 1 << 40;
/// How long a waiter spins before it yields.
const SPIN: Duration = Duration::from_micros(5);
/// How long a waiter keeps yielding its core (to a peer that may be waiting for it) before it
/// sleeps on the futex.
const YIELD: Duration = Duration::from_micros(200);
/// The longest single futex sleep; after each, the waiter checks its peers' liveness.
const SLEEP_SLICE: Duration = Duration::from_millis(50);

// Header offsets.
const H_MAGIC: usize = 0;
const H_VERSION: usize = 8;
const H_SIZE: usize = 12;
const H_SLOTS: usize = 16;
const H_SLOT_BYTES: usize = 24;
const H_READY: usize = 64;
const H_JOINED: usize = 128;
const H_ABORT: usize = 192;
/// The world rank + 1 of a rank lost outside the group, which `abort_outside` reports.
const H_LOST_OUTSIDE: usize = 196;
/// `abort`'s value when the lost rank is outside the group (else it holds the lost member + 1).
const ABORT_OUTSIDE: u32 = u32::MAX;
/// One byte per rank, set when that rank leaves through `Drop`.
const H_DEPARTED: usize = 256;
/// The most ranks the header has `departed` bytes for.
const MAX_RANKS: usize = HEADER_BYTES - H_DEPARTED;

/// What a wait is for, to name it in errors.
#[derive(Clone, Copy)]
pub(crate) struct WaitFor<'a> {
    pub op: &'static str,
    /// The group rank whose action would end the wait.
    pub peer: usize,
    /// Group rank -> world rank, to name ranks the way the user knows them.
    pub world_ranks: &'a [usize],
    pub rank: usize,
}

pub(crate) struct Segment {
    base: *mut u8,
    len: usize,
    fd: libc::c_int,
    path: PathBuf,
    pub(crate) size: usize,
    pub(crate) slots: usize,
    pub(crate) slot_bytes: usize,
    data_offset: usize,
    /// Set on the creator until the file is unlinked, so a failed rendezvous leaves nothing.
    unlink_on_drop: bool,
    timeout: Duration,
    /// The group rank this handle joined as (its byte is locked), for `departed` on drop.
    rank: Option<usize>,
}

// SAFETY: the mapping is shared memory accessed only through atomics and through slot bytes whose
// ownership the channel protocol hands over (post/free counters); moving the handle between
// threads changes nothing about that.
unsafe impl Send for Segment {}

fn layout(size: usize, slots: usize, slot_bytes: usize) -> (usize, usize) {
    let control_end = HEADER_BYTES + size * size * CONTROL_BYTES;
    let data_offset = control_end.div_ceil(4096) * 4096;
    let total = data_offset + size * size * slots * (SLOT_HEADER_BYTES + slot_bytes);
    (data_offset, total)
}

fn c_path(path: &Path) -> CString {
    CString::new(path.as_os_str().as_bytes()).expect("segment paths contain no NUL byte")
}

impl Segment {
    /// Creates the segment at `path` as group rank 0: writes the file under a temporary name,
    /// locks rank 0's byte, then renames it into place (replacing any stale file).
    pub(crate) fn create(
        path: &Path,
        size: usize,
        slots: usize,
        slot_bytes: usize,
        timeout: Duration,
    ) -> Result<Segment> {
        if size > MAX_RANKS {
            return Err(CommError::Rendezvous {
                rank: 0,
                place: path.display().to_string(),
                reason: format!("a shared-memory group holds at most {MAX_RANKS} ranks, not {size}"),
            });
        }
        let (data_offset, total) = layout(size, slots, slot_bytes);
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let c_tmp = c_path(&tmp);
        // SAFETY: c_tmp is a valid NUL-terminated path.
        let fd = unsafe {
            libc::open(c_tmp.as_ptr(), libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC, 0o600)
        };
        if fd < 0 {
            return Err(CommError::io("create shared-memory segment", &tmp, std::io::Error::last_os_error()));
        }
        // SAFETY: fd is open for writing.
        if unsafe { libc::ftruncate(fd, total as libc::off_t) } != 0 {
            let err = std::io::Error::last_os_error();
            // SAFETY: fd is ours; the path was just created by us.
            unsafe {
                libc::close(fd);
                libc::unlink(c_tmp.as_ptr());
            }
            return Err(CommError::io("size shared-memory segment", &tmp, err));
        }
        let mut segment = Segment::map(fd, &tmp, total, size, slots, slot_bytes, data_offset, timeout)?;
        segment.unlink_on_drop = true;
        segment.write_u64(H_MAGIC, MAGIC);
        segment.atomic32(H_VERSION).store(VERSION, Ordering::Relaxed);
        segment.atomic32(H_SIZE).store(size as u32, Ordering::Relaxed);
        segment.atomic32(H_SLOTS).store(slots as u32, Ordering::Relaxed);
        segment.write_u64(H_SLOT_BYTES, slot_bytes as u64);
        segment.lock_rank(0)?;
        segment.atomic32(H_READY).store(1, Ordering::Release);
        let c_final = c_path(path);
        // SAFETY: both paths are valid NUL-terminated strings.
        if unsafe { libc::rename(c_tmp.as_ptr(), c_final.as_ptr()) } != 0 {
            return Err(CommError::io("publish shared-memory segment", path, std::io::Error::last_os_error()));
        }
        segment.path = path.to_path_buf();
        Ok(segment)
    }

    /// Opens the segment at `path` as group rank `rank`, waiting until it exists, is initialized,
    /// and its creator is alive (a file left by a dead job is skipped until replaced).
    pub(crate) fn open(path: &Path, rank: usize, size: usize, timeout: Duration) -> Result<Segment> {
        let deadline = Instant::now() + timeout;
        let c = c_path(path);
        let mut last = String::from("it does not exist");
        loop {
            // SAFETY: c is a valid NUL-terminated path.
            let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
            if fd >= 0 {
                match Segment::try_attach(fd, path, rank, size, timeout) {
                    Ok(Some(segment)) => return Ok(segment),
                    Ok(None) => last = "it was left by a job whose rank 0 is gone".into(),
                    Err(err) => return Err(err),
                }
            }
            if Instant::now() >= deadline {
                return Err(CommError::Rendezvous {
                    rank,
                    place: path.display().to_string(),
                    reason: format!("no live segment appeared within {} s ({last})", timeout.as_secs_f64()),
                });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Maps an opened file; `Ok(None)` when it is not (yet) a live segment (the fd is closed).
    fn try_attach(
        fd: libc::c_int,
        path: &Path,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<Option<Segment>> {
        // SAFETY: stat is plain data, fully written by fstat on success.
        let mut stat: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fd is open; stat is a valid out pointer.
        if unsafe { libc::fstat(fd, &mut stat) } != 0 || (stat.st_size as usize) < HEADER_BYTES {
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            return Ok(None);
        }
        let file_len = stat.st_size as usize;
        let header = Segment::map(fd, path, HEADER_BYTES, 0, 0, 0, 0, timeout)?;
        let valid = header.read_u64(H_MAGIC) == MAGIC && header.atomic32(H_READY).load(Ordering::Acquire) == 1;
        if !valid {
            return Ok(None); // dropping `header` closes fd
        }
        if header.atomic32(H_VERSION).load(Ordering::Relaxed) != VERSION {
            return Err(CommError::Rendezvous {
                rank,
                place: path.display().to_string(),
                reason: "the segment was made by another version of stoke".into(),
            });
        }
        let seg_size = header.atomic32(H_SIZE).load(Ordering::Relaxed) as usize;
        let slots = header.atomic32(H_SLOTS).load(Ordering::Relaxed) as usize;
        let slot_bytes = header.read_u64(H_SLOT_BYTES) as usize;
        if !header.is_alive(0) {
            return Ok(None);
        }
        if seg_size != size {
            return Err(CommError::Rendezvous {
                rank,
                place: path.display().to_string(),
                reason: format!("rank 0 made a group of {seg_size} processes, this process expects {size}"),
            });
        }
        let (data_offset, total) = layout(size, slots, slot_bytes);
        if file_len < total {
            return Ok(None);
        }
        // Re-map the whole file on a duplicate descriptor; the header mapping closes its own.
        // SAFETY: fd is open.
        let fd2 = unsafe { libc::dup(fd) };
        if fd2 < 0 {
            return Err(CommError::io("dup segment descriptor", path, std::io::Error::last_os_error()));
        }
        drop(header);
        let mut segment = Segment::map(fd2, path, total, size, slots, slot_bytes, data_offset, timeout)?;
        segment.lock_rank(rank)?;
        Ok(Some(segment))
    }

    #[allow(clippy::too_many_arguments)]
    fn map(
        fd: libc::c_int,
        path: &Path,
        len: usize,
        size: usize,
        slots: usize,
        slot_bytes: usize,
        data_offset: usize,
        timeout: Duration,
    ) -> Result<Segment> {
        // SAFETY: fd is open read-write and at least `len` bytes long; a shared mapping of it is
        // what the segment is.
        let base = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if base == libc::MAP_FAILED {
            let err = std::io::Error::last_os_error();
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            return Err(CommError::io("map shared-memory segment", path, err));
        }
        Ok(Segment {
            base: base as *mut u8,
            len,
            fd,
            path: path.to_path_buf(),
            size,
            slots,
            slot_bytes,
            data_offset,
            unlink_on_drop: false,
            timeout,
            rank: None,
        })
    }

    fn atomic32(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset + 4 <= self.len && offset.is_multiple_of(4));
        // SAFETY: in bounds and 4-aligned (the mapping is page-aligned); shared words are only
        // accessed atomically.
        unsafe { &*(self.base.add(offset) as *const AtomicU32) }
    }

    fn write_u64(&self, offset: usize, value: u64) {
        // SAFETY: in bounds and 8-aligned, as atomic32.
        unsafe { &*(self.base.add(offset) as *const AtomicU64) }.store(value, Ordering::Relaxed);
    }

    fn read_u64(&self, offset: usize) -> u64 {
        // SAFETY: as write_u64.
        unsafe { &*(self.base.add(offset) as *const AtomicU64) }.load(Ordering::Relaxed)
    }

    fn lock_range(&self, rank: usize, kind: libc::c_short, cmd: libc::c_int) -> std::io::Result<libc::flock> {
        // SAFETY: flock is plain data.
        let mut lock: libc::flock = unsafe { std::mem::zeroed() };
        lock.l_type = kind;
        lock.l_whence = libc::SEEK_SET as libc::c_short;
        lock.l_start = LOCK_BASE + rank as i64;
        lock.l_len = 1;
        // SAFETY: fd is open; lock is a valid flock.
        if unsafe { libc::fcntl(self.fd, cmd, &mut lock) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(lock)
    }

    fn lock_rank(&mut self, rank: usize) -> Result<()> {
        match self.lock_range(rank, libc::F_WRLCK as libc::c_short, libc::F_OFD_SETLK) {
            Ok(_) => {
                self.rank = Some(rank);
                Ok(())
            }
            Err(err) if matches!(err.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
                Err(CommError::Rendezvous {
                    rank,
                    place: self.path.display().to_string(),
                    reason: format!("another live process already joined as rank {rank}"),
                })
            }
            Err(err) => Err(CommError::io("lock rank byte of segment", &self.path, err)),
        }
    }

    /// Whether group rank `rank` still holds its lock (its process is alive and joined).
    pub(crate) fn is_alive(&self, rank: usize) -> bool {
        match self.lock_range(rank, libc::F_WRLCK as libc::c_short, libc::F_OFD_GETLK) {
            Ok(lock) => lock.l_type != libc::F_UNLCK as libc::c_short,
            Err(_) => true, // cannot tell; the timeout still bounds the wait
        }
    }

    /// Joins the group: counts this rank in and waits for all `size` ranks.
    pub(crate) fn join(&mut self, rank: usize, world_ranks: &[usize]) -> Result<()> {
        let joined = self.atomic32(H_JOINED);
        joined.fetch_add(1, Ordering::SeqCst);
        futex_wake(joined, i32::MAX);
        let deadline = Instant::now() + self.timeout;
        loop {
            let seen = joined.load(Ordering::SeqCst);
            if seen as usize >= self.size {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> =
                    (0..self.size).filter(|&r| !self.is_alive(r)).map(|r| world_ranks[r]).collect();
                return Err(CommError::Rendezvous {
                    rank: world_ranks[rank],
                    place: self.path.display().to_string(),
                    reason: format!(
                        "ranks {missing:?} did not join within {} s (timeout_s)",
                        self.timeout.as_secs_f64()
                    ),
                });
            }
            futex_wait(joined, seen, (deadline - now).min(SLEEP_SLICE));
        }
        if self.unlink_on_drop {
            self.unlink();
        }
        Ok(())
    }

    /// Removes the file name; the mapping stays valid for everyone who has it.
    fn unlink(&mut self) {
        let c = c_path(&self.path);
        // SAFETY: c is a valid path; failure (already gone) is harmless.
        unsafe { libc::unlink(c.as_ptr()) };
        self.unlink_on_drop = false;
    }

    fn control(&self, src: usize, dst: usize, word: usize) -> &AtomicU32 {
        self.atomic32(HEADER_BYTES + (src * self.size + dst) * CONTROL_BYTES + word * 64)
    }

    /// Chunks `src` has posted to `dst`.
    pub(crate) fn posted(&self, src: usize, dst: usize) -> (&AtomicU32, &AtomicU32) {
        (self.control(src, dst, 0), self.control(src, dst, 1))
    }

    /// Chunks `dst` has consumed from `src`.
    pub(crate) fn freed(&self, src: usize, dst: usize) -> (&AtomicU32, &AtomicU32) {
        (self.control(src, dst, 2), self.control(src, dst, 3))
    }

    /// The header (`kind`, `len`) and data of slot `index` of channel (src, dst).
    pub(crate) fn slot(&self, src: usize, dst: usize, index: usize) -> (*mut u8, *mut u8) {
        let stride = SLOT_HEADER_BYTES + self.slot_bytes;
        let offset = self.data_offset + ((src * self.size + dst) * self.slots + index) * stride;
        debug_assert!(offset + stride <= self.len);
        // SAFETY: in bounds of the mapping (layout() sized it for every pair and slot).
        unsafe { (self.base.add(offset), self.base.add(offset + SLOT_HEADER_BYTES)) }
    }

    /// Publishes a new value of `word` and wakes its waiter if it sleeps.
    pub(crate) fn publish(word: &AtomicU32, waiter: &AtomicU32, value: u32) {
        word.store(value, Ordering::SeqCst);
        if waiter.swap(0, Ordering::SeqCst) != 0 {
            futex_wake(word, 1);
        }
    }

    /// One pause of a wait on several channels at once (a batch's): spins, then yields, then
    /// sleeps on `word`, one blocked channel's control word last seen at `seen`, with its `waiter`
    /// flag set so the peer's `publish` wakes this rank at once; a sleep lasts 1 ms at most, so the
    /// other channels are looked at again. Between sleeps it checks whether the segment was aborted
    /// or a member died, and gives up once `start` (the last progress) is `timeout_s` ago.
    pub(crate) fn pause(
        &self,
        word: &AtomicU32,
        waiter: &AtomicU32,
        seen: u32,
        start: Instant,
        why: WaitFor<'_>,
    ) -> Result<()> {
        let waited = start.elapsed();
        if waited < SPIN {
            std::hint::spin_loop();
            return Ok(());
        }
        if waited < YIELD {
            std::thread::yield_now();
            return Ok(());
        }
        self.check_peers(why)?;
        if waited >= self.timeout {
            return Err(CommError::Timeout {
                rank: why.world_ranks[why.rank],
                peer: why.world_ranks[why.peer],
                op: why.op,
                timeout_s: self.timeout.as_secs_f64(),
            });
        }
        waiter.store(1, Ordering::SeqCst);
        if word.load(Ordering::SeqCst) == seen {
            futex_wait(word, seen, Duration::from_millis(1));
        }
        Ok(())
    }

    /// Waits until `ready(word)` holds: spins briefly, then sleeps on the futex in slices,
    /// checking after each slice whether the segment was aborted or any member died, and giving
    /// up after `timeout_s`. Returns the word's value.
    pub(crate) fn wait(
        &self,
        word: &AtomicU32,
        waiter: &AtomicU32,
        ready: impl Fn(u32) -> bool,
        why: WaitFor<'_>,
    ) -> Result<u32> {
        let value = word.load(Ordering::Acquire);
        if ready(value) {
            return Ok(value);
        }
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            std::hint::spin_loop();
            let value = word.load(Ordering::Acquire);
            if ready(value) {
                return Ok(value);
            }
            spins += 1;
            if spins.is_multiple_of(64) {
                let waited = start.elapsed();
                if waited >= YIELD {
                    break;
                }
                if waited >= SPIN {
                    std::thread::yield_now();
                }
            }
        }
        let deadline = start + self.timeout;
        loop {
            waiter.store(1, Ordering::SeqCst);
            let value = word.load(Ordering::SeqCst);
            if ready(value) {
                return Ok(value);
            }
            if let Err(err) = self.check_peers(why) {
                // The peer may have done its part, then exited, between the look above and the
                // liveness check: what it left counts.
                let value = word.load(Ordering::SeqCst);
                if ready(value) {
                    return Ok(value);
                }
                return Err(err);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    rank: why.world_ranks[why.rank],
                    peer: why.world_ranks[why.peer],
                    op: why.op,
                    timeout_s: self.timeout.as_secs_f64(),
                });
            }
            futex_wait(word, value, (deadline - now).min(SLEEP_SLICE));
            let value = word.load(Ordering::Acquire);
            if ready(value) {
                return Ok(value);
            }
        }
    }

    /// Group rank `rank`'s `departed` byte.
    fn departed_byte(&self, rank: usize) -> &AtomicU8 {
        debug_assert!(H_DEPARTED + rank < HEADER_BYTES.min(self.len));
        // SAFETY: H_DEPARTED + rank is inside the header (create() bounds the group size); the
        // byte is only accessed atomically.
        unsafe { &*(self.base.add(H_DEPARTED + rank) as *const AtomicU8) }
    }

    /// Whether group rank `rank` left through `Drop` (rather than dying).
    fn departed(&self, rank: usize) -> bool {
        self.departed_byte(rank).load(Ordering::SeqCst) != 0
    }

    /// Fails if the segment was aborted or a member's process is gone; marks the segment aborted
    /// so every other waiter names the same lost rank. A member that departed cleanly counts as
    /// lost only to a wait for that member itself.
    fn check_peers(&self, why: WaitFor<'_>) -> Result<()> {
        let abort = self.atomic32(H_ABORT);
        let mut lost = abort.load(Ordering::SeqCst);
        if lost == 0 {
            let gone = |r: usize| r != why.rank && !self.is_alive(r) && (r == why.peer || !self.departed(r));
            if let Some(dead) = (0..self.size).find(|&r| gone(r)) {
                let _ = abort.compare_exchange(0, dead as u32 + 1, Ordering::SeqCst, Ordering::SeqCst);
                lost = abort.load(Ordering::SeqCst);
            }
        }
        if lost != 0 {
            let lost_rank = if lost == ABORT_OUTSIDE {
                self.atomic32(H_LOST_OUTSIDE).load(Ordering::SeqCst) as usize - 1
            } else {
                why.world_ranks[lost as usize - 1]
            };
            return Err(CommError::PeerLost { rank: why.world_ranks[why.rank], lost_rank, op: why.op });
        }
        Ok(())
    }

    /// Fails every member's current and later waits naming world rank `lost_rank`, a rank outside
    /// this group (another node's, lost to this node's leader over TCP); a group already aborted
    /// keeps the rank it names. The waiters see it within one sleep slice.
    pub(crate) fn abort_outside(&self, lost_rank: usize) {
        self.atomic32(H_LOST_OUTSIDE).store(lost_rank as u32 + 1, Ordering::SeqCst);
        let _ = self.atomic32(H_ABORT).compare_exchange(0, ABORT_OUTSIDE, Ordering::SeqCst, Ordering::SeqCst);
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.unlink_on_drop {
            self.unlink();
        }
        if let Some(rank) = self.rank {
            self.departed_byte(rank).store(1, Ordering::SeqCst);
        }
        // SAFETY: base/len are the mapping made in `map`, fd the descriptor it owns; nothing
        // borrowed from the mapping outlives the segment (slot pointers are used within a call).
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.len);
            libc::close(self.fd);
        }
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts =
        libc::timespec { tv_sec: timeout.as_secs() as libc::time_t, tv_nsec: timeout.subsec_nanos() as libc::c_long };
    // SAFETY: word is a valid, aligned u32 in a shared mapping (hence no FUTEX_PRIVATE_FLAG);
    // the kernel only reads it. EAGAIN, EINTR and ETIMEDOUT all mean "look again".
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            0usize,
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32, count: i32) {
    // SAFETY: word is a valid, aligned u32; waking has no memory effects.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, count, 0usize, 0usize, 0u32);
    }
}
