//! Robot episodes as data: camera frames, an instruction, the robot's state and its actions per
//! time step. `layout` reads the documented JSON-lines layout and `lerobot` the LeRobot v2 layout
//! (Parquet tables and MP4 videos, decoded by `ffmpeg`); `prep` turns either into a prepared
//! directory (frames decoded and resized once, or kept encoded; state and action statistics;
//! instruction tokens; CRC-32s), `store` reads one back, and `synthetic` writes the built-in
//! dataset in the JSON-lines layout; `loader` cuts training batches from a prepared directory (frames
//! decoded and augmented by worker threads, action chunks, exact resume) with `augment`'s crops
//! and colour jitter.

mod augment;
mod layout;
mod lerobot;
mod lerobot_write;
mod loader;
mod prep;
mod source;
mod store;
mod synthetic;

pub use augment::{AugmentConfig, Draw};
pub use layout::{Episode, Episodes, Step};
pub use lerobot_write::{LeRobotLayout, LeRobotWriter};
pub use loader::{Blank, EpisodeBatch, EpisodeLoader, EpisodeLoaderConfig, EpisodeLoaderStats};
pub use prep::{
    prepare_episodes, read_episodes, CheckedFile, EpisodeEntry, EpisodeManifest, FrameEncoding, PrepEpisodesConfig,
    EPISODES_FORMAT,
};
pub use source::EpisodeSource;
pub use store::{read_episode_manifest, EpisodeStore, StepView};
pub use synthetic::{write_synthetic_episodes, write_synthetic_lerobot, SyntheticEpisodes};

#[cfg(test)]
mod tests {
    use super::*;

    /// The built-in dataset prepared both ways reads back as written: decoded frames at the asked
    /// resolution, encoded ones byte for byte, normalized actions that invert to the recorded ones.
    #[test]
    fn synthetic_episodes_prepare_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("raw");
        let spec = SyntheticEpisodes { n_episodes: 3, steps_per_episode: 4, resolution: 48, seed: 7 };
        let n_steps = write_synthetic_episodes(&raw, &spec).unwrap();
        let recorded = read_episodes(&raw).unwrap();
        let first_len = recorded.episodes[0].steps.len() as u64;
        assert_eq!(recorded.episodes.iter().map(|e| e.steps.len() as u64).sum::<u64>(), n_steps);
        assert!(recorded.episodes[1].steps.len() >= 2, "the test reads episode 1's second step");
        for keep_encoded in [false, true] {
            let out = dir.path().join(format!("prepared-{keep_encoded}"));
            let config = PrepEpisodesConfig { resolution: 32, keep_encoded, ..PrepEpisodesConfig::default() };
            let manifest = prepare_episodes(&raw, &config, &out).unwrap();
            assert_eq!(
                (manifest.n_episodes, manifest.n_steps, manifest.state_dim, manifest.action_dim),
                (3, n_steps, 2, 2)
            );
            let store = EpisodeStore::open(&out, true).unwrap();
            assert!(store.episodes()[1].instruction.starts_with("move to the "));
            assert_eq!(store.episodes()[1].tokens.len(), store.episodes()[1].instruction.len());
            let step = store.step(first_len + 1).unwrap();
            let original = &recorded.episodes[1].steps[1];
            let back = store.denormalize_action(&step.action);
            assert!(back.iter().zip(&original.action).all(|(a, b)| (a - b).abs() < 1e-5), "{back:?}");
            if keep_encoded {
                assert_eq!(step.frames[0].bytes, std::fs::read(&original.images[0]).unwrap());
            } else {
                assert_eq!(step.frames[0].shape, [32, 32, 3]);
            }
        }
    }

    /// A damaged file of a prepared directory is refused on open, naming it.
    #[test]
    fn a_damaged_episode_directory_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let raw = dir.path().join("raw");
        write_synthetic_episodes(
            &raw,
            &SyntheticEpisodes { n_episodes: 2, steps_per_episode: 3, ..Default::default() },
        )
        .unwrap();
        let out = dir.path().join("prepared");
        prepare_episodes(&raw, &PrepEpisodesConfig::default(), &out).unwrap();
        let steps = out.join("steps.bin");
        let mut bytes = std::fs::read(&steps).unwrap();
        bytes[5] ^= 1;
        std::fs::write(&steps, bytes).unwrap();
        let err = EpisodeStore::open(&out, false).err().unwrap().to_string();
        assert!(err.contains("steps.bin") && err.contains("checksum"), "{err}");
        let frame = raw.join("frames/ep-00001/front-0000.jpg");
        std::fs::write(&frame, b"not a jpeg").unwrap();
        let err = prepare_episodes(&raw, &PrepEpisodesConfig::default(), &dir.path().join("again")).unwrap_err();
        assert!(err.to_string().contains("front-0000.jpg"), "{err}");
    }
}
