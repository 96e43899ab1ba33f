//! Writes episodes in the LeRobot v2 layout that `lerobot` reads: per episode a Parquet table laid
//! out as pyarrow writes one (optional list columns, Snappy) and one MP4 video per camera,
//! encoded by `ffmpeg` (which must be on PATH) from raw RGB frames piped to it; then
//! `meta/info.json` (codebase_version v2.1), `meta/episodes.jsonl` and `meta/tasks.jsonl`.
//!
//! Videos are H.264 at `-qp 0` in yuv444p (lossless but for the RGB to YUV rounding) where
//! `ffmpeg` has `libx264`, else MPEG-4 part 2 at its best quantizer in yuv420p. Not written:
//! `meta/episodes_stats.jsonl`, which stoke does not read.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use parquet::basic::{Compression, LogicalType, Repetition, Type as Physical};
use parquet::data_type::{FloatType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::types::Type;

use crate::DataError;

/// Episodes per chunk folder, LeRobot's own default.
const CHUNKS_SIZE: u64 = 1000;
const DATA_PATH: &str = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet";
const VIDEO_PATH: &str = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4";
/// How much of `ffmpeg`'s error output is kept for a message.
const STDERR_CAP: u64 = 8 << 10;

/// What every episode of a `LeRobotWriter` shares. Plain data; there are no defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct LeRobotLayout {
    /// Numbers in `observation.state`.
    pub state_dim: usize,
    /// Numbers in `action`.
    pub action_dim: usize,
    /// Camera names; camera `name` is the video feature `observation.images.name`.
    pub cameras: Vec<String>,
    /// Frame width in pixels.
    pub width: u32,
    /// Frame height in pixels.
    pub height: u32,
    /// Steps (and frames) per second, for `fps` and the timestamps.
    pub fps: u32,
    /// `robot_type` in info.json.
    pub robot_type: String,
}

/// The encoder `ffmpeg` offers, best first.
#[derive(Debug, Clone, Copy, PartialEq)]
enum VideoCodec {
    X264,
    Mpeg4,
}

impl VideoCodec {
    /// The encoder's arguments and its (codec, pix_fmt) as info.json names them.
    fn args(self) -> (&'static [&'static str], &'static str, &'static str) {
        match self {
            VideoCodec::X264 => (&["-c:v", "libx264", "-qp", "0", "-pix_fmt", "yuv444p"], "h264", "yuv444p"),
            VideoCodec::Mpeg4 => (&["-c:v", "mpeg4", "-q:v", "1", "-pix_fmt", "yuv420p"], "mpeg4", "yuv420p"),
        }
    }
}

/// The error for an `ffmpeg` that could not be started while writing `path`.
fn ffmpeg_error(path: &Path, err: std::io::Error) -> DataError {
    let source = match err.kind() {
        std::io::ErrorKind::NotFound => std::io::Error::new(
            err.kind(),
            "the `ffmpeg` program is not on PATH; LeRobot videos are encoded with it: install ffmpeg \
             (apt-get install -y ffmpeg)",
        ),
        _ => std::io::Error::new(err.kind(), format!("cannot start `ffmpeg`: {err}")),
    };
    DataError::Write { path: path.to_path_buf(), source }
}

/// Asks `ffmpeg` which encoder to use; refuses a missing `ffmpeg`, naming it.
fn find_codec(dir: &Path) -> Result<VideoCodec, DataError> {
    let out = Command::new("ffmpeg")
        .args(["-hide_banner", "-encoders"])
        .stdin(Stdio::null())
        .output()
        .map_err(|err| ffmpeg_error(dir, err))?;
    let listed = String::from_utf8_lossy(&out.stdout);
    let has_x264 = listed.lines().any(|line| line.split_whitespace().nth(1) == Some("libx264"));
    Ok(if has_x264 { VideoCodec::X264 } else { VideoCodec::Mpeg4 })
}

fn config_error(reason: String) -> DataError {
    DataError::Config { field: "LeRobotLayout", reason }
}

/// An episode (or frame) handed to `LeRobotWriter` that does not fit its layout.
fn episode_error(reason: String) -> DataError {
    DataError::Config { field: "LeRobotWriter episode", reason }
}

fn check_layout(layout: &LeRobotLayout) -> Result<(), DataError> {
    if layout.state_dim == 0 || layout.action_dim == 0 {
        return Err(config_error("state_dim and action_dim must be at least 1".into()));
    }
    if layout.width == 0 || layout.height == 0 || layout.fps == 0 {
        return Err(config_error("width, height and fps must be at least 1".into()));
    }
    if layout.cameras.is_empty() {
        return Err(config_error("at least one camera: stoke reads LeRobot datasets with videos".into()));
    }
    for (idx, name) in layout.cameras.iter().enumerate() {
        if name.is_empty() || name.contains(['/', '\\']) || layout.cameras[..idx].contains(name) {
            return Err(config_error(format!("camera {name:?}: names are distinct, non-empty, without slashes")));
        }
    }
    Ok(())
}

