//! `prepare_episodes` on a LeRobot v2 dataset that the test writes itself with `LeRobotWriter`
//! (Parquet tables as pyarrow lays them out, MP4 videos encoded by `ffmpeg` from generated frames
//! of large flat colours, the meta JSON files), and on the built-in dataset written in that layout.

use std::path::{Path, PathBuf};
use std::process::Command;

use stoke_data::{
    prepare_episodes, read_episodes, write_synthetic_episodes, write_synthetic_lerobot, EpisodeStore, LeRobotLayout,
    LeRobotWriter, PrepEpisodesConfig, SyntheticEpisodes,
};

const TASKS: [&str; 2] = ["pick up the red cube", "push the blue block left"];
const CAMERAS: [&str; 2] = ["front", "wrist"];
const LENGTHS: [usize; 2] = [5, 4];
const STATE_DIM: usize = 2;
const ACTION_DIM: usize = 3;
/// The videos' size: even, as the yuv420p of `ffmpeg` without libx264 needs, and not square, so the prepared frames are resized.
const WIDTH: usize = 64;
const HEIGHT: usize = 48;

/// Fails (never skips) where `ffmpeg` is missing: these tests make their videos with it.
fn require_ffmpeg() {
    let found = Command::new("ffmpeg").arg("-version").output().is_ok_and(|out| out.status.success());
    assert!(
        found,
        "ffmpeg is not installed: the LeRobot tests encode their MP4 files with it and stoke decodes them with it; \
         install it (apt-get install -y ffmpeg; `cargo xtask test` does so when it is missing)"
    );
}

fn state(episode: usize, step: usize) -> Vec<f32> {
    vec![episode as f32 + 0.25 * step as f32, -0.5 * step as f32]
}

fn action(episode: usize, step: usize) -> Vec<f32> {
    vec![0.125 * step as f32, 1.0 - episode as f32, 0.01 * (episode * 10 + step) as f32]
}

/// The two flat colours (left half, right half) of a frame; neighbouring steps differ by at least
/// 45 in some channel, so a frame out of place is seen.
fn colours(episode: usize, camera: usize, step: usize) -> [[u8; 3]; 2] {
    let left =
        [(30 + 45 * step) as u8, (200 - 60 * camera - 50 * episode) as u8, (60 + 90 * ((step + episode) % 2)) as u8];
    let right = [255 - left[0], left[2], left[1]];
    [left, right]
}

/// A `width` x `height` RGB frame: the left half one colour, the right half the other.
fn frame(episode: usize, camera: usize, step: usize, width: usize, height: usize) -> Vec<u8> {
    let [left, right] = colours(episode, camera, step);
    (0..height).flat_map(|_| (0..width).flat_map(move |x| if x < width / 2 { left } else { right })).collect()
}

fn table_path(root: &Path, episode: usize) -> PathBuf {
    root.join(format!("data/chunk-000/episode_{episode:06}.parquet"))
}

fn video_path(root: &Path, episode: usize, camera: &str) -> PathBuf {
    root.join(format!("videos/chunk-000/observation.images.{camera}/episode_{episode:06}.mp4"))
}

/// Writes the whole dataset under `root`, its state `state_dim` wide.
fn write_dataset(root: &Path, state_dim: usize) {
    require_ffmpeg();
    let layout = LeRobotLayout {
        state_dim,
        action_dim: ACTION_DIM,
        cameras: CAMERAS.map(String::from).to_vec(),
        width: WIDTH as u32,
        height: HEIGHT as u32,
        fps: 10,
        robot_type: "test".into(),
    };
    let mut writer = LeRobotWriter::create(root, layout).unwrap();
    for episode in 0..2 {
        let steps = 0..LENGTHS[episode];
        let states: Vec<Vec<f32>> =
            steps.clone().map(|s| state(episode, s).into_iter().cycle().take(state_dim).collect()).collect();
        let actions: Vec<Vec<f32>> = steps.map(|s| action(episode, s)).collect();
        let frames = |camera, step| frame(episode, camera, step, WIDTH, HEIGHT);
        writer.write_episode(TASKS[episode], &states, &actions, frames).unwrap();
    }
    assert_eq!(writer.finish().unwrap(), LENGTHS.iter().sum::<usize>() as u64);
}

