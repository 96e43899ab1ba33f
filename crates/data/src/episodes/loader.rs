//! Batches of robot episodes for training: sample `i` of the stream is one time step `t` of one
//! episode (a Feistel permutation of all steps per epoch, as for text), and holds each camera's
//! frame at `t` and `history` frames before it (the episode's first frame repeated before its
//! start), the instruction's tokens, the state at `t`, and the action chunk `t .. t + chunk`,
//! padded and masked past the episode's end. Worker threads decode (encoded frames) and augment
//! (`augment.rs`) ahead of the trainer; every random draw derives from (seed, epoch, sample,
//! camera), so a batch is a pure function of the loader's position and a resume continues bit for
//! bit, on any world size. Rank `r` takes rows `r*micro_batch..` of each global batch.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};

use super::augment::{AugmentConfig, Draw};
use super::store::EpisodeStore;
use crate::order::Permutation;
use crate::rng::{mix64, SplitMix64};
use crate::DataError;

/// How the episode loader samples and assembles. Plain data.
#[derive(Debug, Clone, PartialEq)]
pub struct EpisodeLoaderConfig {
    pub micro_batch: usize,
    pub rank: usize,
    pub world_size: usize,
    pub seed: u64,
    /// Future actions per sample, the chunk the model predicts. Default 8.
    pub chunk: usize,
    /// Past frames per camera besides the current one. Default 0.
    pub history: usize,
    /// Side of the batch's frames; 0 takes the prepared resolution. Default 0.
    pub resolution: u32,
    /// Augmentation for training; none for evaluation (whole frames, colours kept). Default: the
    /// default `AugmentConfig`.
    pub augment: Option<AugmentConfig>,
    /// Instruction tokens per sample: longer instructions are cut, shorter ones padded and masked.
    /// Default 32.
    pub max_tokens: usize,
    /// Worker threads; 0 assembles each batch on the caller's thread. Default 2.
    pub workers: usize,
    /// Batches assembled ahead. Default 4.
    pub prefetch: usize,
    /// The episodes samples come from, by index (a held-out split takes the tail); None: all.
    /// Default None.
    pub episodes: Option<std::ops::Range<usize>>,
    /// What to blank for an ablation: frames (every pixel 0) or instructions (no token).
    /// Default: nothing.
    pub blank: Blank,
    /// Frames as `[3, side, side]` (PyTorch's NCHW) instead of `[side, side, 3]`, transposed by the
    /// worker that assembles the batch. Default false.
    pub channels_first: bool,
}

/// What an ablation blanks in every sample ([`EpisodeLoaderConfig::blank`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Blank {
    #[default]
    Nothing,
    /// Every frame black.
    Frames,
    /// Every instruction empty (all padding).
    Instructions,
}

impl Default for EpisodeLoaderConfig {
    fn default() -> EpisodeLoaderConfig {
        EpisodeLoaderConfig {
            micro_batch: 8,
            rank: 0,
            world_size: 1,
            seed: 1337,
            chunk: 8,
            history: 0,
            resolution: 0,
            augment: Some(AugmentConfig::default()),
            max_tokens: 32,
            workers: 2,
            prefetch: 4,
            episodes: None,
            blank: Blank::Nothing,
            channels_first: false,
        }
    }
}

