//! The built-in robot dataset: episodes of a point effector moving toward the block an
//! instruction names, among three coloured blocks, recorded as real JPEG frames and JSON lines in the
//! documented layout. Solving it takes both inputs: the instruction says which colour, only the image
//! says where that colour is (block positions change every episode), and the state is only the
//! effector's own position. `write_synthetic_lerobot` writes the same episodes in the LeRobot v2
//! layout (Parquet tables, MP4 videos by `ffmpeg`).

use std::io::Write;
use std::path::Path;

use super::lerobot_write::{LeRobotLayout, LeRobotWriter};
use crate::rng::SplitMix64;
use crate::DataError;

/// The colours a block can have, with the words instructions use for them.
const PALETTE: [(&str, [u8; 3]); 6] = [
    ("red", [220, 40, 40]),
    ("green", [40, 180, 60]),
    ("blue", [50, 80, 220]),
    ("yellow", [230, 210, 40]),
    ("purple", [150, 60, 190]),
    ("orange", [240, 140, 30]),
];

/// Largest move per step and axis, in units of the scene's side.
const MAX_STEP: f64 = 0.08;

/// What to generate. Plain data.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticEpisodes {
    pub n_episodes: usize,
    /// The most steps an episode holds: it ends at the step whose move reaches the named block.
    pub steps_per_episode: usize,
    /// Side of the square frames, in pixels.
    pub resolution: u32,
    pub seed: u64,
}

impl Default for SyntheticEpisodes {
    fn default() -> SyntheticEpisodes {
        SyntheticEpisodes { n_episodes: 64, steps_per_episode: 16, resolution: 64, seed: 1337 }
    }
}

fn uniform(rng: &mut SplitMix64, low: f64, high: f64) -> f64 {
    low + (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * (high - low)
}

/// One frame: grey floor, three blocks, the effector as a white square on top.
fn render(side: u32, blocks: &[([f64; 2], [u8; 3])], effector: [f64; 2]) -> image::RgbImage {
    let mut frame = image::RgbImage::from_pixel(side, side, image::Rgb([90, 90, 90]));
    let mut square = |center: [f64; 2], half: f64, colour: [u8; 3]| {
        let to_px = |v: f64| (v * side as f64).round() as i64;
        let (half_px, cx, cy) = (to_px(half).max(1), to_px(center[0]), to_px(center[1]));
        for y in (cy - half_px).max(0)..(cy + half_px).min(side as i64) {
            for x in (cx - half_px).max(0)..(cx + half_px).min(side as i64) {
                frame.put_pixel(x as u32, y as u32, image::Rgb(colour));
            }
        }
    };
    for (center, colour) in blocks {
        square(*center, 0.08, *colour);
    }
    square(effector, 0.035, [255, 255, 255]);
    frame
}

/// One episode of the built-in dataset, drawn but not yet written: the blocks, the instruction,
/// and per step the effector's position (the state) and its move (the action), up to the move
/// that reaches the block (at most `steps_per_episode` steps). Both layouts write
/// these, so they hold the same episodes.
struct Scene {
    blocks: Vec<([f64; 2], [u8; 3])>,
    instruction: String,
    states: Vec<[f64; 2]>,
    actions: Vec<[f64; 2]>,
}

impl Scene {
    /// Draws one episode from `rng`. Every draw happens here, before the steps, so the steps
    /// themselves are a pure function of the scene.
    fn draw(rng: &mut SplitMix64, n_steps: usize) -> Scene {
        // Three distinct colours at well separated places.
        let mut colours: Vec<usize> = Vec::new();
        while colours.len() < 3 {
            let c = rng.below(PALETTE.len() as u64) as usize;
            if !colours.contains(&c) {
                colours.push(c);
            }
        }
        let mut blocks: Vec<([f64; 2], [u8; 3])> = Vec::new();
        for &c in &colours {
            let center = loop {
                let p = [uniform(rng, 0.15, 0.85), uniform(rng, 0.15, 0.85)];
                if blocks.iter().all(|(q, _)| (p[0] - q[0]).abs().max((p[1] - q[1]).abs()) > 0.2) {
                    break p;
                }
            };
            blocks.push((center, PALETTE[c].1));
        }
        let target_idx = rng.below(3) as usize;
        let (target, word) = (blocks[target_idx].0, PALETTE[colours[target_idx]].0);
        let instruction = format!("move to the {word} block");
        let mut effector = [uniform(rng, 0.05, 0.95), uniform(rng, 0.05, 0.95)];
        let (mut states, mut actions) = (Vec::with_capacity(n_steps), Vec::with_capacity(n_steps));
        for _ in 0..n_steps {
            let to_target = [0, 1].map(|axis| target[axis] - effector[axis]);
            let action = to_target.map(|delta| delta.clamp(-MAX_STEP, MAX_STEP));
            states.push(effector);
            actions.push(action);
            effector = [effector[0] + action[0], effector[1] + action[1]];
            // This move lands on the block: the task is done and the episode ends, as a recorded
            // demonstration does (no steps of standing still, which the state alone would predict).
            if to_target.iter().all(|delta| delta.abs() <= MAX_STEP) {
                break;
            }
        }
        Scene { blocks, instruction, states, actions }
    }

    /// Step `t`'s frame, `side` pixels square.
    fn frame(&self, side: u32, t: usize) -> image::RgbImage {
        render(side, &self.blocks, self.states[t])
    }
}

/// The episodes `spec` asks for, drawn in order from one generator seeded with `spec.seed`.
fn scenes(spec: &SyntheticEpisodes) -> impl Iterator<Item = Scene> + '_ {
    let mut rng = SplitMix64::new(spec.seed);
    (0..spec.n_episodes).map(move |_| Scene::draw(&mut rng, spec.steps_per_episode))
}

