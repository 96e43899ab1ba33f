//! Tensors in the safetensors layout, written as a stream: an 8-byte header length, the JSON
//! header, then each tensor's bytes in order. Writing from the caller's buffers (no serialized
//! copy of the whole file) keeps a save at the disk's speed; the CRC-32 is computed on the way.
//! Reading goes through the `safetensors` crate, which validates what we wrote.

use std::io::Write;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use crate::error::io;
use crate::hostbuf::{AlignedBlock, PAGE};
use crate::CkptError;

/// Element types a checkpoint stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DType {
    F32,
    BF16,
    I64,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 => 2,
            DType::I64 => 8,
        }
    }

    /// The name safetensors uses in its header.
    fn safetensors_name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::BF16 => "BF16",
            DType::I64 => "I64",
        }
    }

    fn from_safetensors(dtype: Dtype) -> Option<DType> {
        match dtype {
            Dtype::F32 => Some(DType::F32),
            Dtype::BF16 => Some(DType::BF16),
            Dtype::I64 => Some(DType::I64),
            _ => None,
        }
    }
}

/// One named tensor's bytes (little-endian, row-major), as safetensors holds them.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorRecord {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl TensorRecord {
    pub fn new(
        name: impl Into<String>,
        dtype: DType,
        shape: Vec<usize>,
        data: Vec<u8>,
    ) -> Result<TensorRecord, CkptError> {
        let name = name.into();
        check_size(&name, dtype, &shape, data.len())?;
        Ok(TensorRecord { name, dtype, shape, data })
    }
}

pub(crate) fn check_size(name: &str, dtype: DType, shape: &[usize], len: usize) -> Result<(), CkptError> {
    let expected = shape.iter().product::<usize>() * dtype.size();
    if len != expected {
        return Err(CkptError::BadTensor {
            name: name.to_string(),
            message: format!("shape {shape:?} of {dtype:?} needs {expected} bytes, got {len}"),
        });
    }
    Ok(())
}

/// A tensor borrowed for writing.
pub(crate) struct TensorRef<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

/// What one file of a checkpoint holds, borrowed: `<stem>.safetensors`.
pub(crate) struct FileSource<'a> {
    pub stem: &'a str,
    pub tensors: Vec<TensorRef<'a>>,
    /// All of `tensors`' bytes as one slice, when they lie back to back in one buffer (a
    /// snapshot's host buffer): written to the disk straight from there when page-aligned.
    pub body: Option<&'a [u8]>,
    /// CRC-32s of pieces of `body` already known (offset, bytes, CRC-32; sorted, apart): hashed
    /// by whoever filled them, while the bytes were in cache, so the write hashes only the rest.
    pub known: Vec<(usize, usize, u32)>,
}

/// The CRC-32 of `body`: the pieces in `known` (offset, bytes, CRC-32; sorted, apart) combined as
/// they are, the bytes between them hashed.
fn body_checksum(body: &[u8], known: &[(usize, usize, u32)]) -> crc32fast::Hasher {
    let mut hasher = crc32fast::Hasher::new();
    let mut at = 0;
    for &(offset, len, crc) in known {
        // Invariant: the pieces are sorted and apart, so `at` never passes the next one.
        debug_assert!(at <= offset && offset + len <= body.len(), "known pieces sorted, apart, in the body");
        hasher.update(&body[at..offset]);
        hasher.combine(&crc32fast::Hasher::new_with_initial_len(crc, len as u64));
        at = offset + len;
    }
    hasher.update(&body[at..]);
    hasher
}

