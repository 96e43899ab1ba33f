//! Host memory for snapshots: page-aligned anonymous mappings that grow in place or move (the
//! content is kept) and are faulted in when they grow (`MADV_POPULATE_WRITE`), so a snapshot into
//! a warm buffer never takes a page fault. Transparent huge pages are not asked for: with this
//! kernel's default `defrag=madvise`, faulting 1.2 GB in with `MADV_HUGEPAGE` stalled 3-6.5 s in
//! compaction against 0.8-1.7 s without, for no measurable gain in the copies (2026-11-30). Page alignment is what lets the writer
//! hand the bytes to the disk with `O_DIRECT` (no copy into the page cache), and what lets a GPU's
//! runtime pin the memory (`pin.rs`).
//!
//! Also the copy into those buffers: `stream_copy` splits a large copy across threads and uses
//! non-temporal stores, which skip reading the destination's cache lines first (a plain copy of a
//! large buffer moves three bytes for every byte copied; this one two) and leave the caches alone.

use std::ptr::NonNull;

/// The alignment of every buffer and of the file offsets written with `O_DIRECT`.
pub(crate) const PAGE: usize = 4096;
/// Buffers grow in steps of 2 MiB (at least doubling).
const HUGE: usize = 2 << 20;

/// A growable, page-aligned byte buffer backed by its own anonymous mapping.
pub(crate) struct HostBuf {
    ptr: NonNull<u8>,
    /// Bytes mapped (a multiple of `HUGE`; 0: nothing mapped).
    cap: usize,
    /// Bytes in use, all faulted in.
    len: usize,
    /// The pinning of the mapped range, if any; undone before the mapping moves or goes.
    pinned: Option<crate::pin::Pinned>,
}

// SAFETY: HostBuf owns its mapping exclusively (like a Vec<u8>); nothing else holds the pointer,
// so moving it to another thread or sharing `&HostBuf` (read-only bytes) is sound.
unsafe impl Send for HostBuf {}
// SAFETY: see above; `&HostBuf` gives only shared access to plain bytes.
unsafe impl Sync for HostBuf {}

impl HostBuf {
    pub(crate) fn new() -> HostBuf {
        HostBuf { ptr: NonNull::dangling(), cap: 0, len: 0, pinned: None }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes of memory this buffer has faulted in (its high-water mark).
    pub(crate) fn resident(&self) -> usize {
        self.len
    }

    /// Grows to `len` bytes (never shrinks), keeping the content; new bytes are zero.
    pub(crate) fn grow_to(&mut self, len: usize) -> std::io::Result<()> {
        self.grow(len, true)
    }

    /// `grow_to`, leaving the new pages to fault in when first written (by a copy off the
    /// step's path) instead of now.
    pub(crate) fn grow_to_lazily(&mut self, len: usize) -> std::io::Result<()> {
        self.grow(len, false)
    }

    fn grow(&mut self, len: usize, populate: bool) -> std::io::Result<()> {
        if len <= self.len {
            return Ok(());
        }
        if len > self.cap {
            let cap = len.max(self.cap.saturating_mul(2)).div_ceil(HUGE) * HUGE;
            self.remap(cap)?;
        }
        if !populate {
            // Fresh anonymous pages read as zero, as `grow_to`'s do.
            self.len = len;
            return Ok(());
        }
        // Fault the new pages in now (the first snapshots pay for it, later ones reuse them).
        // Fresh anonymous pages are zero, and bytes of a grown buffer past `len` were never
        // written (growth only ever extends `len`), so the new bytes read as zero either way.
        let start = self.len / PAGE * PAGE;
        // SAFETY: advice on pages [start, end) of our own mapping (end <= cap: cap is a multiple
        // of HUGE, hence of PAGE); populating maps them without changing their content.
        let rc = unsafe {
            libc::madvise(
                self.ptr.as_ptr().add(start).cast(),
                len.div_ceil(PAGE) * PAGE - start,
                libc::MADV_POPULATE_WRITE,
            )
        };
        if rc != 0 {
            // A kernel before 5.14: touch the pages instead.
            // SAFETY: [self.len, len) lies inside the mapping of `cap` bytes, which we own.
            unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(self.len), 0, len - self.len) };
        }
        self.len = len;
        Ok(())
    }

    fn remap(&mut self, cap: usize) -> std::io::Result<()> {
        // A pinned range is unpinned before its pages move.
        self.pinned = None;
        let ptr = if self.cap == 0 {
            // SAFETY: a fresh private anonymous mapping; no memory of ours is touched.
            unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    cap,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            }
        } else {
            // SAFETY: `ptr`/`cap` is our own mapping; mremap moves it whole (content kept) and
            // the old address is not used afterwards (we store the new one below).
            unsafe { libc::mremap(self.ptr.as_ptr().cast(), self.cap, cap, libc::MREMAP_MAYMOVE) }
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        self.ptr = NonNull::new(ptr.cast()).expect("mmap never returns null on success");
        self.cap = cap;
        Ok(())
    }
}