/// One rank's micro-batch. Row-major arrays, rows in sample order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EpisodeBatch {
    pub micro_batch: usize,
    /// Frames per sample: cameras x (history + 1), cameras outer, oldest frame first.
    pub n_frames: usize,
    pub side: u32,
    /// `[micro_batch, n_frames, side, side, 3]` uint8 (`[.., 3, side, side]` with
    /// `channels_first`), normalized on the compute side.
    pub frames: Vec<u8>,
    /// `[micro_batch, state_dim]`, normalized by the dataset's statistics.
    pub state: Vec<f32>,
    /// `[micro_batch, chunk, action_dim]`, normalized; zeros where masked.
    pub actions: Vec<f32>,
    /// `[micro_batch, chunk]`: 1 where the action exists, 0 past the episode's end.
    pub action_mask: Vec<u8>,
    /// `[micro_batch, max_tokens]` instruction tokens, 0 where masked.
    pub tokens: Vec<i64>,
    /// `[micro_batch, max_tokens]`: 1 where a token is.
    pub token_mask: Vec<u8>,
    /// The global step index each row was cut from.
    pub steps: Vec<u64>,
    /// `[micro_batch, chunk, action_dim]` standard normal draws, the start of a flow-matching
    /// model's flow, a pure function of (seed, epoch, sample).
    pub noise: Vec<f32>,
    /// `[micro_batch]` draws in [0, 0.999), the flow time each row trains at (see `flow_draws`), from the same key.
    pub time: Vec<f32>,
}

/// Counters of the loader's work, for the report's data findings.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EpisodeLoaderStats {
    pub batches: u64,
    /// Batches the trainer had to wait for.
    pub waited: u64,
    pub frames: u64,
    /// Nanoseconds spent decoding encoded frames and augmenting, over all workers.
    pub decode_ns: u64,
    pub augment_ns: u64,
    /// Nanoseconds the workers spent assembling batches (their busy time).
    pub busy_ns: u64,
}

struct Shared {
    store: EpisodeStore,
    config: EpisodeLoaderConfig,
    side: u32,
    /// The global steps samples come from (the chosen episodes').
    steps: std::ops::Range<u64>,
}

