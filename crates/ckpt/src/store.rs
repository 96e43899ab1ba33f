//! Checkpoint storage: save, list, load and delete committed checkpoints, atomically.
//!
//! A checkpoint is a folder `step-<n>/` holding safetensors files and `manifest.json`, which lists
//! each file with its size and CRC-32. It is written under a temporary name, every file is
//! fsynced, and only then is the folder renamed into place and its parent fsynced: a crash at any
//! moment leaves either the complete checkpoint or none (a stray temporary folder that listing
//! ignores and the next save removes). Loading verifies sizes and checksums before parsing.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};

use crate::error::io;
use crate::CkptError;

pub const MANIFEST: &str = "manifest.json";
const FORMAT_VERSION: u32 = 1;
const TMP_PREFIX: &str = ".tmp-";

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

    fn to_safetensors(self) -> Dtype {
        match self {
            DType::F32 => Dtype::F32,
            DType::BF16 => Dtype::BF16,
            DType::I64 => Dtype::I64,
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
        let expected = shape.iter().product::<usize>() * dtype.size();
        if data.len() != expected {
            return Err(CkptError::BadTensor {
                name,
                message: format!("shape {shape:?} of {dtype:?} needs {expected} bytes, got {}", data.len()),
            });
        }
        Ok(TensorRecord { name, dtype, shape, data })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub bytes: u64,
    pub crc32: u32,
}

/// `manifest.json`: what the checkpoint holds; `meta` is the trainer's own state (step, data
/// position, resolved config...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub step: u64,
    pub files: Vec<FileEntry>,
    pub meta: serde_json::Value,
}

/// A loaded checkpoint: its manifest and, per file stem, its tensors.
#[derive(Debug)]
pub struct Loaded {
    pub path: PathBuf,
    pub manifest: Manifest,
    pub files: BTreeMap<String, Vec<TensorRecord>>,
}

/// The checkpoints of one run, in one folder.
#[derive(Debug, Clone)]
pub struct CheckpointStore {
    dir: PathBuf,
}