fn mean_abs_diff(a: &[u8], b: &[u8]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).abs()).sum::<f64>() / a.len() as f64
}

/// The dataset prepared and read back: state and action as written, each episode's task as its
/// instruction and byte tokens, and every frame close to the one generated for its step and camera.
#[test]
fn a_lerobot_dataset_prepares_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("lerobot");
    write_dataset(&raw, STATE_DIM);
    let out = dir.path().join("prepared");
    let side = 32;
    let config = PrepEpisodesConfig { resolution: side as u32, ..PrepEpisodesConfig::default() };
    let manifest = prepare_episodes(&raw, &config, &out).unwrap();
    assert_eq!((manifest.n_episodes, manifest.n_steps, manifest.state_dim, manifest.action_dim), (2, 9, 2, 3));
    assert_eq!(manifest.cameras, CAMERAS);
    let store = EpisodeStore::open(&out, true).unwrap();
    for (episode, entry) in store.episodes().iter().enumerate() {
        assert_eq!(entry.id, format!("episode_{episode:06}"));
        assert_eq!(entry.instruction, TASKS[episode]);
        assert_eq!(entry.tokens, TASKS[episode].bytes().map(u32::from).collect::<Vec<_>>());
        assert_eq!(entry.n_steps as usize, LENGTHS[episode]);
        for step in 0..LENGTHS[episode] {
            let step_idx = entry.first_step + step as u64;
            let (normalized_state, normalized_action) = store.state_action(step_idx).unwrap();
            let m = store.manifest();
            let back_state: Vec<f32> = normalized_state
                .iter()
                .zip(m.state_mean.iter().zip(&m.state_std))
                .map(|(v, (mean, std))| v * std + mean)
                .collect();
            let close = |a: &[f32], b: &[f32]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5);
            assert!(close(&back_state, &state(episode, step)), "state of step {step_idx}: {back_state:?}");
            let back_action = store.denormalize_action(&normalized_action);
            assert!(close(&back_action, &action(episode, step)), "action of step {step_idx}: {back_action:?}");
            for camera in 0..CAMERAS.len() {
                let record = store.frame(step_idx, camera).unwrap();
                assert_eq!(record.shape, [side as u32, side as u32, 3]);
                let expected = frame(episode, camera, step, side, side);
                let mad = mean_abs_diff(record.bytes, &expected);
                // Lossless H.264 in yuv444p leaves the RGB to YUV rounding, and the resize blurs
                // only the middle columns; a neighbouring step's frame is 45 or more away.
                assert!(mad < 10.0, "episode {episode} step {step} camera {camera}: mean |difference| {mad:.1}");
            }
        }
    }
}