/// The safetensors header of `tensors`, padded with spaces so the data starts at a multiple of
/// `PAGE` (4096) bytes: the data can then be written with `O_DIRECT`, and it is 8-byte aligned as
/// safetensors readers expect.
fn header(tensors: &[TensorRef<'_>]) -> Result<Vec<u8>, CkptError> {
    let mut map = serde_json::Map::new();
    let mut offset = 0usize;
    for t in tensors {
        check_size(t.name, t.dtype, t.shape, t.data.len())?;
        if t.name == "__metadata__" || map.contains_key(t.name) {
            return Err(CkptError::BadTensor { name: t.name.into(), message: "name is reserved or used twice".into() });
        }
        let entry = serde_json::json!({
            "dtype": t.dtype.safetensors_name(),
            "shape": t.shape,
            "data_offsets": [offset, offset + t.data.len()],
        });
        map.insert(t.name.to_string(), entry);
        offset += t.data.len();
    }
    let mut json = serde_json::to_vec(&serde_json::Value::Object(map)).expect("a JSON map serializes");
    json.resize((8 + json.len()).div_ceil(PAGE) * PAGE - 8, b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// Bodies smaller than this are written through the page cache (a few pages gain nothing from
/// `O_DIRECT`). Low enough that the small models of the kill tests write with `O_DIRECT`.
const DIRECT_MIN: usize = 64 << 10;
/// Bytes per `O_DIRECT` write call (each is split into the device's requests by the kernel).
const DIRECT_CHUNK: usize = 32 << 20;
/// With buffered writes, writeback of every this many bytes is started at once and waited for
/// one window later, so at most two windows of dirty pages are ever pending.
const WRITEBACK_WINDOW: usize = 64 << 20;

/// Whether page-aligned bodies are written with `O_DIRECT` (the default). `STOKE_CKPT_DIRECT_IO=0`
/// writes every file through the page cache instead (a diagnostic switch; the files are the same).
fn direct_io_enabled() -> bool {
    std::env::var("STOKE_CKPT_DIRECT_IO").map_or(true, |v| v != "0")
}

/// Writes `source` to `path` (a new file), fsyncs it, and returns (bytes, CRC-32).
///
/// A body in a page-aligned host buffer goes to the disk with `O_DIRECT`: no copy into the page
/// cache, no dirty pages for the kernel to throttle against, and the writing thread sleeps while
/// the device works, leaving the cores to the training step; its CRC-32 is computed on a second
/// thread meanwhile. Where the filesystem refuses `O_DIRECT` (tmpfs, some network filesystems),
/// or for scattered tensors, the file is written through the page cache with writeback started
/// every `WRITEBACK_WINDOW` bytes. Either way the file's bytes are the same.
pub(crate) fn write_file(path: &Path, source: &FileSource<'_>) -> Result<(u64, u32), CkptError> {
    let head = header(&source.tensors)?;
    let body = source.body.filter(|b| b.len() >= DIRECT_MIN && b.as_ptr() as usize % PAGE == 0 && direct_io_enabled());
    if let Some(body) = body {
        debug_assert_eq!(body.len(), source.tensors.iter().map(|t| t.data.len()).sum::<usize>());
        if let Some(done) = write_direct(path, &head, body, source)? {
            return Ok(done);
        }
    }
    write_buffered(path, &head, &source.tensors)
}

/// The `O_DIRECT` path; `Ok(None)` when the filesystem does not take `O_DIRECT` (nothing written).
fn write_direct(
    path: &Path,
    head: &[u8],
    body: &[u8],
    source: &FileSource<'_>,
) -> Result<Option<(u64, u32)>, CkptError> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    let file = match std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(file) => file,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(None),
        Err(e) => return Err(CkptError::Io { action: "create", path: path.into(), source: e }),
    };
    let total = (head.len() + body.len()) as u64;
    let known = &source.known;
    let crc = std::thread::scope(|scope| -> Result<u32, CkptError> {
        let body_crc = scope.spawn(|| {
            let hasher = body_checksum(body, known);
            // Every test run (debug builds) checks the known pieces against the bytes.
            debug_assert!(
                known.is_empty() || hasher.clone().finalize() == crc32fast::hash(body),
                "a known CRC-32 is wrong"
            );
            hasher
        });
        let mut direct = true;
        // Writes `block` at `offset`; a device that refuses the alignment (EINVAL) gets the rest
        // of the file through the page cache.
        let mut put = |block: &[u8], offset: u64| -> Result<(), CkptError> {
            if direct {
                match file.write_all_at(block, offset) {
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        direct = false;
                        clear_direct(&file).map_err(io("write", path))?;
                    }
                    other => return other.map_err(io("write", path)),
                }
            }
            file.write_all_at(block, offset).map_err(io("write", path))
        };
        let mut first = AlignedBlock::zeroed(head.len());
        first[..head.len()].copy_from_slice(head);
        put(&first[..head.len()], 0)?;
        let whole = body.len() / PAGE * PAGE;
        for (i, chunk) in body[..whole].chunks(DIRECT_CHUNK).enumerate() {
            put(chunk, (head.len() + i * DIRECT_CHUNK) as u64)?;
        }
        if whole < body.len() {
            // The last partial page goes out whole (zero-padded), then the file is cut to size.
            let mut tail = AlignedBlock::zeroed(PAGE);
            tail[..body.len() - whole].copy_from_slice(&body[whole..]);
            put(&tail, (head.len() + whole) as u64)?;
            file.set_len(total).map_err(io("write", path))?;
        }
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(head);
        hasher.combine(&body_crc.join().expect("the CRC-32 thread does not panic"));
        Ok(hasher.finalize())
    })?;
    file.sync_all().map_err(io("fsync", path))?;
    Ok(Some((total, crc)))
}

