//! The prefetching loader: worker threads fill reusable batch buffers ahead of the trainer.
//!
//! The consumer keeps `prefetch_depth` batches in flight: each `next_batch` takes the oldest one
//! (waiting only if a worker has not finished it) and hands out one more job, so memory is bounded
//! by `prefetch_depth` buffers plus those the trainer holds, and the workers stop when the trainer
//! stops taking (back-pressure). Workers live as long as the loader, across epochs and seeks.
//! With no workers the loader is synchronous: each `next_batch` assembles its batch on the calling
//! thread, which waits for all of it (the baseline a prefetching loader is measured against).
//!
//! The state is one integer, the global stream position of the next batch (plus the seed and the
//! config): batch rows for rank `r` of `world_size` are stream positions
//! `[start + r·micro_batch, start + (r+1)·micro_batch)`, where `start` advances by the global batch
//! `world_size·micro_batch`. Every rank derives the same starts without talking to the others, and a
//! run resumed under another world size continues the same global order from the saved position.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use serde::{Deserialize, Serialize};

use crate::order::SampleStream;
use crate::tokens::TokenStore;
use crate::{Batch, BatchSource, DataError};

/// How the loader cuts and delivers batches. Plain data; `Loader::new` checks it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoaderConfig {
    /// Tokens a row feeds the model; a row holds `seq_len + 1` tokens. Default 128.
    pub seq_len: usize,
    /// Rows per batch on each rank. Default 16.
    pub micro_batch: usize,
    /// Seed of the sample order. Default 0.
    pub seed: u64,
    /// This process's rank, below `world_size`. Default 0.
    pub rank: usize,
    /// Number of ranks sharing the global order. Default 1.
    pub world_size: usize,
    /// Worker threads filling batches; 0 assembles each batch on the calling thread when asked
    /// (no prefetch). Default 2.
    pub n_workers: usize,
    /// Batches prepared ahead of the trainer (the bound of the prefetch queue; unused without
    /// workers). Default 4.
    pub prefetch_depth: usize,
    /// With one dataset, skip the tail of an epoch that cannot fill a whole global batch, so a batch
    /// never mixes epochs; without it batches run across epoch ends. Default true.
    pub drop_last: bool,
}

impl Default for LoaderConfig {
    fn default() -> LoaderConfig {
        LoaderConfig {
            seq_len: 128,
            micro_batch: 16,
            seed: 0,
            rank: 0,
            world_size: 1,
            n_workers: 2,
            prefetch_depth: 4,
            drop_last: true,
        }
    }
}

/// One dataset of a loader and its weight in the blend.
#[derive(Debug, Clone)]
pub struct WeightedStore {
    pub store: TokenStore,
    pub weight: f64,
}

/// What a loader has done, counted (not timed) so tests can assert on it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoaderStats {
    /// Batches handed to the trainer.
    pub batches: u64,
    /// Of those, how many were not ready when asked for (the trainer waited).
    pub waited: u64,
    /// Batch buffers allocated (the rest were reused).
    pub buffers_allocated: u64,
    /// Batch jobs given to workers, including batches prepared but discarded by a seek.
    pub jobs_dispatched: u64,
}

/// The resume state of a loader: with the seed and config, enough to continue bit-exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    pub seed: u64,
    /// The epoch of the next batch (single dataset; 0 for a blend).
    pub epoch: u64,
    /// Global stream position of the next batch: samples consumed by all ranks, counting skipped tails.
    pub samples_consumed: u64,
}

struct Shared {
    stores: Vec<TokenStore>,
    stream: SampleStream,
    seq_len: usize,
    micro_batch: usize,
    rank: usize,
}

struct Job {
    generation: u64,
    start: u64,
    buffer: Vec<i64>,
}

struct Done {
    generation: u64,
    start: u64,
    buffer: Vec<i64>,
    /// Why the batch could not be filled (a shard whose CRC-32 does not match its manifest).
    error: Option<DataError>,
}

impl Shared {
    /// Fills `buffer` with this rank's rows of the global batch starting at stream position `start`.
    /// Refuses a row from a shard whose CRC-32 differs from the manifest's (each shard is hashed
    /// once, by the store's background check or its first reader).
    fn fill(&self, start: u64, buffer: &mut Vec<i64>) -> Result<(), DataError> {
        let width = self.seq_len + 1;
        buffer.resize(self.micro_batch * width, 0);
        let first = start + (self.rank * self.micro_batch) as u64;
        let locate = |row_idx: usize| {
            let (dataset_idx, _epoch, sample) = self.stream.locate(first + row_idx as u64);
            (dataset_idx, sample * self.seq_len as u64)
        };
        // Rows sit at random places in the data: ask for the next row's memory while copying this
        // one, so the copy does not stall on a cache (and TLB) miss per row.
        let mut next = locate(0);
        for (row_idx, row) in buffer.chunks_exact_mut(width).enumerate() {
            let (dataset_idx, token) = next;
            if row_idx + 1 < self.micro_batch {
                next = locate(row_idx + 1);
                self.stores[next.0].prefetch(next.1, width);
            }
            let store = &self.stores[dataset_idx];
            // A row may run over the end of one shard into the next.
            store.verify_at(token)?;
            store.verify_at(token + width as u64 - 1)?;
            store.read(token, row);
        }
        Ok(())
    }
}

