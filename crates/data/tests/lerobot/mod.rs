//! `prepare_episodes` on a LeRobot v2 dataset that the test writes itself: Parquet tables written
//! with the `parquet` crate as pyarrow lays them out (optional lists, Snappy), MP4 videos encoded
//! by `ffmpeg` from generated frames of large flat colours, and the meta JSON files.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

use parquet::basic::{Compression, LogicalType, Repetition, Type as Physical};
use parquet::data_type::{FloatType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::types::Type;
use stoke_data::{prepare_episodes, EpisodeStore, PrepEpisodesConfig};

const TASKS: [&str; 2] = ["pick up the red cube", "push the blue block left"];
const CAMERAS: [&str; 2] = ["front", "wrist"];
const LENGTHS: [usize; 2] = [5, 4];
const STATE_DIM: usize = 2;
const ACTION_DIM: usize = 3;
/// The videos' size: even, as yuv420p needs, and not square, so the prepared frames are resized.
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

/// A list column as pyarrow writes it: optional group (LIST) { repeated group list { optional float element } }.
fn float_list(name: &str) -> Arc<Type> {
    let element =
        Type::primitive_type_builder("element", Physical::FLOAT).with_repetition(Repetition::OPTIONAL).build().unwrap();
    let list = Type::group_type_builder("list")
        .with_repetition(Repetition::REPEATED)
        .with_fields(vec![Arc::new(element)])
        .build()
        .unwrap();
    Arc::new(
        Type::group_type_builder(name)
            .with_repetition(Repetition::OPTIONAL)
            .with_logical_type(Some(LogicalType::List))
            .with_fields(vec![Arc::new(list)])
            .build()
            .unwrap(),
    )
}

fn scalar(name: &str, physical: Physical) -> Arc<Type> {
    Arc::new(Type::primitive_type_builder(name, physical).with_repetition(Repetition::OPTIONAL).build().unwrap())
}

/// Writes one episode's table: state, action, timestamp, frame_index, episode_index, index, task_index.
fn write_table(path: &Path, episode: usize, first_index: usize, state_dim: usize) {
    let n_rows = LENGTHS[episode];
    let columns = vec![
        float_list("observation.state"),
        float_list("action"),
        scalar("timestamp", Physical::FLOAT),
        scalar("frame_index", Physical::INT64),
        scalar("episode_index", Physical::INT64),
        scalar("index", Physical::INT64),
        scalar("task_index", Physical::INT64),
    ];
    let schema = Arc::new(Type::group_type_builder("schema").with_fields(columns).build().unwrap());
    let properties = Arc::new(WriterProperties::builder().set_compression(Compression::SNAPPY).build());
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut writer = SerializedFileWriter::new(std::fs::File::create(path).unwrap(), schema, properties).unwrap();
    let mut row_group = writer.next_row_group().unwrap();
    let rows: Vec<usize> = (0..n_rows).collect();
    let mut column_idx = 0;
    while let Some(mut column) = row_group.next_column().unwrap() {
        match column_idx {
            0 | 1 => {
                let values: Vec<f32> = if column_idx == 0 {
                    rows.iter().flat_map(|&s| state(episode, s).into_iter().cycle().take(state_dim)).collect()
                } else {
                    rows.iter().flat_map(|&s| action(episode, s)).collect()
                };
                let width = values.len() / n_rows;
                let definition = vec![3i16; values.len()];
                let repetition: Vec<i16> = (0..values.len()).map(|i| i16::from(i % width != 0)).collect();
                column.typed::<FloatType>().write_batch(&values, Some(&definition), Some(&repetition)).unwrap();
            }
            2 => {
                let timestamps: Vec<f32> = rows.iter().map(|&s| s as f32 / 10.0).collect();
                column.typed::<FloatType>().write_batch(&timestamps, Some(&vec![1; n_rows]), None).unwrap();
            }
            _ => {
                let values: Vec<i64> = rows
                    .iter()
                    .map(|&s| match column_idx {
                        3 => s,
                        4 => episode,
                        5 => first_index + s,
                        _ => episode,
                    } as i64)
                    .collect();
                column.typed::<Int64Type>().write_batch(&values, Some(&vec![1; n_rows]), None).unwrap();
            }
        }
        column.close().unwrap();
        column_idx += 1;
    }
    row_group.close().unwrap();
    writer.close().unwrap();
}

/// Encodes one camera's frames of an episode as H.264 in MP4, as LeRobot v2.0 stores them.
fn write_video(path: &Path, episode: usize, camera: usize) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut child = Command::new("ffmpeg")
        .args(["-nostdin", "-v", "error", "-y", "-f", "rawvideo", "-pix_fmt", "rgb24"])
        .args(["-s", &format!("{WIDTH}x{HEIGHT}"), "-r", "10", "-i", "-"])
        .args(["-c:v", "libx264", "-pix_fmt", "yuv420p", "-crf", "12"])
        .arg(path)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    for step in 0..LENGTHS[episode] {
        stdin.write_all(&frame(episode, camera, step, WIDTH, HEIGHT)).unwrap();
    }
    drop(stdin);
    assert!(child.wait().unwrap().success(), "ffmpeg could not encode {}", path.display());
}

