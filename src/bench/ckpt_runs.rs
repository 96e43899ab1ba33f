//! The runs of `stoke bench ckpt`: one `stoke train` process per run (background checkpoints,
//! synchronous saves, none, or none with raw disk writes beside it), what each measured, a resume
//! of a finished run, and the PyTorch peer on the same state.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use serde_json::Value;

use super::limits::direct_write_bandwidth;

/// A state of about 100 M parameters (1.2 GB with AdamW's two moments) whose steps are short:
/// wide layers, a short context, one sequence per step.
const STATE_SHAPE: &[&str] = &[
    "model.n_layer=8",
    "model.d_model=1024",
    "model.n_head=8",
    "model.seq_len=32",
    "train.micro_batch=1",
    "train.precision=fp32",
    "train.warmup_steps=2",
    // The monitors' pass every tenth step is the same on every side and only adds noise here.
    "train.monitor_every=0",
];

/// What `stoke bench ckpt` runs.
#[derive(Debug, Clone)]
pub struct CkptBench {
    /// Working folder: the runs, the disk test file, the peers' files.
    pub dir: PathBuf,
    /// Pairs of runs (background, synchronous), interleaved.
    pub pairs: usize,
    /// Checkpoints each run writes (at least 4).
    pub checkpoints: u64,
    /// Steps between checkpoints.
    pub every: u64,
    /// More overrides for every run.
    pub overrides: Vec<String>,
    /// Python with torch for the peers.
    pub python: PathBuf,
    /// The peers' script.
    pub peer_script: PathBuf,
    /// Run no peer.
    pub no_peers: bool,
    /// The `stoke` binary whose `train` the runs use (default: this one).
    pub trainer: Option<PathBuf>,
    /// Also write the figures as JSON here.
    pub json: Option<PathBuf>,
}

/// What one `stoke train` run measured.
pub struct RunFigures {
    /// ckpt_stall of each checkpoint step, in order, ms.
    pub stalls_ms: Vec<f64>,
    /// (step, wall time in ms) of every step logged.
    pub walls: Vec<(u64, f64)>,
    pub bytes_written: u64,
    pub write_s: f64,
    pub commits: u64,
    pub host_bytes: u64,
    pub wait_s: f64,
    /// Wall time of every step after the first two (warm-up), ms: against a run without
    /// checkpoints, what the checkpoints cost the run in all (their copies, the writer's CPU time
    /// and memory traffic beside the steps, retention).
    pub total_ms: f64,
}

/// The binary whose `train` the runs use: `--trainer`, or this one.
fn trainer(args: &CkptBench) -> anyhow::Result<PathBuf> {
    match &args.trainer {
        Some(path) => Ok(path.clone()),
        None => Ok(std::env::current_exe()?),
    }
}

/// How a benchmark run checkpoints.
#[derive(Clone, Copy, PartialEq)]
pub enum Saves {
    Background,
    Synchronous,
    /// No checkpoints: the reference for the whole-run cost.
    None,
    /// No checkpoints, but the benchmark itself writes as many bytes to the disk (`O_DIRECT`, as
    /// the writer does) each time a background checkpoint's writer would start: what writing the
    /// state beside the steps costs them on this machine, whoever writes it (the disk's floor).
    RawWrites(usize),
}

