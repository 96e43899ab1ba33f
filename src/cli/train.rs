//! `stoke train`: resolve the config, prepare the run folder, build the data source, train.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;

use anyhow::Context;
use stoke_ckpt::{CheckpointStore, CheckpointWriter, Loaded, WriterConfig};
use stoke_comm::{Backend, CommConfig, CommunicatorExt, DistEnv};
use stoke_data::BatchSource;
use stoke_train::{CheckpointTarget, DataParallel, NoHooks, Observer, Trainer};

use super::UsageError;
use crate::config::StokeConfig;
use crate::observe::{MetricsWriter, Progress};
use crate::profiler::{Overhead, OverheadProbe, Peaks, Profiler};
use crate::signals::EXIT_PREEMPTED;

#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Train on this text file (byte-level tokens) instead of the built-in corpus; same as
    /// `--set data.path=PATH`.
    #[arg(long, value_name = "PATH")]
    pub data: Option<PathBuf>,
    /// Continue the named run (run.name; default: the most recent run) from its latest checkpoint,
    /// with the configuration saved in it (`--set` may change only keys that keep the trajectory).
    #[arg(long)]
    pub resume: bool,
    /// With --resume: when the latest checkpoint fails its checks, resume from the newest one
    /// before it that passes.
    #[arg(long, requires = "resume")]
    pub fallback: bool,
    /// No progress bar (for logs and tests).
    #[arg(long)]
    pub quiet: bool,
    /// Do not train: find the largest train.micro_batch whose step fits the memory budget (CPU),
    /// with the configured train.recompute, and print it.
    #[arg(long)]
    pub find_batch: bool,
    /// The budget for --find-batch, in bytes (suffixes K, M, G, T for powers of 1024). Default:
    /// 80% of the memory available now.
    #[arg(long, value_name = "BYTES", requires = "find_batch")]
    pub memory_budget: Option<String>,
}

/// The config file and overrides, shared by every subcommand that runs a configuration.
#[derive(Debug, clap::Args)]
pub struct ConfigArgs {
    /// A TOML file with the keys to change (see `stoke config --defaults`).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Override one key: `--set train.steps=20` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
}

impl ConfigArgs {
    pub fn load(&self, extra: &[String]) -> anyhow::Result<StokeConfig> {
        let mut overrides = self.overrides.clone();
        overrides.extend_from_slice(extra);
        StokeConfig::load(self.config.as_deref(), &overrides).map_err(|e| anyhow::Error::new(UsageError(e.to_string())))
    }
}

pub fn run(args: TrainArgs) -> anyhow::Result<ExitCode> {
    let mut extra = Vec::new();
    if let Some(data) = &args.data {
        extra.push(format!("data.path={}", toml::Value::String(data.display().to_string())));
    }
    if args.find_batch {
        return super::find_batch::run(&args.config.load(&extra)?, args.memory_budget.as_deref());
    }
    let stop = crate::signals::install();
    // The only place that reads the launcher's variables: no variables is one process, as before.
    let vars: std::collections::HashMap<String, String> = std::env::vars().collect();
    let env = DistEnv::from_vars(&vars).context("reading the launcher's rank and world variables")?;
    let mut dist = if env.world_size > 1 {
        let config = args.config.load(&extra)?;
        let mut dist = connect(&config, &env)?;
        check_agreement(&dist, &config)?;
        // Every rank must train in the same run folder: rank 0 names it.
        let name = agree_run_name(&mut dist, &args.config, &extra, args.resume)?;
        extra.push(format!("run.name={}", toml::Value::String(name)));
        Some(dist)
    } else {
        None
    };
    let writer = dist.as_ref().is_none_or(|d| d.rank() == 0);
    let (mut config, run_dir, resume) = if args.resume {
        let (config, run_dir, loaded) = prepare_resume(&args.config, &extra, args.fallback, writer)?;
        (config, run_dir, Some(loaded))
    } else {
        let mut config = args.config.load(&extra)?;
        let run_dir = if writer {
            prepare_run_dir(&mut config, false)?
        } else {
            PathBuf::from(&config.run.dir).join(&config.run.name)
        };
        (config, run_dir, None)
    };
    if writer {
        super::launch::Heartbeat::name_run(&run_dir)?;
    }
    config.prof.prometheus_port = metrics_port(config.prof.prometheus_port, env.local_rank)?;
    let progress = !args.quiet && writer;
    let (summary, _report, _) = train_probed(&config, &run_dir, resume, progress, stop, None, dist.as_mut())?;
    if !writer {
        return Ok(if summary.interrupted { ExitCode::from(EXIT_PREEMPTED) } else { ExitCode::SUCCESS });
    }
    println!(
        "\n{} {} steps in {:.1}s | {:.0} tokens/s over the wall time | loss: first {:.4}, final {:.4}, best {:.4} | run: {}",
        if summary.interrupted { "interrupted after" } else { "done:" },
        summary.steps_run,
        summary.wall_s,
        summary.tokens_per_s,
        summary.first_loss,
        summary.final_loss,
        summary.best_loss,
        run_dir.display()
    );
    if summary.early_stopped {
        let best = summary
            .best_eval
            .map_or(String::new(), |(step, loss)| format!("; best evaluation loss {loss:.4} at step {step}"));
        println!("early stopping: the evaluation loss stopped improving (eval.patience){best}");
    }
    if summary.interrupted {
        let signal = crate::signals::received().map(|s| format!(" by signal {s}")).unwrap_or_default();
        eprintln!(
            "stoke: stopped{signal} with a checkpoint at step {}; continue with `stoke train --resume --set run.name={}` \
             (exit code {EXIT_PREEMPTED}: preempted, resumable)",
            summary.last_step, config.run.name
        );
        return Ok(ExitCode::from(EXIT_PREEMPTED));
    }
    Ok(ExitCode::SUCCESS)
}

