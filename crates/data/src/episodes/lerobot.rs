//! The LeRobot v2 layout (v2.0 and v2.1 of Hugging Face's LeRobot datasets), recognised by its
//! `meta/info.json`:
//!
//! ```text
//! meta/info.json        codebase_version, fps, chunks_size, features (dtype, shape, names per key),
//!                       data_path and video_path, templates such as
//!                       "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
//! meta/episodes.jsonl   one line per episode: {"episode_index": 0, "tasks": ["..."], "length": 120}
//! meta/tasks.jsonl      one line per task: {"task_index": 0, "task": "pick up the cube"}
//! data/...parquet       one table per episode, one row per step: observation.state and action
//!                       (lists of numbers), timestamp, frame_index, episode_index, index, task_index
//! videos/...mp4         one video per episode and camera, frame t being step t's
//! ```
//!
//! The state is `observation.state` and the action `action`, each as wide as its feature's shape
//! says on every row. Every feature of dtype `video` is a camera, named by the part of its key after
//! `observation.images.` (or after `observation.`); cameras are sorted by name. An episode's
//! chunk is its index divided by `chunks_size`. The instruction is the episode's task: the text
//! that `task_index` (one value on all of its rows) names in `tasks.jsonl`, or, without that column
//! or that file, the single entry of `tasks` in `episodes.jsonl`.
//!
//! Frames are decoded when the dataset is prepared, by `ffmpeg` (which must be on PATH) started as a
//! process per camera that writes raw RGB at the prepared resolution to a pipe (scaled bilinearly
//! to the square, as image files' frames are resized); a video must hold exactly as many frames
//! as its table has rows. Not read: v3.0 (many episodes per file), and
//! features of dtype `image` (frames stored inside the table), refused by name.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::Field;
use parquet::schema::types::Type;
use serde::Deserialize;

use super::layout::{Episode, Episodes, Step};
use crate::DataError;

const STATE: &str = "observation.state";
const ACTION: &str = "action";

/// Whether `source` is a LeRobot v2 dataset folder.
pub fn is_lerobot(source: &Path) -> bool {
    source.join("meta/info.json").is_file()
}

/// A LeRobot dataset's episodes (state, action and instruction; its steps list no image files)
/// and, per episode, one video per camera in the order of `episodes.cameras`.
pub struct LeRobotEpisodes {
    pub episodes: Episodes,
    pub videos: Vec<Vec<PathBuf>>,
}

/// `meta/info.json`, the fields read (it has more).
#[derive(Debug, Deserialize)]
struct Info {
    #[serde(default)]
    codebase_version: Option<String>,
    chunks_size: u64,
    data_path: String,
    #[serde(default)]
    video_path: Option<String>,
    features: BTreeMap<String, Feature>,
}

#[derive(Debug, Deserialize)]
struct Feature {
    dtype: String,
    #[serde(default)]
    shape: Vec<u64>,
}

/// A line of `meta/episodes.jsonl`.
#[derive(Debug, Deserialize)]
struct EpisodeLine {
    episode_index: u64,
    #[serde(default)]
    tasks: Vec<String>,
    length: u64,
}

/// A line of `meta/tasks.jsonl`.
#[derive(Debug, Deserialize)]
struct TaskLine {
    task_index: u64,
    task: String,
}

/// The largest metadata file read: a tasks or episodes file of a very large dataset is a few MB.
const META_CAP: u64 = 256 << 20;

fn meta_error(path: &Path, line: u64, message: impl Into<String>) -> DataError {
    DataError::Episode { path: path.to_path_buf(), line, message: message.into() }
}

fn read_text(path: &Path) -> Result<String, DataError> {
    stoke_fsio::read_to_string_capped(path, META_CAP).map_err(DataError::read(path))
}

/// The JSON lines of `path`, each parsed; errors name the file and the line.
fn read_json_lines<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Vec<(u64, T)>, DataError> {
    let text = read_text(path)?;
    let mut lines = Vec::new();
    for (line_idx, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let line_no = line_idx as u64 + 1;
        let value = serde_json::from_str(line).map_err(|err| meta_error(path, line_no, err.to_string()))?;
        lines.push((line_no, value));
    }
    Ok(lines)
}

/// The width of the 1-D numeric feature `key`.
fn vector_width(info: &Info, key: &str, info_path: &Path) -> Result<usize, DataError> {
    let feature = info.features.get(key).ok_or_else(|| meta_error(info_path, 0, format!("features has no {key:?}")))?;
    if !matches!(feature.dtype.as_str(), "float32" | "float64") || feature.shape.len() != 1 || feature.shape[0] == 0 {
        return Err(meta_error(
            info_path,
            0,
            format!(
                "feature {key:?} is {} of shape {:?}; stoke reads a vector of float32 or float64",
                feature.dtype, feature.shape
            ),
        ));
    }
    Ok(feature.shape[0] as usize)
}

