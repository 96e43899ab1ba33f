//! `stoke prep episodes`: episodes in the JSON-lines layout (`layout`) or the LeRobot v2 layout
//! (`lerobot`, recognised by its `meta/info.json`) into a prepared episode directory.
//!
//! ```text
//! manifest.json   format "stoke-episodes": sizes, cameras, frame encoding, the per-dimension mean
//!                 and std of state and action, and the size and CRC-32 of the two files below
//! steps.bin       f32 little-endian, per step: state, then action (as recorded: the statistics are
//!                 applied on load and inverted on output)
//! episodes.json   per episode: id, first step, step count, instruction and its tokens
//! frames/         a record directory (`stoke prep records`' format): per step, one record per
//!                 camera in camera order, either decoded RGB at the model's resolution or the
//!                 image file's own JPEG/PNG bytes (`keep_encoded`), decoded at training time
//! ```
//!
//! A LeRobot dataset's frames are in videos, decoded here (by `ffmpeg`) at the resolution asked:
//! `keep_encoded` is refused for it, since a video has no per-frame file to keep and re-encoding
//! its frames would add a second lossy generation.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::layout::{parse_lines, EpisodeBuilder, Episodes};
use super::lerobot::{is_lerobot, read_lerobot, EpisodeVideos};
use crate::prep::{write_atomically, Encoder};
use crate::records::RecordWriter;
use crate::DataError;

pub const EPISODES_FORMAT: &str = "stoke-episodes";

/// How `prepare_episodes` prepares. Plain data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrepEpisodesConfig {
    /// Side of the square frames decoded frames are resized to. Default 64.
    pub resolution: u32,
    /// Keep each image file's encoded bytes instead of decoding now. Default false.
    pub keep_encoded: bool,
    /// A HuggingFace tokenizer.json for instructions, or "bytes". Default "bytes".
    pub tokenizer: String,
    /// Payload bytes per frame shard. Default 268435456 (256 MiB).
    pub shard_bytes: u64,
}

impl Default for PrepEpisodesConfig {
    fn default() -> PrepEpisodesConfig {
        PrepEpisodesConfig { resolution: 64, keep_encoded: false, tokenizer: "bytes".into(), shard_bytes: 256 << 20 }
    }
}

/// How frames are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FrameEncoding {
    /// Decoded RGB, `[resolution, resolution, 3]` uint8.
    Rgb8,
    /// The image file's bytes (JPEG or PNG), as recorded.
    Encoded,
}

/// A file of the directory with its size and CRC-32.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckedFile {
    pub name: String,
    pub bytes: u64,
    pub crc32: u32,
}

/// `manifest.json` of a prepared episode directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EpisodeManifest {
    /// Always "stoke-episodes".
    pub format: String,
    pub version: u32,
    pub n_episodes: u64,
    pub n_steps: u64,
    pub state_dim: usize,
    pub action_dim: usize,
    pub cameras: Vec<String>,
    pub frames: FrameEncoding,
    /// Side of decoded frames (also the model's input resolution for encoded ones).
    pub resolution: u32,
    pub state_mean: Vec<f32>,
    pub state_std: Vec<f32>,
    pub action_mean: Vec<f32>,
    pub action_std: Vec<f32>,
    /// The instruction tokenizer ("bytes" or the tokenizer file's name) and its vocabulary.
    pub tokenizer: String,
    pub vocab_size: u64,
    pub steps: CheckedFile,
    pub episodes: CheckedFile,
}

/// One episode's entry in `episodes.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EpisodeEntry {
    pub id: String,
    pub first_step: u64,
    pub n_steps: u64,
    pub instruction: String,
    pub tokens: Vec<u32>,
}

/// The JSON-lines files under `source`: the file itself, or every `*.jsonl` in the folder, sorted.
fn jsonl_files(source: &Path) -> Result<Vec<PathBuf>, DataError> {
    if source.is_file() {
        return Ok(vec![source.to_path_buf()]);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(source)
        .map_err(DataError::read(source))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(DataError::Episode { path: source.into(), line: 0, message: "no *.jsonl file here".into() });
    }
    Ok(files)
}

/// Reads every episode under `source` (a JSON-lines file or a folder of them).
pub fn read_episodes(source: &Path) -> Result<Episodes, DataError> {
    let mut builder = EpisodeBuilder::default();
    for file in jsonl_files(source)? {
        let text = stoke_fsio::read_to_string_capped(&file, stoke_fsio::LOG_CAP).map_err(DataError::read(&file))?;
        parse_lines(&text, &file, &mut builder)?;
    }
    builder.finish().map_err(|message| DataError::Episode { path: source.into(), line: 0, message })
}

/// Where the frames of the episodes come from.
enum FrameFiles {
    /// Each step's `images`: one image file per camera.
    Images,
    /// Per episode, one video per camera (LeRobot v2), frame t being step t's.
    Videos(Vec<Vec<PathBuf>>),
}

/// The episodes under `source` in either layout, with where their frames are.
fn read_source(source: &Path) -> Result<(Episodes, FrameFiles), DataError> {
    if is_lerobot(source) {
        let lerobot = read_lerobot(source)?;
        return Ok((lerobot.episodes, FrameFiles::Videos(lerobot.videos)));
    }
    Ok((read_episodes(source)?, FrameFiles::Images))
}