/// Joins the data-parallel job described by `env` with the `[dist]` settings of `config`, and
/// gives this rank's libtorch `threads_per_worker` threads unless `train.threads` is set.
fn connect(config: &crate::config::StokeConfig, env: &DistEnv) -> anyhow::Result<DataParallel> {
    let dist = &config.dist;
    let comm_config = CommConfig {
        backend: Backend::parse(&dist.backend).map_err(|e| UsageError(format!("config key `dist.backend`: {e}")))?,
        timeout_s: dist.timeout_s,
        shm_dir: PathBuf::from(&dist.shm_dir),
        ..CommConfig::default()
    };
    if config.train.threads == 0 {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
        tch::set_num_threads(stoke_comm::threads_per_worker(cores, env.local_world_size) as i32);
    }
    let comm = stoke_comm::connect(&comm_config, env)
        .with_context(|| format!("rank {} of {} cannot join the {} job", env.rank, env.world_size, dist.backend))?;
    Ok(DataParallel::new(comm, dist.data_parallel()))
}

/// The start-up check: every rank must run the same model and configuration (but for per-rank
/// keys); a mismatch fails every rank with exit code 2, naming the ranks and keys that differ.
fn check_agreement(dist: &DataParallel, config: &StokeConfig) -> anyhow::Result<()> {
    match dist.check_agreement(&config.agreement_entries()) {
        Err(e @ stoke_train::TrainError::RanksDisagree { .. }) => Err(UsageError(e.to_string()).into()),
        other => Ok(other?),
    }
}

/// The port of this process's `/metrics`: `prof.prometheus_port` + its local rank, so that the
/// ranks on one machine serve side by side (0 stays 0: each picks a free port).
fn metrics_port(base: u16, local_rank: usize) -> anyhow::Result<u16> {
    if base == 0 {
        return Ok(0);
    }
    u16::try_from(base as usize + local_rank).map_err(|_| {
        anyhow::Error::new(UsageError(format!(
            "prof.prometheus_port {base} + local rank {local_rank} is past the last port (65535); choose a lower prof.prometheus_port"
        )))
    })
}

/// The run name all ranks use: rank 0's (made up there when run.name is empty), broadcast.
fn agree_run_name(
    dist: &mut DataParallel,
    args: &ConfigArgs,
    extra: &[String],
    resume: bool,
) -> anyhow::Result<String> {
    const MAX: usize = 1024;
    let mut buf = vec![0u8; MAX + 2];
    if dist.rank() == 0 {
        let mut config = args.load(extra)?;
        if config.run.name.is_empty() {
            locate_run(&mut config, resume)?;
        }
        let name = config.run.name.as_bytes();
        anyhow::ensure!(name.len() <= MAX, "run.name is longer than {MAX} bytes");
        buf[..2].copy_from_slice(&(name.len() as u16).to_le_bytes());
        buf[2..2 + name.len()].copy_from_slice(name);
    }
    dist.communicator()
        .broadcast(&mut buf, 0)
        .with_context(|| format!("rank {}: broadcast of run.name", dist.rank()))?;
    let len = (u16::from_le_bytes([buf[0], buf[1]]) as usize).min(MAX);
    Ok(String::from_utf8_lossy(&buf[2..2 + len]).into_owned())
}

/// Picks the run's name and folder, and writes the resolved config there.
pub(super) fn prepare_run_dir(config: &mut StokeConfig, resume: bool) -> anyhow::Result<PathBuf> {
    let run_dir = locate_run(config, resume)?;
    std::fs::create_dir_all(&run_dir).with_context(|| format!("cannot create run folder {}", run_dir.display()))?;
    write_config(config, &run_dir)?;
    Ok(run_dir)
}

fn write_config(config: &StokeConfig, run_dir: &Path) -> anyhow::Result<()> {
    let config_path = run_dir.join("config.toml");
    std::fs::write(&config_path, config.to_toml()).with_context(|| format!("cannot write {}", config_path.display()))
}

/// The run's folder: named by run.name (made up for a fresh run, the most recent run with a
/// checkpoint for a resume); a fresh run must not find checkpoints there, a resume must.
fn locate_run(config: &mut StokeConfig, resume: bool) -> anyhow::Result<PathBuf> {
    let runs = PathBuf::from(&config.run.dir);
    if config.run.name.is_empty() {
        config.run.name = if resume {
            most_recent_run(&runs)?.ok_or_else(|| {
                UsageError(format!(
                    "--resume: no run with a checkpoint in {}; name one with --set run.name=NAME",
                    runs.display()
                ))
            })?
        } else {
            format!("{}-{}", config.model.preset, timestamp())
        };
    }
    let run_dir = runs.join(&config.run.name);
    let store = CheckpointStore::new(run_dir.join("checkpoints"));
    let latest = store.latest()?;
    match (resume, latest) {
        (true, None) if config.ckpt.mirror.is_empty() => {
            return Err(UsageError(format!("--resume: run {} has no checkpoint to resume from", run_dir.display())).into())
        }
        (false, Some(step)) => {
            return Err(UsageError(format!(
                "run {} already has checkpoints (latest step {step}); pass --resume to continue it, or choose another run.name",
                run_dir.display()
            ))
            .into())
        }
        _ => {}
    }
    Ok(run_dir)
}