/// A camera's name: its key after `observation.images.` (or after `observation.`).
fn camera_name(key: &str) -> &str {
    key.strip_prefix("observation.images.").or_else(|| key.strip_prefix("observation.")).unwrap_or(key)
}

/// The video features, as (camera name, feature key), sorted by camera name.
fn cameras(info: &Info, info_path: &Path) -> Result<Vec<(String, String)>, DataError> {
    if let Some((key, _)) = info.features.iter().find(|(_, f)| f.dtype == "image") {
        return Err(meta_error(
            info_path,
            0,
            format!("feature {key:?} has dtype image (frames inside the table); stoke reads cameras of dtype video"),
        ));
    }
    let mut cameras: Vec<(String, String)> = info
        .features
        .iter()
        .filter(|(_, f)| f.dtype == "video")
        .map(|(key, _)| (camera_name(key).to_string(), key.clone()))
        .collect();
    cameras.sort();
    if cameras.is_empty() {
        return Err(meta_error(info_path, 0, "no feature of dtype video: stoke needs at least one camera"));
    }
    if let Some(pair) = cameras.windows(2).find(|pair| pair[0].0 == pair[1].0) {
        return Err(meta_error(
            info_path,
            0,
            format!("features {:?} and {:?} are both camera {:?}", pair[0].1, pair[1].1, pair[0].0),
        ));
    }
    Ok(cameras)
}

