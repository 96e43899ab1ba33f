//! A token dataset opened for reading: one or more segments of little-endian tokens (memory-mapped
//! shards, or bytes in memory), seen as one stream. Opening reads only headers and manifests, so it
//! costs the same for a thousand tokens and for a billion.

use std::cell::Cell;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use memmap2::Mmap;

use crate::format::{
    raw_layout, sibling, Dtype, MegatronIndex, TokenIndexHeader, TokenManifest, MEGATRON_HEADER, TOKEN_INDEX_HEADER,
    TOKEN_MANIFEST,
};
use crate::DataError;

thread_local! {
    /// Bytes that opening datasets read from files on this thread (headers, indexes, manifests).
    static STARTUP_BYTES_READ: Cell<u64> = const { Cell::new(0) };
}

/// How many bytes of headers, indexes and manifests this thread has read while opening datasets:
/// tests count this work instead of timing start-up.
pub fn startup_bytes_read() -> u64 {
    STARTUP_BYTES_READ.with(Cell::get)
}

fn count_read(n: usize) {
    STARTUP_BYTES_READ.with(|c| c.set(c.get() + n as u64));
}

enum Bytes {
    Mapped(Mmap),
    Memory(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(map) => map,
            Bytes::Memory(bytes) => bytes,
        }
    }
}

struct Segment {
    bytes: Bytes,
    data_offset: usize,
    dtype: Dtype,
    n_tokens: u64,
    /// The file the tokens come from, or a description for in-memory data.
    path: PathBuf,
    /// The manifest's CRC-32 of the whole file, for prepared shards; none for formats without one.
    expected_crc: Option<u32>,
    /// The CRC-32 as computed, once: by the background check started at open, or by the first
    /// reader that gets there before it (which then waits for it).
    computed_crc: OnceLock<u32>,
}

impl Segment {
    /// Whether the bytes match the manifest's CRC-32; the first call hashes the whole file.
    fn verify(&self) -> Result<(), DataError> {
        let Some(expected) = self.expected_crc else { return Ok(()) };
        let actual = *self.computed_crc.get_or_init(|| crc32fast::hash(self.bytes.as_slice()));
        if actual != expected {
            return Err(DataError::ChecksumMismatch { path: self.path.clone(), expected, actual });
        }
        Ok(())
    }
}

/// A read-only token stream over one or more segments; cheap to clone (shared by loader workers).
#[derive(Clone)]
pub struct TokenStore {
    segments: Arc<Vec<Segment>>,
    /// `starts[i]` is the stream offset of segment `i`; `starts[len]` is the total.
    starts: Arc<Vec<u64>>,
    n_documents: u64,
    vocab_size: Option<u64>,
    label: String,
    /// The visible window of the segments' stream: `[base, base + len)` (all of it unless split
    /// by `split_tail`); offsets given to `read`, `prefetch` and `path_of` are relative to it.
    base: u64,
    len: u64,
}

impl std::fmt::Debug for TokenStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenStore")
            .field("label", &self.label)
            .field("n_segments", &self.segments.len())
            .field("n_tokens", &self.n_tokens())
            .finish()
    }
}

fn read_small(path: &Path) -> Result<Vec<u8>, DataError> {
    let bytes = stoke_fsio::read_capped(path, stoke_fsio::MANIFEST_CAP).map_err(DataError::read(path))?;
    count_read(bytes.len());
    Ok(bytes)
}

fn read_head(path: &Path, n: usize) -> Result<(Vec<u8>, u64), DataError> {
    let file = File::open(path).map_err(DataError::read(path))?;
    let len = file.metadata().map_err(DataError::read(path))?.len();
    let mut head = Vec::with_capacity(n);
    file.take(n as u64).read_to_end(&mut head).map_err(DataError::read(path))?;
    count_read(head.len());
    Ok((head, len))
}

