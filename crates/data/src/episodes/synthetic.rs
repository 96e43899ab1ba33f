//! The built-in robot dataset: episodes of a point effector moving toward the block an
//! instruction names, among three coloured blocks, recorded as real JPEG frames and JSON lines in the
//! documented layout. Solving it takes both inputs: the instruction says which colour, only the image
//! says where that colour is (block positions change every episode), and the state is only the
//! effector's own position.

use std::io::Write;
use std::path::Path;

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

/// Writes the dataset into `dir`: `episodes.jsonl` and `frames/ep-NNNNN/front-TTTT.jpg`. Returns the
/// number of steps written.
pub fn write_synthetic_episodes(dir: &Path, spec: &SyntheticEpisodes) -> Result<u64, DataError> {
    let mut rng = SplitMix64::new(spec.seed);
    let lines_path = dir.join("episodes.jsonl");
    std::fs::create_dir_all(dir).map_err(DataError::write(dir))?;
    let mut lines = std::io::BufWriter::new(std::fs::File::create(&lines_path).map_err(DataError::write(&lines_path))?);
    let mut n_steps = 0u64;
    for episode_idx in 0..spec.n_episodes {
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
                let p = [uniform(&mut rng, 0.15, 0.85), uniform(&mut rng, 0.15, 0.85)];
                if blocks.iter().all(|(q, _)| (p[0] - q[0]).abs().max((p[1] - q[1]).abs()) > 0.2) {
                    break p;
                }
            };
            blocks.push((center, PALETTE[c].1));
        }
        let target_idx = rng.below(3) as usize;
        let (target, word) = (blocks[target_idx].0, PALETTE[colours[target_idx]].0);
        let instruction = format!("move to the {word} block");
        let mut effector = [uniform(&mut rng, 0.05, 0.95), uniform(&mut rng, 0.05, 0.95)];
        let frames_dir = dir.join(format!("frames/ep-{episode_idx:05}"));
        std::fs::create_dir_all(&frames_dir).map_err(DataError::write(&frames_dir))?;
        for t in 0..spec.steps_per_episode {
            let action = [0, 1].map(|axis| (target[axis] - effector[axis]).clamp(-MAX_STEP, MAX_STEP));
            let frame_name = format!("frames/ep-{episode_idx:05}/front-{t:04}.jpg");
            let frame_path = dir.join(&frame_name);
            let file = std::fs::File::create(&frame_path).map_err(DataError::write(&frame_path))?;
            let mut encoder = image::codecs::jpeg::JpegEncoder::new_with_quality(std::io::BufWriter::new(file), 90);
            encoder
                .encode_image(&render(spec.resolution, &blocks, effector))
                .map_err(|err| DataError::Image { path: frame_path.clone(), detail: err.to_string() })?;
            let line = serde_json::json!({
                "episode": format!("ep-{episode_idx:05}"),
                "t": t,
                "instruction": instruction,
                "state": effector,
                "action": action,
                "images": {"front": frame_name},
            });
            writeln!(lines, "{line}").map_err(DataError::write(&lines_path))?;
            effector = [effector[0] + action[0], effector[1] + action[1]];
            n_steps += 1;
        }
    }
    lines.flush().map_err(DataError::write(&lines_path))?;
    Ok(n_steps)
}