/// A list column as pyarrow writes it: optional group (LIST) { repeated group list { optional float element } }.
fn float_list(name: &str) -> Arc<Type> {
    let element = Type::primitive_type_builder("element", Physical::FLOAT)
        .with_repetition(Repetition::OPTIONAL)
        .build()
        .expect("a valid primitive type");
    let list = Type::group_type_builder("list")
        .with_repetition(Repetition::REPEATED)
        .with_fields(vec![Arc::new(element)])
        .build()
        .expect("a valid group type");
    Arc::new(
        Type::group_type_builder(name)
            .with_repetition(Repetition::OPTIONAL)
            .with_logical_type(Some(LogicalType::List))
            .with_fields(vec![Arc::new(list)])
            .build()
            .expect("a valid list type"),
    )
}

fn scalar(name: &str, physical: Physical) -> Arc<Type> {
    Arc::new(
        Type::primitive_type_builder(name, physical)
            .with_repetition(Repetition::OPTIONAL)
            .build()
            .expect("a valid primitive type"),
    )
}

/// One episode's rows, ready for its table.
struct TableRows<'a> {
    states: &'a [Vec<f32>],
    actions: &'a [Vec<f32>],
    episode_index: u64,
    task_index: u64,
    /// The dataset-wide index of the episode's first step.
    first_index: u64,
    fps: u32,
}

/// Writes one episode's table at `path`: observation.state, action, timestamp, frame_index,
/// episode_index, index, task_index, in one row group.
fn write_table(path: &Path, rows: &TableRows) -> Result<(), DataError> {
    let failed = |err: parquet::errors::ParquetError| DataError::Write {
        path: path.to_path_buf(),
        source: std::io::Error::other(format!("Parquet: {err}")),
    };
    let columns = vec![
        float_list("observation.state"),
        float_list("action"),
        scalar("timestamp", Physical::FLOAT),
        scalar("frame_index", Physical::INT64),
        scalar("episode_index", Physical::INT64),
        scalar("index", Physical::INT64),
        scalar("task_index", Physical::INT64),
    ];
    let schema = Arc::new(Type::group_type_builder("schema").with_fields(columns).build().map_err(failed)?);
    let properties = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).build());
    let file = std::fs::File::create(path).map_err(DataError::write(path))?;
    let mut writer = SerializedFileWriter::new(file, schema, properties).map_err(failed)?;
    let mut row_group = writer.next_row_group().map_err(failed)?;
    let n_rows = rows.states.len();
    let present = vec![1i16; n_rows];
    let mut column_idx = 0;
    while let Some(mut column) = row_group.next_column().map_err(failed)? {
        match column_idx {
            0 | 1 => {
                let list = if column_idx == 0 { rows.states } else { rows.actions };
                let values: Vec<f32> = list.iter().flatten().copied().collect();
                // Every element is present (definition 3); repetition 0 starts a row's list.
                let definition = vec![3i16; values.len()];
                let repetition: Vec<i16> =
                    list.iter().flat_map(|row| (0..row.len()).map(|i| i16::from(i != 0))).collect();
                column
                    .typed::<FloatType>()
                    .write_batch(&values, Some(&definition), Some(&repetition))
                    .map_err(failed)?;
            }
            2 => {
                let timestamps: Vec<f32> = (0..n_rows).map(|t| t as f32 / rows.fps as f32).collect();
                column.typed::<FloatType>().write_batch(&timestamps, Some(&present), None).map_err(failed)?;
            }
            _ => {
                let values: Vec<i64> = (0..n_rows as u64)
                    .map(|t| match column_idx {
                        3 => t,
                        4 => rows.episode_index,
                        5 => rows.first_index + t,
                        _ => rows.task_index,
                    } as i64)
                    .collect();
                column.typed::<Int64Type>().write_batch(&values, Some(&present), None).map_err(failed)?;
            }
        }
        column.close().map_err(failed)?;
        column_idx += 1;
    }
    row_group.close().map_err(failed)?;
    writer.close().map_err(failed)?;
    Ok(())
}

