//! Record shards: arbitrary samples decoded once, offline, so training does no decoding.
//!
//! `prepare_records` walks its inputs (files, or directories in the ImageFolder layout
//! `root/<class>/<file>`), decodes images (PNG, JPEG) into uint8 HWC tensors, keeps any other file's
//! bytes as they are, and packs them into `records-NNNNN.rec` payload shards with a fixed-width
//! offset index `records-NNNNN.ridx` and a crc32 per file in `manifest.json`. `RecordStore` maps the
//! shards and returns each record as a borrowed slice.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use crate::prep::write_atomically;
use crate::tokens::check_crc;
use crate::DataError;

/// The first 8 bytes of a record index.
pub const RECORD_INDEX_MAGIC: &[u8; 8] = b"STOKREC1";
const RECORD_INDEX_HEADER: usize = 16;
const RECORD_ENTRY: usize = 40;
pub const RECORD_FORMAT: &str = "stoke-records";

/// How `prepare_records` packs. Plain data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrepRecordsConfig {
    /// Payload bytes per shard; a record never straddles shards. Default 268435456 (256 MiB).
    pub shard_bytes: u64,
    /// Decoder threads. Default 2.
    pub n_threads: usize,
}

impl Default for PrepRecordsConfig {
    fn default() -> PrepRecordsConfig {
        PrepRecordsConfig { shard_bytes: 256 << 20, n_threads: 2 }
    }
}

/// `manifest.json` of a record directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordManifest {
    /// Always "stoke-records".
    pub format: String,
    pub version: u32,
    pub n_records: u64,
    /// Class names; a record's label indexes this list (empty when inputs were plain files).
    pub classes: Vec<String>,
    pub shards: Vec<RecordShardEntry>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordShardEntry {
    pub rec: String,
    pub ridx: String,
    pub n_records: u64,
    pub rec_crc32: u32,
    pub ridx_crc32: u32,
}

/// One record: its label, its shape (`[h, w, c]` for images, `[len, 1, 1]` for raw bytes) and bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record<'a> {
    pub label: i64,
    pub shape: [u32; 3],
    pub bytes: &'a [u8],
}

/// A record shard being written: file, its temporary path, payload crc, index bytes, payload
/// offset, records so far.
type OpenRecordShard = (BufWriter<File>, PathBuf, crc32fast::Hasher, Vec<u8>, u64, u64);
/// A decoded record: its shape and bytes.
type Decoded = ([u32; 3], Vec<u8>);

struct Input {
    path: PathBuf,
    label: i64,
}

fn list_inputs(inputs: &[PathBuf]) -> Result<(Vec<Input>, Vec<String>), DataError> {
    let mut classes: Vec<String> = Vec::new();
    let mut files: Vec<(PathBuf, Option<String>)> = Vec::new();
    for input in inputs {
        if input.is_dir() {
            let mut class_dirs: Vec<PathBuf> = std::fs::read_dir(input)
                .map_err(DataError::read(input))?
                .map(|entry| entry.map(|e| e.path()).map_err(DataError::read(input)))
                .collect::<Result<_, _>>()?;
            class_dirs.sort();
            for class_dir in class_dirs.into_iter().filter(|p| p.is_dir()) {
                let class = class_dir.file_name().unwrap_or_default().to_string_lossy().into_owned();
                let mut members: Vec<PathBuf> = std::fs::read_dir(&class_dir)
                    .map_err(DataError::read(&class_dir))?
                    .map(|entry| entry.map(|e| e.path()).map_err(DataError::read(&class_dir)))
                    .collect::<Result<_, _>>()?;
                members.sort();
                files.extend(members.into_iter().filter(|p| p.is_file()).map(|p| (p, Some(class.clone()))));
                classes.push(class);
            }
        } else {
            files.push((input.clone(), None));
        }
    }
    classes.sort();
    classes.dedup();
    let inputs = files
        .into_iter()
        .map(|(path, class)| {
            let label = class.map_or(-1, |c| classes.binary_search(&c).expect("class listed") as i64);
            Input { path, label }
        })
        .collect();
    Ok((inputs, classes))
}

/// Decodes an image into HWC uint8 RGB, or keeps another file's bytes.
fn decode(path: &Path) -> Result<Decoded, DataError> {
    let bytes = std::fs::read(path).map_err(DataError::read(path))?;
    let is_image = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| matches!(e.to_ascii_lowercase().as_str(), "png" | "jpg" | "jpeg"));
    if !is_image {
        return Ok(([bytes.len() as u32, 1, 1], bytes));
    }
    let image = image::load_from_memory(&bytes)
        .map_err(|err| DataError::Image { path: path.to_path_buf(), detail: err.to_string() })?
        .into_rgb8();
    let shape = [image.height(), image.width(), 3];
    Ok((shape, image.into_raw()))
}