/// Keys a resume may change: they leave the sequence of losses as it was. `train.steps` extends
/// or shortens the run (the schedule's horizon is kept unless `train.lr_horizon` is set too), as
/// early stopping's settings may; `train.debug_poison_step` may be cleared to continue past it;
/// run placement, logging, profiling, checkpointing, loader threads and the cache are not part
/// of the trajectory (the batches are a function of the data position alone).
fn resume_may_change(key: &str) -> bool {
    let section = key.split('.').next().unwrap_or("");
    matches!(section, "prof" | "ckpt" | "dist")
        || matches!(
            key,
            "run.name"
                | "run.dir"
                | "train.steps"
                | "train.lr_horizon"
                | "train.log_every"
                | "train.host_memory"
                | "train.debug_poison_step"
                | "train.monitor_every"
                | "train.spike_window"
                | "eval.batches"
                | "eval.patience"
                | "eval.min_delta"
                | "eval.keep_best"
                | "data.workers"
                | "data.prefetch"
                | "data.cache_dir"
                | "data.cache_budget_bytes"
        )
}

/// `--resume`: the run's newest good checkpoint, and the config saved in it with the command
/// line's changes, which may touch only `resume_may_change` keys.
fn prepare_resume(
    args: &ConfigArgs,
    extra: &[String],
    fallback: bool,
    writer: bool,
) -> anyhow::Result<(StokeConfig, PathBuf, Resume)> {
    // The command line names the run (run.dir, run.name); the checkpoint holds its config.
    let mut located = args.load(extra)?;
    let run_dir = locate_run(&mut located, true)?;
    let store = CheckpointStore::new(run_dir.join("checkpoints"));
    let (tier, fetch_s) = fetch_from_mirror(&store, &located.ckpt.mirror)?;
    let start = std::time::Instant::now();
    let loaded = pick_checkpoint(&store, fallback)?;
    let load_s = start.elapsed().as_secs_f64();
    println!("resuming from step {} of the {tier}", loaded.manifest.step);
    let step = loaded.manifest.step;
    let manifest_path = loaded.path.join(stoke_ckpt::MANIFEST);
    let saved_toml = loaded.manifest.meta.get("config_toml").and_then(serde_json::Value::as_str).ok_or_else(|| {
        anyhow::anyhow!(
            "checkpoint {} holds no config (meta.config_toml); it was not written by stoke train",
            manifest_path.display()
        )
    })?;
    let saved: StokeConfig = toml::from_str(saved_toml)
        .with_context(|| format!("the config saved in {} does not parse", manifest_path.display()))?;
    let mut overrides = args.overrides.clone();
    overrides.extend_from_slice(extra);
    let mut config = StokeConfig::load_resumed(&saved, args.config.as_deref(), &overrides)
        .map_err(|e| anyhow::Error::new(UsageError(e.to_string())))?;
    config.run.name = located.run.name.clone();
    config.run.dir = located.run.dir.clone();
    let refused: Vec<String> = saved
        .differing_keys(&config)
        .into_iter()
        .filter(|key| !resume_may_change(key))
        .map(|key| format!("{key} (checkpoint: {}, asked: {})", saved.value_of(&key), config.value_of(&key)))
        .collect();
    if !refused.is_empty() {
        return Err(UsageError(format!(
            "--resume from step {step} of {}: these keys would change the run's trajectory: {}; \
             resume without them, or start a new run",
            run_dir.display(),
            refused.join(", ")
        ))
        .into());
    }
    if config.train.steps != saved.train.steps && config.train.lr_horizon == saved.train.lr_horizon {
        // An extension keeps the schedule of the steps already run.
        config.train.lr_horizon = saved.train.horizon();
    }
    if writer {
        write_config(&config, &run_dir)?;
    }
    Ok((config, run_dir, Resume { loaded, load_s, tier, fetch_s }))
}

/// With a mirror (`ckpt.mirror`): when it holds a newer complete checkpoint than the local folder
/// (or the local folder has none), downloads it into the local folder (committed with the local
/// protocol). Returns the tier the resume reads and the seconds the download took.
fn fetch_from_mirror(store: &CheckpointStore, url: &str) -> anyhow::Result<(String, f64)> {
    let local = store.latest()?;
    if url.is_empty() {
        return Ok(("local tier".into(), 0.0));
    }
    let mirror = stoke_ckpt::MirrorStore::open(url)?;
    // The mirror's latest, when it is newer than the local folder's.
    let Some(remote) = mirror.latest()?.filter(|&r| local.is_none_or(|l| r > l)) else {
        return match local {
            Some(_) => Ok(("local tier".into(), 0.0)),
            None => {
                Err(UsageError(format!("--resume: no checkpoint in {} nor on the mirror {url}", store.dir().display()))
                    .into())
            }
        };
    };
    let start = std::time::Instant::now();
    mirror.download(remote, store)?;
    let fetch_s = start.elapsed().as_secs_f64();
    let had = local.map_or("none".to_string(), |s| format!("step {s}"));
    println!("fetched step {remote} from the mirror {url} in {fetch_s:.2} s (the local tier had {had})");
    Ok((format!("mirror {url}"), fetch_s))
}

/// A checkpoint to resume from, loaded and verified, and how long that took.
pub struct Resume {
    pub loaded: Loaded,
    pub load_s: f64,
    /// The tier the checkpoint came from ("local tier" or "mirror URL").
    pub tier: String,
    /// Seconds spent downloading it from the mirror first (0 from the local tier).
    pub fetch_s: f64,
}

