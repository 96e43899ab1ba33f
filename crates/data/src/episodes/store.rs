//! A prepared episode directory opened for reading: steps and episodes in memory (checked against
//! the manifest's CRC-32 on open), frames memory-mapped through the record store.

use std::path::{Path, PathBuf};

use super::prep::{CheckedFile, EpisodeEntry, EpisodeManifest, FrameEncoding, EPISODES_FORMAT};
use crate::records::{read_manifest, Record, RecordStore};
use crate::tokens::check_crc;
use crate::DataError;

/// A prepared episode directory.
pub struct EpisodeStore {
    dir: PathBuf,
    manifest: EpisodeManifest,
    episodes: Vec<EpisodeEntry>,
    /// Per step: state then action, as recorded.
    steps: Vec<f32>,
    frames: RecordStore,
}

/// One time step: state and action normalized by the manifest's statistics.
#[derive(Debug, Clone, PartialEq)]
pub struct StepView<'a> {
    pub state: Vec<f32>,
    pub action: Vec<f32>,
    /// One frame per camera, in camera order.
    pub frames: Vec<Record<'a>>,
}

fn read_checked(dir: &Path, file: &CheckedFile) -> Result<Vec<u8>, DataError> {
    let path = dir.join(&file.name);
    let bytes = stoke_fsio::read_capped(&path, stoke_fsio::LOG_CAP).map_err(DataError::read(&path))?;
    if bytes.len() as u64 != file.bytes {
        return Err(DataError::Truncated {
            path,
            what: "episode file",
            offset: 0,
            needed: file.bytes,
            len: bytes.len() as u64,
        });
    }
    check_crc(&path, &bytes, file.crc32)?;
    Ok(bytes)
}

/// The manifest of the prepared folder `dir`, parsed and its format checked, and nothing else read
/// (what a config needs of a dataset: its widths and cameras).
pub fn read_episode_manifest(dir: &Path) -> Result<EpisodeManifest, DataError> {
    let (manifest_path, manifest): (PathBuf, EpisodeManifest) = read_manifest(dir)?;
    if manifest.format != EPISODES_FORMAT {
        return Err(DataError::Corrupt {
            path: manifest_path,
            what: "manifest",
            offset: 0,
            detail: format!("format {:?}, expected {EPISODES_FORMAT:?}", manifest.format),
        });
    }
    Ok(manifest)
}