fn map(path: &Path) -> Result<Mmap, DataError> {
    let file = File::open(path).map_err(DataError::read(path))?;
    // SAFETY: shards are written once by `stoke prep` (or another tool) and never modified while a
    // run reads them; a concurrent writer would be a user error, as with any mmap-based loader.
    let map = unsafe { Mmap::map(&file) }.map_err(DataError::read(path))?;
    // Rows are read at random offsets a few KiB long: read-ahead would only evict useful pages.
    #[cfg(unix)]
    let _ = map.advise(memmap2::Advice::Random);
    Ok(map)
}

impl TokenStore {
    fn from_segments(segments: Vec<Segment>, n_documents: u64, vocab_size: Option<u64>, label: String) -> TokenStore {
        let mut starts = Vec::with_capacity(segments.len() + 1);
        let mut total = 0u64;
        for segment in &segments {
            starts.push(total);
            total += segment.n_tokens;
        }
        starts.push(total);
        TokenStore {
            segments: Arc::new(segments),
            starts: Arc::new(starts),
            n_documents,
            vocab_size,
            label,
            base: 0,
            len: total,
        }
    }

    /// Tokens held in memory, one byte each (the built-in corpus, byte-level text).
    pub fn from_bytes(bytes: Vec<u8>, label: &str) -> TokenStore {
        let n_tokens = bytes.len() as u64;
        let segment = Segment {
            bytes: Bytes::Memory(bytes),
            data_offset: 0,
            dtype: Dtype::U8,
            n_tokens,
            path: PathBuf::from(label),
            expected_crc: None,
            computed_crc: OnceLock::new(),
        };
        TokenStore::from_segments(vec![segment], 1, Some(256), label.to_string())
    }

    /// Tokens held in memory as `u32` (tests, small generated data).
    pub fn from_u32(tokens: &[u32], label: &str) -> TokenStore {
        let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        let n_tokens = tokens.len() as u64;
        let segment = Segment {
            bytes: Bytes::Memory(bytes),
            data_offset: 0,
            dtype: Dtype::U32,
            n_tokens,
            path: PathBuf::from(label),
            expected_crc: None,
            computed_crc: OnceLock::new(),
        };
        TokenStore::from_segments(vec![segment], 1, None, label.to_string())
    }

    /// Opens whatever `path` is: a prepared stoke directory, a Megatron `.bin`/`.idx` pair (either
    /// name, or the common prefix), or a raw token file (`.bin`, llm.c header or headerless u16).
    pub fn open(path: &Path) -> Result<TokenStore, DataError> {
        if path.is_dir() {
            return TokenStore::open_prepared(path);
        }
        let idx = sibling(path, "idx");
        let bin = sibling(path, "bin");
        if idx.is_file() && bin.is_file() {
            let (head, _) = read_head(&idx, 9)?;
            if head.starts_with(b"MMIDIDX") {
                return TokenStore::open_megatron(&bin);
            }
        }
        if path.is_file() && path.extension().is_some_and(|e| e == "bin") {
            return TokenStore::open_raw(path, Dtype::U16);
        }
        if path.is_file() {
            return Err(DataError::UnknownFormat { path: path.to_path_buf() });
        }
        Err(DataError::Read { path: path.to_path_buf(), source: std::io::ErrorKind::NotFound.into() })
    }

    /// Opens a directory written by `stoke prep text`.
    pub fn open_prepared(dir: &Path) -> Result<TokenStore, DataError> {
        let manifest_path = dir.join(TOKEN_MANIFEST);
        let manifest = TokenManifest::parse(&manifest_path, &read_small(&manifest_path)?)?;
        let label = dir.display().to_string();
        TokenStore::open_manifest(&manifest, &label, |name| Ok(dir.join(name)))
    }