pub fn run_train(args: &CkptBench, name: &str, saves: Saves) -> anyhow::Result<RunFigures> {
    let background = saves == Saves::Background;
    let checkpoints = matches!(saves, Saves::Background | Saves::Synchronous);
    let run_dir = args.dir.join(name);
    if run_dir.exists() {
        std::fs::remove_dir_all(&run_dir).with_context(|| format!("cannot clear {}", run_dir.display()))?;
    }
    // Two steps past the last checkpoint, which is then not the run's last (a run's last
    // checkpoint is copied at once: there is no next step to copy beside) and has its next step.
    let steps = args.every * args.checkpoints + 2;
    let mut overrides: Vec<String> = STATE_SHAPE.iter().map(|s| s.to_string()).collect();
    overrides.extend([
        format!("run.dir={}", toml::Value::String(args.dir.display().to_string())),
        format!("run.name={name}"),
        format!("train.steps={steps}"),
        format!("ckpt.every={}", if checkpoints { args.every } else { 0 }),
        "ckpt.keep=1".into(),
        "ckpt.at_end=false".into(),
        format!("ckpt.background={background}"),
        "prof.enabled=false".into(),
    ]);
    overrides.extend(args.overrides.iter().cloned());
    let mut cmd = Command::new(trainer(args)?);
    cmd.args(["train", "--quiet"]);
    for o in &overrides {
        cmd.arg("--set").arg(o);
    }
    let out = match saves {
        Saves::RawWrites(bytes) => write_beside(args, cmd, &run_dir.join("metrics.jsonl"), bytes)?,
        _ => cmd.output().with_context(|| format!("cannot run {cmd:?}"))?,
    };
    if !out.status.success() {
        bail!("{name} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let metrics = std::fs::read_to_string(run_dir.join("metrics.jsonl"))?;
    let mut stalls_ms = Vec::new();
    let mut walls = Vec::new();
    for line in metrics.lines() {
        let v: Value = serde_json::from_str(line)?;
        let step = v["step"].as_u64().context("step in metrics")?;
        if step % args.every == 0 && step <= args.every * args.checkpoints {
            stalls_ms.push(v["phases_ms"]["ckpt_stall"].as_f64().context("ckpt_stall in metrics")?);
        }
        walls.push((step, v["step_ms"].as_f64().context("step_ms in metrics")?));
    }
    let total_ms = walls.iter().filter(|&&(step, _)| step > 2).map(|&(_, ms)| ms).sum();
    if !checkpoints {
        return Ok(RunFigures {
            stalls_ms: Vec::new(),
            walls,
            bytes_written: 0,
            write_s: 0.0,
            commits: 0,
            host_bytes: 0,
            wait_s: 0.0,
            total_ms,
        });
    }
    let stats: Value = serde_json::from_str(&std::fs::read_to_string(run_dir.join("checkpoint-stats.json"))?)?;
    let number = |key: &str| stats[key].as_f64().with_context(|| format!("{key} in checkpoint-stats.json"));
    Ok(RunFigures {
        stalls_ms,
        walls,
        bytes_written: number("bytes_written")? as u64,
        write_s: number("write_s")?,
        commits: number("commits")? as u64,
        host_bytes: number("host_bytes")? as u64,
        wait_s: number("wait_s")?,
        total_ms,
    })
}

/// Per checkpoint step k x `every` (k = 1..=`checkpoints`): the wall time of that step and the
/// next (the one whose optimizer saves the state) beyond two steps of `base_ms`, the median step
/// of the same round's run without checkpoints. (Not the same run's other steps: those the
/// background write slows, so a base taken from them hides the stall in the write's cost.)
pub fn wall_excess(walls: &[(u64, f64)], every: u64, checkpoints: u64, base_ms: f64) -> Vec<f64> {
    let wall = |step: u64| walls.iter().find(|&&(s, _)| s == step).map_or(f64::NAN, |&(_, ms)| ms);
    (1..=checkpoints).map(|k| wall(k * every) + wall(k * every + 1) - 2.0 * base_ms).collect()
}

/// The wall time a warm checkpoint's interval (its step and the `every - 1` after it) takes beyond
/// the same steps of `reference` (the run without checkpoints), averaged over checkpoints 3 to
/// the one before last: the first two fault their host buffers in, and the last one's write
/// outlasts the run. Everything a checkpoint costs the steps, wherever it lands, and nothing else.
pub fn warm_cost(walls: &[(u64, f64)], reference: &[(u64, f64)], every: u64, checkpoints: u64) -> f64 {
    let interval = |walls: &[(u64, f64)], k: u64| -> f64 {
        walls.iter().filter(|(step, _)| (k * every..(k + 1) * every).contains(step)).map(|w| w.1).sum()
    };
    let warm = 3..checkpoints;
    let excess: f64 = warm.clone().map(|k| interval(walls, k) - interval(reference, k)).sum();
    excess / warm.count() as f64
}

/// Runs `cmd` (a training run without checkpoints, writing `metrics`), and each time it logs a
/// step k x `every` + 1 (k = 1..=`checkpoints`: when a background checkpoint's writer starts)
/// writes `bytes` to a scratch file with `O_DIRECT` and fsyncs it, as the writer does.
fn write_beside(
    args: &CkptBench,
    mut cmd: Command,
    metrics: &Path,
    bytes: usize,
) -> anyhow::Result<std::process::Output> {
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    let due: Vec<u64> = (1..=args.checkpoints).map(|k| k * args.every + 1).collect();
    let mut written = 0;
    while written < due.len() {
        if child.try_wait()?.is_some() {
            break;
        }
        let logged = std::fs::read_to_string(metrics).unwrap_or_default();
        let last = logged.lines().rev().find_map(|l| serde_json::from_str::<Value>(l).ok()?["step"].as_u64());
        if last.is_some_and(|step| step >= due[written]) {
            direct_write_bandwidth(&args.dir, bytes)?;
            written += 1;
        } else {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    Ok(child.wait_with_output()?)
}

/// Drops the checkpoint's pages from the page cache (they are clean after fsync), so a resume
/// reads from the disk.
fn evict_from_page_cache(folder: &Path) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    for entry in std::fs::read_dir(folder)? {
        let file = std::fs::File::open(entry?.path())?;
        // SAFETY: posix_fadvise only reads the descriptor, which `file` keeps open for the call.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            bail!("posix_fadvise on {} failed: {rc}", folder.display());
        }
    }
    Ok(())
}

/// Resumes the finished run `name` (no steps left): returns (load and verify s, restore s).
pub fn run_resume(args: &CkptBench, name: &str) -> anyhow::Result<(f64, f64)> {
    let run_dir = args.dir.join(name);
    let latest = stoke_ckpt::CheckpointStore::new(run_dir.join("checkpoints")).latest()?.context("a checkpoint")?;
    evict_from_page_cache(&run_dir.join(format!("checkpoints/step-{latest}")))?;
    let mut cmd = Command::new(trainer(args)?);
    cmd.args(["train", "--quiet", "--resume", "--set"])
        .arg(format!("run.dir={}", toml::Value::String(args.dir.display().to_string())))
        .args(["--set", &format!("run.name={name}")]);
    let out = cmd.output().with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!("resume of {name} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let stats: Value = serde_json::from_str(&std::fs::read_to_string(run_dir.join("checkpoint-stats.json"))?)?;
    let resume = &stats["resume"];
    Ok((resume["load_s"].as_f64().context("load_s")?, resume["restore_s"].as_f64().context("restore_s")?))
}

pub fn run_peer(args: &CkptBench, state: &Path) -> anyhow::Result<Value> {
    let out_dir = args.dir.join("peer");
    let mut cmd = Command::new(&args.python);
    cmd.arg(&args.peer_script).arg("--state").arg(state).arg("--out").arg(&out_dir).args(["--repeats", "3"]);
    let out = cmd.output().with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!("peer failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rev().find(|l| l.starts_with('{')).context("the peer printed no JSON line")?;
    Ok(serde_json::from_str(line)?)
}
