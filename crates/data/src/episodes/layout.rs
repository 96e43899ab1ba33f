//! The documented episode layout: JSON lines, one per time step of one episode, each
//!
//! ```text
//! {"episode": "ep-0007", "t": 3, "instruction": "move to the red block",
//!  "state": [0.41, 0.62], "action": [0.05, -0.02], "images": {"front": "frames/ep-0007/front-0003.jpg"}}
//! ```
//!
//! `episode` names the episode (lines of one episode may be anywhere in the files); `t` counts its
//! steps from 0 without gaps; `state` and `action` have the same length on every line; `images` maps
//! each camera, the same cameras on every line, to an image file relative to the JSON-lines file.
//! The instruction is the episode's: every line of an episode carries the same one.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::DataError;

/// One line as written.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
struct StepLine {
    episode: String,
    t: u64,
    instruction: String,
    state: Vec<f64>,
    action: Vec<f64>,
    images: BTreeMap<String, String>,
}

/// One time step, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub state: Vec<f32>,
    pub action: Vec<f32>,
    /// One image file per camera, in the order of [`Episodes::cameras`].
    pub images: Vec<PathBuf>,
}

/// One episode: its steps in time order.
#[derive(Debug, Clone, PartialEq)]
pub struct Episode {
    pub id: String,
    pub instruction: String,
    pub steps: Vec<Step>,
}

/// Every episode of a set of JSON-lines files, in order of first appearance, with the sizes all
/// of them share.
#[derive(Debug, Clone, PartialEq)]
pub struct Episodes {
    pub episodes: Vec<Episode>,
    pub state_dim: usize,
    pub action_dim: usize,
    /// Camera names, sorted.
    pub cameras: Vec<String>,
}

/// The longest line read: a step is a few hundred bytes; a megabyte is a wrong file.
const MAX_LINE_BYTES: usize = 1 << 20;

/// Parses the JSON-lines `text` read from `path` (image paths resolve against its folder) into
/// `into`, checking every line; errors name the file, the line and the field.
pub fn parse_lines(text: &str, path: &Path, into: &mut EpisodeBuilder) -> Result<(), DataError> {
    let base = path.parent().unwrap_or(Path::new("."));
    for (line_idx, line) in text.lines().enumerate() {
        let line_no = line_idx as u64 + 1;
        let bad = |message: String| DataError::Episode { path: path.to_path_buf(), line: line_no, message };
        if line.trim().is_empty() {
            continue;
        }
        if line.len() > MAX_LINE_BYTES {
            return Err(bad(format!("a line of {} bytes; at most {MAX_LINE_BYTES}", line.len())));
        }
        let step: StepLine = serde_json::from_str(line).map_err(|err| bad(err.to_string()))?;
        into.add(step, base).map_err(bad)?;
    }
    Ok(())
}

/// Collects lines into episodes, checking that they agree.
#[derive(Debug, Default)]
pub struct EpisodeBuilder {
    order: Vec<String>,
    episodes: HashMap<String, (String, BTreeMap<u64, Step>)>,
    dims: Option<(usize, usize, Vec<String>)>,
}

impl EpisodeBuilder {
    fn add(&mut self, line: StepLine, base: &Path) -> Result<(), String> {
        if line.episode.is_empty() || line.episode.len() > 256 {
            return Err(format!("episode: an id of 1 to 256 characters; got {} characters", line.episode.len()));
        }
        if let Some(bad) = line.state.iter().chain(&line.action).find(|v| !v.is_finite() || v.abs() > f32::MAX as f64) {
            return Err(format!("state and action hold finite numbers within f32's range; found {bad}"));
        }
        if line.images.is_empty() {
            return Err("images: at least one camera".into());
        }
        let cameras: Vec<String> = line.images.keys().cloned().collect();
        let dims = (line.state.len(), line.action.len(), cameras);
        match &self.dims {
            None => {
                if dims.0 == 0 || dims.1 == 0 {
                    return Err("state and action: at least one number each".into());
                }
                self.dims = Some(dims);
            }
            Some(first) if *first != dims => {
                return Err(format!(
                    "state {}, action {}, cameras {:?}; earlier lines have state {}, action {}, cameras {:?}",
                    dims.0, dims.1, dims.2, first.0, first.1, first.2
                ))
            }
            Some(_) => {}
        }
        let step = Step {
            state: line.state.iter().map(|&v| v as f32).collect(),
            action: line.action.iter().map(|&v| v as f32).collect(),
            images: line.images.values().map(|image| base.join(image)).collect(),
        };
        if !self.episodes.contains_key(&line.episode) {
            self.order.push(line.episode.clone());
        }
        let (instruction, steps) =
            self.episodes.entry(line.episode.clone()).or_insert_with(|| (line.instruction.clone(), BTreeMap::new()));
        if *instruction != line.instruction {
            return Err(format!(
                "instruction differs from the episode's earlier lines ({:?})",
                stoke_fsio::clip(instruction)
            ));
        }
        if steps.insert(line.t, step).is_some() {
            return Err(format!("episode {:?} has step t = {} twice", line.episode, line.t));
        }
        Ok(())
    }