impl HostBuf {
    /// Pins the pages in use through `pinner` (the CUDA runtime); a buffer that grew since (and
    /// so may have moved, or have more pages in use) is pinned again.
    pub(crate) fn pin_with(&mut self, pinner: &std::sync::Arc<crate::pin::Pinner>) -> Result<(), String> {
        let len = self.len.div_ceil(PAGE) * PAGE;
        if len == 0 || self.pinned.as_ref().is_some_and(|p| p.len() >= len) {
            return Ok(());
        }
        self.pinned = None;
        self.pinned = Some(pinner.pin(self.ptr.as_ptr(), len)?);
        Ok(())
    }

    #[cfg(test)]
    pub(crate) fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }

    /// Bytes page-locked now.
    pub(crate) fn pinned_bytes(&self) -> usize {
        self.pinned.as_ref().map_or(0, |p| p.len())
    }
}

impl std::ops::Deref for HostBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` bytes from `ptr` are mapped, initialized (zeroed or written) and ours;
        // with len 0 the dangling pointer is non-null and aligned, as an empty slice needs.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for HostBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        self.pinned = None;
        if self.cap > 0 {
            // SAFETY: our own mapping, unmapped once; no slice of it outlives `self`.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.cap) };
        }
    }
}

/// An aligned, zeroed block of `len` bytes rounded up to whole pages, for the header and the tail
/// of a file written with `O_DIRECT` (and a disk benchmark that writes the same way).
pub struct AlignedBlock {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

impl AlignedBlock {
    pub fn zeroed(len: usize) -> AlignedBlock {
        let layout = std::alloc::Layout::from_size_align(len.max(PAGE).div_ceil(PAGE) * PAGE, PAGE)
            .expect("a page-aligned layout of a sane size");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBlock { ptr, layout }
    }
}

impl std::ops::Deref for AlignedBlock {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `layout.size()` zeroed bytes allocated by us.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl std::ops::DerefMut for AlignedBlock {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBlock {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Below this many bytes a copy stays on the calling thread.
const PARALLEL_MIN: usize = 8 << 20;

/// Copies `src` into `dst` (same length): large copies on up to `threads` threads, with
/// non-temporal stores on x86-64.
pub fn stream_copy(dst: &mut [u8], src: &[u8], threads: usize) {
    assert_eq!(dst.len(), src.len(), "stream_copy needs equal lengths");
    split_across(dst, src, threads, copy_one);
}

/// Runs `work` on consecutive pieces of `dst` and `src` (whole cache lines, one per thread, up to
/// `threads` of them; a copy under `PARALLEL_MIN / 2` per thread stays on the calling thread,
/// which always takes the last piece), and returns each piece's result in order.
fn split_across<R: Send>(
    dst: &mut [u8],
    src: &[u8],
    threads: usize,
    work: impl Fn(&mut [u8], &[u8]) -> R + Sync,
) -> Vec<R> {
    let threads = threads.clamp(1, 64).min(dst.len() / (PARALLEL_MIN / 2)).max(1);
    if threads == 1 {
        return vec![work(dst, src)];
    }
    let piece = dst.len().div_ceil(threads).div_ceil(64) * 64;
    let work = &work;
    std::thread::scope(|scope| {
        let mut pieces = dst.chunks_mut(piece).zip(src.chunks(piece)).peekable();
        let mut spawned = Vec::new();
        let mut last = None;
        while let Some((d, s)) = pieces.next() {
            if pieces.peek().is_some() {
                spawned.push(scope.spawn(move || work(d, s)));
            } else {
                last = Some(work(d, s));
            }
        }
        let mut out: Vec<R> = spawned.into_iter().map(|h| h.join().expect("a copy thread does not panic")).collect();
        out.extend(last);
        out
    })
}

/// The CRC-32 (IEEE, the manifests' checksum) of `bytes`.
pub fn checksum(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// The CRC-32 of consecutive pieces, each given as (its CRC-32, its length in bytes).
pub fn checksum_concat(pieces: impl IntoIterator<Item = (u32, usize)>) -> u32 {
    let mut total: Option<crc32fast::Hasher> = None;
    // Empty pieces change nothing (a kernel's head and tail often are).
    for (crc, len) in pieces.into_iter().filter(|&(_, len)| len > 0) {
        let piece = crc32fast::Hasher::new_with_initial_len(crc, len as u64);
        match &mut total {
            Some(total) => total.combine(&piece),
            None => total = Some(piece),
        }
    }
    total.map_or(0, crc32fast::Hasher::finalize)
}

/// A checksummed copy hashes each piece of this many bytes right after copying it, while the
/// source is still in the core's cache (L2 holds it), so the hash reads no memory of its own.
const CHECKSUM_PIECE: usize = 256 << 10;

/// `stream_copy`, returning the CRC-32 of the bytes copied. Each piece is hashed just after it is
/// copied, from the cache: a writer handed the result (`Snapshot::add_checksums`) need not read
/// the buffer again to checksum it.
pub fn stream_copy_checksummed(dst: &mut [u8], src: &[u8], threads: usize) -> u32 {
    assert_eq!(dst.len(), src.len(), "stream_copy_checksummed needs equal lengths");
    let hashers = split_across(dst, src, threads, |dst, src| {
        let mut hasher = crc32fast::Hasher::new();
        for (d, s) in dst.chunks_mut(CHECKSUM_PIECE).zip(src.chunks(CHECKSUM_PIECE)) {
            copy_one(d, s);
            hasher.update(s);
        }
        hasher
    });
    let mut total = crc32fast::Hasher::new();
    for hasher in &hashers {
        total.combine(hasher);
    }
    total.finalize()
}

#[cfg(target_arch = "x86_64")]
fn copy_one(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    if dst.len() < 1 << 16 {
        dst.copy_from_slice(src);
        return;
    }
    // A plain copy up to the first 64-byte boundary of the destination, streaming stores of
    // whole lines after it, and a plain copy of what is left.
    let head = dst.as_ptr().align_offset(64).min(dst.len());
    dst[..head].copy_from_slice(&src[..head]);
    let body = (dst.len() - head) / 64 * 64;
    let (d, s) = (dst[head..].as_mut_ptr(), src[head..].as_ptr());
    let mut i = 0;
    while i < body {
        // SAFETY: [i, i + 64) lies within both slices' bodies (body <= len - head); `d + i` is
        // 16-byte aligned (64-byte aligned at head), as _mm_stream_si128 requires; the loads
        // are unaligned loads. SSE2 is part of x86-64.
        unsafe {
            let s = s.add(i).cast::<__m128i>();
            let d = d.add(i).cast::<__m128i>();
            let (a, b, c, e) =
                (_mm_loadu_si128(s), _mm_loadu_si128(s.add(1)), _mm_loadu_si128(s.add(2)), _mm_loadu_si128(s.add(3)));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        i += 64;
    }
    // SAFETY: a store fence orders the streaming stores before anything this thread does next
    // (the join that hands the buffer to the writer).
    unsafe { _mm_sfence() };
    dst[head + body..].copy_from_slice(&src[head + body..]);
}

#[cfg(not(target_arch = "x86_64"))]
fn copy_one(dst: &mut [u8], src: &[u8]) {
    dst.copy_from_slice(src);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_in_place_or_moves_with_its_content_and_stays_aligned() {
        let mut buf = HostBuf::new();
        assert!(buf.is_empty());
        buf.grow_to(10).unwrap();
        buf[..10].copy_from_slice(b"0123456789");
        buf.grow_to(5 << 20).unwrap();
        buf.grow_to(3).unwrap();
        assert_eq!(buf.len(), 5 << 20);
        assert_eq!(&buf[..10], b"0123456789");
        assert!(buf[10..].iter().all(|&b| b == 0));
        // Grown without faulting in (and moved): the same content, zeros after it, writable.
        buf.grow_to_lazily(40 << 20).unwrap();
        assert_eq!((buf.len(), &buf[..10]), (40 << 20, &b"0123456789"[..]));
        assert!(buf[10..].iter().all(|&b| b == 0));
        buf[(40 << 20) - 1] = 7;
        assert_eq!(buf.as_ptr() as usize % PAGE, 0);
        let block = AlignedBlock::zeroed(100);
        assert_eq!((block.len(), block.as_ptr() as usize % PAGE), (PAGE, 0));
    }

    #[test]
    fn a_checksummed_copy_gives_the_bytes_and_their_crc() {
        let src: Vec<u8> = (0..(9 << 20) + 333).map(|i| (i * 13 % 249) as u8).collect();
        for (offset, len, threads) in [(0, src.len(), 2), (7, src.len() - 7, 3), (1, 300_001, 2), (0, 0, 2), (2, 5, 1)]
        {
            let mut dst = vec![0u8; len + 9];
            let crc = stream_copy_checksummed(&mut dst[offset..offset + len], &src[..len], threads);
            assert_eq!(&dst[offset..offset + len], &src[..len], "offset {offset} len {len}");
            assert_eq!(crc, crc32fast::hash(&src[..len]), "offset {offset} len {len} threads {threads}");
        }
        let parts = [0..3, 3..3, 3..1000, 1000..src.len()].map(|r| (crc32fast::hash(&src[r.clone()]), r.len()));
        assert_eq!(checksum_concat(parts), crc32fast::hash(&src));
    }

    #[test]
    fn stream_copy_copies_every_byte_at_any_offset() {
        let src: Vec<u8> = (0..(20 << 20) + 77).map(|i| (i * 31 % 251) as u8).collect();
        for (offset, len, threads) in [(0, src.len(), 2), (3, src.len() - 3, 3), (5, 70_001, 2), (1, 100, 4)] {
            let mut dst = vec![0u8; len + 9];
            stream_copy(&mut dst[offset..offset + len], &src[..len], threads);
            assert_eq!(&dst[offset..offset + len], &src[..len], "offset {offset} len {len}");
            assert!(dst[..offset].iter().chain(&dst[offset + len..]).all(|&b| b == 0));
        }
    }
}
