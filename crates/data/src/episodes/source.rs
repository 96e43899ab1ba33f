//! The episode loader as the trainer's batch source.

use super::loader::EpisodeLoader;
use crate::DataError;

/// An [`EpisodeLoader`] as the trainer's [`BatchSource`](crate::BatchSource): each batch's
/// `episode` holds the loader's batch, `seq_len` its instruction tokens.
pub struct EpisodeSource {
    loader: EpisodeLoader,
}

impl EpisodeSource {
    pub fn new(loader: EpisodeLoader) -> EpisodeSource {
        EpisodeSource { loader }
    }

    pub fn loader(&self) -> &EpisodeLoader {
        &self.loader
    }
}

impl crate::BatchSource for EpisodeSource {
    fn next_batch(&mut self) -> Result<crate::Batch, DataError> {
        let batch = self.loader.next_batch()?;
        Ok(crate::Batch {
            micro_batch: batch.micro_batch,
            seq_len: self.loader.max_tokens(),
            tokens: Vec::new(),
            loss_mask: Vec::new(),
            episode: Some(Box::new(batch)),
        })
    }

    fn position(&self) -> u64 {
        self.loader.position()
    }

    fn seek(&mut self, position: u64) {
        self.loader.seek(position)
    }

    fn frame_stages(&self) -> Option<crate::EpisodeLoaderStats> {
        Some(self.loader.stats())
    }
}