/// Writes the dataset into `dir`: `episodes.jsonl` and `frames/ep-NNNNN/front-TTTT.jpg`. Returns the
/// number of steps written.
pub fn write_synthetic_episodes(dir: &Path, spec: &SyntheticEpisodes) -> Result<u64, DataError> {
    let lines_path = dir.join("episodes.jsonl");
    std::fs::create_dir_all(dir).map_err(DataError::write(dir))?;
    let mut lines = std::io::BufWriter::new(std::fs::File::create(&lines_path).map_err(DataError::write(&lines_path))?);
    let mut n_steps = 0u64;
    for (episode_idx, scene) in scenes(spec).enumerate() {
        let frames_dir = dir.join(format!("frames/ep-{episode_idx:05}"));
        std::fs::create_dir_all(&frames_dir).map_err(DataError::write(&frames_dir))?;
        for t in 0..scene.states.len() {
            let frame_name = format!("frames/ep-{episode_idx:05}/front-{t:04}.jpg");
            let frame_path = dir.join(&frame_name);
            let file = std::fs::File::create(&frame_path).map_err(DataError::write(&frame_path))?;
            let mut encoder = image::codecs::jpeg::JpegEncoder::new_with_quality(std::io::BufWriter::new(file), 90);
            encoder
                .encode_image(&scene.frame(spec.resolution, t))
                .map_err(|err| DataError::Image { path: frame_path.clone(), detail: err.to_string() })?;
            let line = serde_json::json!({
                "episode": format!("ep-{episode_idx:05}"),
                "t": t,
                "instruction": scene.instruction,
                "state": scene.states[t],
                "action": scene.actions[t],
                "images": {"front": frame_name},
            });
            writeln!(lines, "{line}").map_err(DataError::write(&lines_path))?;
            n_steps += 1;
        }
    }
    lines.flush().map_err(DataError::write(&lines_path))?;
    Ok(n_steps)
}

/// Writes the same dataset into `dir` in the LeRobot v2 layout (see `LeRobotWriter`): the same
/// episodes as `write_synthetic_episodes` with the same spec, the frames of camera `front` in one
/// nearly lossless H.264 video per episode, encoded by `ffmpeg` (which must be on PATH). Returns the
/// number of steps written.
pub fn write_synthetic_lerobot(dir: &Path, spec: &SyntheticEpisodes) -> Result<u64, DataError> {
    let layout = LeRobotLayout {
        state_dim: 2,
        action_dim: 2,
        cameras: vec!["front".into()],
        width: spec.resolution,
        height: spec.resolution,
        fps: 10,
        robot_type: "stoke-synthetic".into(),
    };
    let mut writer = LeRobotWriter::create(dir, layout)?;
    let as_f32 = |rows: &[[f64; 2]]| rows.iter().map(|row| row.map(|v| v as f32).to_vec()).collect::<Vec<_>>();
    for scene in scenes(spec) {
        let (states, actions) = (as_f32(&scene.states), as_f32(&scene.actions));
        writer
            .write_episode(&scene.instruction, &states, &actions, |_, t| scene.frame(spec.resolution, t).into_raw())?;
    }
    writer.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every move heads for the named block at most MAX_STEP an axis, and an episode ends with
    /// the move that lands on it (or at the most steps): no step stands still.
    #[test]
    fn an_episode_moves_toward_its_block_and_ends_on_it() {
        let spec = SyntheticEpisodes { n_episodes: 200, steps_per_episode: 16, ..Default::default() };
        let (mut ended_early, mut total) = (0, 0);
        for scene in scenes(&spec) {
            let word = scene.instruction.trim_start_matches("move to the ").trim_end_matches(" block");
            let colour = PALETTE.iter().find(|(name, _)| *name == word).unwrap().1;
            let target = scene.blocks.iter().find(|(_, c)| *c == colour).unwrap().0;
            let n = scene.states.len();
            assert!((1..=16).contains(&n) && scene.actions.len() == n);
            for (state, action) in scene.states.iter().zip(&scene.actions) {
                for axis in 0..2 {
                    let to_target = target[axis] - state[axis];
                    assert!(action[axis].abs() <= MAX_STEP + 1e-12 && action[axis] * to_target >= 0.0);
                }
                assert!(action.iter().any(|a| a.abs() > 0.0), "a step stands still");
            }
            let last = scene.states[n - 1];
            let end = [last[0] + scene.actions[n - 1][0], last[1] + scene.actions[n - 1][1]];
            let reached = (0..2).all(|axis| (end[axis] - target[axis]).abs() < 1e-9);
            assert!(reached || n == 16, "an episode of {n} steps ends away from its block");
            ended_early += usize::from(n < 16);
            total += n;
        }
        assert!(ended_early > 150 && total < 200 * 10, "{ended_early} of 200 ended early, {total} steps");
    }
}
