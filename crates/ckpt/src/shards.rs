//! Checkpoints written by several ranks (ZeRO): each rank writes its own files, holding its pieces
//! of the logical tensors, and the manifest's shard table lists every tensor's pieces (which file,
//! which element range of the flattened tensor). Loading assembles the logical tensors, so a
//! sharded checkpoint reads like a whole one (`Loaded::files` by logical stem: `model`, `optim`,
//! ...), on any world size.
//!
//! The ranks' files meet in the checkpoint through the commit protocol (`store.rs`): rank r > 0
//! writes and fsyncs its files and a `part.json` (its files' sizes and CRC-32s, its pieces) in its
//! own temporary folder, then renames it to `.part-rank<r>-step-<n>/`; rank 0, the coordinator,
//! writes its own files, waits for every rank's part (up to a timeout, naming the ranks missing),
//! moves their files into its temporary folder, and writes the manifest with the merged table.
//! Until that manifest exists no checkpoint of the step exists, so a rank killed mid-write leaves
//! only leftovers that the next run removes.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{CkptError, DType, TensorRecord};

/// Which rank of how many a writer is, and how long the coordinator waits for the other ranks'
/// parts of a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardRole {
    pub rank: usize,
    pub world: usize,
    pub wait: std::time::Duration,
}

/// One rank's piece of a logical tensor: elements `start..end` of the flattened tensor, stored in
/// `file` under the tensor's name as a 1-D tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    pub file: String,
    pub start: u64,
    pub end: u64,
}

/// A logical tensor of a sharded checkpoint and where its pieces are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardedTensor {
    /// The logical file it belongs to (`model`, `optim`), as a whole checkpoint would name it.
    pub stem: String,
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Ordered by `start`; together they cover the tensor exactly once.
    pub pieces: Vec<Piece>,
}

impl ShardedTensor {
    fn numel(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64
    }
}

/// The manifest's table of a sharded checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardTable {
    /// Ranks that wrote the checkpoint (each wrote `<stem>-rank<r>.safetensors` files).
    pub world_size: usize,
    pub tensors: Vec<ShardedTensor>,
}

/// A piece as a snapshot records it, before its file is named.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PieceRecord {
    pub stem: String,
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub start: u64,
    pub end: u64,
}

/// The file stem rank `rank` writes a logical stem's data to.
pub(crate) fn rank_stem(stem: &str, rank: usize) -> String {
    format!("{stem}-rank{rank}")
}

/// The logical stem of a rank's file stem (`model-rank3` -> `model`).
fn logical_stem(file_stem: &str) -> &str {
    match file_stem.rsplit_once("-rank") {
        Some((stem, rank)) if !rank.is_empty() && rank.bytes().all(|b| b.is_ascii_digit()) => stem,
        _ => file_stem,
    }
}

/// Merges pieces (any order, any ranks) into the table, one entry per logical tensor.
pub(crate) fn merge(world_size: usize, pieces: Vec<(String, PieceRecord)>) -> ShardTable {
    let mut tensors: BTreeMap<(String, String), ShardedTensor> = BTreeMap::new();
    for (file, p) in pieces {
        let entry = tensors.entry((p.stem.clone(), p.name.clone())).or_insert_with(|| ShardedTensor {
            stem: p.stem.clone(),
            name: p.name.clone(),
            dtype: p.dtype,
            shape: p.shape.clone(),
            pieces: Vec::new(),
        });
        entry.pieces.push(Piece { file, start: p.start, end: p.end });
    }
    let mut tensors: Vec<ShardedTensor> = tensors.into_values().collect();
    for t in &mut tensors {
        t.pieces.sort_by_key(|p| p.start);
    }
    ShardTable { world_size, tensors }
}

/// Checks that the table is consistent: pieces cover each tensor exactly once, and name files the
/// manifest lists. `manifest_path` names the manifest in errors.
pub(crate) fn check_table(table: &ShardTable, files: &[String], manifest_path: &Path) -> Result<(), CkptError> {
    let bad = |message: String| CkptError::BadManifest { path: manifest_path.to_path_buf(), message };
    for t in &table.tensors {
        let mut next = 0u64;
        for p in &t.pieces {
            if p.start != next || p.end <= p.start {
                return Err(bad(format!(
                    "tensor {:?} of {:?}: piece {}..{} in {} does not continue at element {next}",
                    t.name, t.stem, p.start, p.end, p.file
                )));
            }
            if !files.contains(&p.file) {
                return Err(bad(format!("tensor {:?}: piece in {} which the manifest does not list", t.name, p.file)));
            }
            next = p.end;
        }
        if next != t.numel() {
            return Err(bad(format!(
                "tensor {:?} of {:?}: pieces cover {next} of its {} elements",
                t.name,
                t.stem,
                t.numel()
            )));
        }
    }
    Ok(())
}

/// Checks that file `file` (its tensors read) holds every piece the table places in it, with the
/// listed type and length (for a full verification pass that reads one file at a time).
pub(crate) fn check_file(
    table: &ShardTable,
    file: &str,
    tensors: &[TensorRecord],
    path: &Path,
) -> Result<(), CkptError> {
    for t in &table.tensors {
        for p in t.pieces.iter().filter(|p| p.file == file) {
            let want = (p.end - p.start) as usize * t.dtype.size();
            match tensors.iter().find(|r| r.name == t.name) {
                Some(r) if r.dtype == t.dtype && r.data.len() == want => {}
                _ => {
                    return Err(CkptError::Corrupt {
                        path: path.to_path_buf(),
                        message: format!("has no piece of {:?} of {want} bytes as the manifest lists", t.name),
                    })
                }
            }
        }
    }
    Ok(())
}

