//! Batches of token sequences and the sources that produce them.

use crate::rng::mix64;
use crate::DataError;

/// One micro-batch: `micro_batch` rows of `seq_len + 1` tokens, row-major. The trainer feeds the
/// first `seq_len` tokens of a row and predicts the last `seq_len` (the row shifted by one).
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub micro_batch: usize,
    pub seq_len: usize,
    pub tokens: Vec<i64>,
    /// Laid out like `tokens`: true where a token is no target of the loss (an instruction's
    /// prompt and padding; the first token of a row is never one). Empty: every token counts.
    pub loss_mask: Vec<bool>,
    /// A robot sample's batch (frames, state, actions, the instruction's tokens) from an
    /// [`EpisodeSource`](crate::EpisodeSource); `tokens` is then empty. None for token data.
    pub episode: Option<Box<crate::episodes::EpisodeBatch>>,
}

impl Batch {
    pub fn row(&self, row_idx: usize) -> &[i64] {
        let width = self.seq_len + 1;
        &self.tokens[row_idx * width..(row_idx + 1) * width]
    }
}

/// Where the trainer gets its batches. Implementations are deterministic: the batches after
/// `seek(p)` are a pure function of the source's construction and `p`, so a resumed run sees the
/// same data.
pub trait BatchSource: Send {
    /// The next batch; the position advances.
    fn next_batch(&mut self) -> Result<Batch, DataError>;
    /// The resume point, the state a checkpoint keeps: an opaque integer that only `seek` interprets
    /// (`RandomWindows`: batches handed out; `Loader`: global samples consumed by all ranks).
    fn position(&self) -> u64;
    /// Continue from a point that `position()` returned (possibly in another process).
    fn seek(&mut self, position: u64);
    /// Gives a batch's buffer back for reuse once the trainer has copied it; optional.
    fn recycle(&mut self, batch: Batch) {
        drop(batch);
    }
    /// Where a loader that decodes and augments frames spent its threads' time so far (the
    /// episode loader); None for the others.
    fn frame_stages(&self) -> Option<crate::EpisodeLoaderStats> {
        None
    }
}

/// Windows at pseudo-random offsets of an in-memory token stream; the offsets of batch `n` derive
/// from `(seed, n, row)` alone.
pub struct RandomWindows {
    tokens: Vec<u16>,
    seq_len: usize,
    micro_batch: usize,
    seed: u64,
    position: u64,
}

impl RandomWindows {
    pub fn new(tokens: Vec<u16>, seq_len: usize, micro_batch: usize, seed: u64) -> Result<RandomWindows, DataError> {
        if tokens.len() < seq_len + 2 {
            return Err(DataError::TooShortInMemory { n_tokens: tokens.len(), needed: seq_len + 2 });
        }
        Ok(RandomWindows { tokens, seq_len, micro_batch, seed, position: 0 })
    }

    pub fn from_bytes(bytes: &[u8], seq_len: usize, micro_batch: usize, seed: u64) -> Result<RandomWindows, DataError> {
        RandomWindows::new(bytes.iter().map(|&b| b as u16).collect(), seq_len, micro_batch, seed)
    }

    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }
}

impl BatchSource for RandomWindows {
    fn next_batch(&mut self) -> Result<Batch, DataError> {
        let width = self.seq_len + 1;
        let n_starts = (self.tokens.len() - width) as u64;
        let mut tokens = Vec::with_capacity(self.micro_batch * width);
        for row_idx in 0..self.micro_batch as u64 {
            let key = mix64(self.seed ^ mix64(self.position.wrapping_mul(0x1000_0000_01B3) ^ row_idx));
            let start = ((key as u128 * n_starts as u128) >> 64) as usize;
            tokens.extend(self.tokens[start..start + width].iter().map(|&t| t as i64));
        }
        self.position += 1;
        Ok(Batch { micro_batch: self.micro_batch, seq_len: self.seq_len, tokens, loss_mask: Vec::new(), episode: None })
    }

    fn position(&self) -> u64 {
        self.position
    }

    fn seek(&mut self, position: u64) {
        self.position = position;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_deterministic_and_seekable() {
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let mut a = RandomWindows::from_bytes(&bytes, 16, 4, 9).unwrap();
        let batches: Vec<Batch> = (0..5).map(|_| a.next_batch().unwrap()).collect();
        let mut b = RandomWindows::from_bytes(&bytes, 16, 4, 9).unwrap();
        b.seek(3);
        assert_eq!(b.next_batch().unwrap(), batches[3]);
        assert_eq!(b.position(), 4);
        // Rows are contiguous windows of the stream.
        let row = batches[0].row(1);
        for pair in row.windows(2) {
            assert_eq!((pair[0] + 1) % 251, pair[1] % 251);
        }
    }

    #[test]
    fn too_short_data_is_an_error() {
        assert!(RandomWindows::from_bytes(b"abc", 16, 2, 0).is_err());
    }
}