impl CheckpointStore {
    pub fn new(dir: impl Into<PathBuf>) -> CheckpointStore {
        CheckpointStore { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.dir.join(format!("step-{step}"))
    }

    /// Writes `files` (stem -> tensors, each to `<stem>.safetensors`) and the manifest, and commits
    /// them atomically as `step-<step>/`. An existing checkpoint of the same step is replaced only
    /// after the new one is complete.
    pub fn save(
        &self,
        step: u64,
        files: &[(&str, &[TensorRecord])],
        meta: serde_json::Value,
    ) -> Result<PathBuf, CkptError> {
        std::fs::create_dir_all(&self.dir).map_err(io("create", &self.dir))?;
        self.remove_stale_temporaries()?;
        let tmp = self.dir.join(format!("{TMP_PREFIX}step-{step}-{}", std::process::id()));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).map_err(io("remove", &tmp))?;
        }
        std::fs::create_dir(&tmp).map_err(io("create", &tmp))?;
        let mut entries = Vec::with_capacity(files.len());
        for (stem, tensors) in files {
            let name = format!("{stem}.safetensors");
            let path = tmp.join(&name);
            let bytes = serialize(tensors)?;
            write_synced(&path, &bytes)?;
            entries.push(FileEntry { name, bytes: bytes.len() as u64, crc32: crc32fast::hash(&bytes) });
        }
        let manifest = Manifest { format_version: FORMAT_VERSION, step, files: entries, meta };
        let manifest_bytes = serde_json::to_vec_pretty(&manifest).expect("a manifest always serializes");
        write_synced(&tmp.join(MANIFEST), &manifest_bytes)?;
        sync_dir(&tmp)?;
        let target = self.step_dir(step);
        if target.exists() {
            // Move the old one aside first: rename cannot replace a non-empty folder.
            let old = self.dir.join(format!("{TMP_PREFIX}old-step-{step}-{}", std::process::id()));
            std::fs::rename(&target, &old).map_err(io("move aside", &target))?;
            std::fs::rename(&tmp, &target).map_err(io("commit", &target))?;
            std::fs::remove_dir_all(&old).map_err(io("remove", &old))?;
        } else {
            std::fs::rename(&tmp, &target).map_err(io("commit", &target))?;
        }
        sync_dir(&self.dir)?;
        Ok(target)
    }

    /// Steps of the committed checkpoints, oldest first. Folders without a manifest (never
    /// committed) are not checkpoints.
    pub fn list(&self) -> Result<Vec<u64>, CkptError> {
        let read = match std::fs::read_dir(&self.dir) {
            Ok(read) => read,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(CkptError::Io { action: "list", path: self.dir.clone(), source: e }),
        };
        let mut steps = Vec::new();
        for entry in read {
            let entry = entry.map_err(io("list", &self.dir))?;
            let name = entry.file_name();
            let Some(step) = name.to_str().and_then(|n| n.strip_prefix("step-")).and_then(|n| n.parse::<u64>().ok())
            else {
                continue;
            };
            if entry.path().join(MANIFEST).is_file() {
                steps.push(step);
            }
        }
        steps.sort_unstable();
        Ok(steps)
    }

    pub fn latest(&self) -> Result<Option<u64>, CkptError> {
        Ok(self.list()?.last().copied())
    }

    /// Reads and verifies the checkpoint of `step`.
    pub fn load(&self, step: u64) -> Result<Loaded, CkptError> {
        let path = self.step_dir(step);
        if !path.join(MANIFEST).is_file() {
            return Err(CkptError::Missing { dir: self.dir.clone(), step });
        }
        load_dir(&path)
    }

    pub fn delete(&self, step: u64) -> Result<(), CkptError> {
        let path = self.step_dir(step);
        std::fs::remove_dir_all(&path).map_err(io("delete", &path))
    }

    fn remove_stale_temporaries(&self) -> Result<(), CkptError> {
        for entry in std::fs::read_dir(&self.dir).map_err(io("list", &self.dir))? {
            let entry = entry.map_err(io("list", &self.dir))?;
            if entry.file_name().to_string_lossy().starts_with(TMP_PREFIX) {
                let path = entry.path();
                std::fs::remove_dir_all(&path).map_err(io("remove", &path))?;
            }
        }
        Ok(())
    }
}

/// Reads and verifies a checkpoint folder.
pub fn load_dir(path: &Path) -> Result<Loaded, CkptError> {
    let manifest_path = path.join(MANIFEST);
    let text = std::fs::read(&manifest_path).map_err(io("read", &manifest_path))?;
    let manifest: Manifest = serde_json::from_slice(&text)
        .map_err(|e| CkptError::BadManifest { path: manifest_path.clone(), message: e.to_string() })?;
    if manifest.format_version != FORMAT_VERSION {
        return Err(CkptError::BadManifest {
            path: manifest_path,
            message: format!("format_version {} is not {FORMAT_VERSION}", manifest.format_version),
        });
    }
    let mut files = BTreeMap::new();
    for entry in &manifest.files {
        let file_path = path.join(&entry.name);
        let bytes = std::fs::read(&file_path).map_err(io("read", &file_path))?;
        if bytes.len() as u64 != entry.bytes {
            return Err(CkptError::Corrupt {
                path: file_path,
                message: format!("{} bytes on disk, the manifest says {}", bytes.len(), entry.bytes),
            });
        }
        let crc = crc32fast::hash(&bytes);
        if crc != entry.crc32 {
            return Err(CkptError::Corrupt {
                path: file_path,
                message: format!("CRC-32 {crc:08x}, the manifest says {:08x}", entry.crc32),
            });
        }
        let tensors = deserialize(&bytes).map_err(|message| CkptError::Corrupt { path: file_path.clone(), message })?;
        let stem = entry.name.strip_suffix(".safetensors").unwrap_or(&entry.name).to_string();
        files.insert(stem, tensors);
    }
    Ok(Loaded { path: path.to_path_buf(), manifest, files })
}