/// Per-dimension mean and standard deviation (a constant dimension gets std 1, so normalizing it is
/// a shift).
fn mean_std(rows: impl Iterator<Item = Vec<f32>> + Clone, dim: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut sum, mut n) = (vec![0f64; dim], 0f64);
    for row in rows.clone() {
        row.iter().zip(&mut sum).for_each(|(v, s)| *s += *v as f64);
        n += 1.0;
    }
    let mean: Vec<f64> = sum.iter().map(|s| s / n.max(1.0)).collect();
    let mut squares = vec![0f64; dim];
    for row in rows {
        row.iter().zip(&mean).zip(&mut squares).for_each(|((v, m), q)| *q += (*v as f64 - m).powi(2));
    }
    let std = squares.iter().map(|q| (q / n.max(1.0)).sqrt()).map(|s| if s > 1e-8 { s as f32 } else { 1.0 });
    (mean.iter().map(|&m| m as f32).collect(), std.collect())
}

/// One camera's frame as stored: its shape and bytes.
fn frame(path: &Path, config: &PrepEpisodesConfig) -> Result<([u32; 3], Vec<u8>), DataError> {
    let bytes = std::fs::read(path).map_err(DataError::read(path))?;
    let image = image::load_from_memory(&bytes)
        .map_err(|err| DataError::Image { path: path.to_path_buf(), detail: err.to_string() })?;
    if config.keep_encoded {
        // Decoded once here all the same, so a broken file is found now, not mid-training.
        return Ok(([bytes.len() as u32, 1, 1], bytes));
    }
    let side = config.resolution;
    let resized = image.resize_exact(side, side, image::imageops::FilterType::Triangle).into_rgb8();
    Ok(([side, side, 3], resized.into_raw()))
}

/// Prepares the episodes under `source` into `out_dir`.
pub fn prepare_episodes(
    source: &Path,
    config: &PrepEpisodesConfig,
    out_dir: &Path,
) -> Result<EpisodeManifest, DataError> {
    if !(8..=1024).contains(&config.resolution) {
        return Err(DataError::Config {
            field: "resolution",
            reason: format!("must be 8 to 1024; got {}", config.resolution),
        });
    }
    if config.keep_encoded && is_lerobot(source) {
        return Err(DataError::Config {
            field: "keep_encoded",
            reason: format!(
                "{} is a LeRobot dataset, whose frames are in videos: prepare them decoded, at a resolution \
                 large enough for the crops training takes",
                source.display()
            ),
        });
    }
    let (episodes, frame_files) = read_source(source)?;
    let encoder = Encoder::load(&config.tokenizer)?;
    std::fs::create_dir_all(out_dir).map_err(DataError::write(out_dir))?;
    let all_steps = || episodes.episodes.iter().flat_map(|e| e.steps.iter());
    let (state_mean, state_std) = mean_std(all_steps().map(|s| s.state.clone()), episodes.state_dim);
    let (action_mean, action_std) = mean_std(all_steps().map(|s| s.action.clone()), episodes.action_dim);
    let mut frames = RecordWriter::create(&out_dir.join("frames"), config.shard_bytes)?;
    let mut steps_bin = Vec::new();
    let mut entries = Vec::with_capacity(episodes.episodes.len());
    let mut first_step = 0u64;
    let side = config.resolution;
    for (episode_idx, episode) in episodes.episodes.iter().enumerate() {
        let mut videos = match &frame_files {
            FrameFiles::Images => None,
            FrameFiles::Videos(videos) => {
                Some(EpisodeVideos::start(&videos[episode_idx], side, episode.steps.len() as u64)?)
            }
        };
        for (step_idx, step) in episode.steps.iter().enumerate() {
            step.state.iter().chain(&step.action).for_each(|v| steps_bin.extend_from_slice(&v.to_le_bytes()));
            for camera_idx in 0..episodes.cameras.len() {
                let label = ((first_step + step_idx as u64) * episodes.cameras.len() as u64 + camera_idx as u64) as i64;
                match &mut videos {
                    Some(videos) => frames.push(label, [side, side, 3], videos.next_frame(camera_idx)?)?,
                    None => {
                        let (shape, bytes) = frame(&step.images[camera_idx], config)?;
                        frames.push(label, shape, &bytes)?;
                    }
                }
            }
        }
        if let Some(videos) = videos {
            videos.finish()?;
        }
        let tokens = encoder.encode_text(&episode.instruction, source)?;
        entries.push(EpisodeEntry {
            id: episode.id.clone(),
            first_step,
            n_steps: episode.steps.len() as u64,
            instruction: episode.instruction.clone(),
            tokens,
        });
        first_step += episode.steps.len() as u64;
    }
    frames.finish(episodes.cameras.clone())?;
    let episodes_json = serde_json::to_vec(&entries).expect("entries serialize");
    let checked = |name: &str, bytes: &[u8]| CheckedFile {
        name: name.into(),
        bytes: bytes.len() as u64,
        crc32: crc32fast::hash(bytes),
    };
    write_atomically(&out_dir.join("steps.bin"), &steps_bin)?;
    write_atomically(&out_dir.join("episodes.json"), &episodes_json)?;
    let tokenizer_name =
        Path::new(&config.tokenizer).file_name().map_or("bytes".into(), |n| n.to_string_lossy().into());
    let manifest = EpisodeManifest {
        format: EPISODES_FORMAT.into(),
        version: 1,
        n_episodes: entries.len() as u64,
        n_steps: first_step,
        state_dim: episodes.state_dim,
        action_dim: episodes.action_dim,
        cameras: episodes.cameras,
        frames: if config.keep_encoded { FrameEncoding::Encoded } else { FrameEncoding::Rgb8 },
        resolution: config.resolution,
        state_mean,
        state_std,
        action_mean,
        action_std,
        tokenizer: tokenizer_name,
        vocab_size: encoder.vocab_size(),
        steps: checked("steps.bin", &steps_bin),
        episodes: checked("episodes.json", &episodes_json),
    };
    write_atomically(&out_dir.join("manifest.json"), &serde_json::to_vec_pretty(&manifest).expect("serializes"))?;
    Ok(manifest)
}