/// A key's draws for the flow: `n` standard normals (Box-Muller) then a time, `0.999 (1 - u)` with
/// u ~ Beta(1.5, 1) (drawn as a uniform to the power 2/3), as π0 and GR00T N1 draw it: more of the
/// noisy end, where the velocity depends most on the frames and the instruction. Drawn uniformly,
/// the probe's flow model stayed at 1.0-1.1 of the error of reading nothing for 750 steps; drawn
/// so, it was at 0.44 by step 250 (`benches/vla_grounding_probe.py`, RESULTS "Does it use what
/// it sees and what it is told?").
fn flow_draws(key: u64, n: usize, noise: &mut Vec<f32>, time: &mut Vec<f32>) {
    let mut rng = SplitMix64::new(key);
    let mut unit = || ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    for _ in 0..n {
        let (u, v) = (unit(), unit());
        noise.push(((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32);
    }
    time.push((0.999 * (1.0 - unit().powf(2.0 / 3.0))) as f32);
}

/// Assembles the batch of this rank starting at global sample `start`.
fn assemble(shared: &Shared, start: u64) -> Result<(EpisodeBatch, EpisodeLoaderStats), DataError> {
    let busy = Instant::now();
    let (store, config) = (&shared.store, &shared.config);
    let manifest = store.manifest();
    let n_steps = shared.steps.end - shared.steps.start;
    let (n_cameras, per_camera) = (manifest.cameras.len(), config.history + 1);
    let mut batch = EpisodeBatch {
        micro_batch: config.micro_batch,
        n_frames: n_cameras * per_camera,
        side: shared.side,
        ..EpisodeBatch::default()
    };
    let mut stats = EpisodeLoaderStats::default();
    for row in 0..config.micro_batch as u64 {
        let sample = start + config.rank as u64 * config.micro_batch as u64 + row;
        let (epoch, within) = (sample / n_steps, sample % n_steps);
        let step = shared.steps.start + Permutation::for_epoch(n_steps, config.seed, epoch).apply(within);
        let (episode, t) = store.locate(step);
        let (episode_first, episode_len) = (episode.first_step, episode.n_steps);
        batch.steps.push(step);
        for camera in 0..n_cameras {
            let key = mix64(config.seed ^ mix64(epoch ^ mix64(sample ^ mix64(camera as u64 + 1))));
            let draw = match &config.augment {
                Some(augment) => Draw::new(augment, &mut SplitMix64::new(key)),
                None => Draw::IDENTITY,
            };
            for back in (0..per_camera as u64).rev() {
                if config.blank == Blank::Frames {
                    // An ablation's black frame: nothing to read, decode or augment.
                    batch.frames.resize(batch.frames.len() + (shared.side as usize).pow(2) * 3, 0);
                    stats.frames += 1;
                    continue;
                }
                let frame_step = episode_first + t.saturating_sub(back);
                let record = store.frame(frame_step, camera)?;
                let decode_start = Instant::now();
                // A decoded frame is augmented straight from the mapped shard, without a copy.
                let augment_start =
                    if store.frames_decoded() {
                        let [h, w, _] = record.shape;
                        let image = image::ImageBuffer::<image::Rgb<u8>, &[u8]>::from_raw(w, h, record.bytes)
                            .ok_or_else(|| DataError::Corrupt {
                                path: manifest_path(store),
                                what: "frame",
                                offset: frame_step,
                                detail: format!("{} bytes for a {w}x{h} RGB frame", record.bytes.len()),
                            })?;
                        let augment_start = Instant::now();
                        draw.apply(&image, shared.side, &mut batch.frames);
                        augment_start
                    } else {
                        let image = image::load_from_memory(record.bytes)
                            .map_err(|err| DataError::Image {
                                path: manifest_path(store),
                                detail: format!("frame of step {frame_step}, camera {camera}: {err}"),
                            })?
                            .into_rgb8();
                        let augment_start = Instant::now();
                        draw.apply(&image, shared.side, &mut batch.frames);
                        augment_start
                    };
                stats.decode_ns += (augment_start - decode_start).as_nanos() as u64;
                stats.augment_ns += augment_start.elapsed().as_nanos() as u64;
                stats.frames += 1;
            }
        }
        let (state, _) = store.state_action(step)?;
        batch.state.extend_from_slice(&state);
        for ahead in 0..config.chunk as u64 {
            if t + ahead < episode_len {
                let (_, action) = store.state_action(step + ahead)?;
                batch.actions.extend_from_slice(&action);
                batch.action_mask.push(1);
            } else {
                batch.actions.extend(std::iter::repeat_n(0.0, manifest.action_dim));
                batch.action_mask.push(0);
            }
        }
        let flow_key = mix64(config.seed ^ mix64(epoch ^ mix64(sample ^ FLOW_SALT)));
        flow_draws(flow_key, config.chunk * manifest.action_dim, &mut batch.noise, &mut batch.time);
        let kept = if config.blank == Blank::Instructions { 0 } else { episode.tokens.len().min(config.max_tokens) };
        let tokens = &episode.tokens[..kept];
        batch.tokens.extend(tokens.iter().map(|&t| t as i64));
        batch.token_mask.extend(std::iter::repeat_n(1, tokens.len()));
        let pad = config.max_tokens - tokens.len();
        batch.tokens.extend(std::iter::repeat_n(0, pad));
        batch.token_mask.extend(std::iter::repeat_n(0, pad));
    }
    if config.channels_first {
        to_channels_first(&mut batch.frames, shared.side as usize);
    }
    stats.busy_ns = busy.elapsed().as_nanos() as u64;
    Ok((batch, stats))
}

/// Each `[side, side, 3]` frame of `frames` rewritten as `[3, side, side]`.
fn to_channels_first(frames: &mut [u8], side: usize) {
    let pixels = side * side;
    if pixels == 0 {
        return;
    }
    let mut planar = vec![0u8; 3 * pixels];
    for frame in frames.chunks_exact_mut(3 * pixels) {
        let (r, rest) = planar.split_at_mut(pixels);
        let (g, b) = rest.split_at_mut(pixels);
        for (p, rgb) in frame.chunks_exact(3).enumerate() {
            (r[p], g[p], b[p]) = (rgb[0], rgb[1], rgb[2]);
        }
        frame.copy_from_slice(&planar);
    }
}

/// Keeps the flow's draws apart from the cameras' augmentation keys.
const FLOW_SALT: u64 = 0x666c_6f77_0000_0001;

fn manifest_path(store: &EpisodeStore) -> std::path::PathBuf {
    store.dir().join("manifest.json")
}

struct Job {
    generation: u64,
    start: u64,
}

type Done = (u64, u64, Result<(EpisodeBatch, EpisodeLoaderStats), DataError>);

/// The prefetching, resumable, rank-aware episode batch source.
pub struct EpisodeLoader {
    shared: Arc<Shared>,
    global_batch: u64,
    /// Global samples consumed: the whole resume state.
    position: u64,
    generation: u64,
    job_tx: Option<Sender<Job>>,
    done_rx: Receiver<Done>,
    workers: Vec<JoinHandle<()>>,
    in_flight: VecDeque<u64>,
    finished: HashMap<u64, Result<(EpisodeBatch, EpisodeLoaderStats), DataError>>,
    stats: EpisodeLoaderStats,
}

impl EpisodeLoader {
    pub fn new(store: EpisodeStore, config: EpisodeLoaderConfig) -> Result<EpisodeLoader, DataError> {
        let invalid = |field, reason: String| DataError::Config { field, reason };
        if config.micro_batch == 0 || config.world_size == 0 || config.chunk == 0 || config.max_tokens == 0 {
            return Err(invalid("micro_batch, world_size, chunk, max_tokens", "must each be at least 1".into()));
        }
        if config.rank >= config.world_size {
            return Err(invalid("rank", format!("{} is not below world_size {}", config.rank, config.world_size)));
        }
        let side = if config.resolution == 0 { store.manifest().resolution } else { config.resolution };
        if !(8..=1024).contains(&side) {
            return Err(invalid("resolution", format!("must be 8 to 1024; got {side}")));
        }
        let global_batch = (config.micro_batch * config.world_size) as u64;
        let episodes = store.episodes();
        let steps = match &config.episodes {
            None => 0..store.n_steps(),
            Some(range) if range.start < range.end && range.end <= episodes.len() => {
                let last = &episodes[range.end - 1];
                episodes[range.start].first_step..last.first_step + last.n_steps
            }
            Some(range) => {
                return Err(invalid(
                    "episodes",
                    format!("{range:?} is not a non-empty range of the dataset's {} episodes", episodes.len()),
                ))
            }
        };
        let shared = Arc::new(Shared { store, config, side, steps });
        let (job_tx, job_rx) = crossbeam_channel::unbounded::<Job>();
        let (done_tx, done_rx) = crossbeam_channel::unbounded::<Done>();
        let workers = (0..shared.config.workers)
            .map(|worker_idx| {
                let (shared, job_rx, done_tx) = (Arc::clone(&shared), job_rx.clone(), done_tx.clone());
                std::thread::Builder::new()
                    .name(format!("stoke-episodes-{worker_idx}"))
                    .spawn(move || {
                        for job in job_rx {
                            if done_tx.send((job.generation, job.start, assemble(&shared, job.start))).is_err() {
                                return;
                            }
                        }
                    })
                    .expect("spawning a loader thread")
            })
            .collect();
        Ok(EpisodeLoader {
            shared,
            global_batch,
            position: 0,
            generation: 0,
            job_tx: Some(job_tx),
            done_rx,
            workers,
            in_flight: VecDeque::new(),
            finished: HashMap::new(),
            stats: EpisodeLoaderStats::default(),
        })
    }

    /// The next micro-batch of this rank.
    pub fn next_batch(&mut self) -> Result<EpisodeBatch, DataError> {
        let start = self.position;
        let (batch, stats) = if self.workers.is_empty() {
            assemble(&self.shared, start)?
        } else {
            self.top_up(start)?;
            let mut waited = false;
            let result = loop {
                if let Some(result) = self.finished.remove(&start) {
                    break result;
                }
                let done = match self.done_rx.try_recv() {
                    Ok(done) => done,
                    Err(_) => {
                        waited = true;
                        self.done_rx.recv().map_err(|_| DataError::WorkerGone)?
                    }
                };
                if done.0 == self.generation {
                    self.finished.insert(done.1, done.2);
                }
            };
            self.in_flight.pop_front();
            self.stats.waited += waited as u64;
            result?
        };
        self.position = start + self.global_batch;
        self.stats.batches += 1;
        self.stats.frames += stats.frames;
        self.stats.decode_ns += stats.decode_ns;
        self.stats.augment_ns += stats.augment_ns;
        self.stats.busy_ns += stats.busy_ns;
        if !self.workers.is_empty() {
            self.top_up(self.position)?;
        }
        Ok(batch)
    }

    /// Keeps `prefetch` batches from `from` on in flight.
    fn top_up(&mut self, from: u64) -> Result<(), DataError> {
        let depth = self.shared.config.prefetch.max(1) as u64;
        let mut next = self.in_flight.back().map_or(from, |&last| last + self.global_batch);
        while (self.in_flight.len() as u64) < depth {
            let job = Job { generation: self.generation, start: next };
            self.job_tx.as_ref().expect("sender lives until drop").send(job).map_err(|_| DataError::WorkerGone)?;
            self.in_flight.push_back(next);
            next += self.global_batch;
        }
        Ok(())
    }

    /// The resume state: global samples consumed by all ranks.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Continues from a position `position()` returned (on this or another world size: the
    /// position counts samples, not batches). Batches in flight are dropped.
    pub fn seek(&mut self, position: u64) {
        self.position = position;
        self.generation += 1;
        self.in_flight.clear();
        self.finished.clear();
    }

    pub fn stats(&self) -> EpisodeLoaderStats {
        self.stats
    }

    pub fn store(&self) -> &EpisodeStore {
        &self.shared.store
    }

    /// Instruction tokens per sample (`EpisodeLoaderConfig::max_tokens`).
    pub fn max_tokens(&self) -> usize {
        self.shared.config.max_tokens
    }
}

impl Drop for EpisodeLoader {
    fn drop(&mut self) {
        drop(self.job_tx.take());
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::episodes::{prepare_episodes, write_synthetic_episodes, PrepEpisodesConfig, SyntheticEpisodes};

    fn prepared(dir: &std::path::Path, keep_encoded: bool) -> std::path::PathBuf {
        let raw = dir.join("raw");
        if !raw.exists() {
            let spec = SyntheticEpisodes { n_episodes: 5, steps_per_episode: 6, resolution: 40, seed: 3 };
            write_synthetic_episodes(&raw, &spec).unwrap();
        }
        let out = dir.join(format!("prepared-{keep_encoded}"));
        let config = PrepEpisodesConfig { resolution: 32, keep_encoded, ..PrepEpisodesConfig::default() };
        prepare_episodes(&raw, &config, &out).unwrap();
        out
    }

    fn loader(dir: &std::path::Path, config: EpisodeLoaderConfig) -> EpisodeLoader {
        EpisodeLoader::new(EpisodeStore::open(dir, false).unwrap(), config).unwrap()
    }

    fn batches(loader: &mut EpisodeLoader, n: usize) -> Vec<EpisodeBatch> {
        (0..n).map(|_| loader.next_batch().unwrap()).collect()
    }

    #[test]
    fn a_resumed_loader_continues_bit_for_bit_with_or_without_workers() {
        let dir = tempfile::tempdir().unwrap();
        for keep_encoded in [false, true] {
            let data = prepared(dir.path(), keep_encoded);
            let config =
                EpisodeLoaderConfig { micro_batch: 4, history: 1, chunk: 3, resolution: 24, ..Default::default() };
            let whole = batches(&mut loader(&data, config.clone()), 12);
            let mut first = loader(&data, EpisodeLoaderConfig { workers: 0, ..config.clone() });
            let head = batches(&mut first, 5);
            let mut resumed = loader(&data, config.clone());
            resumed.seek(first.position());
            let tail = batches(&mut resumed, 7);
            assert!(head.iter().chain(&tail).eq(whole.iter()), "keep_encoded {keep_encoded}");
            // 12 batches of 4 run past the at most 30 steps (episodes end when the effector
            // reaches its block): the second epoch is another permutation.
            let n_steps = EpisodeStore::open(&data, false).unwrap().manifest().n_steps as usize;
            assert!((12..48).contains(&n_steps), "{n_steps} steps");
            let epoch_0: std::collections::BTreeSet<u64> =
                whole.iter().flat_map(|b| b.steps.clone()).take(n_steps).collect();
            assert_eq!(epoch_0.len(), n_steps, "distinct steps within an epoch");
            let b = &whole[0];
            assert_eq!((b.n_frames, b.frames.len()), (2, 4 * 2 * 24 * 24 * 3));
            // Channels first: the same pixels, each frame's planes red, green, blue.
            let planar = batches(&mut loader(&data, EpisodeLoaderConfig { channels_first: true, ..config.clone() }), 2);
            for (hwc, chw) in whole[..2].iter().zip(&planar) {
                assert_eq!(
                    EpisodeBatch { frames: vec![], ..hwc.clone() },
                    EpisodeBatch { frames: vec![], ..chw.clone() }
                );
                for (frame_hwc, frame_chw) in hwc.frames.chunks(24 * 24 * 3).zip(chw.frames.chunks(24 * 24 * 3)) {
                    for p in 0..24 * 24 {
                        for c in 0..3 {
                            assert_eq!(frame_chw[c * 24 * 24 + p], frame_hwc[p * 3 + c], "pixel {p} channel {c}");
                        }
                    }
                }
            }
            assert_eq!((b.state.len(), b.actions.len(), b.action_mask.len()), (4 * 2, 4 * 3 * 2, 4 * 3));
        }
    }

    #[test]
    fn ranks_take_their_rows_of_the_global_batch() {
        let dir = tempfile::tempdir().unwrap();
        let data = prepared(dir.path(), false);
        let config = EpisodeLoaderConfig { micro_batch: 4, augment: None, ..Default::default() };
        let single = batches(&mut loader(&data, config.clone()), 3);
        let ranks: Vec<Vec<EpisodeBatch>> = (0..2)
            .map(|rank| {
                batches(
                    &mut loader(&data, EpisodeLoaderConfig { micro_batch: 2, rank, world_size: 2, ..config.clone() }),
                    3,
                )
            })
            .collect();
        for step in 0..3 {
            let joined: Vec<u64> = ranks.iter().flat_map(|r| r[step].steps.clone()).collect();
            assert_eq!(joined, single[step].steps);
            let frames: Vec<u8> = ranks.iter().flat_map(|r| r[step].frames.clone()).collect();
            assert_eq!(frames, single[step].frames);
        }
    }

    #[test]
    fn action_chunks_are_masked_past_the_episode_end_and_frames_kept_without_augmentation() {
        let dir = tempfile::tempdir().unwrap();
        let data = prepared(dir.path(), false);
        let store = EpisodeStore::open(&data, false).unwrap();
        let config = EpisodeLoaderConfig { micro_batch: 30, chunk: 4, augment: None, workers: 0, ..Default::default() };
        let batch = loader(&data, config).next_batch().unwrap();
        for (row, &step) in batch.steps.iter().enumerate() {
            let (episode, t) = store.locate(step);
            let mask = &batch.action_mask[row * 4..row * 4 + 4];
            let expected: Vec<u8> = (0..4).map(|k| u8::from(t + k < episode.n_steps)).collect();
            assert_eq!(mask, expected.as_slice(), "step {step} at t = {t}");
            let (_, action) = store.state_action(step).unwrap();
            assert_eq!(&batch.actions[row * 8..row * 8 + 2], action.as_slice());
            let frame = &batch.frames[row * 32 * 32 * 3..(row + 1) * 32 * 32 * 3];
            assert_eq!(frame, store.frame(step, 0).unwrap().bytes);
            let n_tokens = episode.tokens.len().min(32);
            assert_eq!(batch.token_mask[row * 32..row * 32 + 32].iter().filter(|&&m| m == 1).count(), n_tokens);
        }
    }
}
