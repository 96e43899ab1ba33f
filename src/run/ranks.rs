//! A data-parallel run's ranks: setting the group up over the model, the loop of a rank other
//! than 0, each rank's memory, and rank 0 collecting the others' step reports.

use std::sync::atomic::AtomicBool;

use anyhow::Context;
use stoke_ckpt::{CheckpointStore, CheckpointWriter};
use stoke_data::BatchSource;
use stoke_train::{CheckpointTarget, DataParallel, Trainer};

use super::checkpoints::writer_config;
use super::clock::start_together;
use super::heartbeat::Heartbeat;
use crate::config::StokeConfig;
use crate::profiler::Profiler;

/// Starts every rank from rank 0's parameters (fresh or restored), loads this rank's compression
/// residuals and shards the model states by `dist.zero`; rank 0 says how.
pub fn set_up(
    config: &StokeConfig,
    dist: &mut DataParallel,
    trainer: &mut Trainer,
    residuals: Vec<(String, Vec<f32>)>,
) -> anyhow::Result<()> {
    let rank = dist.rank();
    // All ranks start from rank 0's parameters (fresh or restored).
    dist.broadcast_parameters(trainer)?;
    let how = format!(
        "{} ranks over {}, overlap {}",
        dist.world_size(),
        dist.communicator().backend(),
        if dist.config().overlap { "on" } else { "off" }
    );
    let plan = dist.plan(trainer.model().params())?.to_string();
    dist.load_residual_state(residuals)?;
    if rank == 0 {
        let (_, copies) = dist.data_rank();
        if config.dist.tensor > 1 {
            let over = dist.tensor_transports().unwrap_or_default();
            let pieces = if trainer.model().sequence_group().is_some() {
                format!(", the sequence in {} pieces between its branches", config.dist.tensor)
            } else {
                String::new()
            };
            println!(
                "tensor parallel: the model cut over {} ranks, {copies} copies of it ({over}){pieces}",
                config.dist.tensor
            );
        }
        if config.dist.pipeline > 1 {
            println!(
                "pipeline parallel: {} stages ({}), {copies} copy(ies) of the model",
                config.dist.pipeline, config.dist.pipeline_schedule
            );
        }
        if config.dist.pipeline <= 1 {
            println!("data parallel: {how}; gradients in {plan}");
        } else if copies > 1 {
            println!(
                "data parallel: {copies} copies over {}; each stage's gradients averaged over its copies after backward",
                dist.communicator().backend()
            );
        }
    }
    dist.shard(trainer)?;
    let schedule = config.dist.schedule().map_err(|m| anyhow::anyhow!("dist.pipeline_schedule {m}"))?;
    let split = config.dist.split().map_err(|m| anyhow::anyhow!("dist.pipeline_split {m}"))?;
    if dist.pipeline_stage(trainer, schedule, &split)?.is_some() && rank == 0 {
        let units: Vec<String> = dist.stage_units().iter().map(|u| format!("{}..{}", u.start, u.end)).collect();
        println!("pipeline stages' units: {}", units.join(", "));
    }
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
    Ok(())
}

/// A data-parallel rank other than 0: it trains with its own profiler (its `/metrics`, its step
/// report) and the launcher's heartbeat, and at the end sends its report to rank 0. It writes in
/// the run folder only its parts of sharded checkpoints (`store` with a shard role, under ZeRO).
pub fn train_other_rank(
    config: &StokeConfig,
    trainer: &mut Trainer,
    source: &mut dyn BatchSource,
    stop: &AtomicBool,
    dist: &mut DataParallel,
    store: CheckpointStore,
) -> anyhow::Result<stoke_train::Summary> {
    let (rank, world_size) = (dist.rank(), dist.world_size());
    let mut profiler = Profiler::for_rank(&config.prof, &config.run.name, rank, world_size)?;
    let (zero, host_ns, _) = start_together(dist)?;
    profiler.set_clock_zero(zero, host_ns);
    let mut heartbeat = Heartbeat::from_env(rank);
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
    Ok(summary)
}

/// This rank's memory: the model states its ZeRO stage holds, and the peak resident set measured
/// from `rss_start` (`reset_peak_rss`, just before the first step) to now.
pub fn rank_memory(dist: &DataParallel, trainer: &Trainer, rss_start: Option<u64>) -> stoke_prof::RankMemory {
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
                // A cut model's part is sharded over its copies.
                dist.data_rank().1,
                dist.data_rank().0,
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

/// Rank 0: every other rank's step report (a length, then the bytes), in rank order.
pub fn gather_rank_reports(dist: &DataParallel) -> anyhow::Result<Vec<stoke_prof::RankStepReport>> {
    let received =
        dist.gather_bytes_at_rank0(&[], "receive the step reports").context("rank 0: receiving the step reports")?;
    (1..).zip(received).map(|(from, bytes)| Ok(stoke_prof::RankStepReport::from_bytes(from, &bytes)?)).collect()
}