/// The built-in dataset written in both layouts from one spec prepares to the same steps: the same
/// instructions, byte-identical state and action rows, and frames that differ only by the JPEG
/// and H.264 encodings.
#[test]
fn the_built_in_dataset_as_lerobot_matches_its_json_lines() {
    require_ffmpeg();
    let dir = tempfile::tempdir().unwrap();
    let spec = SyntheticEpisodes { n_episodes: 3, steps_per_episode: 5, resolution: 32, seed: 11 };
    let (jsonl, lerobot) = (dir.path().join("jsonl"), dir.path().join("lerobot"));
    assert_eq!(write_synthetic_episodes(&jsonl, &spec).unwrap(), 15);
    assert_eq!(write_synthetic_lerobot(&lerobot, &spec).unwrap(), 15);
    let recorded = read_episodes(&jsonl).unwrap();
    let config = PrepEpisodesConfig { resolution: 32, ..PrepEpisodesConfig::default() };
    let stores: Vec<EpisodeStore> = [&jsonl, &lerobot]
        .iter()
        .map(|raw| {
            let out = raw.with_extension("prepared");
            prepare_episodes(raw, &config, &out).unwrap();
            EpisodeStore::open(&out, true).unwrap()
        })
        .collect();
    let [from_jsonl, from_lerobot] = [&stores[0], &stores[1]];
    assert_eq!(from_lerobot.manifest().cameras, ["front"]);
    assert_eq!((from_lerobot.manifest().state_dim, from_lerobot.manifest().action_dim), (2, 2));
    let read_steps = |raw: &Path| std::fs::read(raw.with_extension("prepared").join("steps.bin")).unwrap();
    assert_eq!(read_steps(&jsonl), read_steps(&lerobot), "steps.bin differs between the layouts");
    for (a, b) in from_jsonl.episodes().iter().zip(from_lerobot.episodes()) {
        assert_eq!((&a.instruction, a.first_step, a.n_steps), (&b.instruction, b.first_step, b.n_steps));
    }
    for (episode_idx, episode) in recorded.episodes.iter().enumerate() {
        assert_eq!(from_lerobot.episodes()[episode_idx].instruction, episode.instruction);
    }
    for step_idx in 0..15 {
        let (a, b) = (from_jsonl.frame(step_idx, 0).unwrap(), from_lerobot.frame(step_idx, 0).unwrap());
        assert_eq!(a.shape, b.shape);
        let mad = mean_abs_diff(a.bytes, b.bytes);
        // JPEG at quality 90 rings and halves the chroma at the blocks' edges (3.2 at most here on
        // 2026-12-05); the video is nearly lossless; another episode's frame, its blocks
        // elsewhere, is 14.5 or more away.
        assert!(mad < 6.0, "step {step_idx}: mean |difference| {mad:.2} between the layouts' frames");
    }
}

fn prepare_error(raw: &Path) -> String {
    let out = raw.with_extension("prepared");
    prepare_episodes(raw, &PrepEpisodesConfig::default(), &out).unwrap_err().to_string()
}

/// A damaged or missing table, a table of the wrong width, a truncated video, a video longer than
/// its table and `keep_encoded` each fail naming the file (and the column or frame).
#[test]
fn damaged_lerobot_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let fresh = |name: &str| {
        let raw = dir.path().join(name);
        write_dataset(&raw, STATE_DIM);
        raw
    };

    let raw = fresh("corrupt-table");
    std::fs::write(table_path(&raw, 1), b"PAR1 this is not a Parquet file PAR1").unwrap();
    let err = prepare_error(&raw);
    assert!(err.contains("episode_000001.parquet") && err.contains("Parquet"), "{err}");

    let raw = fresh("missing-table");
    std::fs::remove_file(table_path(&raw, 0)).unwrap();
    let err = prepare_error(&raw);
    assert!(err.contains("episode_000000.parquet"), "{err}");

    let raw = fresh("wide-state");
    let wide = dir.path().join("wide-state-source");
    write_dataset(&wide, STATE_DIM + 1);
    std::fs::copy(table_path(&wide, 1), table_path(&raw, 1)).unwrap();
    let err = prepare_error(&raw);
    assert!(
        err.contains("episode_000001.parquet") && err.contains("row 0") && err.contains("observation.state"),
        "{err}"
    );

    let raw = fresh("truncated-video");
    let video = video_path(&raw, 1, "wrist");
    let bytes = std::fs::read(&video).unwrap();
    std::fs::write(&video, &bytes[..bytes.len() / 2]).unwrap();
    let err = prepare_error(&raw);
    assert!(err.contains("observation.images.wrist/episode_000001.mp4") && err.contains("frame"), "{err}");

    let raw = fresh("long-video");
    std::fs::copy(video_path(&raw, 0, "front"), video_path(&raw, 1, "front")).unwrap();
    let err = prepare_error(&raw);
    assert!(err.contains("observation.images.front/episode_000001.mp4") && err.contains("5 frames"), "{err}");

    let raw = fresh("keep-encoded");
    let config = PrepEpisodesConfig { keep_encoded: true, ..PrepEpisodesConfig::default() };
    let err = prepare_episodes(&raw, &config, &dir.path().join("encoded")).unwrap_err().to_string();
    assert!(err.contains("keep_encoded") && err.contains("LeRobot"), "{err}");
}
