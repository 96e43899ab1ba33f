//! Training a `RunSpec`: the trainer and its data built from the config, the checkpoint
//! restored, the data-parallel group set up, then the loop of this rank with its observers (the
//! metrics file, the profiler, the progress bar, the launcher's heartbeat, the caller's own) and
//! the run's closing figures.

use std::path::Path;
use std::sync::atomic::AtomicBool;

use anyhow::Context;
use stoke_ckpt::CheckpointWriter;
use stoke_data::BatchSource;
use stoke_train::{CheckpointTarget, DataParallel, NoHooks, Observer, Trainer};

use super::checkpoints::{
    checkpoint_store, finish_mirror, print_checkpoint_stats, start_mirror, write_checkpoint_stats, writer_config,
};
use super::clock::start_together;
use super::data::{batch_source_for, eval_source_for};
use super::heartbeat::Heartbeat;
use super::ranks::{gather_rank_reports, rank_memory, set_up, train_other_rank};
use super::resume::restore;
use super::spec::{RunOutcome, RunSpec};
use crate::observe::{MetricsWriter, Progress};
use crate::profiler::{OverheadProbe, Peaks, Profiler};

impl RunSpec<'_> {
    /// Trains the run in its folder. One process, or with `dist` one rank of a data-parallel job:
    /// rank 0 writes the metrics file, the profiler's outputs (trace.json, /metrics, report.json,
    /// report.html) and the checkpoints; the other ranks serve their own /metrics, write only
    /// their parts of sharded checkpoints and send their step reports to rank 0.
    pub fn train(self, stop: &AtomicBool, mut dist: Option<&mut DataParallel>) -> anyhow::Result<RunOutcome> {
        let config = &self.config;
        let device = stoke_train::device_for_rank(&config.run.device, self.local.0, self.local.1)?;
        let (rank, world_size) = dist.as_ref().map_or((0, 1), |d| (d.rank(), d.world_size()));
        // The ranks that read different rows: every rank, or with a cut model one per copy.
        let (data_rank, data_world) = dist.as_ref().map_or((0, 1), |d| d.data_rank());
        // The batch-size rule of the learning rate counts every copy's rows.
        let train_config = stoke_train::TrainConfig { world_size: data_world, ..config.train.for_world(data_world)? };
        let mut trainer = Trainer::new(&config.model, &train_config, &config.ckpt, device)?;
        trainer.set_sync_every(config.prof.sync_every);
        trainer.set_adaptive(&config.adaptive)?;
        if let Some(eval_source) = eval_source_for(config, data_rank, data_world)? {
            trainer.set_eval(&config.eval, eval_source)?;
        }
        let mut source = batch_source_for(config, data_rank, data_world)?;
        let resumed_step = self.resume.as_ref().map(|r| r.loaded.manifest.step);
        // `_lock` keeps the run folder locked until training returns.
        let RunSpec { config, run_dir, resume, progress, overhead_block, extra, lock: _lock, local: _ } = self;
        // A cut model: each rank keeps its parts (`dist.tensor`); a checkpoint holds whole
        // tensors, which the restore cuts, so any layout resumes from any other's.
        if let Some(dist) = dist.as_deref_mut() {
            if let Some(group) = dist.tensor_group() {
                trainer.split_tensor(group)?;
                if config.dist.sequence_parallel {
                    trainer.enable_sequence_parallel()?;
                }
                dist.track_cut_model(&trainer);
            }
        }
        let restored = restore(&config, resume, &mut trainer, source.as_mut(), rank, data_world)?;
        if let Some(dist) = dist.as_deref_mut() {
            set_up(&config, dist, &mut trainer, restored.residuals)?;
            if rank != 0 {
                let store = checkpoint_store(&config, &run_dir, rank, world_size)?;
                let summary = train_other_rank(&config, &mut trainer, source.as_mut(), stop, dist, store)?;
                return Ok(RunOutcome { summary, report: None, overhead: None });
            }
        }
        let rank0 = Rank0 { trainer, source, device, resumed_step, resume_stats: restored.stats };
        rank0.train(&config, &run_dir, progress, overhead_block, extra, stop, dist)
    }
}

/// Rank 0 (or the only process), ready to train.
struct Rank0 {
    trainer: Trainer,
    source: Box<dyn BatchSource>,
    device: tch::Device,
    resumed_step: Option<u64>,
    /// The restore's figures for `checkpoint-stats.json`.
    resume_stats: serde_json::Value,
}

impl Rank0 {
    #[allow(clippy::too_many_arguments)] // the parts of the RunSpec this rank still needs
    fn train(
        self,
        config: &crate::config::StokeConfig,
        run_dir: &Path,
        progress: bool,
        overhead_block: Option<u64>,
        extra: Option<&mut dyn Observer>,
        stop: &AtomicBool,
        mut dist: Option<&mut DataParallel>,
    ) -> anyhow::Result<RunOutcome> {
        let Rank0 { mut trainer, mut source, device, resumed_step, resume_stats } = self;
        let mut extra = MaybeObserver(extra);
        let (rank, world_size) = dist.as_ref().map_or((0, 1), |d| (d.rank(), d.world_size()));
        // The checkpoint's `world_size` counts the copies of the model (the ranks reading
        // different rows), which the global batch depends on; `tensor` the ranks one is cut over.
        let data_world = dist.as_ref().map_or(1, |d| d.data_rank().1);
        let (tensor, pipeline) =
            if dist.is_some() { (config.dist.tensor.max(1), config.dist.pipeline.max(1)) } else { (1, 1) };
        // Measured after Trainer::new has set the thread count, so the peak is for the run's threads.
        let peaks = Peaks::measure(device)?;
        let environment = crate::environment::Environment::capture().to_json();
        let environment_path = run_dir.join("environment.json");
        let text = serde_json::to_string_pretty(&environment).expect("the environment serializes") + "\n";
        std::fs::write(&environment_path, text)
            .with_context(|| format!("cannot write {}", environment_path.display()))?;
        let meta = serde_json::json!({
            "config_toml": config.to_toml(),
            "world_size": data_world,
            "tensor": tensor,
            "pipeline": pipeline,
            "environment": environment,
        });
        let store = checkpoint_store(config, run_dir, rank, world_size)?;
        let mirror = start_mirror(config, &store)?;
        let mut writer = CheckpointWriter::with_mirror(store, writer_config(config), mirror.clone())?;
        if device.is_cuda() {
            // The snapshot's device-to-host copy then goes straight into page-locked memory (DMA).
            writer.pin_host_buffers()?;
        }
        let mut target = CheckpointTarget { writer, meta };
        let mut metrics = MetricsWriter::create(&run_dir.join("metrics.jsonl"), resumed_step)?;
        let mut profiler = Profiler::new(&config.prof, run_dir, &config.run.name, peaks, rank, world_size)?;
        profiler.set_environment(environment);
        profiler.set_tensor(tensor);
        let chunks = config.dist.schedule().map_or(1, |s| s.chunks());
        profiler.set_pipeline(pipeline, &config.dist.pipeline_schedule, chunks);
        let mut bar = Progress::new(progress);
        let mut heartbeat = Heartbeat::from_env(rank);
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
            finish_mirror(mirror);
        }
        write_checkpoint_stats(&target.writer, resume_stats, &run_dir.join("checkpoint-stats.json"))?;
        let others = match dist.as_deref() {
            Some(dist) => gather_rank_reports(dist)?,
            None => Vec::new(),
        };
        let report = profiler.finish(others)?;
        Ok(RunOutcome { summary, report, overhead })
    }
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
