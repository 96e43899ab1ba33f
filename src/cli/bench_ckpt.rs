//! `stoke bench ckpt`: what a checkpoint costs the training step, in the background (the copy
//! into host buffers) against a synchronous save of the same state; save throughput against the
//! disk's write bandwidth with fsync, measured in the same run; the time to resume; and PyTorch's
//! `torch.save` and DCP `async_save` of the same state as peers.
//!
//! Background and synchronous runs alternate (A, B, A, B, ...), each its own `stoke train`
//! process writing several checkpoints, with two references in every round: a run without
//! checkpoints, and one beside which the benchmark writes as many bytes to the disk itself
//! (`O_DIRECT`, when the background writer would), whose cost to the steps is the disk's floor on
//! this machine: what writing the state costs any checkpointer here. Figures are the median with
//! min and max over all runs' checkpoints, ratios per round.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{bail, Context};
use serde_json::{json, Value};

use stoke_prof::median;

use super::bench::disk_bandwidth;

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

#[derive(Debug, clap::Args)]
pub struct CkptBenchArgs {
    /// Working folder: the runs, the disk test file, the peers' files.
    #[arg(long, default_value = "runs/bench-ckpt")]
    pub dir: PathBuf,
    /// Pairs of runs (background, synchronous), interleaved.
    #[arg(long, default_value_t = 3)]
    pub pairs: usize,
    /// Checkpoints each run writes (at least 4: the warm figures leave out the first two, whose
    /// host buffers fault in, and the last, whose write outlasts the run).
    #[arg(long, default_value_t = 8)]
    pub checkpoints: u64,
    /// Steps between checkpoints.
    #[arg(long, default_value_t = 6)]
    pub every: u64,
    /// More overrides for every run (for example another model size).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
    /// Python with torch for the peers.
    #[arg(long, default_value = ".stoke/venv/bin/python")]
    pub python: PathBuf,
    #[arg(long, default_value = "benches/peers/ckpt_torch.py")]
    pub peer_script: PathBuf,
    #[arg(long)]
    pub no_peers: bool,
    /// The `stoke` binary whose `train` the runs use (default: this one): to compare two builds
    /// under the same measurement.
    #[arg(long, value_name = "BIN")]
    pub trainer: Option<PathBuf>,
    /// Also write the figures as JSON here.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// What one `stoke train` run measured.
struct RunFigures {
    /// ckpt_stall of each checkpoint step, in order, ms.
    stalls_ms: Vec<f64>,
    /// (step, wall time in ms) of every step logged.
    walls: Vec<(u64, f64)>,
    bytes_written: u64,
    write_s: f64,
    commits: u64,
    host_bytes: u64,
    wait_s: f64,
    /// Wall time of every step after the first two (warm-up), ms: against a run without
    /// checkpoints, what the checkpoints cost the run in all (their copies, the writer's CPU time
    /// and memory traffic beside the steps, retention).
    total_ms: f64,
}

/// The binary whose `train` the runs use: `--trainer`, or this one.
fn trainer(args: &CkptBenchArgs) -> anyhow::Result<PathBuf> {
    match &args.trainer {
        Some(path) => Ok(path.clone()),
        None => Ok(std::env::current_exe()?),
    }
}

/// How a benchmark run checkpoints.
#[derive(Clone, Copy, PartialEq)]
enum Saves {
    Background,
    Synchronous,
    /// No checkpoints: the reference for the whole-run cost.
    None,
    /// No checkpoints, but the benchmark itself writes as many bytes to the disk (`O_DIRECT`, as
    /// the writer does) each time a background checkpoint's writer would start: what writing the
    /// state beside the steps costs them on this machine, whoever writes it (the disk's floor).
    RawWrites(usize),
}

fn run_train(args: &CkptBenchArgs, name: &str, saves: Saves) -> anyhow::Result<RunFigures> {
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
fn wall_excess(walls: &[(u64, f64)], every: u64, checkpoints: u64, base_ms: f64) -> Vec<f64> {
    let wall = |step: u64| walls.iter().find(|&&(s, _)| s == step).map_or(f64::NAN, |&(_, ms)| ms);
    (1..=checkpoints).map(|k| wall(k * every) + wall(k * every + 1) - 2.0 * base_ms).collect()
}

/// The wall time a warm checkpoint's interval (its step and the `every - 1` after it) takes beyond
/// the same steps of `reference` (the run without checkpoints), averaged over checkpoints 3 to
/// the one before last: the first two fault their host buffers in, and the last one's write
/// outlasts the run. Everything a checkpoint costs the steps, wherever it lands, and nothing else.
fn warm_cost(walls: &[(u64, f64)], reference: &[(u64, f64)], every: u64, checkpoints: u64) -> f64 {
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
    args: &CkptBenchArgs,
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

/// The disk's limit without the page cache: `bytes` written with `O_DIRECT` from one page-aligned
/// buffer in 32 MiB blocks, then fsynced (the way the checkpoint writer writes). Bytes per second.
fn direct_write_bandwidth(dir: &Path, bytes: usize) -> anyhow::Result<f64> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    const BLOCK: usize = 32 << 20;
    let block = stoke_ckpt::AlignedBlock::zeroed(BLOCK);
    let path = dir.join(".stoke-disk-test-direct");
    let result = (|| -> anyhow::Result<f64> {
        let start = std::time::Instant::now();
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .with_context(|| format!("cannot create {} with O_DIRECT", path.display()))?;
        let mut written = 0;
        while written < bytes {
            f.write_all(&block)?;
            written += BLOCK;
        }
        f.sync_all()?;
        Ok(written as f64 / start.elapsed().as_secs_f64())
    })();
    let _ = std::fs::remove_file(&path);
    result
}

/// The memory limit on a snapshot's copy, measured beside the runs: `bytes` copied between two
/// warm buffers by `stream_copy` on the intra-op threads (what the trainer's snapshot uses), and
/// by one thread's memcpy. Returns (stream, memcpy) in copied bytes per second, best of three.
fn copy_bandwidth(bytes: usize) -> (f64, f64) {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let threads = tch::get_num_threads().max(1) as usize;
    let (mut stream, mut plain) = (0f64, 0f64);
    for _ in 0..3 {
        let start = std::time::Instant::now();
        stoke_ckpt::stream_copy(&mut dst, &src, threads);
        stream = stream.max(bytes as f64 / start.elapsed().as_secs_f64());
        let start = std::time::Instant::now();
        dst.copy_from_slice(&src);
        plain = plain.max(bytes as f64 / start.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    (stream, plain)
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
fn run_resume(args: &CkptBenchArgs, name: &str) -> anyhow::Result<(f64, f64)> {
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

fn run_peer(args: &CkptBenchArgs, state: &Path) -> anyhow::Result<Value> {
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

/// (median, min, max).
fn spread(values: &[f64]) -> (f64, f64, f64) {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    let mid = v.len() / 2;
    let median = if v.len() % 2 == 0 { 0.5 * (v[mid - 1] + v[mid]) } else { v[mid] };
    (median, v[0], v[v.len() - 1])
}

fn row(name: &str, unit: &str, values: &[f64]) -> Value {
    let (median, min, max) = spread(values);
    println!("| {name} | {median:.4} | {min:.4} | {max:.4} | {unit} | {} |", values.len());
    json!({ "name": name, "unit": unit, "median": median, "min": min, "max": max, "n": values.len() })
}

pub fn run(args: CkptBenchArgs) -> anyhow::Result<ExitCode> {
    std::fs::create_dir_all(&args.dir)?;
    let (mut disk, mut async_steady, mut async_first, mut sync_save) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut sync_tput, mut async_tput, mut load_s, mut restore_s) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut state_bytes, mut host_bytes, mut waits) = (0u64, 0u64, Vec::new());
    let (mut copy_stream, mut copy_plain, mut disk_direct) = (Vec::new(), Vec::new(), Vec::new());
    let (mut async_excess, mut sync_excess) = (Vec::new(), Vec::new());
    let (mut async_run, mut sync_run) = (Vec::new(), Vec::new());
    let (mut async_warm, mut sync_warm, mut raw_warm) = (Vec::new(), Vec::new(), Vec::new());
    if args.checkpoints < 4 {
        bail!("--checkpoints must be at least 4: the first two are cold, the last is cut off by the run's end");
    }
    for pair in 0..args.pairs {
        let a = run_train(&args, &format!("async-{pair}"), Saves::Background)?;
        let b = run_train(&args, &format!("sync-{pair}"), Saves::Synchronous)?;
        let none = run_train(&args, &format!("none-{pair}"), Saves::None)?;
        state_bytes = b.bytes_written / b.commits.max(1);
        let raw = run_train(&args, &format!("raw-{pair}"), Saves::RawWrites(state_bytes as usize))?;
        let per_checkpoint = |run: &RunFigures| (run.total_ms - none.total_ms) / args.checkpoints as f64;
        async_run.push(per_checkpoint(&a));
        sync_run.push(per_checkpoint(&b));
        async_warm.push(warm_cost(&a.walls, &none.walls, args.every, args.checkpoints));
        sync_warm.push(warm_cost(&b.walls, &none.walls, args.every, args.checkpoints));
        raw_warm.push(warm_cost(&raw.walls, &none.walls, args.every, args.checkpoints));
        let none_step = median(&none.walls.iter().filter(|w| w.0 > 2).map(|w| w.1).collect::<Vec<_>>());
        let (a_excess, b_excess) = (
            wall_excess(&a.walls, args.every, args.checkpoints, none_step),
            wall_excess(&b.walls, args.every, args.checkpoints, none_step),
        );
        let (write, _) = disk_bandwidth(&args.dir, state_bytes as usize)?;
        disk.push(write / 1e9);
        disk_direct.push(direct_write_bandwidth(&args.dir, state_bytes as usize)? / 1e9);
        let (stream, plain) = copy_bandwidth(state_bytes as usize);
        copy_stream.push(stream / 1e9);
        copy_plain.push(plain / 1e9);
        // The first snapshot into each of the two host buffers faults its pages in; later ones reuse them.
        let cold = a.stalls_ms.len().min(2);
        async_first.extend_from_slice(&a.stalls_ms[..cold]);
        async_steady.extend_from_slice(&a.stalls_ms[cold..]);
        sync_save.extend_from_slice(&b.stalls_ms);
        async_excess.extend_from_slice(&a_excess[cold..]);
        sync_excess.extend_from_slice(&b_excess);
        sync_tput.push(b.bytes_written as f64 / b.write_s / 1e9);
        async_tput.push(a.bytes_written as f64 / a.write_s / 1e9);
        host_bytes = a.host_bytes;
        waits.push(a.wait_s * 1e3);
        let (load, restore) = run_resume(&args, &format!("sync-{pair}"))?;
        load_s.push(load);
        restore_s.push(restore);
        // Each run keeps a checkpoint of the whole state: keep only the last one (the peers' input).
        std::fs::remove_dir_all(args.dir.join(format!("async-{pair}")))?;
        std::fs::remove_dir_all(args.dir.join(format!("none-{pair}")))?;
        std::fs::remove_dir_all(args.dir.join(format!("raw-{pair}")))?;
        if pair + 1 < args.pairs {
            std::fs::remove_dir_all(args.dir.join(format!("sync-{pair}")))?;
        }
        println!(
            "round {pair}: background stalls {:?} ms (wall excess {:?}; whole run {:.0} ms a checkpoint, warm {:.0}), synchronous saves {:?} ms (wall excess {:?}; whole run {:.0} ms a checkpoint, warm {:.0}), raw writes beside a run without checkpoints: warm {:.0} ms a write; step {:.1} ms without checkpoints; disk {:.2} GB/s",
            a.stalls_ms.iter().map(|v| v.round()).collect::<Vec<_>>(),
            a_excess.iter().map(|v| v.round()).collect::<Vec<_>>(),
            async_run[pair],
            async_warm[pair],
            b.stalls_ms.iter().map(|v| v.round()).collect::<Vec<_>>(),
            b_excess.iter().map(|v| v.round()).collect::<Vec<_>>(),
            sync_run[pair],
            sync_warm[pair],
            raw_warm[pair],
            none_step,
            write / 1e9
        );
    }
    println!(
        "\nstate: {:.1} MB per checkpoint (model and AdamW moments, fp32); host buffers {:.1} MB",
        state_bytes as f64 / 1e6,
        host_bytes as f64 / 1e6
    );
    println!("\n| figure | median | min | max | unit | n |\n|---|---|---|---|---|---|");
    let mut rows = vec![
        row(
            "background checkpoint: wall time of its step and the next beyond two steps of the run without checkpoints (warm)",
            "ms",
            &async_excess,
        ),
        row(
            "synchronous save: wall time of its step and the next beyond two steps of the run without checkpoints",
            "ms",
            &sync_excess,
        ),
        row(
            "background checkpoint: the whole run's wall time beyond a run without checkpoints, per checkpoint",
            "ms",
            &async_run,
        ),
        row(
            "synchronous save: the whole run's wall time beyond a run without checkpoints, per checkpoint",
            "ms",
            &sync_run,
        ),
        row(
            "background checkpoint: wall time of a warm checkpoint's interval beyond the run without checkpoints'",
            "ms",
            &async_warm,
        ),
        row("synchronous save: the same, per warm interval", "ms", &sync_warm),
        row(
            "raw O_DIRECT write of the state beside a run without checkpoints: the same, per warm interval (the disk's floor)",
            "ms",
            &raw_warm,
        ),
        row("background checkpoint: ckpt_stall phase (warm host buffers)", "ms", &async_steady),
        row("background checkpoint: step stall, first two (buffers faulted in)", "ms", &async_first),
        row("background: back-pressure waits per run", "ms", &waits),
        row("synchronous save of the same state: step stall", "ms", &sync_save),
        row("synchronous save throughput (write, fsync, commit)", "GB/s", &sync_tput),
        row("background save throughput (beside training)", "GB/s", &async_tput),
        row("disk write with fsync, same size, same run", "GB/s", &disk),
        row("disk write with O_DIRECT and fsync, same size, same run", "GB/s", &disk_direct),
        row("copy of as many bytes into a warm buffer: stream_copy, intra-op threads", "GB/s", &copy_stream),
        row("copy of as many bytes into a warm buffer: memcpy, one thread", "GB/s", &copy_plain),
        row("resume: load and verify (page cache dropped)", "s", &load_s),
        row("resume: restore into the model", "s", &restore_s),
    ];
    // The stall is the wall time a checkpoint costs the run, so that a copy moved beside the next
    // step counts with the cores it takes from it; the synchronous save is measured the same way.
    let (stall, _, _) = spread(&async_excess);
    let (save, _, _) = spread(&sync_excess);
    let (phase_stall, _, _) = spread(&async_steady);
    let (phase_save, _, _) = spread(&sync_save);
    let (tput, _, _) = spread(&sync_tput);
    let (disk_median, _, _) = spread(&disk);
    let stall_ratio = stall / save;
    // Per round, so each ratio's two runs are neighbours in time.
    let run_ratios: Vec<f64> = async_run.iter().zip(&sync_run).map(|(a, s)| a / s).collect();
    let (run_ratio, run_ratio_min, run_ratio_max) = spread(&run_ratios);
    let warm_ratios: Vec<f64> = async_warm.iter().zip(&sync_warm).map(|(a, s)| a / s).collect();
    let (warm_ratio, warm_ratio_min, warm_ratio_max) = spread(&warm_ratios);
    // What stoke adds beyond the disk's floor (the same bytes written beside the same steps).
    let own_ratios: Vec<f64> =
        async_warm.iter().zip(&raw_warm).zip(&sync_warm).map(|((a, r), s)| (a - r) / s).collect();
    let (own_ratio, own_ratio_min, own_ratio_max) = spread(&own_ratios);
    let floor_ratios: Vec<f64> = raw_warm.iter().zip(&sync_warm).map(|(r, s)| r / s).collect();
    let (floor_ratio, _, _) = spread(&floor_ratios);
    let tput_ratio = tput / disk_median;
    let (direct_median, _, _) = spread(&disk_direct);
    let (copy_median, _, _) = spread(&copy_stream);
    // The least a snapshot's copy can cost: the state copied at the memory's measured speed.
    let stall_floor_ratio = (state_bytes as f64 / 1e9 / copy_median * 1e3) / save;
    println!(
        "\nstall / synchronous save, in wall time: {:.1}% (target at most 5%: {}; in ckpt_stall phases: {:.1}%); save throughput / disk: {:.0}% (target at least 70%: {})",
        100.0 * stall_ratio,
        if stall_ratio <= 0.05 { "met" } else { "NOT met" },
        100.0 * phase_stall / phase_save,
        100.0 * tput_ratio,
        if tput_ratio >= 0.7 { "met" } else { "NOT met" }
    );
    println!(
        "whole-run cost, background / synchronous, per round: {:.1}% ({:.1}-{:.1}%; everything a checkpoint costs the run: the copy and its CRC-32s, the writer's CPU time and memory traffic beside the steps, retention)",
        100.0 * run_ratio,
        100.0 * run_ratio_min,
        100.0 * run_ratio_max
    );
    println!(
        "warm checkpoints' whole-run cost, background / synchronous, per round: {:.1}% ({:.1}-{:.1}%); of which the disk's floor (the same bytes written raw beside the same steps) {:.1}%; stoke's own beyond that floor: {:.1}% ({:.1}-{:.1}%)",
        100.0 * warm_ratio,
        100.0 * warm_ratio_min,
        100.0 * warm_ratio_max,
        100.0 * floor_ratio,
        100.0 * own_ratio,
        100.0 * own_ratio_min,
        100.0 * own_ratio_max
    );
    println!(
        "save throughput / O_DIRECT disk write: {:.0}%; the copy alone at the measured copy speed would be {:.1}% of the synchronous save (the floor of the first ratio)",
        100.0 * tput / direct_median,
        100.0 * stall_floor_ratio
    );
    // The write path alone, tightly interleaved with the raw disk figure: the last run's state,
    // saved through the store (serialize, CRC-32, write, fsync, commit), against the same bytes
    // written in 4 MiB blocks and fsynced.
    let last = args.dir.join(format!("sync-{}", args.pairs - 1)).join("checkpoints");
    let latest = stoke_ckpt::CheckpointStore::new(&last).latest()?.context("a checkpoint")?;
    let loaded = stoke_ckpt::CheckpointStore::new(&last).load(latest)?;
    let files: Vec<(&str, &[stoke_ckpt::TensorRecord])> =
        loaded.files.iter().map(|(stem, records)| (stem.as_str(), records.as_slice())).collect();
    let scratch = stoke_ckpt::CheckpointStore::new(args.dir.join("write-path"));
    let (mut save_tput, mut raw_tput) = (Vec::new(), Vec::new());
    for round in 0..args.pairs.max(3) {
        let (write, _) = disk_bandwidth(&args.dir, state_bytes as usize)?;
        raw_tput.push(write / 1e9);
        let start = std::time::Instant::now();
        scratch.save(round as u64, &files, loaded.manifest.meta.clone())?;
        save_tput.push(state_bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
        scratch.delete(round as u64)?;
    }
    drop(loaded);
    println!("\nthe write path alone, interleaved (store save, raw write):");
    println!("| figure | median | min | max | unit | n |\n|---|---|---|---|---|---|");
    rows.push(row("store save of the state (CRC-32, write, fsync, commit)", "GB/s", &save_tput));
    rows.push(row("raw write of as many bytes in 4 MiB blocks, fsync", "GB/s", &raw_tput));
    let ratios: Vec<f64> = save_tput.iter().zip(&raw_tput).map(|(s, r)| s / r).collect();
    rows.push(row("store save / raw write, per round", "ratio", &ratios));
    let (write_path_ratio, _, _) = spread(&ratios);
    println!(
        "store save / raw disk write, same bytes, interleaved: {:.0}% (target at least 70%: {})",
        100.0 * write_path_ratio,
        if write_path_ratio >= 0.7 { "met" } else { "NOT met" }
    );

    let mut peer = Value::Null;
    if !args.no_peers {
        peer = run_peer(&args, &last.join(format!("step-{latest}")))?;
        let seconds = |key: &str| -> Vec<f64> {
            peer[key].as_array().map(|a| a.iter().filter_map(Value::as_f64).collect()).unwrap_or_default()
        };
        println!(
            "\nPyTorch {} on the same state ({:.1} MB):",
            peer["torch"],
            peer["bytes"].as_f64().unwrap_or(0.0) / 1e6
        );
        println!("| figure | median | min | max | unit | n |\n|---|---|---|---|---|---|");
        let ms = |v: Vec<f64>| v.iter().map(|s| s * 1e3).collect::<Vec<_>>();
        rows.push(row("torch.save + fsync", "ms", &ms(seconds("torch_save_s"))));
        rows.push(row("DCP async_save: stall until it returns", "ms", &ms(seconds("dcp_async_stall_s"))));
        rows.push(row("DCP async_save: until written", "ms", &ms(seconds("dcp_async_total_s"))));
    }
    if let Some(path) = &args.json {
        let out = json!({
            "state_bytes": state_bytes, "host_bytes": host_bytes, "rows": rows,
            "stall_over_sync_save": stall_ratio, "ckpt_stall_phase_over_sync_save": phase_stall / phase_save,
            "whole_run_over_sync_save": run_ratio,
            "warm_whole_run_over_sync_save": warm_ratio, "disk_floor_over_sync_save": floor_ratio,
            "own_beyond_disk_floor_over_sync_save": own_ratio,
            "save_throughput_over_disk": tput_ratio,
            "save_throughput_over_direct_disk": tput / direct_median, "copy_floor_over_sync_save": stall_floor_ratio,
            "write_path_over_raw_write": write_path_ratio, "peer": peer,
        });
        std::fs::write(path, serde_json::to_string_pretty(&out)? + "\n")?;
    }
    Ok(ExitCode::SUCCESS)
}