/// The newest checkpoint that loads and verifies; with `fallback`, older ones when it does not.
fn pick_checkpoint(store: &CheckpointStore, fallback: bool) -> anyhow::Result<Loaded> {
    let steps = store.list()?;
    for &step in steps.iter().rev() {
        match store.load(step) {
            Ok(loaded) => return Ok(loaded),
            Err(e) if fallback => eprintln!("stoke: skipping checkpoint step {step}: {e}"),
            Err(e) => {
                return Err(anyhow::Error::new(e).context(format!(
                    "cannot resume from the latest checkpoint (step {step}); \
                     `--resume --fallback` resumes from the newest good one before it"
                )))
            }
        }
    }
    anyhow::bail!("--fallback: none of the {} checkpoints in {} passes its checks", steps.len(), store.dir().display())
}

fn most_recent_run(runs: &Path) -> anyhow::Result<Option<String>> {
    let Ok(entries) = std::fs::read_dir(runs) else { return Ok(None) };
    let mut best: Option<(std::time::SystemTime, String)> = None;
    for entry in entries.flatten() {
        let store = CheckpointStore::new(entry.path().join("checkpoints"));
        let Some(step) = store.latest()? else { continue };
        let manifest = store.step_dir(step).join(stoke_ckpt::MANIFEST);
        let modified = std::fs::metadata(&manifest).and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH);
        if best.as_ref().is_none_or(|(t, _)| modified > *t) {
            best = Some((modified, entry.file_name().to_string_lossy().into_owned()));
        }
    }
    Ok(best.map(|(_, name)| name))
}

/// `YYYYmmdd-HHMMSS` in UTC, from the civil-from-days algorithm (Howard Hinnant).
pub(super) fn timestamp() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The data the config names, as a prefetching loader at the start of its order. Every kind of data
/// (the built-in corpus and text files as byte-level tokens in memory, prepared shards, Megatron and
/// raw token files, remote shards through the cache) goes through the same loader.
/// For rank `rank` of `world_size`: its rows of each global batch (`0, 1` for one process).
pub fn batch_source_for(config: &StokeConfig, rank: usize, world_size: usize) -> anyhow::Result<Box<dyn BatchSource>> {
    Ok(sources_for(config, rank, world_size, false)?.expect("the training part always exists"))
}

/// The held-out split's source when `eval.every` > 0 (one batch at a time, no loader threads).
pub fn eval_source_for(
    config: &StokeConfig,
    rank: usize,
    world_size: usize,
) -> anyhow::Result<Option<Box<dyn BatchSource>>> {
    if config.eval.every == 0 {
        return Ok(None);
    }
    sources_for(config, rank, world_size, true)
}

/// The training part (`held_out` false) or the held-out part of the data; with `eval.every` = 0
/// nothing is held out and the training part is all of it.
fn sources_for(
    config: &StokeConfig,
    rank: usize,
    world_size: usize,
    held_out: bool,
) -> anyhow::Result<Option<Box<dyn BatchSource>>> {
    let shape = config.model.shape()?;
    let data = &config.data;
    let mut datasets = Vec::with_capacity(1 + data.blend.len());
    for (dataset_idx, spec) in std::iter::once(&data.path).chain(&data.blend).enumerate() {
        let store = open_store(config, spec)?;
        if let Some(vocab_size) = store.vocab_size().filter(|&v| v > shape.vocab_size as u64) {
            return Err(anyhow::Error::new(UsageError(format!(
                "data {spec} has a vocabulary of {vocab_size}, the model's (model.vocab_size) is {}",
                shape.vocab_size
            ))));
        }
        let store = if config.eval.every > 0 {
            let min_tokens = ((shape.seq_len + 1) * config.train.micro_batch * world_size) as u64;
            let (train, tail) = store.split_tail(config.eval.holdout, min_tokens).with_context(|| {
                format!("data {spec}: holding out eval.holdout = {} for evaluation", config.eval.holdout)
            })?;
            if held_out {
                tail
            } else {
                train
            }
        } else {
            store
        };
        let weight = data.weights.get(dataset_idx).copied().unwrap_or(1.0);
        datasets.push(stoke_data::WeightedStore { store, weight });
    }
    let loader = stoke_data::LoaderConfig {
        seq_len: shape.seq_len,
        micro_batch: config.train.micro_batch,
        seed: config.train.seed,
        rank,
        world_size,
        n_workers: if held_out { 0 } else { data.workers },
        prefetch_depth: data.prefetch,
        drop_last: data.drop_last,
    };
    Ok(Some(Box::new(stoke_data::Loader::blend(datasets, loader)?)))
}

/// One dataset as a token store: "" is the built-in corpus.
fn open_store(config: &StokeConfig, spec: &str) -> anyhow::Result<stoke_data::TokenStore> {
    let data = &config.data;
    let path = Path::new(spec);
    Ok(if spec.is_empty() {
        let corpus = stoke_data::builtin_corpus(config.train.seed, data.builtin_bytes);
        stoke_data::TokenStore::from_bytes(corpus, "built-in corpus")
    } else if stoke_data::is_remote(spec) {
        let budget_bytes = data.cache_budget_bytes;
        let cache = stoke_data::CacheConfig { dir: data.cache_dir.clone().into(), budget_bytes };
        stoke_data::open_cached(spec, &cache)?.0
    } else if path.is_dir() || path.extension().is_some_and(|e| e == "bin" || e == "idx") {
        stoke_data::TokenStore::open(path)?
    } else {
        stoke_data::TokenStore::from_bytes(stoke_data::read_text_bytes(path)?, spec)
    })
}

