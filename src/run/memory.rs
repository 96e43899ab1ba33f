//! The memory check before a run builds anything: the planner's estimate of one rank's step
//! against what this process can have (`stoke_train::memory_limit`).

use crate::config::StokeConfig;
use crate::exit::usage;

/// Whether a run checks that its step fits in memory before building the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryCheck {
    /// Refuse a step estimated above what this process can have (the default).
    Enforce,
    /// Build whatever the config says (`--force`): the allocator has the last word.
    Skip,
}

/// Refuses `config`'s step when it cannot fit, naming its parts and the limit (exit 2). Each of the
/// `local_ranks` processes on this machine gets its share of the host's memory. Every rank builds
/// the whole model and its optimizer state before ZeRO shards them, so the estimate is ZeRO-0's.
pub fn check_memory(config: &StokeConfig, world_size: usize, local_ranks: usize) -> anyhow::Result<()> {
    let device = stoke_train::parse_device(&config.run.device)?;
    // The batch is cut between the model's copies, not between a copy's stages or parts.
    let copies = (world_size / (config.dist.tensor.max(1) * config.dist.pipeline.max(1))).max(1);
    let train = config.train.for_world(copies)?;
    let estimate = stoke_train::estimate_step_memory(&config.model, &train, copies, 0, device)?;
    let Some(limit) = stoke_train::memory_limit(device, local_ranks) else {
        return Ok(());
    };
    stoke_train::check_fits(&estimate, &limit).map_err(|err| usage(err.to_string()))
}