/// The prefetching, resumable, rank-aware batch source. See the module docs.
pub struct Loader {
    shared: Arc<Shared>,
    config: LoaderConfig,
    global_batch: u64,
    job_tx: Option<Sender<Job>>,
    done_rx: Receiver<Done>,
    workers: Vec<JoinHandle<()>>,
    generation: u64,
    /// Starts of the batches in flight, oldest first.
    in_flight: VecDeque<u64>,
    /// Finished batches that arrived before an older one.
    finished: BTreeMap<u64, Vec<i64>>,
    free: Vec<Vec<i64>>,
    /// Stream position of the next batch handed to the trainer (before drop_last alignment).
    position: u64,
    /// Stream position of the next batch to dispatch to a worker.
    dispatch_position: u64,
    stats: LoaderStats,
}

fn invalid(field: &'static str, reason: String) -> DataError {
    DataError::Config { field, reason }
}

impl Loader {
    /// A loader over one dataset.
    pub fn new(store: TokenStore, config: LoaderConfig) -> Result<Loader, DataError> {
        Loader::blend(vec![WeightedStore { store, weight: 1.0 }], config)
    }

    /// A loader over a weighted blend of datasets.
    pub fn blend(datasets: Vec<WeightedStore>, config: LoaderConfig) -> Result<Loader, DataError> {
        let c = &config;
        for (field, value) in [
            ("seq_len", c.seq_len),
            ("micro_batch", c.micro_batch),
            ("world_size", c.world_size),
            ("prefetch_depth", c.prefetch_depth),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be at least 1".into()));
            }
        }
        if c.rank >= c.world_size {
            return Err(invalid("rank", format!("{} is not below world_size {}", c.rank, c.world_size)));
        }
        if datasets.is_empty() {
            return Err(invalid("datasets", "no dataset given".into()));
        }
        let mut sizes = Vec::with_capacity(datasets.len());
        for dataset in &datasets {
            let n_tokens = dataset.store.n_tokens();
            if n_tokens < c.seq_len as u64 + 1 {
                return Err(DataError::TooShort {
                    path: dataset.store.label().into(),
                    n_tokens: n_tokens as usize,
                    needed: c.seq_len + 1,
                });
            }
            if !(dataset.weight.is_finite() && dataset.weight > 0.0) {
                return Err(invalid(
                    "weight",
                    format!("{} for {} must be positive", dataset.weight, dataset.store.label()),
                ));
            }
            // Sample i is tokens [i·seq_len, i·seq_len + seq_len + 1): consecutive samples share one
            // token, so documents are packed end to end with nothing wasted.
            sizes.push(((n_tokens - 1) / c.seq_len as u64, dataset.weight));
        }
        let stream = if sizes.len() == 1 {
            SampleStream::single(sizes[0].0, c.seed)
        } else {
            SampleStream::blend(&sizes, c.seed)
        };
        let global_batch = (c.world_size * c.micro_batch) as u64;
        if let Some(epoch_len) = stream.epoch_len() {
            if c.drop_last && epoch_len < global_batch {
                return Err(invalid(
                    "drop_last",
                    format!(
                        "{} holds {epoch_len} samples, fewer than one global batch of {global_batch}",
                        datasets[0].store.label()
                    ),
                ));
            }
        }
        let shared = Arc::new(Shared {
            stores: datasets.into_iter().map(|d| d.store).collect(),
            stream,
            seq_len: c.seq_len,
            micro_batch: c.micro_batch,
            rank: c.rank,
        });
        let (job_tx, job_rx) = crossbeam_channel::unbounded::<Job>();
        let (done_tx, done_rx) = crossbeam_channel::unbounded::<Done>();
        let workers = (0..c.n_workers)
            .map(|worker_idx| {
                let shared = Arc::clone(&shared);
                let job_rx = job_rx.clone();
                let done_tx = done_tx.clone();
                std::thread::Builder::new()
                    .name(format!("stoke-data-{worker_idx}"))
                    .spawn(move || {
                        for mut job in job_rx {
                            let error = shared.fill(job.start, &mut job.buffer).err();
                            let done = Done { generation: job.generation, start: job.start, buffer: job.buffer, error };
                            if done_tx.send(done).is_err() {
                                return;
                            }
                        }
                    })
                    .map_err(|source| DataError::Read { path: "worker thread".into(), source })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut loader = Loader {
            shared,
            global_batch,
            job_tx: Some(job_tx),
            done_rx,
            workers,
            generation: 0,
            in_flight: VecDeque::new(),
            finished: BTreeMap::new(),
            free: Vec::new(),
            position: 0,
            dispatch_position: 0,
            stats: LoaderStats::default(),
            config,
        };
        loader.top_up()?;
        Ok(loader)
    }

    /// Where a batch asked for at `position` really starts: with drop_last, the next epoch's start
    /// when the rest of this epoch cannot fill a global batch.
    fn align(&self, position: u64) -> u64 {
        match self.shared.stream.epoch_len() {
            Some(epoch_len) if self.config.drop_last && position % epoch_len + self.global_batch > epoch_len => {
                (position / epoch_len + 1) * epoch_len
            }
            _ => position,
        }
    }

    fn top_up(&mut self) -> Result<(), DataError> {
        while !self.workers.is_empty() && self.in_flight.len() < self.config.prefetch_depth {
            let start = self.align(self.dispatch_position);
            let buffer = self.take_buffer();
            let job = Job { generation: self.generation, start, buffer };
            self.job_tx.as_ref().expect("sender lives until drop").send(job).map_err(|_| DataError::WorkerGone)?;
            self.in_flight.push_back(start);
            self.stats.jobs_dispatched += 1;
            self.dispatch_position = start + self.global_batch;
        }
        Ok(())
    }

    /// Fills `buffer` on the calling thread with this rank's rows of the global batch that starts at
    /// stream position `start` (what a worker does for one job; for benchmarks and tools).
    pub fn assemble(&self, start: u64, buffer: &mut Vec<i64>) -> Result<(), DataError> {
        self.shared.fill(start, buffer)
    }

    /// The resume state (seed, epoch, samples consumed).
    pub fn state(&self) -> LoaderState {
        let samples_consumed = self.align(self.position);
        let epoch = self.shared.stream.epoch_len().map_or(0, |len| samples_consumed / len);
        LoaderState { seed: self.config.seed, epoch, samples_consumed }
    }

    /// Samples in one epoch of the single dataset (None for a blend).
    pub fn samples_per_epoch(&self) -> Option<u64> {
        self.shared.stream.epoch_len()
    }

    pub fn stats(&self) -> LoaderStats {
        self.stats
    }

    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }
}

