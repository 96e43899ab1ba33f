//! `stoke train`: resolve the config, prepare the run folder, build the data source, train.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use stoke_ckpt::CheckpointStore;
use stoke_data::BatchSource;
use stoke_train::{CheckpointTarget, Observer, Trainer};

use super::UsageError;
use crate::config::StokeConfig;
use crate::observe::{MetricsWriter, Progress};
use crate::profiler::{Overhead, OverheadProbe, Peaks, Profiler};

#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Train on this text file (byte-level tokens) instead of the built-in corpus; same as
    /// `--set data.path=PATH`.
    #[arg(long, value_name = "PATH")]
    pub data: Option<PathBuf>,
    /// Continue the named run (run.name; default: the most recent run) from its latest checkpoint.
    #[arg(long)]
    pub resume: bool,
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
    let mut config = args.config.load(&extra)?;
    if args.find_batch {
        return super::find_batch::run(&config, args.memory_budget.as_deref());
    }
    let run_dir = prepare_run_dir(&mut config, args.resume)?;
    let stop = Arc::new(AtomicBool::new(false));
    install_interrupt_handler(stop.clone());
    let (summary, _report) = train(&config, &run_dir, args.resume, !args.quiet, &stop)?;
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
    Ok(ExitCode::SUCCESS)
}

/// Picks the run's name and folder, and writes the resolved config there.
pub(super) fn prepare_run_dir(config: &mut StokeConfig, resume: bool) -> anyhow::Result<PathBuf> {
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
        (true, None) => {
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
    std::fs::create_dir_all(&run_dir).with_context(|| format!("cannot create run folder {}", run_dir.display()))?;
    let config_path = run_dir.join("config.toml");
    std::fs::write(&config_path, config.to_toml())
        .with_context(|| format!("cannot write {}", config_path.display()))?;
    Ok(run_dir)
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

pub(super) fn install_interrupt_handler(stop: Arc<AtomicBool>) {
    // The first Ctrl-C finishes the current step and checkpoints; a second one exits at once.
    let _ = ctrlc::set_handler(move || {
        if stop.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!("\nstopping after this step (Ctrl-C again to quit now)");
    });
}

/// The data the config names, as a prefetching loader at the start of its order. Every kind of data
/// (the built-in corpus and text files as byte-level tokens in memory, prepared shards, Megatron and
/// raw token files, remote shards through the cache) goes through the same loader.
pub fn batch_source(config: &StokeConfig) -> anyhow::Result<Box<dyn BatchSource>> {
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
        let weight = data.weights.get(dataset_idx).copied().unwrap_or(1.0);
        datasets.push(stoke_data::WeightedStore { store, weight });
    }
    let loader = stoke_data::LoaderConfig {
        seq_len: shape.seq_len,
        micro_batch: config.train.micro_batch,
        seed: config.train.seed,
        rank: 0,
        world_size: 1,
        n_workers: data.workers,
        prefetch_depth: data.prefetch,
        drop_last: data.drop_last,
    };
    Ok(Box::new(stoke_data::Loader::blend(datasets, loader)?))
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
/// the progress bar as observers. Returns the run's summary and its step report.
pub fn train(
    config: &StokeConfig,
    run_dir: &Path,
    resume: bool,
    progress: bool,
    stop: &AtomicBool,
) -> anyhow::Result<(stoke_train::Summary, Option<stoke_prof::RunReport>)> {
    let (summary, report, _) = train_probed(config, run_dir, resume, progress, stop, None)?;
    Ok((summary, report))
}

/// `train`, and with `overhead_block` the profiler's own cost measured in the same run: the
/// profiler sees alternate blocks of that many steps (`OverheadProbe`).
pub fn train_probed(
    config: &StokeConfig,
    run_dir: &Path,
    resume: bool,
    progress: bool,
    stop: &AtomicBool,
    overhead_block: Option<u64>,
) -> anyhow::Result<(stoke_train::Summary, Option<stoke_prof::RunReport>, Option<Overhead>)> {
    let (summary, report, overhead) = train_inner(config, run_dir, resume, progress, stop, overhead_block, None)?;
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
    let (summary, report, _) = train_inner(config, run_dir, false, false, stop, None, Some(extra))?;
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

fn train_inner(
    config: &StokeConfig,
    run_dir: &Path,
    resume: bool,
    progress: bool,
    stop: &AtomicBool,
    overhead_block: Option<u64>,
    extra: Option<&mut dyn Observer>,
) -> anyhow::Result<(stoke_train::Summary, Option<stoke_prof::RunReport>, Option<Overhead>)> {
    let mut extra = MaybeObserver(extra);
    let device = stoke_train::parse_device(&config.run.device)?;
    let mut trainer = Trainer::new(&config.model, &config.train, &config.ckpt, device)?;
    trainer.set_sync_every(config.prof.sync_every);
    // Measured after Trainer::new has set the thread count, so the peak is for the run's threads.
    let peaks = Peaks::measure(device, Path::new(&config.run.dir))?;
    let store = CheckpointStore::new(run_dir.join("checkpoints"));
    let mut source = batch_source(config)?;
    if resume {
        let step = store.latest()?.expect("prepare_run_dir checked that a checkpoint exists");
        let position = trainer.restore(&store, step)?;
        source.seek(position);
    }
    let meta = serde_json::json!({ "config_toml": config.to_toml() });
    let target = CheckpointTarget { store, meta };
    let mut metrics = MetricsWriter::create(&run_dir.join("metrics.jsonl"), resume)?;
    let mut profiler = Profiler::new(&config.prof, run_dir, &config.run.name, peaks)?;
    let mut bar = Progress::new(progress);
    let (summary, overhead) = match overhead_block {
        Some(block) => {
            let mut probe = OverheadProbe::new(&mut profiler, block);
            let mut observers: Vec<&mut dyn Observer> = vec![&mut metrics, &mut probe, &mut bar, &mut extra];
            let summary = trainer.run(source.as_mut(), &mut observers, Some(&target), stop)?;
            drop(observers);
            (summary, probe.result())
        }
        None => {
            let mut observers: Vec<&mut dyn Observer> = vec![&mut metrics, &mut profiler, &mut bar, &mut extra];
            (trainer.run(source.as_mut(), &mut observers, Some(&target), stop)?, None)
        }
    };
    bar.finish();
    let report = profiler.finish()?;
    Ok((summary, report, overhead))
}
