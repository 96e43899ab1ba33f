//! Tensors in the safetensors layout, written as a stream: an 8-byte header length, the JSON
//! header, then each tensor's bytes in order. Writing from the caller's buffers (no serialized
//! copy of the whole file) keeps a save at the disk's speed; the CRC-32 is computed on the way.
//! Reading goes through the `safetensors` crate, which validates what we wrote.

use std::io::Write;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use crate::error::io;
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
}

/// The safetensors header of `tensors`, padded so the data starts 8-byte aligned.
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
    while (8 + json.len()) % 8 != 0 {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// Writes `source` to `path` (a new file), fsyncs it, and returns (bytes, CRC-32).
pub(crate) fn write_file(path: &Path, source: &FileSource<'_>) -> Result<(u64, u32), CkptError> {
    let head = header(&source.tensors)?;
    let file = std::fs::File::create(path).map_err(io("create", path))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    let mut crc = crc32fast::Hasher::new();
    let mut bytes = 0u64;
    let mut put = |out: &mut std::io::BufWriter<std::fs::File>, chunk: &[u8]| {
        crc.update(chunk);
        bytes += chunk.len() as u64;
        out.write_all(chunk).map_err(io("write", path))
    };
    put(&mut out, &head)?;
    for t in &source.tensors {
        put(&mut out, t.data)?;
    }
    let file =
        out.into_inner().map_err(|e| CkptError::Io { action: "write", path: path.into(), source: e.into_error() })?;
    file.sync_all().map_err(io("fsync", path))?;
    Ok((bytes, crc.finalize()))
}

/// Writes `tensors` as one safetensors file at `path`: into a temporary file beside it, fsynced,
/// then renamed over `path` and the folder fsynced, so `path` is either absent, the old file or
/// the whole new one. Returns its bytes.
pub fn write_safetensors(path: &Path, tensors: &[TensorRecord]) -> Result<u64, CkptError> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let source = FileSource {
        stem: "",
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
    fn wrong_size_or_duplicate_is_rejected() {
        assert!(TensorRecord::new("x", DType::F32, vec![3], vec![0; 8]).is_err());
        let data = [0u8; 4];
        let t = || TensorRef { name: "x", dtype: DType::F32, shape: &[1], data: &data };
        assert!(header(&[t(), t()]).is_err());
    }
}