/// Writes a dataset in the LeRobot v2 layout, one episode at a time; `finish` writes the metadata.
///
/// ```no_run
/// # fn main() -> Result<(), stoke_data::DataError> {
/// use stoke_data::{LeRobotLayout, LeRobotWriter};
/// let layout = LeRobotLayout {
///     state_dim: 1,
///     action_dim: 1,
///     cameras: vec!["front".into()],
///     width: 16,
///     height: 16,
///     fps: 10,
///     robot_type: "example".into(),
/// };
/// let mut writer = LeRobotWriter::create(std::path::Path::new("lerobot"), layout)?;
/// let rows = vec![vec![0.5f32]; 3];
/// writer.write_episode("stand still", &rows, &rows, |_camera, _t| vec![128u8; 16 * 16 * 3])?;
/// assert_eq!(writer.finish()?, 3);
/// # Ok(()) }
/// ```
pub struct LeRobotWriter {
    dir: PathBuf,
    layout: LeRobotLayout,
    codec: VideoCodec,
    /// Distinct instructions, in order of first use; a task's index is its position.
    tasks: Vec<String>,
    /// Per episode written: its task index and its number of steps.
    episodes: Vec<(u64, u64)>,
    n_steps: u64,
}

impl LeRobotWriter {
    /// Checks `layout` and that `ffmpeg` runs, and creates `dir`.
    pub fn create(dir: &Path, layout: LeRobotLayout) -> Result<LeRobotWriter, DataError> {
        check_layout(&layout)?;
        let codec = find_codec(dir)?;
        std::fs::create_dir_all(dir.join("meta")).map_err(DataError::write(dir))?;
        Ok(LeRobotWriter { dir: dir.to_path_buf(), layout, codec, tasks: Vec::new(), episodes: Vec::new(), n_steps: 0 })
    }

    fn episode_path(&self, template_dir: &str, episode_index: u64, file_name: &str) -> PathBuf {
        let chunk = episode_index / CHUNKS_SIZE;
        self.dir.join(format!("{template_dir}/chunk-{chunk:03}")).join(file_name)
    }

    /// Writes the next episode: its table from `states` and `actions` (one row per step) and one
    /// video per camera, whose frame `t` is `frame(camera_idx, t)`: `width * height * 3` bytes of
    /// RGB, rows top to bottom.
    pub fn write_episode(
        &mut self,
        instruction: &str,
        states: &[Vec<f32>],
        actions: &[Vec<f32>],
        mut frame: impl FnMut(usize, usize) -> Vec<u8>,
    ) -> Result<(), DataError> {
        let episode_index = self.episodes.len() as u64;
        let episode_error = |reason: String| episode_error(format!("episode {episode_index}: {reason}"));
        if states.is_empty() || states.len() != actions.len() {
            return Err(episode_error(format!(
                "{} states and {} actions; an episode has at least one step, each with both",
                states.len(),
                actions.len()
            )));
        }
        let (state_dim, action_dim) = (self.layout.state_dim, self.layout.action_dim);
        if let Some(t) = states.iter().position(|s| s.len() != state_dim) {
            return Err(episode_error(format!("step {t}: {} state numbers, not {state_dim}", states[t].len())));
        }
        if let Some(t) = actions.iter().position(|a| a.len() != action_dim) {
            return Err(episode_error(format!("step {t}: {} action numbers, not {action_dim}", actions[t].len())));
        }
        let task_index = match self.tasks.iter().position(|task| task == instruction) {
            Some(idx) => idx,
            None => {
                self.tasks.push(instruction.to_string());
                self.tasks.len() - 1
            }
        } as u64;
        let table_path = self.episode_path("data", episode_index, &format!("episode_{episode_index:06}.parquet"));
        let table_dir = table_path.parent().expect("a chunk folder");
        std::fs::create_dir_all(table_dir).map_err(DataError::write(table_dir))?;
        let rows =
            TableRows { states, actions, episode_index, task_index, first_index: self.n_steps, fps: self.layout.fps };
        write_table(&table_path, &rows)?;
        for camera_idx in 0..self.layout.cameras.len() {
            let key = format!("observation.images.{}", self.layout.cameras[camera_idx]);
            let name = format!("{key}/episode_{episode_index:06}.mp4");
            let video_path = self.episode_path("videos", episode_index, &name);
            let video_dir = video_path.parent().expect("a camera folder");
            std::fs::create_dir_all(video_dir).map_err(DataError::write(video_dir))?;
            self.encode_video(&video_path, states.len(), |t| frame(camera_idx, t))?;
        }
        self.episodes.push((task_index, states.len() as u64));
        self.n_steps += states.len() as u64;
        Ok(())
    }