/// Runs the configured training in `run_dir`, with the metrics file, the profiler (trace.json,
/// /metrics, report.json, report.html; the step report is printed at the end) and (if `progress`)
/// the progress bar as observers, and with `overhead_block` the profiler's own cost measured in
/// the same run: the profiler sees alternate blocks of that many steps (`OverheadProbe`). With
/// `dist`, a data-parallel rank: rank 0 does all of that, the other ranks write nothing.
pub fn train_probed(
    config: &StokeConfig,
    run_dir: &Path,
    resume: Option<Resume>,
    progress: bool,
    stop: &AtomicBool,
    overhead_block: Option<u64>,
    dist: Option<&mut DataParallel>,
) -> anyhow::Result<(stoke_train::Summary, Option<stoke_prof::RunReport>, Option<Overhead>)> {
    let (summary, report, overhead) = train_inner(config, run_dir, resume, progress, stop, overhead_block, None, dist)?;
    if let Some(report) = &report {
        println!("\n{}", report.render_text());
    }
    Ok((summary, report, overhead))
}

/// A fresh run with one more observer beside the usual ones, no progress bar and no printed
/// report (for `stoke bench gate`).
pub fn train_observed(
    config: &StokeConfig,
    run_dir: &Path,
    stop: &AtomicBool,
    extra: &mut dyn Observer,
) -> anyhow::Result<(stoke_train::Summary, Option<stoke_prof::RunReport>)> {
    let (summary, report, _) = train_inner(config, run_dir, None, false, stop, None, Some(extra), None)?;
    Ok((summary, report))
}

/// A caller's optional observer.
struct MaybeObserver<'a>(Option<&'a mut dyn Observer>);

impl Observer for MaybeObserver<'_> {
    fn on_event(&mut self, event: &stoke_train::TrainEvent<'_>) -> Result<(), stoke_train::ObserverError> {
        match &mut self.0 {
            Some(observer) => observer.on_event(event),
            None => Ok(()),
        }
    }
}