    /// The episodes, each checked to have steps 0..n without a gap.
    pub fn finish(mut self) -> Result<Episodes, String> {
        let (state_dim, action_dim, cameras) = self.dims.take().ok_or("no steps")?;
        let mut episodes = Vec::with_capacity(self.order.len());
        for id in self.order {
            let (instruction, steps) = self.episodes.remove(&id).expect("ordered ids are present");
            if let Some((expected, (t, _))) = steps.iter().enumerate().find(|(i, (t, _))| *i as u64 != **t) {
                return Err(format!(
                    "episode {id:?} has step t = {t} where t = {expected} belongs (steps count from 0)"
                ));
            }
            episodes.push(Episode { id, instruction, steps: steps.into_values().collect() });
        }
        Ok(Episodes { episodes, state_dim, action_dim, cameras })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn line(episode: &str, t: u64, state: &str) -> String {
        format!(
            r#"{{"episode": "{episode}", "t": {t}, "instruction": "go", "state": {state}, "action": [0.5], "images": {{"front": "f{t}.jpg"}}}}"#
        )
    }

    fn parse(text: &str) -> Result<Episodes, String> {
        let mut builder = EpisodeBuilder::default();
        parse_lines(text, Path::new("data/steps.jsonl"), &mut builder).map_err(|e| e.to_string())?;
        builder.finish()
    }

    #[test]
    fn lines_group_into_episodes_in_time_order() {
        let text = [line("b", 1, "[1, 2]"), line("a", 0, "[0, 0]"), line("b", 0, "[3, 4]")].join("\n");
        let episodes = parse(&text).unwrap();
        assert_eq!(episodes.episodes.iter().map(|e| e.id.as_str()).collect::<Vec<_>>(), ["b", "a"]);
        assert_eq!(episodes.episodes[0].steps[0].state, [3.0, 4.0]);
        assert_eq!(episodes.episodes[0].steps[1].images, [PathBuf::from("data/f1.jpg")]);
        assert_eq!((episodes.state_dim, episodes.action_dim), (2, 1));
    }

    #[test]
    fn bad_lines_are_named_by_file_line_and_field() {
        for (text, says) in [
            (line("a", 0, "[1]") + "\n" + &line("a", 1, "[1, 2]"), "steps.jsonl:2: state 2"),
            (line("a", 0, "[1]") + "\n" + &line("a", 0, "[1]"), "t = 0 twice"),
            (line("a", 1, "[1]"), "t = 1 where t = 0 belongs"),
            (line("a", 0, "[1e300]"), "f32's range"),
            (line("a", 0, "[1]").replace("\"t\": 0", "\"t\": -1"), "steps.jsonl:1:"),
            (line("a", 0, "[1]").replace("images", "pictures"), "unknown field `pictures`"),
            ("{".into(), "steps.jsonl:1:"),
        ] {
            let err = parse(&text).unwrap_err();
            assert!(err.contains(says), "{says:?} not in {err}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any mutation of valid lines parses or fails with an error naming a line, never a panic.
        #[test]
        fn fuzz_mutated_episode_lines(cuts in proptest::collection::vec((0usize..1000, any::<u8>()), 1..6)) {
            let text = [line("a", 0, "[1, 2]"), line("a", 1, "[3, 4]"), line("b", 0, "[5, 6]")].join("\n");
            let mut bytes = text.into_bytes();
            for (at, byte) in cuts {
                let i = at % bytes.len();
                bytes[i] = byte;
            }
            let text = String::from_utf8_lossy(&bytes);
            let mut builder = EpisodeBuilder::default();
            match parse_lines(&text, Path::new("x.jsonl"), &mut builder) {
                Ok(()) => { let _ = builder.finish(); }
                Err(err) => prop_assert!(err.to_string().starts_with("x.jsonl:")),
            }
        }
    }
}