    /// Pipes `n_frames` frames into an `ffmpeg` that writes the video at `path`.
    fn encode_video(
        &self,
        path: &Path,
        n_frames: usize,
        mut frame: impl FnMut(usize) -> Vec<u8>,
    ) -> Result<(), DataError> {
        let (width, height) = (self.layout.width, self.layout.height);
        let (codec_args, _, _) = self.codec.args();
        let mut child = Command::new("ffmpeg")
            .args(["-nostdin", "-v", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24"])
            .args(["-s", &format!("{width}x{height}"), "-r", &self.layout.fps.to_string(), "-i", "-"])
            .args(codec_args)
            .arg(path)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|err| ffmpeg_error(path, err))?;
        let mut stderr = child.stderr.take().expect("stderr is piped");
        let said = std::thread::spawn(move || {
            let mut kept = Vec::new();
            // Errors reading ffmpeg's own messages leave them out of ours; the exit status still counts.
            let _ = (&mut stderr).take(STDERR_CAP).read_to_end(&mut kept);
            let _ = std::io::copy(&mut stderr, &mut std::io::sink());
            String::from_utf8_lossy(&kept).trim().to_string()
        });
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let frame_bytes = width as usize * height as usize * 3;
        let mut piped: Result<(), DataError> = Ok(());
        for t in 0..n_frames {
            let rgb = frame(t);
            if rgb.len() != frame_bytes {
                piped = Err(episode_error(format!(
                    "{}: frame {t} has {} bytes; {width} x {height} RGB is {frame_bytes}",
                    path.display(),
                    rgb.len()
                )));
                // A video cut short is no video: stop ffmpeg rather than let it finish one.
                let _ = child.kill();
                break;
            }
            if let Err(err) = stdin.write_all(&rgb) {
                // A broken pipe means ffmpeg stopped; its exit status and message say why.
                piped = Err(DataError::Write { path: path.to_path_buf(), source: err });
                break;
            }
        }
        drop(stdin);
        let status = child.wait().map_err(DataError::write(path))?;
        let said = said.join().unwrap_or_default();
        piped?;
        if !status.success() {
            let said = if said.is_empty() { status.to_string() } else { said };
            return Err(DataError::Write {
                path: path.to_path_buf(),
                source: std::io::Error::other(format!("ffmpeg: {said}")),
            });
        }
        Ok(())
    }

    /// Writes `meta/info.json`, `meta/episodes.jsonl` and `meta/tasks.jsonl`; returns the number
    /// of steps written.
    pub fn finish(self) -> Result<u64, DataError> {
        let layout = &self.layout;
        let (_, codec, pix_fmt) = self.codec.args();
        let vector = |n: usize| serde_json::json!({"dtype": "float32", "shape": [n], "names": null});
        let scalar = |dtype: &str| serde_json::json!({"dtype": dtype, "shape": [1], "names": null});
        let mut features = serde_json::json!({
            "observation.state": vector(layout.state_dim),
            "action": vector(layout.action_dim),
            "timestamp": scalar("float32"),
            "frame_index": scalar("int64"),
            "episode_index": scalar("int64"),
            "index": scalar("int64"),
            "task_index": scalar("int64"),
        });
        for camera in &layout.cameras {
            features[format!("observation.images.{camera}")] = serde_json::json!({
                "dtype": "video",
                "shape": [layout.height, layout.width, 3],
                "names": ["height", "width", "channels"],
                "info": {
                    "video.fps": layout.fps as f64,
                    "video.height": layout.height,
                    "video.width": layout.width,
                    "video.channels": 3,
                    "video.codec": codec,
                    "video.pix_fmt": pix_fmt,
                    "video.is_depth_map": false,
                    "has_audio": false,
                },
            });
        }
        let n_episodes = self.episodes.len() as u64;
        let info = serde_json::json!({
            "codebase_version": "v2.1",
            "robot_type": layout.robot_type,
            "total_episodes": n_episodes,
            "total_frames": self.n_steps,
            "total_tasks": self.tasks.len(),
            "total_videos": n_episodes * layout.cameras.len() as u64,
            "total_chunks": n_episodes.div_ceil(CHUNKS_SIZE),
            "chunks_size": CHUNKS_SIZE,
            "fps": layout.fps,
            "splits": {"train": format!("0:{n_episodes}")},
            "data_path": DATA_PATH,
            "video_path": VIDEO_PATH,
            "features": features,
        });
        let meta = self.dir.join("meta");
        let write = |name: &str, text: String| {
            let path = meta.join(name);
            std::fs::write(&path, text).map_err(DataError::write(&path))
        };
        let lines = |items: Vec<serde_json::Value>| items.iter().map(|v| format!("{v}\n")).collect::<String>();
        let tasks = self.tasks.iter().enumerate();
        write(
            "tasks.jsonl",
            lines(tasks.map(|(i, task)| serde_json::json!({"task_index": i, "task": task})).collect()),
        )?;
        let episodes = self.episodes.iter().enumerate().map(|(i, &(task_index, length))| {
            serde_json::json!({"episode_index": i, "tasks": [self.tasks[task_index as usize]], "length": length})
        });
        write("episodes.jsonl", lines(episodes.collect()))?;
        // info.json last: it is what marks the folder as a LeRobot dataset.
        write("info.json", serde_json::to_string_pretty(&info).expect("JSON values serialize"))?;
        Ok(self.n_steps)
    }
}
