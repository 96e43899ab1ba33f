//! stoke-data: the data that feeds training, with no libtorch.
//!
//! Today: the built-in default corpus, a user's text file as byte-level tokens, and a deterministic
//! batch source whose batch `n` is a pure function of `(seed, n)`, so a resumed run sees exactly
//! the batches it would have seen.
//!
//! ```
//! use stoke_data::{builtin_corpus, BatchSource, RandomWindows};
//! let text = builtin_corpus(0, 4096);
//! let mut source = RandomWindows::from_bytes(&text, 64, 8, 0).unwrap();
//! let batch = source.next_batch().unwrap();
//! assert_eq!(batch.tokens.len(), 8 * 65);
//! ```

mod batch;
mod corpus;
mod error;
mod rng;

pub use batch::{Batch, BatchSource, RandomWindows};
pub use corpus::{builtin_corpus, unigram_entropy_nats};
pub use error::DataError;
pub use rng::{mix64, SplitMix64};

use std::path::Path;

/// Reads a text file as byte-level tokens.
pub fn read_text_bytes(path: &Path) -> Result<Vec<u8>, DataError> {
    std::fs::read(path).map_err(|source| DataError::Read { path: path.to_path_buf(), source })
}