fn table_path(root: &Path, episode: usize) -> PathBuf {
    root.join(format!("data/chunk-000/episode_{episode:06}.parquet"))
}

fn video_path(root: &Path, episode: usize, camera: &str) -> PathBuf {
    root.join(format!("videos/chunk-000/observation.images.{camera}/episode_{episode:06}.mp4"))
}

/// Writes the whole dataset under `root`.
fn write_dataset(root: &Path) {
    require_ffmpeg();
    let vector = |n: usize| serde_json::json!({"dtype": "float32", "shape": [n], "names": null});
    let scalar = |dtype: &str| serde_json::json!({"dtype": dtype, "shape": [1], "names": null});
    let mut features = serde_json::json!({
        "observation.state": vector(STATE_DIM),
        "action": vector(ACTION_DIM),
        "timestamp": scalar("float32"),
        "frame_index": scalar("int64"),
        "episode_index": scalar("int64"),
        "index": scalar("int64"),
        "task_index": scalar("int64"),
    });
    for camera in CAMERAS {
        features[format!("observation.images.{camera}")] = serde_json::json!({
            "dtype": "video",
            "shape": [HEIGHT, WIDTH, 3],
            "names": ["height", "width", "channels"],
            "info": {"video.fps": 10.0, "video.codec": "h264", "video.pix_fmt": "yuv420p"},
        });
    }
    let info = serde_json::json!({
        "codebase_version": "v2.1",
        "robot_type": "test",
        "total_episodes": 2,
        "total_frames": LENGTHS.iter().sum::<usize>(),
        "total_tasks": 2,
        "chunks_size": 1000,
        "fps": 10,
        "splits": {"train": "0:2"},
        "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
        "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
        "features": features,
    });
    std::fs::create_dir_all(root.join("meta")).unwrap();
    std::fs::write(root.join("meta/info.json"), serde_json::to_string_pretty(&info).unwrap()).unwrap();
    let lines = |items: Vec<serde_json::Value>| items.iter().map(|v| format!("{v}\n")).collect::<String>();
    let tasks = (0..2).map(|i| serde_json::json!({"task_index": i, "task": TASKS[i]})).collect();
    std::fs::write(root.join("meta/tasks.jsonl"), lines(tasks)).unwrap();
    let episodes =
        (0..2).map(|i| serde_json::json!({"episode_index": i, "tasks": [TASKS[i]], "length": LENGTHS[i]})).collect();
    std::fs::write(root.join("meta/episodes.jsonl"), lines(episodes)).unwrap();
    for episode in 0..2 {
        write_table(&table_path(root, episode), episode, LENGTHS[..episode].iter().sum(), STATE_DIM);
        for (camera_idx, camera) in CAMERAS.iter().enumerate() {
            write_video(&video_path(root, episode, camera), episode, camera_idx);
        }
    }
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
    write_dataset(&raw);
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
                // H.264 at CRF 12 over flat colours, yuv420p chroma and the resize blur only the
                // middle columns; a neighbouring step's frame is 45 or more away.
                assert!(mad < 10.0, "episode {episode} step {step} camera {camera}: mean |difference| {mad:.1}");
            }
        }
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
        write_dataset(&raw);
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
    write_table(&table_path(&raw, 1), 1, LENGTHS[0], STATE_DIM + 1);
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
    write_video(&video_path(&raw, 1, "front"), 0, 0);
    let err = prepare_error(&raw);
    assert!(err.contains("observation.images.front/episode_000001.mp4") && err.contains("5 frames"), "{err}");

    let raw = fresh("keep-encoded");
    let config = PrepEpisodesConfig { keep_encoded: true, ..PrepEpisodesConfig::default() };
    let err = prepare_episodes(&raw, &config, &dir.path().join("encoded")).unwrap_err().to_string();
    assert!(err.contains("keep_encoded") && err.contains("LeRobot"), "{err}");
}