/// Decodes and packs `inputs` into a record directory `out_dir`.
pub fn prepare_records(
    inputs: &[PathBuf],
    config: &PrepRecordsConfig,
    out_dir: &Path,
) -> Result<RecordManifest, DataError> {
    let (inputs, classes) = list_inputs(inputs)?;
    let mut writer = RecordWriter::create(out_dir, config.shard_bytes)?;
    let n_threads = config.n_threads.max(1);
    // Decode in parallel in windows of inputs, write in input order.
    for window in inputs.chunks(64 * n_threads) {
        let decoded = decode_parallel(window, n_threads)?;
        for (input, (shape, bytes)) in window.iter().zip(decoded) {
            writer.push(input.label, shape, &bytes)?;
        }
    }
    writer.finish(classes)
}

/// Writes records in order into `records-NNNNN.rec` shards of about `shard_bytes` with their
/// indexes, then the directory's manifest: what `prepare_records` and the episode preparation
/// both write frames with.
pub(crate) struct RecordWriter {
    out_dir: PathBuf,
    shard_bytes: u64,
    shards: Vec<RecordShardEntry>,
    open: Option<OpenRecordShard>,
}

impl RecordWriter {
    pub(crate) fn create(out_dir: &Path, shard_bytes: u64) -> Result<RecordWriter, DataError> {
        std::fs::create_dir_all(out_dir).map_err(DataError::write(out_dir))?;
        Ok(RecordWriter { out_dir: out_dir.to_path_buf(), shard_bytes, shards: Vec::new(), open: None })
    }

    /// Appends one record; a record never straddles shards.
    pub(crate) fn push(&mut self, label: i64, shape: [u32; 3], bytes: &[u8]) -> Result<(), DataError> {
        if self.open.is_none() {
            let path = self.out_dir.join(format!("records-{:05}.rec.tmp", self.shards.len()));
            let file = File::create(&path).map_err(DataError::write(&path))?;
            let mut index = RECORD_INDEX_MAGIC.to_vec();
            index.extend_from_slice(&0u64.to_le_bytes());
            self.open = Some((BufWriter::new(file), path, crc32fast::Hasher::new(), index, 0, 0));
        }
        let (file, path, crc, index, offset, n_records) = self.open.as_mut().expect("opened above");
        file.write_all(bytes).map_err(DataError::write(path))?;
        crc.update(bytes);
        index.extend_from_slice(&offset.to_le_bytes());
        index.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        index.extend_from_slice(&label.to_le_bytes());
        shape.iter().for_each(|s| index.extend_from_slice(&s.to_le_bytes()));
        index.extend_from_slice(&0u32.to_le_bytes());
        *offset += bytes.len() as u64;
        *n_records += 1;
        if *offset >= self.shard_bytes {
            let open = self.open.take().expect("open");
            self.shards.push(finish_records_shard(&self.out_dir, self.shards.len(), open)?);
        }
        Ok(())
    }

    /// Closes the last shard and writes `manifest.json`.
    pub(crate) fn finish(mut self, classes: Vec<String>) -> Result<RecordManifest, DataError> {
        if let Some(open) = self.open.take() {
            self.shards.push(finish_records_shard(&self.out_dir, self.shards.len(), open)?);
        }
        let manifest = RecordManifest {
            format: RECORD_FORMAT.into(),
            version: 1,
            n_records: self.shards.iter().map(|s| s.n_records).sum(),
            classes,
            shards: self.shards,
        };
        let json = serde_json::to_vec_pretty(&manifest).expect("serializes");
        write_atomically(&self.out_dir.join("manifest.json"), &json)?;
        Ok(manifest)
    }
}

fn finish_records_shard(
    out_dir: &Path,
    shard_idx: usize,
    (file, tmp, crc, mut index, _offset, n_records): OpenRecordShard,
) -> Result<RecordShardEntry, DataError> {
    let file = file.into_inner().map_err(|err| DataError::Write { path: tmp.clone(), source: err.into_error() })?;
    file.sync_all().map_err(DataError::write(&tmp))?;
    let rec = format!("records-{shard_idx:05}.rec");
    let ridx = format!("records-{shard_idx:05}.ridx");
    std::fs::rename(&tmp, out_dir.join(&rec)).map_err(DataError::write(&tmp))?;
    index[8..16].copy_from_slice(&n_records.to_le_bytes());
    write_atomically(&out_dir.join(&ridx), &index)?;
    Ok(RecordShardEntry { rec, ridx, n_records, rec_crc32: crc.finalize(), ridx_crc32: crc32fast::hash(&index) })
}