#[allow(clippy::too_many_arguments)] // the three entry points above each fix some of them
fn train_inner(
    config: &StokeConfig,
    run_dir: &Path,
    resume: Option<Resume>,
    progress: bool,
    stop: &AtomicBool,
    overhead_block: Option<u64>,
    extra: Option<&mut dyn Observer>,
    mut dist: Option<&mut DataParallel>,
) -> anyhow::Result<(stoke_train::Summary, Option<stoke_prof::RunReport>, Option<Overhead>)> {
    let mut extra = MaybeObserver(extra);
    let device = stoke_train::parse_device(&config.run.device)?;
    let (rank, world_size) = dist.as_ref().map_or((0, 1), |d| (d.rank(), d.world_size()));
    // The batch-size rule of the learning rate counts every process's rows.
    let train_config = stoke_train::TrainConfig { world_size, ..config.train.for_world(world_size)? };
    let mut trainer = Trainer::new(&config.model, &train_config, &config.ckpt, device)?;
    trainer.set_sync_every(config.prof.sync_every);
    trainer.set_adaptive(&config.adaptive)?;
    if let Some(eval_source) = eval_source_for(config, rank, world_size)? {
        trainer.set_eval(&config.eval, eval_source)?;
    }
    let mut source = batch_source_for(config, rank, world_size)?;
    let resumed_step = resume.as_ref().map(|r| r.loaded.manifest.step);
    if let Some(saved) = resume.as_ref().and_then(|r| r.loaded.manifest.meta.get("world_size")).and_then(|v| v.as_u64())
    {
        if saved as usize != world_size {
            let train = config.train.for_world(world_size)?;
            if config.train.global_batch == 0 {
                eprintln!(
                    "stoke: warning: the checkpoint was written by {saved} rank(s), this run has {world_size}: the global \
                     batch changes from {} to {} sequences (set train.global_batch to keep it)",
                    saved as usize * train.micro_batch * train.grad_accum,
                    world_size * train.micro_batch * train.grad_accum
                );
            } else {
                println!(
                    "resuming on {world_size} rank(s) (checkpoint: {saved}): {} accumulated micro-batches keep the global \
                     batch of {} sequences",
                    train.grad_accum, config.train.global_batch
                );
            }
        }
    }
    let mut resume_stats = serde_json::Value::Null;
    // This rank's compression residuals in the checkpoint (written by a run of the same size).
    let residuals: Vec<(String, Vec<f32>)> = resume
        .as_ref()
        .and_then(|r| r.loaded.files.get("dist"))
        .map(|tensors| {
            let suffix = format!("@rank{rank}");
            tensors
                .iter()
                .filter_map(|t| {
                    let name = t.name.strip_suffix(&suffix)?;
                    let values = t.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                    Some((name.to_string(), values))
                })
                .collect()
        })
        .unwrap_or_default();
    if let Some(Resume { loaded, load_s, tier, fetch_s }) = resume {
        let start = std::time::Instant::now();
        let position = trainer.restore_loaded(&loaded)?;
        source.seek(position);
        let restore_s = start.elapsed().as_secs_f64();
        let bytes = loaded.manifest.total_bytes();
        println!(
            "resumed from step {} ({:.1} MB): loaded and verified in {load_s:.3} s, restored in {restore_s:.3} s",
            loaded.manifest.step,
            bytes as f64 / 1e6
        );
        resume_stats = serde_json::json!({
            "step": loaded.manifest.step,
            "bytes": bytes,
            "tier": tier,
            "fetch_s": fetch_s,
            "load_s": load_s,
            "restore_s": restore_s,
        });
    }
    if let Some(dist) = dist.as_deref_mut() {
        // All ranks start from rank 0's parameters (fresh or restored).
        dist.broadcast_parameters(&trainer)?;
        let how = format!(
            "{} ranks over {}, overlap {}",
            dist.world_size(),
            dist.communicator().backend(),
            if dist.config().overlap { "on" } else { "off" }
        );
        let plan = dist.plan(trainer.model().params())?.to_string();
        dist.load_residual_state(residuals)?;
        if rank == 0 {
            println!("data parallel: {how}; gradients in {plan}");
        }
        dist.shard(&mut trainer)?;
        if rank == 0 && config.dist.zero > 0 {
            println!(
                "ZeRO stage {}: {}",
                config.dist.zero,
                match config.dist.zero {
                    1 => "optimizer state sharded",
                    2 => "optimizer state and gradients sharded",
                    _ => "optimizer state, gradients and parameters sharded",
                }
            );
        }
        if rank != 0 {
            let store = checkpoint_store(config, run_dir, rank, world_size)?;
            return train_other_rank(config, &mut trainer, source.as_mut(), stop, dist, store);
        }
    }
    // Measured after Trainer::new has set the thread count, so the peak is for the run's threads.
    let peaks = Peaks::measure(device, Path::new(&config.run.dir))?;
    let meta = serde_json::json!({ "config_toml": config.to_toml(), "world_size": world_size });
    let store = checkpoint_store(config, run_dir, rank, world_size)?;
    let mirror = match config.ckpt.mirror.as_str() {
        "" => None,
        url => {
            let mirror = stoke_ckpt::Mirror::start(
                stoke_ckpt::MirrorStore::open(url)?,
                &store,
                config.ckpt.mirror_keep,
                config.ckpt.mirror_keep_every,
            )?;
            Some(std::sync::Arc::new(mirror))
        }
    };
    let mut writer = CheckpointWriter::with_mirror(store, writer_config(config), mirror.clone())?;
    if device.is_cuda() {
        // The snapshot's device-to-host copy then goes straight into page-locked memory (DMA).
        writer.pin_host_buffers()?;
    }
    let mut target = CheckpointTarget { writer, meta };
    let mut metrics = MetricsWriter::create(&run_dir.join("metrics.jsonl"), resumed_step)?;
    let mut profiler = Profiler::new(&config.prof, run_dir, &config.run.name, peaks, rank, world_size)?;
    let mut bar = Progress::new(progress);
    let mut heartbeat = super::launch::Heartbeat::from_env(rank);
    let mut no_hooks = NoHooks;
    let hooks: &mut dyn stoke_train::StepHooks = match dist.as_deref_mut() {
        Some(dist) => {
            let (zero, host_ns, offsets) = start_together(dist)?;
            profiler.set_clock_zero(zero, host_ns);
            profiler.set_clock_offsets(offsets);
            dist
        }
        None => &mut no_hooks,
    };
    let rss_start = stoke_train::reset_peak_rss();
    let (summary, overhead) = match overhead_block {
        Some(block) => {
            let mut probe = OverheadProbe::new(&mut profiler, block);
            let mut observers: Vec<&mut dyn Observer> =
                vec![&mut metrics, &mut probe, &mut bar, &mut extra, &mut heartbeat];
            let result = trainer.run_with_hooks(source.as_mut(), &mut observers, Some(&mut target), stop, hooks);
            let summary = with_nan_dump(result, run_dir)?;
            drop(observers);
            (summary, probe.result())
        }
        None => {
            let mut observers: Vec<&mut dyn Observer> =
                vec![&mut metrics, &mut profiler, &mut bar, &mut extra, &mut heartbeat];
            let result = trainer.run_with_hooks(source.as_mut(), &mut observers, Some(&mut target), stop, hooks);
            (with_nan_dump(result, run_dir)?, None)
        }
    };
    bar.finish();
    if let Some(dist) = dist.as_deref() {
        profiler.set_memory(rank_memory(dist, &trainer, rss_start));
    }
    print_checkpoint_stats(&target.writer);
    if let Some(mirror) = &mirror {
        let stats = mirror.finish();
        println!(
            "mirror: {} checkpoints, {:.1} MB uploaded in {:.2} s in the background to {}; {} deleted by ckpt.mirror_keep",
            stats.uploaded,
            stats.bytes as f64 / 1e6,
            stats.upload_s,
            mirror.url(),
            stats.deleted
        );
        if let Some(error) = &stats.error {
            eprintln!("stoke: warning: the mirror stopped after an error (local checkpoints are intact): {error}");
        }
    }
    write_checkpoint_stats(&target.writer, resume_stats, &run_dir.join("checkpoint-stats.json"))?;
    let others = match dist.as_deref() {
        Some(dist) => gather_rank_reports(dist)?,
        None => Vec::new(),
    };
    let report = profiler.finish(others)?;
    Ok((summary, report, overhead))
}

fn writer_config(config: &StokeConfig) -> WriterConfig {
    WriterConfig {
        background: config.ckpt.background,
        buffers: config.ckpt.host_buffers,
        keep: config.ckpt.keep,
        keep_every: config.ckpt.keep_every,
    }
}

