//! A prepared episode directory opened for reading: steps and episodes in memory (checked against
//! the manifest's CRC-32 on open), frames memory-mapped through the record store.

use std::path::{Path, PathBuf};

use super::prep::{CheckedFile, EpisodeEntry, EpisodeManifest, FrameEncoding, EPISODES_FORMAT};
use crate::records::{Record, RecordStore};
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

impl EpisodeStore {
    /// Opens `dir`; with `verify`, every frame shard's CRC-32 too (what `stoke prep verify` does).
    pub fn open(dir: &Path, verify: bool) -> Result<EpisodeStore, DataError> {
        let manifest_path = dir.join("manifest.json");
        let bytes = stoke_fsio::read_capped(&manifest_path, stoke_fsio::MANIFEST_CAP)
            .map_err(DataError::read(&manifest_path))?;
        let manifest: EpisodeManifest = serde_json::from_slice(&bytes)
            .map_err(|source| DataError::Manifest { path: manifest_path.clone(), source })?;
        let corrupt =
            |detail: String| DataError::Corrupt { path: manifest_path.clone(), what: "manifest", offset: 0, detail };
        if manifest.format != EPISODES_FORMAT {
            return Err(corrupt(format!("format {:?}, expected {EPISODES_FORMAT:?}", manifest.format)));
        }
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
        let m = &self.manifest;
        if step_idx >= m.n_steps {
            return Err(DataError::Corrupt {
                path: self.dir.clone(),
                what: "step index",
                offset: step_idx,
                detail: format!("the directory holds {} steps", m.n_steps),
            });
        }
        let width = m.state_dim + m.action_dim;
        let row = &self.steps[step_idx as usize * width..(step_idx as usize + 1) * width];
        let normalize = |values: &[f32], mean: &[f32], std: &[f32]| -> Vec<f32> {
            values.iter().zip(mean).zip(std).map(|((v, m), s)| (v - m) / s).collect()
        };
        let n_cameras = m.cameras.len() as u64;
        let frames = (0..n_cameras).map(|c| self.frames.get(step_idx * n_cameras + c)).collect::<Result<_, _>>()?;
        Ok(StepView {
            state: normalize(&row[..m.state_dim], &m.state_mean, &m.state_std),
            action: normalize(&row[m.state_dim..], &m.action_mean, &m.action_std),
            frames,
        })
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