    /// Opens the shards of `manifest`, finding each file through `resolve` (a directory, a cache).
    pub fn open_manifest(
        manifest: &TokenManifest,
        label: &str,
        mut resolve: impl FnMut(&str) -> Result<PathBuf, DataError>,
    ) -> Result<TokenStore, DataError> {
        let mut segments = Vec::with_capacity(manifest.shards.len());
        for shard in &manifest.shards {
            let idx_path = resolve(&shard.idx)?;
            let (head, idx_len) = read_head(&idx_path, TOKEN_INDEX_HEADER)?;
            // Parse the header alone: the document offsets are not needed to read tokens, and reading
            // them would make start-up grow with the dataset.
            let header = TokenIndexHeader::parse_head(&idx_path, &head, idx_len)?;
            if header.dtype != manifest.dtype {
                return Err(DataError::DtypeMismatch {
                    path: idx_path,
                    offset: 8,
                    expected: manifest.dtype.name().into(),
                    found: header.dtype.name().into(),
                });
            }
            if header.n_tokens != shard.n_tokens || header.n_documents != shard.n_documents {
                return Err(DataError::Corrupt {
                    path: idx_path,
                    what: "index header",
                    offset: 16,
                    detail: format!(
                        "{} tokens in {} documents, the manifest says {} in {}",
                        header.n_tokens, header.n_documents, shard.n_tokens, shard.n_documents
                    ),
                });
            }
            let bin_path = resolve(&shard.bin)?;
            let bytes = map(&bin_path)?;
            let needed = shard.n_tokens * manifest.dtype.size() as u64;
            if bytes.len() as u64 != needed {
                return Err(DataError::Truncated {
                    path: bin_path,
                    what: "tokens",
                    offset: 0,
                    needed,
                    len: bytes.len() as u64,
                });
            }
            segments.push(Segment {
                bytes: Bytes::Mapped(bytes),
                data_offset: 0,
                dtype: manifest.dtype,
                n_tokens: shard.n_tokens,
                path: bin_path,
                expected_crc: Some(shard.bin_crc32),
                computed_crc: OnceLock::new(),
            });
        }
        let store =
            TokenStore::from_segments(segments, manifest.n_documents, Some(manifest.vocab_size), label.to_string());
        store.start_verifying();
        Ok(store)
    }

    /// Hashes every shard that has a CRC in the manifest on a background thread, in stream order,
    /// so that a flipped bit is found without reading the whole dataset before the first batch.
    /// A reader that reaches a shard first hashes it itself ([`TokenStore::verify_at`]).
    fn start_verifying(&self) {
        if self.segments.iter().all(|segment| segment.expected_crc.is_none()) {
            return;
        }
        let segments = Arc::clone(&self.segments);
        let spawned = std::thread::Builder::new().name("stoke-shard-crc".into()).spawn(move || {
            for segment in segments.iter() {
                // A mismatch is reported to the reader of that shard; here the hash is only made.
                let _ = segment.verify();
            }
        });
        // Without a thread, every shard is hashed by its first reader instead.
        drop(spawned);
    }

    /// Checks the CRC-32 of the shard holding stream offset `token` (relative to this store's
    /// window), hashing it now if no one has yet: a shard whose bytes differ from the manifest is
    /// never read into a batch. After the first call per shard it costs an atomic load.
    pub fn verify_at(&self, token: u64) -> Result<(), DataError> {
        let token = (token + self.base).min(self.starts[self.segments.len()].saturating_sub(1));
        let segment_idx = self.starts.partition_point(|&s| s <= token).saturating_sub(1);
        self.segments[segment_idx.min(self.segments.len() - 1)].verify()
    }

    /// Opens a Megatron-LM dataset by its `.bin` path (the `.idx` sits next to it).
    pub fn open_megatron(bin_path: &Path) -> Result<TokenStore, DataError> {
        let idx_path = sibling(bin_path, "idx");
        let (head, idx_len) = read_head(&idx_path, MEGATRON_HEADER)?;
        let index = MegatronIndex::parse_head(&idx_path, &head, idx_len)?;
        let bytes = map(bin_path)?;
        let size = index.dtype.size() as u64;
        let len = bytes.len() as u64;
        if len % size != 0 {
            return Err(DataError::DtypeMismatch {
                path: bin_path.to_path_buf(),
                offset: len - len % size,
                expected: format!("a whole number of {} tokens", index.dtype.name()),
                found: format!("{len} bytes"),
            });
        }
        let segment = Segment {
            bytes: Bytes::Mapped(bytes),
            data_offset: 0,
            dtype: index.dtype,
            n_tokens: len / size,
            path: bin_path.into(),
            expected_crc: None,
            computed_crc: OnceLock::new(),
        };
        Ok(TokenStore::from_segments(vec![segment], index.n_sequences, None, bin_path.display().to_string()))
    }

