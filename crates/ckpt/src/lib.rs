//! stoke-ckpt: checkpoints as safetensors shards plus a JSON manifest, committed atomically.
//!
//! This is the synchronous first version: the trainer hands over host copies of its tensors and a
//! step is committed by renaming a fully written, fsynced folder. The files load in PyTorch with
//! `safetensors.torch.load_file`. The async writer, tiers and resharding are later capabilities
//! that keep this on-disk format.
//!
//! ```
//! use stoke_ckpt::{CheckpointStore, DType, TensorRecord};
//! let dir = tempfile::tempdir().unwrap();
//! let store = CheckpointStore::new(dir.path());
//! let w = TensorRecord::new("w", DType::F32, vec![2], [1f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect()).unwrap();
//! store.save(100, &[("model", &[w])], serde_json::json!({"step": 100})).unwrap();
//! assert_eq!(store.latest().unwrap(), Some(100));
//! ```

mod error;
mod store;

pub use error::CkptError;
pub use store::{
    load_dir, steps_to_delete, CheckpointStore, DType, FileEntry, Loaded, Manifest, TensorRecord, MANIFEST,
};