impl EpisodeStore {
    /// Opens `dir`; with `verify`, every frame shard's CRC-32 too (what `stoke prep verify` does).
    pub fn open(dir: &Path, verify: bool) -> Result<EpisodeStore, DataError> {
        let manifest = read_episode_manifest(dir)?;
        let manifest_path = dir.join("manifest.json");
        let corrupt =
            |detail: String| DataError::Corrupt { path: manifest_path.clone(), what: "manifest", offset: 0, detail };
        let dims = [
            manifest.state_mean.len(),
            manifest.state_std.len(),
            manifest.action_mean.len(),
            manifest.action_std.len(),
        ];
        if dims != [manifest.state_dim, manifest.state_dim, manifest.action_dim, manifest.action_dim] {
            return Err(corrupt("statistics do not match state_dim and action_dim".into()));
        }
        let width = manifest.state_dim + manifest.action_dim;
        let raw = read_checked(dir, &manifest.steps)?;
        if raw.len() as u64 != manifest.n_steps * width as u64 * 4 {
            return Err(corrupt(format!(
                "steps.bin holds {} bytes, not {} steps of {width} numbers",
                raw.len(),
                manifest.n_steps
            )));
        }
        let steps = raw.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))).collect();
        let episodes: Vec<EpisodeEntry> = serde_json::from_slice(&read_checked(dir, &manifest.episodes)?)
            .map_err(|source| DataError::Manifest { path: dir.join(&manifest.episodes.name), source })?;
        let covered: u64 = episodes.iter().map(|e| e.n_steps).sum();
        if episodes.len() as u64 != manifest.n_episodes || covered != manifest.n_steps {
            return Err(corrupt(format!(
                "{} episodes of {covered} steps, the manifest says {} of {}",
                episodes.len(),
                manifest.n_episodes,
                manifest.n_steps
            )));
        }
        let frames = RecordStore::open(&dir.join("frames"), verify)?;
        if frames.len() as u64 != manifest.n_steps * manifest.cameras.len() as u64 {
            return Err(corrupt(format!(
                "{} frames for {} steps of {} cameras",
                frames.len(),
                manifest.n_steps,
                manifest.cameras.len()
            )));
        }
        Ok(EpisodeStore { dir: dir.to_path_buf(), manifest, episodes, steps, frames })
    }

    /// The directory it was opened from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn manifest(&self) -> &EpisodeManifest {
        &self.manifest
    }

    pub fn episodes(&self) -> &[EpisodeEntry] {
        &self.episodes
    }

    pub fn n_steps(&self) -> u64 {
        self.manifest.n_steps
    }

    /// Step `step_idx` (over all episodes), normalized.
    pub fn step(&self, step_idx: u64) -> Result<StepView<'_>, DataError> {
        let (state, action) = self.state_action(step_idx)?;
        let n_cameras = self.manifest.cameras.len();
        let frames = (0..n_cameras).map(|camera| self.frame(step_idx, camera)).collect::<Result<_, _>>()?;
        Ok(StepView { state, action, frames })
    }

    /// The normalized state and action of step `step_idx`.
    pub fn state_action(&self, step_idx: u64) -> Result<(Vec<f32>, Vec<f32>), DataError> {
        let m = &self.manifest;
        self.check_step(step_idx)?;
        let width = m.state_dim + m.action_dim;
        let row = &self.steps[step_idx as usize * width..(step_idx as usize + 1) * width];
        let normalize = |values: &[f32], mean: &[f32], std: &[f32]| -> Vec<f32> {
            values.iter().zip(mean).zip(std).map(|((v, m), s)| (v - m) / s).collect()
        };
        Ok((
            normalize(&row[..m.state_dim], &m.state_mean, &m.state_std),
            normalize(&row[m.state_dim..], &m.action_mean, &m.action_std),
        ))
    }

    /// Camera `camera`'s frame of step `step_idx`, as stored (decoded RGB or encoded bytes).
    pub fn frame(&self, step_idx: u64, camera: usize) -> Result<Record<'_>, DataError> {
        self.check_step(step_idx)?;
        self.frames.get(step_idx * self.manifest.cameras.len() as u64 + camera as u64)
    }

    /// The episode holding step `step_idx`, and the step's time within it.
    pub fn locate(&self, step_idx: u64) -> (&EpisodeEntry, u64) {
        let episode_idx = self.episodes.partition_point(|e| e.first_step <= step_idx).saturating_sub(1);
        let episode = &self.episodes[episode_idx];
        (episode, step_idx - episode.first_step)
    }

    fn check_step(&self, step_idx: u64) -> Result<(), DataError> {
        if step_idx >= self.manifest.n_steps {
            return Err(DataError::Corrupt {
                path: self.dir.clone(),
                what: "step index",
                offset: step_idx,
                detail: format!("the directory holds {} steps", self.manifest.n_steps),
            });
        }
        Ok(())
    }

    /// A normalized action back in the recorded units (what a policy's output is turned into).
    pub fn denormalize_action(&self, action: &[f32]) -> Vec<f32> {
        let m = &self.manifest;
        action.iter().zip(&m.action_mean).zip(&m.action_std).map(|((a, mean), std)| a * std + mean).collect()
    }

    /// Whether frames are stored decoded.
    pub fn frames_decoded(&self) -> bool {
        self.manifest.frames == FrameEncoding::Rgb8
    }
}