/// The logical files of a sharded checkpoint from its ranks' files (`by_file`: file name ->
/// tensors): each table tensor assembled from its pieces, every other tensor taken as it is into
/// its file's logical stem (a name found twice is an error). `dir` names the checkpoint in errors.
pub(crate) fn assemble(
    table: &ShardTable,
    mut by_file: BTreeMap<String, Vec<TensorRecord>>,
    dir: &Path,
) -> Result<BTreeMap<String, Vec<TensorRecord>>, CkptError> {
    let corrupt = |file: &str, message: String| CkptError::Corrupt { path: dir.join(file), message };
    // Each file's tensors by name, taken out as they are used.
    let mut index: BTreeMap<String, BTreeMap<String, TensorRecord>> = BTreeMap::new();
    for (file, tensors) in std::mem::take(&mut by_file) {
        index.insert(file, tensors.into_iter().map(|t| (t.name.clone(), t)).collect());
    }
    let mut out: BTreeMap<String, Vec<TensorRecord>> = BTreeMap::new();
    for t in &table.tensors {
        let size = t.dtype.size();
        let mut data = Vec::with_capacity(t.numel() as usize * size);
        for p in &t.pieces {
            let piece = index.get_mut(&p.file).and_then(|f| f.remove(&t.name)).ok_or_else(|| {
                corrupt(
                    &p.file,
                    format!("has no piece of {:?} (the manifest lists elements {}..{})", t.name, p.start, p.end),
                )
            })?;
            let want = (p.end - p.start) as usize * size;
            if piece.dtype != t.dtype || piece.data.len() != want {
                return Err(corrupt(
                    &p.file,
                    format!(
                        "piece of {:?} is {:?} of {} bytes, the manifest says {:?} of {want}",
                        t.name,
                        piece.dtype,
                        piece.data.len(),
                        t.dtype
                    ),
                ));
            }
            data.extend_from_slice(&piece.data);
        }
        out.entry(t.stem.clone()).or_default().push(TensorRecord {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            data,
        });
    }
    // The rest (whole tensors a rank wrote, such as its own compression residuals).
    for (file, rest) in index {
        let stem = logical_stem(file.strip_suffix(".safetensors").unwrap_or(&file)).to_string();
        let tensors = out.entry(stem.clone()).or_default();
        for (name, record) in rest {
            if tensors.iter().any(|t| t.name == name) {
                return Err(corrupt(&file, format!("tensor {name:?} of {stem:?} is also in another file")));
            }
            tensors.push(record);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(stem: &str, name: &str, shape: &[usize], start: u64, end: u64) -> PieceRecord {
        PieceRecord { stem: stem.into(), name: name.into(), dtype: DType::F32, shape: shape.to_vec(), start, end }
    }

    fn record(name: &str, values: &[f32]) -> TensorRecord {
        TensorRecord::new(name, DType::F32, vec![values.len()], values.iter().flat_map(|v| v.to_le_bytes()).collect())
            .unwrap()
    }

    #[test]
    fn pieces_assemble_into_the_logical_tensor() {
        let table = merge(
            2,
            vec![
                ("model-rank1.safetensors".into(), piece("model", "w", &[2, 3], 4, 6)),
                ("model-rank0.safetensors".into(), piece("model", "w", &[2, 3], 0, 4)),
            ],
        );
        let files: Vec<String> = vec!["model-rank0.safetensors".into(), "model-rank1.safetensors".into()];
        check_table(&table, &files, Path::new("manifest.json")).unwrap();
        let mut by_file = BTreeMap::new();
        by_file.insert(files[0].clone(), vec![record("w", &[0., 1., 2., 3.])]);
        by_file.insert(files[1].clone(), vec![record("w", &[4., 5.]), record("r@rank1", &[9.])]);
        let out = assemble(&table, by_file, Path::new("step-1")).unwrap();
        let w = &out["model"][0];
        assert_eq!(w.shape, [2, 3]);
        assert_eq!(w.data, record("w", &[0., 1., 2., 3., 4., 5.]).data);
        assert_eq!(out["model"][1].name, "r@rank1", "a whole tensor lands in its logical stem");
    }

    #[test]
    fn a_gap_or_a_missing_piece_is_an_error_naming_the_tensor() {
        let files: Vec<String> = vec!["model-rank0.safetensors".into(), "model-rank1.safetensors".into()];
        let gap = merge(
            2,
            vec![
                ("model-rank0.safetensors".into(), piece("model", "w", &[6], 0, 3)),
                ("model-rank1.safetensors".into(), piece("model", "w", &[6], 4, 6)),
            ],
        );
        let err = check_table(&gap, &files, Path::new("m.json")).unwrap_err().to_string();
        assert!(err.contains("\"w\"") && err.contains("element 3"), "{err}");
        let short = merge(2, vec![("model-rank0.safetensors".into(), piece("model", "w", &[6], 0, 3))]);
        let err = check_table(&short, &files, Path::new("m.json")).unwrap_err().to_string();
        assert!(err.contains("cover 3 of its 6"), "{err}");
        let whole = merge(2, vec![("model-rank0.safetensors".into(), piece("model", "w", &[2], 0, 2))]);
        let mut by_file = BTreeMap::new();
        by_file.insert(files[0].clone(), vec![record("v", &[1., 2.])]);
        let err = assemble(&whole, by_file, Path::new("step-1")).unwrap_err().to_string();
        assert!(err.contains("model-rank0.safetensors") && err.contains("no piece of \"w\""), "{err}");
    }

    #[test]
    fn logical_stems_drop_only_a_rank_suffix() {
        assert_eq!(logical_stem("model-rank12"), "model");
        assert_eq!(logical_stem("dist-rank0"), "dist");
        assert_eq!(logical_stem("model"), "model");
        assert_eq!(logical_stem("my-rankings"), "my-rankings");
    }
}