impl Loader {
    /// A recycled buffer, or a new one (counted).
    fn take_buffer(&mut self) -> Vec<i64> {
        self.free.pop().unwrap_or_else(|| {
            self.stats.buffers_allocated += 1;
            Vec::with_capacity(self.config.micro_batch * (self.config.seq_len + 1))
        })
    }

    /// `next_batch` without workers: the whole batch is assembled now, on this thread.
    fn next_batch_synchronous(&mut self) -> Result<Batch, DataError> {
        let start = self.align(self.position);
        let mut buffer = self.take_buffer();
        self.shared.fill(start, &mut buffer)?;
        self.stats.batches += 1;
        self.stats.waited += 1;
        self.position = start + self.global_batch;
        Ok(Batch {
            micro_batch: self.config.micro_batch,
            seq_len: self.config.seq_len,
            tokens: buffer,
            loss_mask: Vec::new(),
            episode: None,
        })
    }
}

impl BatchSource for Loader {
    fn next_batch(&mut self) -> Result<Batch, DataError> {
        if self.workers.is_empty() {
            return self.next_batch_synchronous();
        }
        let start = *self.in_flight.front().expect("top_up keeps batches in flight");
        let mut waited = false;
        // Invariant: every Done of the current generation is either in `finished` or still coming.
        let buffer = loop {
            if let Some(buffer) = self.finished.remove(&start) {
                break buffer;
            }
            let done = match self.done_rx.try_recv() {
                Ok(done) => done,
                Err(_) => {
                    waited = true;
                    self.done_rx.recv().map_err(|_| DataError::WorkerGone)?
                }
            };
            if let (Some(error), true) = (done.error, done.generation == self.generation) {
                return Err(error);
            }
            if done.generation == self.generation {
                self.finished.insert(done.start, done.buffer);
            } else {
                self.free.push(done.buffer);
            }
        };
        self.in_flight.pop_front();
        self.stats.batches += 1;
        self.stats.waited += waited as u64;
        self.position = start + self.global_batch;
        self.top_up()?;
        Ok(Batch {
            micro_batch: self.config.micro_batch,
            seq_len: self.config.seq_len,
            tokens: buffer,
            loss_mask: Vec::new(),
            episode: None,
        })
    }

    /// The global stream position of the next batch (samples consumed by all ranks).
    fn position(&self) -> u64 {
        self.position
    }

    fn seek(&mut self, position: u64) {
        // Batches already in flight belong to the old position; their buffers come back as free.
        self.generation += 1;
        self.in_flight.clear();
        self.free.extend(std::mem::take(&mut self.finished).into_values());
        self.position = position;
        self.dispatch_position = position;
        // A failed send means the workers are gone; the next `next_batch` reports it.
        let _ = self.top_up();
    }

    fn recycle(&mut self, batch: Batch) {
        if self.free.len() < self.config.prefetch_depth {
            self.free.push(batch.tokens);
        }
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        // Closing the job channel ends the workers' loops.
        self.job_tx = None;
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}