/// The run's checkpoint folder as this rank writes it: rank 0 alone, or under ZeRO (`dist.zero`
/// > 0) every rank its own pieces, rank 0 waiting at most `dist.timeout_s` for the others'.
fn checkpoint_store(
    config: &StokeConfig,
    run_dir: &Path,
    rank: usize,
    world_size: usize,
) -> anyhow::Result<CheckpointStore> {
    let store = CheckpointStore::new(run_dir.join("checkpoints"));
    if config.dist.zero == 0 {
        return Ok(store);
    }
    let wait = std::time::Duration::from_secs_f64(config.dist.timeout_s.max(1.0));
    Ok(store.with_shard(stoke_ckpt::ShardRole { rank, world: world_size, wait })?)
}

/// A data-parallel rank other than 0: it trains with its own profiler (its `/metrics`, its step
/// report) and the launcher's heartbeat, and at the end sends its report to rank 0. It writes in
/// the run folder only its parts of sharded checkpoints (`store` with a shard role, under ZeRO).
fn train_other_rank(
    config: &StokeConfig,
    trainer: &mut Trainer,
    source: &mut dyn BatchSource,
    stop: &AtomicBool,
    dist: &mut DataParallel,
    store: CheckpointStore,
) -> anyhow::Result<(stoke_train::Summary, Option<stoke_prof::RunReport>, Option<Overhead>)> {
    let (rank, world_size) = (dist.rank(), dist.world_size());
    let mut profiler = Profiler::for_rank(&config.prof, &config.run.name, rank, world_size)?;
    let (zero, host_ns, _) = start_together(dist)?;
    profiler.set_clock_zero(zero, host_ns);
    let mut heartbeat = super::launch::Heartbeat::from_env(rank);
    let rss_start = stoke_train::reset_peak_rss();
    let mut target = match store.shard_role() {
        Some(_) => {
            let mut writer = CheckpointWriter::new(store, writer_config(config))?;
            if stoke_train::parse_device(&config.run.device)?.is_cuda() {
                writer.pin_host_buffers()?;
            }
            Some(CheckpointTarget { writer, meta: serde_json::Value::Null })
        }
        None => None,
    };
    // The target's writer is finished inside the run (its last part handed over) before the
    // report below, which rank 0 collects only after committing its last checkpoint.
    let summary = trainer.run_with_hooks(source, &mut [&mut profiler, &mut heartbeat], target.as_mut(), stop, dist)?;
    profiler.set_memory(rank_memory(dist, trainer, rss_start));
    let bytes = profiler.rank_report().to_bytes();
    dist.gather_bytes_at_rank0(&bytes, "send the step report to rank 0")
        .with_context(|| format!("rank {rank}: sending its step report ({} bytes) to rank 0", bytes.len()))?;
    // /metrics stays up until the report is delivered: the end of the run on every rank.
    drop(profiler);
    Ok((summary, None, None))
}

/// This rank's memory: the model states its ZeRO stage holds, and the peak resident set measured
/// from `rss_start` (`reset_peak_rss`, just before the first step) to now.
fn rank_memory(dist: &DataParallel, trainer: &Trainer, rss_start: Option<u64>) -> stoke_prof::RankMemory {
    let units: Vec<u64> =
        trainer.model().params().units().iter().map(|u| (u.range.end - u.range.start) as u64).collect();
    let stage = dist.zero_stage();
    // The shard maps the model's buffers when the fused CPU optimizer runs (see DataParallel::shard).
    let slices = if trainer.fused_cpu_optimizer() { stoke_plan::Slices::Mapped } else { stoke_plan::Slices::Copied };
    let bytes = stoke_plan::ZeroStage::try_from(stage)
        .map_err(|e| stoke_plan::PlanError::InvalidConfig { key: "dist.zero", message: e })
        .and_then(|zero| {
            stoke_plan::zero_rank_bytes(
                &units,
                dist.world_size(),
                dist.rank(),
                zero,
                trainer.optimizer_buffers() as u64,
                slices,
                stoke_plan::ZeroInFlight::NONE,
            )
        })
        .unwrap_or_else(|e| panic!("the ZeRO formula refused a running configuration: {e}"));
    stoke_prof::RankMemory {
        rank: dist.rank(),
        zero: stage,
        parameters: bytes.parameters,
        gradients: bytes.gradients,
        optimizer: bytes.optimizer,
        comm_buffers: bytes.comm_buffers,
        rss_start_bytes: rss_start,
        peak_rss_bytes: rss_start.and(stoke_train::peak_rss_bytes()),
    }
}

/// Ping-pongs per rank in `start_together`: the one with the shortest round trip gives the offset.
const CLOCK_ROUNDS: usize = 16;