/// Turns `O_DIRECT` off on an open file.
fn clear_direct(file: &std::fs::File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on a descriptor `file` keeps open; F_GETFL/F_SETFL touch no memory of ours.
    let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(file.as_raw_fd(), libc::F_SETFL, flags & !libc::O_DIRECT) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The page-cache path: writes in order, starting writeback every `WRITEBACK_WINDOW` bytes and
/// waiting for the window before the last, so dirty pages never pile up.
fn write_buffered(path: &Path, head: &[u8], tensors: &[TensorRef<'_>]) -> Result<(u64, u32), CkptError> {
    let file = std::fs::File::create(path).map_err(io("create", path))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    let mut crc = crc32fast::Hasher::new();
    let mut bytes = 0u64;
    // Writeback started up to `kicked`; waited for up to `waited`.
    let (mut kicked, mut waited) = (0u64, 0u64);
    let mut put = |out: &mut std::io::BufWriter<std::fs::File>, chunk: &[u8]| -> Result<(), CkptError> {
        for piece in chunk.chunks(WRITEBACK_WINDOW) {
            crc.update(piece);
            out.write_all(piece).map_err(io("write", path))?;
            bytes += piece.len() as u64;
            if bytes - kicked >= WRITEBACK_WINDOW as u64 {
                out.flush().map_err(io("write", path))?;
                writeback(out.get_ref(), kicked, bytes - kicked, false).map_err(io("write", path))?;
                if waited < kicked {
                    writeback(out.get_ref(), waited, kicked - waited, true).map_err(io("write", path))?;
                    waited = kicked;
                }
                kicked = bytes;
            }
        }
        Ok(())
    };
    put(&mut out, head)?;
    for t in tensors {
        put(&mut out, t.data)?;
    }
    let file =
        out.into_inner().map_err(|e| CkptError::Io { action: "write", path: path.into(), source: e.into_error() })?;
    file.sync_all().map_err(io("fsync", path))?;
    Ok((bytes, crc.finalize()))
}

/// Starts writeback of `len` bytes at `offset` (`wait`: and waits until they are on the disk).
/// Only a hint for the kernel's pacing: durability still comes from the final fsync, so a
/// filesystem without `sync_file_range` is fine.
fn writeback(file: &std::fs::File, offset: u64, len: u64, wait: bool) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let flags = if wait {
        libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER
    } else {
        libc::SYNC_FILE_RANGE_WRITE
    };
    // SAFETY: a syscall on a descriptor `file` keeps open; it touches no memory of ours.
    let rc = unsafe { libc::sync_file_range(file.as_raw_fd(), offset as i64, len as i64, flags) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ENOSYS) && e.raw_os_error() != Some(libc::EINVAL) {
            return Err(e);
        }
    }
    Ok(())
}