fn decode_parallel(window: &[Input], n_threads: usize) -> Result<Vec<Decoded>, DataError> {
    let chunk = window.len().div_ceil(n_threads).max(1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = window
            .chunks(chunk)
            .map(|part| scope.spawn(move || part.iter().map(|input| decode(&input.path)).collect::<Vec<_>>()))
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("decoder thread panicked")).collect()
    })
}

struct RecordShard {
    rec: Mmap,
    rec_path: PathBuf,
    ridx: Vec<u8>,
    ridx_path: PathBuf,
    n_records: u64,
}

/// A record directory opened for reading.
pub struct RecordStore {
    manifest: RecordManifest,
    shards: Vec<RecordShard>,
    /// `starts[i]`: index of shard `i`'s first record.
    starts: Vec<u64>,
}

fn parse_record_index(path: &Path, bytes: &[u8]) -> Result<u64, DataError> {
    if bytes.len() < RECORD_INDEX_HEADER {
        return Err(DataError::Truncated {
            path: path.into(),
            what: "record index header",
            offset: 0,
            needed: RECORD_INDEX_HEADER as u64,
            len: bytes.len() as u64,
        });
    }
    if &bytes[..8] != RECORD_INDEX_MAGIC {
        return Err(DataError::BadMagic { path: path.into(), offset: 0, expected: "STOKREC1" });
    }
    let n_records = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
    let needed = n_records.checked_mul(RECORD_ENTRY as u64).ok_or_else(|| DataError::Corrupt {
        path: path.into(),
        what: "record count",
        offset: 8,
        detail: format!("{n_records} overflows"),
    })?;
    if bytes.len() as u64 != RECORD_INDEX_HEADER as u64 + needed {
        return Err(DataError::Truncated {
            path: path.into(),
            what: "record entries",
            offset: RECORD_INDEX_HEADER as u64,
            needed,
            len: bytes.len() as u64,
        });
    }
    Ok(n_records)
}

/// `dir`'s `manifest.json` (read up to the manifest cap) parsed as `T`, with its path; the caller
/// checks its format.
pub(crate) fn read_manifest<T: serde::de::DeserializeOwned>(dir: &Path) -> Result<(PathBuf, T), DataError> {
    let path = dir.join("manifest.json");
    let bytes = stoke_fsio::read_capped(&path, stoke_fsio::MANIFEST_CAP).map_err(DataError::read(&path))?;
    let manifest =
        serde_json::from_slice(&bytes).map_err(|source| DataError::Manifest { path: path.clone(), source })?;
    Ok((path, manifest))
}

impl RecordStore {
    /// Opens a record directory; with `verify`, checks every file's crc32 first (reads everything).
    pub fn open(dir: &Path, verify: bool) -> Result<RecordStore, DataError> {
        let (manifest_path, manifest): (PathBuf, RecordManifest) = read_manifest(dir)?;
        if manifest.format != RECORD_FORMAT {
            return Err(DataError::Corrupt {
                path: manifest_path,
                what: "format",
                offset: 0,
                detail: format!("{} is not {RECORD_FORMAT}", manifest.format),
            });
        }
        let mut shards = Vec::new();
        let mut starts = vec![0u64];
        for entry in &manifest.shards {
            let ridx_path = dir.join(&entry.ridx);
            let rec_path = dir.join(&entry.rec);
            let ridx = std::fs::read(&ridx_path).map_err(DataError::read(&ridx_path))?;
            let file = File::open(&rec_path).map_err(DataError::read(&rec_path))?;
            // SAFETY: record shards are immutable once `prepare_records` renamed them into place.
            let rec = unsafe { Mmap::map(&file) }.map_err(DataError::read(&rec_path))?;
            if verify {
                check_crc(&ridx_path, &ridx, entry.ridx_crc32)?;
                check_crc(&rec_path, &rec, entry.rec_crc32)?;
            }
            let n_records = parse_record_index(&ridx_path, &ridx)?;
            if n_records != entry.n_records {
                return Err(DataError::Corrupt {
                    path: ridx_path,
                    what: "record count",
                    offset: 8,
                    detail: format!("{n_records}, the manifest says {}", entry.n_records),
                });
            }
            starts.push(starts.last().expect("non-empty") + n_records);
            shards.push(RecordShard { rec, rec_path, ridx, ridx_path, n_records });
        }
        Ok(RecordStore { manifest, shards, starts })
    }