/// The common time line of a data-parallel run's traces. Every rank leaves a barrier just before its
/// first step and takes that instant as the zero of its own monotonic clock. The barrier releases
/// the ranks up to a scheduler wake-up apart (milliseconds on a busy machine), so rank 0 then
/// measures each rank's zero against its own: `CLOCK_ROUNDS` ping-pongs, each giving the rank's
/// reading minus the midpoint of rank 0's send and receive; the round with the shortest round trip
/// is kept (off by at most half of it). Returns the zero, the host's CLOCK_MONOTONIC then (ns; a
/// check of the offsets when the ranks share a host) and, on rank 0, the offsets.
fn start_together(
    dist: &DataParallel,
) -> anyhow::Result<(std::time::Instant, Option<u64>, Vec<stoke_prof::ClockOffset>)> {
    let (rank, comm) = (dist.rank(), dist.communicator());
    comm.barrier().with_context(|| format!("rank {rank}: barrier before the first step"))?;
    let (zero, host_ns) = zero_with_host_clock();
    let now_us = || zero.elapsed().as_secs_f64() * 1e6;
    let context = |peer: usize| format!("rank {rank}: clock alignment with rank {peer}");
    let mut offsets = Vec::new();
    if rank == 0 {
        for peer in 1..dist.world_size() {
            let mut best = stoke_prof::ClockOffset {
                rank: peer,
                offset_us: 0.0,
                round_trip_us: f64::INFINITY,
                host_clock_offset_us: None,
            };
            for _ in 0..CLOCK_ROUNDS {
                let sent = now_us();
                comm.send(&sent.to_le_bytes(), peer).with_context(|| context(peer))?;
                let mut reply = [0u8; 8];
                comm.recv(&mut reply, peer).with_context(|| context(peer))?;
                let back = now_us();
                if back - sent < best.round_trip_us {
                    let theirs = f64::from_le_bytes(reply);
                    best.offset_us = theirs - (sent + back) / 2.0;
                    best.round_trip_us = back - sent;
                }
            }
            offsets.push(best);
        }
    } else {
        for _ in 0..CLOCK_ROUNDS {
            let mut ping = [0u8; 8];
            comm.recv(&mut ping, 0).with_context(|| context(0))?;
            comm.send(&now_us().to_le_bytes(), 0).with_context(|| context(0))?;
        }
    }
    Ok((zero, host_ns, offsets))
}

/// Now, and the host's CLOCK_MONOTONIC now (ns): the midpoint of readings just before and after,
/// retried when the process was descheduled in between (more than 10 us apart), so the two name
/// the same moment within 5 us.
fn zero_with_host_clock() -> (std::time::Instant, Option<u64>) {
    let mut zero = std::time::Instant::now();
    for _ in 0..10 {
        let (Some(before), now, Some(after)) = (host_monotonic_ns(), std::time::Instant::now(), host_monotonic_ns())
        else {
            return (zero, None);
        };
        zero = now;
        if after - before <= 10_000 {
            return (zero, Some(before + (after - before) / 2));
        }
    }
    (zero, None)
}

/// The host's CLOCK_MONOTONIC, ns (None if the call fails).
fn host_monotonic_ns() -> Option<u64> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// Rank 0: every other rank's step report (a length, then the bytes), in rank order.
fn gather_rank_reports(dist: &DataParallel) -> anyhow::Result<Vec<stoke_prof::RankStepReport>> {
    let received =
        dist.gather_bytes_at_rank0(&[], "receive the step reports").context("rank 0: receiving the step reports")?;
    (1..).zip(received).map(|(from, bytes)| Ok(stoke_prof::RankStepReport::from_bytes(from, &bytes)?)).collect()
}

/// Writes `nan-dump.json` into the run folder when the run stopped on a non-finite loss or
/// gradient (the error then names the file).
fn with_nan_dump(
    result: Result<stoke_train::Summary, stoke_train::TrainError>,
    run_dir: &Path,
) -> anyhow::Result<stoke_train::Summary> {
    match result {
        Err(stoke_train::TrainError::NonFinite(dump)) => {
            let path = run_dir.join("nan-dump.json");
            let json = serde_json::to_string_pretty(&*dump)? + "\n";
            std::fs::write(&path, json).with_context(|| format!("cannot write {}", path.display()))?;
            let err = stoke_train::TrainError::NonFinite(dump);
            Err(anyhow::anyhow!("{err}; the step, its samples and the offending tensors are in {}", path.display()))
        }
        other => Ok(other?),
    }
}

fn print_checkpoint_stats(writer: &CheckpointWriter) {
    let stats = writer.stats();
    if stats.commits == 0 {
        return;
    }
    println!(
        "checkpoints: {} written, {:.1} MB in {:.2} s ({:.2} GB/s){}; host buffers: {} of {:.1} MB; back-pressure waits {:.1} ms",
        stats.commits,
        stats.bytes_written as f64 / 1e6,
        stats.write_s,
        stats.bytes_written as f64 / stats.write_s.max(1e-9) / 1e9,
        if writer.config().background { " in the background" } else { " in the step" },
        stats.buffers,
        stats.host_bytes as f64 / 1e6,
        stats.wait_s * 1e3
    );
}

/// `checkpoint-stats.json`: the writer's totals and, after a resume, its load and restore times.
fn write_checkpoint_stats(writer: &CheckpointWriter, resume: serde_json::Value, path: &Path) -> anyhow::Result<()> {
    let stats = writer.stats();
    let json = serde_json::json!({
        "background": writer.config().background,
        "snapshots": stats.snapshots,
        "commits": stats.commits,
        "bytes_written": stats.bytes_written,
        "write_s": stats.write_s,
        "wait_s": stats.wait_s,
        "buffers": stats.buffers,
        "host_bytes": stats.host_bytes,
        "pinned_bytes": stats.pinned_bytes,
        "resume": resume,
    });
    std::fs::write(path, serde_json::to_string_pretty(&json)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::metrics_port;

    #[test]
    fn each_local_rank_serves_metrics_on_the_next_port() {
        for (base, local_rank, expected) in
            [(9477, 0, Some(9477)), (9477, 3, Some(9480)), (0, 2, Some(0)), (65535, 0, Some(65535)), (65535, 1, None)]
        {
            let got = metrics_port(base, local_rank);
            assert_eq!(got.as_ref().ok().copied(), expected, "{base} + {local_rank}: {got:?}");
        }
        let err = metrics_port(65000, 600).unwrap_err().to_string();
        assert!(err.contains("prof.prometheus_port 65000") && err.contains("local rank 600"), "{err}");
    }
}