fn serialize(tensors: &[TensorRecord]) -> Result<Vec<u8>, CkptError> {
    let mut views = Vec::with_capacity(tensors.len());
    for t in tensors {
        let view = TensorView::new(t.dtype.to_safetensors(), t.shape.clone(), &t.data)
            .map_err(|e| CkptError::BadTensor { name: t.name.clone(), message: e.to_string() })?;
        views.push((t.name.as_str(), view));
    }
    safetensors::tensor::serialize(views, None)
        .map_err(|e| CkptError::BadTensor { name: "<file>".into(), message: e.to_string() })
}

fn deserialize(bytes: &[u8]) -> Result<Vec<TensorRecord>, String> {
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

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CkptError> {
    let mut file = File::create(path).map_err(io("create", path))?;
    file.write_all(bytes).map_err(io("write", path))?;
    file.sync_all().map_err(io("fsync", path))
}

fn sync_dir(path: &Path) -> Result<(), CkptError> {
    File::open(path).and_then(|dir| dir.sync_all()).map_err(io("fsync", path))
}

/// Retention policy, apart from the mechanism: given committed steps (any order), which to delete
/// so that the newest `keep` remain. `keep == 0` keeps everything.
pub fn steps_to_delete(steps: &[u64], keep: usize) -> Vec<u64> {
    if keep == 0 || steps.len() <= keep {
        return Vec::new();
    }
    let mut sorted = steps.to_vec();
    sorted.sort_unstable();
    sorted[..sorted.len() - keep].to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str, values: &[f32]) -> TensorRecord {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        TensorRecord::new(name, DType::F32, vec![values.len()], data).unwrap()
    }

    #[test]
    fn save_list_load_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        let model = [record("a", &[1.0, 2.0]), record("b", &[3.0])];
        store.save(10, &[("model", &model)], serde_json::json!({"data_position": 10})).unwrap();
        store.save(20, &[("model", &model)], serde_json::json!({})).unwrap();
        assert_eq!(store.list().unwrap(), vec![10, 20]);
        let loaded = store.load(10).unwrap();
        assert_eq!(loaded.manifest.meta["data_position"], 10);
        assert_eq!(loaded.files["model"], model.to_vec());
    }

    #[test]
    fn uncommitted_folder_is_not_a_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        // What a crash between writing the shards and the manifest leaves behind.
        std::fs::create_dir_all(dir.path().join(".tmp-step-5-1")).unwrap();
        std::fs::create_dir_all(dir.path().join("step-7")).unwrap();
        assert_eq!(store.list().unwrap(), Vec::<u64>::new());
        store.save(9, &[("model", &[record("a", &[1.0])])], serde_json::json!({})).unwrap();
        assert!(!dir.path().join(".tmp-step-5-1").exists(), "the next save cleans up");
    }

    #[test]
    fn flipped_byte_is_reported_with_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        let path = store.save(1, &[("model", &[record("a", &[1.0, 2.0, 3.0])])], serde_json::json!({})).unwrap();
        let file = path.join("model.safetensors");
        let mut bytes = std::fs::read(&file).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&file, &bytes).unwrap();
        let err = store.load(1).unwrap_err().to_string();
        assert!(err.contains("model.safetensors") && err.contains("CRC-32"), "{err}");
        std::fs::write(&file, &bytes[..10]).unwrap();
        let err = store.load(1).unwrap_err().to_string();
        assert!(err.contains("bytes on disk"), "{err}");
    }

    #[test]
    fn malformed_manifest_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = CheckpointStore::new(dir.path());
        let path = store.save(3, &[], serde_json::json!({})).unwrap();
        std::fs::write(path.join(MANIFEST), b"{\"format_version\": 1, \"step\":").unwrap();
        let err = store.load(3).unwrap_err().to_string();
        assert!(err.contains("manifest.json") && err.contains("malformed"), "{err}");
    }

    #[test]
    fn retention_keeps_newest() {
        assert_eq!(steps_to_delete(&[30, 10, 20, 40], 2), vec![10, 20]);
        assert_eq!(steps_to_delete(&[10, 20], 3), Vec::<u64>::new());
        assert_eq!(steps_to_delete(&[10, 20], 0), Vec::<u64>::new());
    }

    #[test]
    fn wrong_size_record_is_rejected() {
        assert!(TensorRecord::new("x", DType::F32, vec![3], vec![0; 8]).is_err());
    }
}
