//! stoke-data: the data that feeds training, with no libtorch.
//!
//! Offline preparation turns text into packed token shards (`prepare_text`) and samples into record
//! shards (`prepare_records`). At training time a `TokenStore` maps shards (stoke's own, Megatron-LM
//! `.bin/.idx`, nanoGPT/llm.c raw files, or bytes in memory) and a `Loader` cuts fixed-length rows
//! from them in an order that is a pure function of `(seed, epoch, index)` (`Permutation`), splits
//! every global batch between ranks, and fills reusable buffers on worker threads ahead of the
//! trainer. Its state is the global sample position, so resume is O(1) and exact under any world
//! size. Remote shards go through a local `ShardCache`.
//!
//! ```
//! use stoke_data::{builtin_corpus, BatchSource, Loader, LoaderConfig, TokenStore};
//! let store = TokenStore::from_bytes(builtin_corpus(0, 1 << 16), "builtin");
//! let config = LoaderConfig { seq_len: 64, micro_batch: 8, ..LoaderConfig::default() };
//! let mut loader = Loader::new(store.clone(), config.clone()).unwrap();
//! let first = loader.next_batch().unwrap();
//! assert_eq!(first.tokens.len(), 8 * 65);
//! let saved = loader.position();
//! let second = loader.next_batch().unwrap();
//!
//! // A fresh loader seeked to the saved position continues bit-exactly.
//! let mut resumed = Loader::new(store, config).unwrap();
//! resumed.seek(saved);
//! assert_eq!(resumed.next_batch().unwrap(), second);
//! ```

mod batch;
mod cache;
mod corpus;
mod episodes;
mod error;
mod format;
mod instructions;
mod loader;
mod order;
mod prep;
mod records;
mod remote;
mod rng;
mod tokens;

pub use batch::{Batch, BatchSource, RandomWindows};
pub use cache::{CacheConfig, CacheStats, LocalDirSource, ShardCache, ShardSource};
pub use corpus::{builtin_corpus, unigram_entropy_nats};
pub use episodes::{
    prepare_episodes, read_episode_manifest, read_episodes, write_synthetic_episodes, write_synthetic_lerobot,
    AugmentConfig, Blank, CheckedFile, Draw, Episode, EpisodeBatch, EpisodeEntry, EpisodeLoader, EpisodeLoaderConfig,
    EpisodeLoaderStats, EpisodeManifest, EpisodeSource, EpisodeStore, Episodes, FrameEncoding, LeRobotLayout,
    LeRobotWriter, PrepEpisodesConfig, Step, StepView, SyntheticEpisodes, EPISODES_FORMAT,
};
pub use error::DataError;
pub use format::{
    encode_megatron_index, encode_token_index, raw_layout, Dtype, MegatronIndex, RawLayout, TokenIndexHeader,
    TokenManifest, TokenShardEntry, LLMC_HEADER, LLMC_MAGIC, TOKEN_MANIFEST,
};
pub use instructions::{read_instructions, Instruction, InstructionSource};
pub use loader::{Loader, LoaderConfig, LoaderState, LoaderStats, WeightedStore};
pub use order::{Permutation, SampleStream};
pub use prep::{prepare_text, PrepTextConfig};
pub use records::{prepare_records, PrepRecordsConfig, Record, RecordManifest, RecordShardEntry, RecordStore};
pub use remote::{is_remote, open_cached, shard_source};
pub use rng::{mix64, SplitMix64};
pub use tokens::{startup_bytes_read, verify_prepared, TokenStore};

use std::path::Path;

/// Reads a text file as byte-level tokens.
pub fn read_text_bytes(path: &Path) -> Result<Vec<u8>, DataError> {
    std::fs::read(path).map_err(|source| DataError::Read { path: path.to_path_buf(), source })
}