    /// Opens a raw token file: llm.c's header if present, else headerless tokens of `dtype`.
    pub fn open_raw(path: &Path, dtype: Dtype) -> Result<TokenStore, DataError> {
        let (head, len) = read_head(path, 12)?;
        let layout = raw_layout(path, &head, len, dtype)?;
        let bytes = map(path)?;
        let segment = Segment {
            bytes: Bytes::Mapped(bytes),
            data_offset: layout.data_offset as usize,
            dtype: layout.dtype,
            n_tokens: layout.n_tokens,
            path: path.into(),
            expected_crc: None,
            computed_crc: OnceLock::new(),
        };
        Ok(TokenStore::from_segments(vec![segment], 1, None, path.display().to_string()))
    }

    pub fn n_tokens(&self) -> u64 {
        self.len
    }

    /// Splits off a held-out tail of about `fraction` of the tokens: whole files (shards, which
    /// never split a document) when there are several, else the stream's last tokens. Returns
    /// (the rest, the tail); both share the mapped data. Errors when a part would hold fewer than
    /// `min_tokens`.
    pub fn split_tail(&self, fraction: f64, min_tokens: u64) -> Result<(TokenStore, TokenStore), DataError> {
        let total = self.len;
        let target = self.base + (total as f64 * (1.0 - fraction)).round() as u64;
        let inner: Vec<u64> = self.starts.iter().copied().filter(|&s| s > self.base && s < self.base + total).collect();
        let cut = match inner.iter().min_by_key(|&&s| s.abs_diff(target)) {
            Some(&boundary) => boundary,
            None => target,
        };
        let head_len = cut - self.base;
        let tail_len = total - head_len;
        if head_len < min_tokens || tail_len < min_tokens {
            return Err(DataError::TooShortInMemory {
                n_tokens: head_len.min(tail_len) as usize,
                needed: min_tokens as usize,
            });
        }
        let head = TokenStore { len: head_len, label: format!("{} (training part)", self.label), ..self.clone() };
        let tail = TokenStore { base: cut, len: tail_len, label: format!("{} (held out)", self.label), ..self.clone() };
        Ok((head, tail))
    }

    pub fn n_documents(&self) -> u64 {
        self.n_documents
    }