/// Fills a path template of info.json: `{name}` or `{name:06d}` (zero-padded to 6 digits) with
/// `episode_chunk`, `episode_index` or `video_key`.
fn fill_template(template: &str, episode_index: u64, chunk: u64, video_key: &str) -> Result<String, String> {
    let mut out = String::with_capacity(template.len() + 16);
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let close = rest[open..].find('}').ok_or_else(|| format!("template {template:?}: a '{{' without '}}'"))?;
        let field = &rest[open + 1..open + close];
        let (name, spec) = field.split_once(':').unwrap_or((field, ""));
        let number = match name {
            "episode_index" => episode_index,
            "episode_chunk" => chunk,
            "video_key" if spec.is_empty() => {
                out.push_str(video_key);
                rest = &rest[open + close + 1..];
                continue;
            }
            _ => return Err(format!("template {template:?}: unknown field {{{field}}}")),
        };
        match spec.strip_suffix('d').unwrap_or(spec) {
            "" => out.push_str(&number.to_string()),
            width if width.starts_with('0') && width.parse::<usize>().is_ok() => {
                out.push_str(&format!("{number:0width$}", width = width.parse::<usize>().expect("checked")))
            }
            _ => return Err(format!("template {template:?}: format {{{field}}} is not d or 0Nd")),
        }
        rest = &rest[open + close + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// One episode's table, checked.
struct Table {
    states: Vec<Vec<f32>>,
    actions: Vec<Vec<f32>>,
    /// The `task_index` of its rows, where the table has that column.
    task_index: Option<u64>,
}

/// The numbers of list column `column`, exactly `width` of them.
fn numbers(field: &Field, column: &str, width: usize) -> Result<Vec<f32>, String> {
    let Field::ListInternal(list) = field else {
        return Err(format!(
            "column {column}: a list of numbers expected, found {}",
            stoke_fsio::clip(&field.to_string())
        ));
    };
    if list.len() != width {
        return Err(format!("column {column}: {} numbers; info.json's shape says {width}", list.len()));
    }
    list.elements()
        .iter()
        .map(|element| {
            let value = match element {
                Field::Float(v) => *v,
                Field::Double(v) if v.abs() <= f32::MAX as f64 => *v as f32,
                _ => {
                    return Err(format!(
                        "column {column}: a number expected, found {}",
                        stoke_fsio::clip(&element.to_string())
                    ))
                }
            };
            if value.is_finite() {
                Ok(value)
            } else {
                Err(format!("column {column}: {value} is not a finite number"))
            }
        })
        .collect()
}

fn integer(field: &Field, column: &str) -> Result<u64, String> {
    match *field {
        Field::Long(v) if v >= 0 => Ok(v as u64),
        Field::Int(v) if v >= 0 => Ok(v as u64),
        Field::ULong(v) => Ok(v),
        Field::UInt(v) => Ok(v as u64),
        _ => Err(format!(
            "column {column}: a non-negative integer expected, found {}",
            stoke_fsio::clip(&field.to_string())
        )),
    }
}

/// Reads the table of episode `episode_index`: every row's state and action, checking widths,
/// that `frame_index` counts rows from 0 and `episode_index` is this episode's.
fn read_table(path: &Path, episode_index: u64, state_dim: usize, action_dim: usize) -> Result<Table, DataError> {
    let bad = |detail: String| DataError::Table { path: path.to_path_buf(), detail };
    let file = std::fs::File::open(path).map_err(DataError::read(path))?;
    let reader = SerializedFileReader::new(file).map_err(|err| bad(format!("not a readable Parquet file: {err}")))?;
    let root = reader.metadata().file_metadata().schema();
    let wanted = [STATE, ACTION, "frame_index", "episode_index", "task_index"];
    let fields: Vec<_> = root.get_fields().iter().filter(|f| wanted.contains(&f.name())).cloned().collect();
    for required in [STATE, ACTION] {
        if !fields.iter().any(|f| f.name() == required) {
            let present: Vec<&str> = root.get_fields().iter().map(|f| f.name()).collect();
            return Err(bad(format!("no column {required} (columns: {})", present.join(", "))));
        }
    }
    let projection =
        Type::group_type_builder(root.name()).with_fields(fields).build().map_err(|e| bad(e.to_string()))?;
    let rows = reader.get_row_iter(Some(projection)).map_err(|err| bad(err.to_string()))?;
    let mut table = Table { states: Vec::new(), actions: Vec::new(), task_index: None };
    for (row_idx, row) in rows.enumerate() {
        let at_row = |detail: String| bad(format!("row {row_idx}: {detail}"));
        let row = row.map_err(|err| at_row(err.to_string()))?;
        for (name, field) in row.get_column_iter() {
            match name.as_str() {
                STATE => table.states.push(numbers(field, STATE, state_dim).map_err(at_row)?),
                ACTION => table.actions.push(numbers(field, ACTION, action_dim).map_err(at_row)?),
                "frame_index" => {
                    let frame_index = integer(field, name).map_err(at_row)?;
                    if frame_index != row_idx as u64 {
                        return Err(at_row(format!(
                            "frame_index {frame_index}; rows are the steps 0, 1, ... in order"
                        )));
                    }
                }
                "episode_index" => {
                    let found = integer(field, name).map_err(at_row)?;
                    if found != episode_index {
                        return Err(at_row(format!("episode_index {found} in the table of episode {episode_index}")));
                    }
                }
                "task_index" => {
                    let task = integer(field, name).map_err(at_row)?;
                    match table.task_index {
                        Some(first) if first != task => {
                            return Err(at_row(format!(
                                "task_index {task} after {first}; stoke takes one instruction per episode"
                            )))
                        }
                        _ => table.task_index = Some(task),
                    }
                }
                _ => {}
            }
        }
    }
    if table.states.is_empty() {
        return Err(bad("no rows".into()));
    }
    Ok(table)
}

/// Reads the LeRobot v2 dataset in folder `source`: its metadata and every episode's table (the
/// videos are only located here; `EpisodeVideos` decodes them).
pub fn read_lerobot(source: &Path) -> Result<LeRobotEpisodes, DataError> {
    let info_path = source.join("meta/info.json");
    let info: Info = serde_json::from_str(&read_text(&info_path)?)
        .map_err(|err| meta_error(&info_path, err.line() as u64, err.to_string()))?;
    if let Some(version) = info.codebase_version.as_deref().filter(|v| !v.starts_with("v2")) {
        return Err(meta_error(
            &info_path,
            0,
            format!("codebase_version {version}; stoke reads LeRobot v2.0 and v2.1"),
        ));
    }
    if info.chunks_size == 0 {
        return Err(meta_error(&info_path, 0, "chunks_size is 0"));
    }
    let state_dim = vector_width(&info, STATE, &info_path)?;
    let action_dim = vector_width(&info, ACTION, &info_path)?;
    let cameras = cameras(&info, &info_path)?;
    let video_path =
        info.video_path.as_deref().ok_or_else(|| meta_error(&info_path, 0, "video features but no video_path"))?;
    let tasks_path = source.join("meta/tasks.jsonl");
    let tasks: HashMap<u64, String> = if tasks_path.is_file() {
        read_json_lines::<TaskLine>(&tasks_path)?.into_iter().map(|(_, t)| (t.task_index, t.task)).collect()
    } else {
        HashMap::new()
    };
    let episodes_path = source.join("meta/episodes.jsonl");
    let episode_lines = read_json_lines::<EpisodeLine>(&episodes_path)?;
    if episode_lines.is_empty() {
        return Err(meta_error(&episodes_path, 0, "no episodes"));
    }
    let mut episodes = Vec::with_capacity(episode_lines.len());
    let mut videos = Vec::with_capacity(episode_lines.len());
    for (line_no, line) in &episode_lines {
        let index = line.episode_index;
        let chunk = index / info.chunks_size;
        let locate = |template: &str, key: &str| {
            fill_template(template, index, chunk, key)
                .map(|relative| source.join(relative))
                .map_err(|message| meta_error(&info_path, 0, message))
        };
        let table_path = locate(&info.data_path, "")?;
        let table = read_table(&table_path, index, state_dim, action_dim)?;
        let n_rows = table.states.len() as u64;
        if table.actions.len() as u64 != n_rows || n_rows != line.length {
            return Err(DataError::Table {
                path: table_path,
                detail: format!(
                    "{} states and {} actions; {} line {line_no} says length {}",
                    n_rows,
                    table.actions.len(),
                    episodes_path.display(),
                    line.length
                ),
            });
        }
        let instruction = match table.task_index.filter(|_| tasks_path.is_file()) {
            Some(task_index) => tasks.get(&task_index).cloned().ok_or_else(|| {
                meta_error(&tasks_path, 0, format!("no task_index {task_index} (named by {})", table_path.display()))
            })?,
            None => match line.tasks.as_slice() {
                [task] => task.clone(),
                other => {
                    return Err(meta_error(
                        &episodes_path,
                        *line_no,
                        format!("{} tasks; stoke takes one instruction per episode", other.len()),
                    ))
                }
            },
        };
        let steps = table
            .states
            .into_iter()
            .zip(table.actions)
            .map(|(state, action)| Step { state, action, images: Vec::new() })
            .collect();
        episodes.push(Episode { id: format!("episode_{index:06}"), instruction, steps });
        videos.push(cameras.iter().map(|(_, key)| locate(video_path, key)).collect::<Result<Vec<_>, _>>()?);
    }
    let cameras = cameras.into_iter().map(|(name, _)| name).collect();
    Ok(LeRobotEpisodes { episodes: Episodes { episodes, state_dim, action_dim, cameras }, videos })
}

/// How much of `ffmpeg`'s error output is kept for a message.
const STDERR_CAP: u64 = 8 << 10;

/// One video decoded by an `ffmpeg` process into `side` x `side` RGB frames, read one at a time.
struct VideoDecoder {
    path: PathBuf,
    child: Child,
    stdout: ChildStdout,
    /// Collects `ffmpeg`'s error output, so a full pipe never stalls it.
    stderr: Option<std::thread::JoinHandle<String>>,
    frame: Vec<u8>,
    n_frames: u64,
    n_expected: u64,
    finished: bool,
}

impl VideoDecoder {
    fn start(path: &Path, side: u32, n_expected: u64) -> Result<VideoDecoder, DataError> {
        let bad = |detail: String| DataError::Video { path: path.to_path_buf(), detail };
        if !path.is_file() {
            return Err(bad("no such file (info.json's video_path names it)".into()));
        }
        let mut child = Command::new("ffmpeg")
            .args(["-nostdin", "-v", "error", "-i"])
            .arg(path)
            .args(["-map", "0:v:0", "-f", "rawvideo", "-pix_fmt", "rgb24", "-vf"])
            .arg(format!("scale={side}:{side}:flags=bilinear"))
            .arg("-")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|err| match err.kind() {
                std::io::ErrorKind::NotFound => {
                    bad("the `ffmpeg` program is not on PATH; LeRobot videos are decoded with it: install ffmpeg \
                     (apt-get install -y ffmpeg)"
                        .into())
                }
                _ => bad(format!("cannot start `ffmpeg`: {err}")),
            })?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let mut stderr = child.stderr.take().expect("stderr is piped");
        let stderr = std::thread::spawn(move || {
            let mut kept = Vec::new();
            // Errors reading ffmpeg's own messages leave them out of ours; the exit status still counts.
            let _ = (&mut stderr).take(STDERR_CAP).read_to_end(&mut kept);
            let _ = std::io::copy(&mut stderr, &mut std::io::sink());
            String::from_utf8_lossy(&kept).trim().to_string()
        });
        let frame = vec![0; side as usize * side as usize * 3];
        Ok(VideoDecoder {
            path: path.to_path_buf(),
            child,
            stdout,
            stderr: Some(stderr),
            frame,
            n_frames: 0,
            n_expected,
            finished: false,
        })
    }

    /// Reads into `frame` until it is full or the stream ends; returns the bytes read.
    fn fill(&mut self) -> Result<usize, DataError> {
        let mut filled = 0;
        while filled < self.frame.len() {
            match self.stdout.read(&mut self.frame[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
                Err(err) => return Err(DataError::Read { path: self.path.clone(), source: err }),
            }
        }
        Ok(filled)
    }

    /// Waits for `ffmpeg` to exit: whether it succeeded, and what it said (its error output, or its
    /// exit status where it printed nothing).
    fn wait(&mut self) -> Result<(bool, String), DataError> {
        self.finished = true;
        let status = self.child.wait().map_err(|source| DataError::Read { path: self.path.clone(), source })?;
        let stderr = self.stderr.take().map(|t| t.join().unwrap_or_default()).unwrap_or_default();
        Ok((status.success(), format!("ffmpeg: {}", if stderr.is_empty() { status.to_string() } else { stderr })))
    }

    /// The next frame, `side * side * 3` bytes of RGB.
    fn next_frame(&mut self) -> Result<&[u8], DataError> {
        let filled = self.fill()?;
        if filled < self.frame.len() {
            let (_, said) = self.wait()?;
            return Err(DataError::Video {
                path: self.path.clone(),
                detail: format!(
                    "frame {}: the video ends after {} frames (and {filled} bytes), its table has {} rows; {said}",
                    self.n_frames, self.n_frames, self.n_expected
                ),
            });
        }
        self.n_frames += 1;
        Ok(&self.frame)
    }

    /// Checks that the video held no more frames and `ffmpeg` succeeded.
    fn finish(mut self) -> Result<(), DataError> {
        let mut extra_bytes = 0u64;
        loop {
            let filled = self.fill()?;
            extra_bytes += filled as u64;
            if filled < self.frame.len() {
                break;
            }
        }
        let (success, said) = self.wait()?;
        let bad = |detail: String| DataError::Video { path: self.path.clone(), detail };
        if extra_bytes > 0 {
            let extra_frames = extra_bytes / self.frame.len() as u64;
            return Err(bad(format!(
                "{} frames, its table has {} rows",
                self.n_frames + extra_frames,
                self.n_expected
            )));
        }
        if !success {
            return Err(bad(format!("after frame {}: {said}", self.n_frames)));
        }
        Ok(())
    }
}

impl Drop for VideoDecoder {
    fn drop(&mut self) {
        if !self.finished {
            // Stopped early by an error elsewhere: end ffmpeg rather than leave it blocked on a pipe.
            // It may have exited already, so a failed kill is expected and says nothing.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One episode's videos, one decoder per camera, read in step order.
pub struct EpisodeVideos {
    decoders: Vec<VideoDecoder>,
}

impl EpisodeVideos {
    /// Starts decoding `videos` (one per camera) into `side` x `side` frames, `n_steps` each.
    pub fn start(videos: &[PathBuf], side: u32, n_steps: u64) -> Result<EpisodeVideos, DataError> {
        let decoders = videos.iter().map(|path| VideoDecoder::start(path, side, n_steps)).collect::<Result<_, _>>()?;
        Ok(EpisodeVideos { decoders })
    }

    /// Camera `camera_idx`'s next frame; each camera's frames are read in step order.
    pub fn next_frame(&mut self, camera_idx: usize) -> Result<&[u8], DataError> {
        self.decoders[camera_idx].next_frame()
    }

    /// Checks that every video ended with the episode's last step.
    pub fn finish(self) -> Result<(), DataError> {
        self.decoders.into_iter().try_for_each(VideoDecoder::finish)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_fill_like_python_format() {
        let data = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet";
        assert_eq!(fill_template(data, 1234, 1, "").unwrap(), "data/chunk-001/episode_001234.parquet");
        let video = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4";
        assert_eq!(
            fill_template(video, 7, 0, "observation.images.top").unwrap(),
            "videos/chunk-000/observation.images.top/episode_000007.mp4"
        );
        assert_eq!(fill_template("e{episode_index}", 42, 0, "").unwrap(), "e42");
        for (template, says) in
            [("{nope}", "unknown field {nope}"), ("{episode_index:>6}", "not d or 0Nd"), ("{episode_index", "without")]
        {
            let err = fill_template(template, 1, 0, "").unwrap_err();
            assert!(err.contains(says), "{says:?} not in {err}");
        }
    }

    #[test]
    fn cameras_are_named_after_their_prefix() {
        assert_eq!(camera_name("observation.images.front"), "front");
        assert_eq!(camera_name("observation.image"), "image");
        assert_eq!(camera_name("wrist"), "wrist");
    }
}
