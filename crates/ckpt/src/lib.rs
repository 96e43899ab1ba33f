//! stoke-ckpt: checkpoints as safetensors shards plus a JSON manifest, committed atomically, and
//! written in the background from reusable host buffers.
//!
//! `CheckpointStore` is the mechanism: the commit protocol (temporary folder per writer, fsync,
//! rename or atomic exchange, trash before removal), listing of complete checkpoints, verified
//! loading, `verify_dir` for a full pass. `steps_to_delete` is the retention policy.
//! `CheckpointWriter` persists `Snapshot`s (host buffers, two by default) on a long-lived thread,
//! with back-pressure when every buffer is busy; a snapshot is published once the caller
//! `release`s its step (after recording it), so no checkpoint is ever ahead of the run's
//! records. Host buffers are page-aligned mappings (`hostbuf.rs`), so a snapshot's files go to the
//! disk with `O_DIRECT` straight from them, and can be page-locked for a GPU through the CUDA
//! runtime loaded at run time (`pin.rs`, `CheckpointWriter::pin_host_buffers`); `stream_copy` is
//! the copy into them (`stream_copy_checksummed` also returns the bytes' CRC-32, hashed from the
//! cache, for `Snapshot::add_checksums`; `Crc32x256` takes the CRC-32 from a kernel's AVX2
//! registers). `Mirror` copies committed checkpoints to a second tier (S3 or a folder, through
//! `object_store`) in the background, and `MirrorStore` lists, downloads and deletes them there.
//! The files load in PyTorch with
//! `safetensors.torch.load_file`.
//!
//! ```
//! use stoke_ckpt::{CheckpointStore, CheckpointWriter, DType, WriterConfig};
//! let dir = tempfile::tempdir().unwrap();
//! let store = CheckpointStore::new(dir.path());
//! let mut writer = CheckpointWriter::new(store.clone(), WriterConfig::default()).unwrap();
//! let mut snapshot = writer.begin(100).unwrap();
//! snapshot.tensor("model", "w", DType::F32, &[2]).copy_from_slice(&[0, 0, 128, 63, 0, 0, 0, 64]);
//! snapshot.set_meta(serde_json::json!({"data_position": 1600}));
//! writer.submit(snapshot).unwrap();
//! writer.release(100).unwrap();
//! let committed = writer.finish().unwrap();
//! assert_eq!(committed[0].step, 100);
//! assert_eq!(store.latest().unwrap(), Some(100));
//! assert_eq!(store.load(100).unwrap().files["model"][0].data[4..], 2f32.to_le_bytes());
//! ```

#[cfg(target_arch = "x86_64")]
mod crcfold;
mod error;
mod format;
mod fsops;
mod hostbuf;
mod mirror;
mod pin;
mod shards;
mod store;
mod writer;

#[cfg(target_arch = "x86_64")]
pub use crcfold::{crc32x256_available, Crc32x256};
pub use error::CkptError;
pub use format::{write_safetensors, DType, TensorRecord};
pub use fsops::{into_fresh_dir, rename_exchange, FreshDirError};
pub use hostbuf::{checksum, checksum_concat, stream_copy, stream_copy_checksummed, AlignedBlock};
pub use mirror::{Mirror, MirrorStats, MirrorStore};
pub use shards::{Piece, ShardRole, ShardTable, ShardedTensor};
pub use store::{
    load_dir, steps_to_delete, steps_to_delete_protecting, verify_dir, CheckpointStore, FileEntry, Loaded, Manifest,
    VerifyReport, MANIFEST,
};
pub use writer::{CheckpointWriter, Committed, Snapshot, WriterConfig, WriterStats};