/// Writes `tensors` as one safetensors file at `path`: into a temporary file beside it, fsynced,
/// then renamed over `path` and the folder fsynced, so `path` is either absent, the old file or
/// the whole new one. Returns its bytes.
pub fn write_safetensors(path: &Path, tensors: &[TensorRecord]) -> Result<u64, CkptError> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let source = FileSource {
        stem: "",
        body: None,
        known: Vec::new(),
        tensors: tensors
            .iter()
            .map(|t| TensorRef { name: &t.name, dtype: t.dtype, shape: &t.shape, data: &t.data })
            .collect(),
    };
    let result = write_file(&tmp, &source).and_then(|(bytes, _)| {
        std::fs::rename(&tmp, path).map_err(io("rename", path))?;
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::File::open(parent).and_then(|d| d.sync_all()).map_err(io("fsync", parent))?;
        }
        Ok(bytes)
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Parses a safetensors file's bytes into records, sorted by name.
pub(crate) fn deserialize(bytes: &[u8]) -> Result<Vec<TensorRecord>, String> {
    let parsed = SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for (name, view) in parsed.tensors() {
        let dtype = DType::from_safetensors(view.dtype())
            .ok_or_else(|| format!("tensor {name:?} has unsupported dtype {:?}", view.dtype()))?;
        out.push(TensorRecord { name, dtype, shape: view.shape().to_vec(), data: view.data().to_vec() });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_file_parses_with_the_safetensors_crate() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        let a: Vec<u8> = [1f32, 2.0, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let b: Vec<u8> = [7i64].iter().flat_map(|v| v.to_le_bytes()).collect();
        let source = FileSource {
            stem: "x",
            body: None,
            known: Vec::new(),
            tensors: vec![
                TensorRef { name: "w.\"quoted\"", dtype: DType::F32, shape: &[3], data: &a },
                TensorRef { name: "n", dtype: DType::I64, shape: &[], data: &b },
            ],
        };
        let (bytes, crc) = write_file(&path, &source).unwrap();
        let on_disk = std::fs::read(&path).unwrap();
        assert_eq!((on_disk.len() as u64, crc32fast::hash(&on_disk)), (bytes, crc));
        let records = deserialize(&on_disk).unwrap();
        assert_eq!(records[0], TensorRecord::new("n", DType::I64, vec![], b).unwrap());
        assert_eq!(records[1], TensorRecord::new("w.\"quoted\"", DType::F32, vec![3], a).unwrap());
    }

    #[test]
    fn direct_and_page_cache_writes_give_the_same_file() {
        // Three tensors back to back in a page-aligned buffer, the last one ending mid-page.
        let (a, b, c) = ((3 << 20) + 12, 4096 * 3, 4 * 1001);
        let mut arena = crate::hostbuf::HostBuf::new();
        arena.grow_to(a + b + c).unwrap();
        for (i, byte) in arena.iter_mut().enumerate() {
            *byte = (i * 7 % 253) as u8;
        }
        let shapes = [[a / 4], [b / 4], [c / 4]];
        let (x, rest) = arena.split_at(a);
        let (y, z) = rest.split_at(b);
        let tensors = || {
            vec![
                TensorRef { name: "a", dtype: DType::F32, shape: &shapes[0], data: x },
                TensorRef { name: "b", dtype: DType::F32, shape: &shapes[1], data: y },
                TensorRef { name: "c", dtype: DType::F32, shape: &shapes[2], data: z },
            ]
        };
        let dir = tempfile::tempdir().unwrap();
        let direct = FileSource { stem: "d", tensors: tensors(), body: Some(&arena[..]), known: Vec::new() };
        let (d_bytes, d_crc) = write_file(&dir.path().join("d"), &direct).unwrap();
        // The same file with some pieces' CRC-32s handed in (a gap, one at the start, one at the end).
        let piece = |range: std::ops::Range<usize>| (range.start, range.len(), crc32fast::hash(&arena[range]));
        let known = vec![piece(0..4096), piece(10_000..(1 << 20)), piece(a + 5..a + b + c)];
        assert_eq!(body_checksum(&arena, &known).finalize(), crc32fast::hash(&arena));
        let with_known = FileSource { stem: "k", tensors: tensors(), body: Some(&arena[..]), known: known.clone() };
        assert_eq!(write_file(&dir.path().join("k"), &with_known).unwrap(), (d_bytes, d_crc));
        // The known pieces are taken as given, not hashed again.
        let mut wrong = known;
        wrong[1].2 ^= 1;
        assert_ne!(body_checksum(&arena, &wrong).finalize(), crc32fast::hash(&arena));
        let (p_bytes, p_crc) = write_buffered(&dir.path().join("p"), &header(&tensors()).unwrap(), &tensors()).unwrap();
        let (d, p) = (std::fs::read(dir.path().join("d")).unwrap(), std::fs::read(dir.path().join("p")).unwrap());
        assert!(d == p, "the two paths wrote different bytes");
        assert_eq!((d_bytes, d_crc), (p_bytes, p_crc));
        assert_eq!((d.len() as u64, crc32fast::hash(&d)), (d_bytes, d_crc));
        let head = u64::from_le_bytes(d[..8].try_into().unwrap()) as usize + 8;
        assert_eq!(head % PAGE, 0, "the data starts on a page boundary");
        let records = deserialize(&d).unwrap();
        assert_eq!(records.iter().map(|r| r.data.as_slice()).collect::<Vec<_>>(), [x, y, z]);
    }

    #[test]
    fn wrong_size_or_duplicate_is_rejected() {
        assert!(TensorRecord::new("x", DType::F32, vec![3], vec![0; 8]).is_err());
        let data = [0u8; 4];
        let t = || TensorRef { name: "x", dtype: DType::F32, shape: &[1], data: &data };
        assert!(header(&[t(), t()]).is_err());
    }
}