    /// The vocabulary size the preparer recorded, if the format has one.
    pub fn vocab_size(&self) -> Option<u64> {
        self.vocab_size
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    /// Copies tokens `[start, start + out.len())` of the stream into `out`, widening to i64.
    /// Panics if the range is outside the stream (callers derive ranges from `n_tokens`).
    pub fn read(&self, start: u64, out: &mut [i64]) {
        let end = start + out.len() as u64;
        assert!(end <= self.n_tokens(), "token range {start}..{end} beyond {}", self.n_tokens());
        let start = start + self.base;
        // The segment holding `start`: the last one whose start is <= start.
        let mut segment_idx = self.starts.partition_point(|&s| s <= start) - 1;
        let mut position = start;
        let mut written = 0usize;
        // Invariant: out[..written] holds tokens [start, position).
        while written < out.len() {
            let segment = &self.segments[segment_idx];
            let local = position - self.starts[segment_idx];
            let take = ((segment.n_tokens - local) as usize).min(out.len() - written);
            let size = segment.dtype.size();
            let from = segment.data_offset + local as usize * size;
            segment.dtype.widen(&segment.bytes.as_slice()[from..from + take * size], &mut out[written..written + take]);
            written += take;
            position += take as u64;
            segment_idx += 1;
            debug_assert_eq!(position - start, written as u64);
        }
    }

    /// Hints the CPU to start loading tokens `[start, start + len)` into cache, so that the next
    /// `read` of them overlaps its memory latency with the current work. Never faults.
    pub fn prefetch(&self, start: u64, len: usize) {
        let start = start + self.base;
        let segment_idx = self.starts.partition_point(|&s| s <= start).saturating_sub(1);
        let Some(segment) = self.segments.get(segment_idx) else { return };
        let local = start.saturating_sub(self.starts[segment_idx]);
        let size = segment.dtype.size();
        let bytes = segment.bytes.as_slice();
        let from = (segment.data_offset + local as usize * size).min(bytes.len());
        let to = (from + len * size).min(bytes.len());
        #[cfg(target_arch = "x86_64")]
        for line in (from..to).step_by(64) {
            // SAFETY: a prefetch is only a hint and never faults; the address is inside the mapping.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    bytes.as_ptr().add(line) as *const i8
                )
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (from, to);
    }

    /// The file behind stream offset `token` (for error messages).
    pub fn path_of(&self, token: u64) -> &Path {
        let token = token + self.base;
        let segment_idx = self.starts.partition_point(|&s| s <= token).saturating_sub(1);
        &self.segments[segment_idx.min(self.segments.len() - 1)].path
    }
}

/// Reads a prepared directory completely: checks every file's crc32 against the manifest, every
/// index's document offsets and sizes. O(dataset); `stoke prep verify` runs it, training hashes the
/// token files in the background instead (`TokenStore::verify_at`).
pub fn verify_prepared(dir: &Path) -> Result<TokenManifest, DataError> {
    let manifest_path = dir.join(TOKEN_MANIFEST);
    let manifest = TokenManifest::parse(&manifest_path, &read_small(&manifest_path)?)?;
    for shard in &manifest.shards {
        let idx_path = dir.join(&shard.idx);
        let index = std::fs::read(&idx_path).map_err(DataError::read(&idx_path))?;
        check_crc(&idx_path, &index, shard.idx_crc32)?;
        let header = TokenIndexHeader::parse(&idx_path, &index)?;
        header.check_offsets(&idx_path, &index)?;
    }
    // Opening checks each token file's size against its index; the store's own per-shard hash
    // (shared with its background check, so no file is hashed twice) checks the bytes.
    let store = TokenStore::open_prepared(dir)?;
    for segment in store.segments.iter() {
        segment.verify()?;
    }
    Ok(manifest)
}

pub(crate) fn check_crc(path: &Path, bytes: &[u8], expected: u32) -> Result<(), DataError> {
    let actual = crc32fast::hash(bytes);
    if actual != expected {
        return Err(DataError::ChecksumMismatch { path: path.to_path_buf(), expected, actual });
    }
    Ok(())
}

#[cfg(test)]
mod split_tests {
    use super::*;

    #[test]
    fn one_segment_splits_at_the_tail() {
        let store = TokenStore::from_u32(&(0..1000).collect::<Vec<_>>(), "counting");
        let (head, tail) = store.split_tail(0.1, 10).unwrap();
        assert_eq!((head.n_tokens(), tail.n_tokens()), (900, 100));
        let mut out = [0i64; 3];
        tail.read(0, &mut out);
        assert_eq!(out, [900, 901, 902], "the tail starts where the head ends");
        head.read(897, &mut out);
        assert_eq!(out, [897, 898, 899]);
        assert!(store.split_tail(0.5, 600).is_err(), "a part shorter than asked is refused");
    }

    #[test]
    fn several_segments_split_at_a_file_boundary() {
        let seg = |first: u32| Segment {
            bytes: Bytes::Memory((first..first + 100).flat_map(|t| t.to_le_bytes()).collect()),
            data_offset: 0,
            dtype: Dtype::U32,
            n_tokens: 100,
            path: PathBuf::from(format!("shard-{first}")),
            expected_crc: None,
            computed_crc: OnceLock::new(),
        };
        let store = TokenStore::from_segments(vec![seg(0), seg(1000), seg(2000), seg(3000)], 4, None, "s".into());
        let (head, tail) = store.split_tail(0.2, 1).unwrap();
        assert_eq!((head.n_tokens(), tail.n_tokens()), (300, 100), "the nearest file boundary to 80%");
        let mut out = [0i64; 2];
        tail.read(0, &mut out);
        assert_eq!(out, [3000, 3001]);
        assert_eq!(tail.path_of(5), Path::new("shard-3000"));
    }
}