    pub fn len(&self) -> u64 {
        *self.starts.last().expect("non-empty")
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn manifest(&self) -> &RecordManifest {
        &self.manifest
    }

    /// Record `record_idx`; a bad entry (payload outside its shard) is an error naming both files.
    pub fn get(&self, record_idx: u64) -> Result<Record<'_>, DataError> {
        if record_idx >= self.len() {
            return Err(DataError::Config { field: "record index", reason: format!("{record_idx} >= {}", self.len()) });
        }
        let shard_idx = self.starts.partition_point(|&s| s <= record_idx) - 1;
        let shard = &self.shards[shard_idx];
        let local = (record_idx - self.starts[shard_idx]) as usize;
        debug_assert!((local as u64) < shard.n_records);
        let at = RECORD_INDEX_HEADER + local * RECORD_ENTRY;
        let entry = &shard.ridx[at..at + RECORD_ENTRY];
        let field = |i: usize| u64::from_le_bytes(entry[i..i + 8].try_into().expect("8 bytes"));
        let small = |i: usize| u32::from_le_bytes(entry[i..i + 4].try_into().expect("4 bytes"));
        let (offset, len) = (field(0), field(8));
        let end = offset.checked_add(len).filter(|&end| end <= shard.rec.len() as u64);
        let Some(end) = end else {
            return Err(DataError::Corrupt {
                path: shard.ridx_path.clone(),
                what: "record entry",
                offset: at as u64,
                detail: format!("bytes {offset}+{len} beyond {} ({} bytes)", shard.rec_path.display(), shard.rec.len()),
            });
        };
        Ok(Record {
            label: field(16) as i64,
            shape: [small(24), small(28), small(32)],
            bytes: &shard.rec[offset as usize..end as usize],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_decode_once_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("images");
        for (class, shade) in [("cat", 10u8), ("dog", 200u8)] {
            std::fs::create_dir_all(root.join(class)).unwrap();
            let image = image::RgbImage::from_pixel(3, 2, image::Rgb([shade, shade / 2, 1]));
            image.save(root.join(class).join("a.png")).unwrap();
        }
        std::fs::write(root.join("dog").join("note.bin"), b"raw").unwrap();
        let out = dir.path().join("records");
        let config = PrepRecordsConfig { shard_bytes: 20, n_threads: 2 };
        let manifest = prepare_records(&[root], &config, &out).unwrap();
        assert_eq!(manifest.classes, vec!["cat", "dog"]);
        assert_eq!(manifest.n_records, 3);
        let store = RecordStore::open(&out, true).unwrap();
        let cat = store.get(0).unwrap();
        assert_eq!((cat.label, cat.shape), (0, [2, 3, 3]));
        assert_eq!(&cat.bytes[..3], &[10, 5, 1]);
        let dog = store.get(1).unwrap();
        assert_eq!((dog.label, dog.bytes[0]), (1, 200));
        let raw = store.get(2).unwrap();
        assert_eq!((raw.label, raw.shape, raw.bytes), (1, [3, 1, 1], &b"raw"[..]));

        // A flipped payload byte is a checksum error naming the shard.
        let rec = out.join(&manifest.shards[0].rec);
        let mut bytes = std::fs::read(&rec).unwrap();
        bytes[0] ^= 1;
        std::fs::write(&rec, bytes).unwrap();
        let err = RecordStore::open(&out, true).err().unwrap();
        assert!(err.to_string().contains("records-00000.rec") && err.to_string().contains("checksum"), "{err}");
        // An entry pointing past its shard is an error naming the index and the entry's offset.
        let ridx = out.join(&manifest.shards[0].ridx);
        let mut index = std::fs::read(&ridx).unwrap();
        index[16..24].copy_from_slice(&1000u64.to_le_bytes());
        std::fs::write(&ridx, index).unwrap();
        let err = RecordStore::open(&out, false).unwrap().get(0).unwrap_err();
        assert!(err.to_string().contains("records-00000.ridx") && err.to_string().contains("offset 16"), "{err}");
    }

    #[test]
    fn record_index_parser_rejects_damage() {
        let path = Path::new("r.ridx");
        let mut index = RECORD_INDEX_MAGIC.to_vec();
        index.extend_from_slice(&1u64.to_le_bytes());
        assert!(matches!(parse_record_index(path, &index), Err(DataError::Truncated { offset: 16, .. })));
        index.extend_from_slice(&[0u8; RECORD_ENTRY]);
        assert_eq!(parse_record_index(path, &index).unwrap(), 1);
        index[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(parse_record_index(path, &index).is_err());
        assert!(parse_record_index(path, b"STOK").is_err());
    }
}
