//! Whether a run's step fits in memory, decided before anything is allocated: the planner's
//! formula (`stoke plan`'s memory per device) for the configured model, precision, recomputation,
//! micro-batch and ZeRO stage, against the memory this process can have. A model too large for the
//! machine is then a clear error naming the sizes, instead of libtorch's allocator failing midway
//! through the build (or the kernel's OOM killer ending the process).

use tch::Device;

use crate::config::{ModelConfig, Precision, Recompute, TrainConfig};
use crate::TrainError;

/// The estimated bytes of one rank's training step, split as the planner splits them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryEstimate {
    pub parameters: f64,
    pub gradients: f64,
    pub optimizer: f64,
    pub activations: f64,
}

impl MemoryEstimate {
    pub fn total(&self) -> f64 {
        self.parameters + self.gradients + self.optimizer + self.activations
    }
}

/// The memory this process may use, and what set that figure.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryLimit {
    pub bytes: u64,
    /// Where the figure comes from ("MemAvailable", "the cgroup's memory.max", "RLIMIT_AS", "free
    /// device memory").
    pub source: &'static str,
}

/// One rank's step under `train` on `world_size` ranks with ZeRO stage `zero_stage`, on `device`.
/// Shapes so large that the planner's integer counts would overflow are estimated in floating point
/// first and come back as they are (far beyond any machine).
pub fn estimate_step_memory(
    model: &ModelConfig,
    train: &TrainConfig,
    world_size: usize,
    zero_stage: u8,
    device: Device,
) -> Result<MemoryEstimate, TrainError> {
    let shape = model.shape()?;
    let (layers, width, seq, vocab, batch) = (
        shape.n_layer as f64,
        shape.d_model as f64,
        shape.seq_len as f64,
        shape.vocab_size as f64,
        train.micro_batch.max(1) as f64,
    );
    // A lower bound on the parameters of any family (12·h² per block, the embedding) and on the
    // logits; past 2^53 elements the planner's integer arithmetic is not to be trusted, and no
    // machine holds that many bytes anyway.
    let rough_params = layers * 12.0 * width * width + vocab * width;
    let rough_logits = seq * batch * vocab;
    if rough_params.max(rough_logits) > (1u64 << 53) as f64 {
        return Ok(MemoryEstimate {
            parameters: 4.0 * rough_params,
            gradients: 4.0 * rough_params,
            optimizer: 8.0 * rough_params,
            activations: 4.0 * rough_logits,
        });
    }
    let plan = crate::models::plan_model_for(model, train)?;
    let data = world_size.max(1);
    let zero = match zero_stage {
        0 => stoke_plan::ZeroStage::None,
        1 => stoke_plan::ZeroStage::Optimizer,
        2 => stoke_plan::ZeroStage::Gradients,
        _ => stoke_plan::ZeroStage::Parameters,
    };
    let recompute = match train.recompute {
        // Recomputing a half or every K-th block keeps more than whole blocks do: count it as
        // keeping everything, an upper bound.
        Recompute::Block => stoke_plan::Recompute::Full,
        _ => stoke_plan::Recompute::None,
    };
    let precision = match train.precision {
        Precision::Fp32 => stoke_plan::Precision::Fp32,
        // fp16 keeps the same bytes as bf16.
        Precision::Bf16 | Precision::Fp16 => stoke_plan::Precision::Bf16,
    };
    let layout = stoke_plan::Layout {
        data,
        zero,
        recompute,
        micro_batch: train.micro_batch.max(1),
        n_micro_batches: train.grad_accum.max(1),
        ..stoke_plan::Layout::single(train.micro_batch.max(1))
    };
    // The planner's device reserve (a CUDA context) is not this process's to count.
    let mut cluster = stoke_plan::ClusterConfig::preset("cpu", data)
        .map_err(|err| TrainError::InvalidConfig { key: "model", message: err.to_string() })?;
    cluster.reserved_bytes = 0.0;
    let breakdown = stoke_plan::memory_per_device(&plan, &cluster, precision, &layout);
    // A frozen matrix of a LoRA's base (the blocks' and the head's; the planner counts it in fp32)
    // has under 16-bit precision on a CPU its kept cast besides (`Llama::compute_weights`).
    let frozen_matrices = if plan.lora_rank > 0 {
        (plan.n_layer * plan.matmul_params_per_layer() + plan.vocab_size * plan.d_model) as f64
    } else {
        0.0
    };
    let on_cpu = precision == stoke_plan::Precision::Bf16 && device == Device::Cpu;
    let kept = if on_cpu { 2.0 * frozen_matrices } else { 0.0 };
    Ok(MemoryEstimate {
        parameters: breakdown.parameters + kept,
        gradients: breakdown.gradients,
        optimizer: breakdown.optimizer,
        activations: breakdown.activations + breakdown.comm_buffers,
    })
}

/// The memory this process can have now: on a GPU the device's free memory; on the CPU the least
/// of `MemAvailable`, the cgroup's `memory.max` less what the cgroup uses, and `RLIMIT_AS` less the
/// address space already mapped, shared by the `local_ranks` processes of this machine.
pub fn memory_limit(device: Device, local_ranks: usize) -> Option<MemoryLimit> {
    if let Device::Cuda(_) = device {
        let (free, _) = crate::peak::cuda_mem_info()?;
        return Some(MemoryLimit { bytes: free, source: "free device memory" });
    }
    let mut limits = Vec::new();
    if let Some(available) = crate::peak::memory_available_bytes() {
        limits.push(MemoryLimit { bytes: available / local_ranks.max(1) as u64, source: "MemAvailable" });
    }
    if let Some(cgroup) = cgroup_headroom() {
        limits.push(MemoryLimit { bytes: cgroup / local_ranks.max(1) as u64, source: "the cgroup's memory.max" });
    }
    if let Some(address_space) = address_space_headroom() {
        limits.push(MemoryLimit { bytes: address_space, source: "RLIMIT_AS (ulimit -v)" });
    }
    limits.into_iter().min_by_key(|limit| limit.bytes)
}

/// Refuses a step estimated above what `limit` allows, naming the estimate's parts and the limit.
pub fn check_fits(estimate: &MemoryEstimate, limit: &MemoryLimit) -> Result<(), TrainError> {
    if estimate.total() <= limit.bytes as f64 {
        return Ok(());
    }
    let gib = |bytes: f64| bytes / (1u64 << 30) as f64;
    Err(TrainError::TooLarge {
        message: format!(
            "a training step needs about {:.3} GiB (parameters {:.3}, gradients {:.3}, optimizer state {:.3}, \
             activations {:.3}: `stoke plan`'s formula), but this process can have {:.3} GiB ({}); \
             shrink the model (model.*) or train.micro_batch, or pass --force to try anyway",
            gib(estimate.total()),
            gib(estimate.parameters),
            gib(estimate.gradients),
            gib(estimate.optimizer),
            gib(estimate.activations),
            gib(limit.bytes as f64),
            limit.source
        ),
    })
}

/// Bytes left under cgroup v2's `memory.max` of this process's cgroup; none without a limit.
fn cgroup_headroom() -> Option<u64> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let path = membership.lines().find_map(|line| line.strip_prefix("0::"))?;
    let dir = std::path::Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let max: u64 = std::fs::read_to_string(dir.join("memory.max")).ok()?.trim().parse().ok()?;
    let current: u64 = std::fs::read_to_string(dir.join("memory.current")).ok()?.trim().parse().unwrap_or(0);
    Some(max.saturating_sub(current))
}

/// Bytes of address space left under `RLIMIT_AS`; none when unlimited.
fn address_space_headroom() -> Option<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the struct we pass and reads nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) } != 0 || limit.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmSize:"))?;
    let mapped_kib: u64 = line["VmSize:".len()..].split_whitespace().next()?.parse().ok()?;
    Some((limit.rlim_cur as u64).saturating_sub(mapped_kib * 1024))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tiny_model_fits_and_a_huge_one_is_refused_with_its_sizes() {
        let train = TrainConfig::default();
        let tiny = estimate_step_memory(&ModelConfig::default(), &train, 1, 0, Device::Cpu).unwrap();
        assert!(tiny.total() > 1e6 && tiny.total() < 1e9, "{tiny:?}");
        let limit = MemoryLimit { bytes: 10 << 30, source: "a test" };
        check_fits(&tiny, &limit).unwrap();
        let huge = ModelConfig { d_model: 100_000_000, n_head: 1, ..ModelConfig::default() };
        let estimate = estimate_step_memory(&huge, &train, 1, 0, Device::Cpu).unwrap();
        let err = check_fits(&estimate, &limit).unwrap_err().to_string();
        assert!(err.contains("GiB") && err.contains("a test") && err.contains("--force"), "{err}");
    }

    #[test]
    fn lora_counts_optimizer_state_and_gradients_for_the_adapters_alone() {
        let model = ModelConfig { family: "llama".into(), preset: "llama3-8b".into(), ..ModelConfig::default() };
        let full = estimate_step_memory(&model, &TrainConfig::default(), 1, 0, Device::Cpu).unwrap();
        let mut train = TrainConfig::default();
        train.lora.rank = 16;
        let lora = estimate_step_memory(&model, &train, 1, 0, Device::Cpu).unwrap();
        // Llama 3 8B: 32 blocks, q_proj 4096 x 4096, v_proj 4096 x 1024: 16 · (8192 + 5120) per block.
        let adapters = 32.0 * 16.0 * (8192.0 + 5120.0);
        assert_eq!(lora.optimizer, 12.0 * adapters, "{lora:?}");
        assert_eq!(lora.gradients, 2.0 * adapters, "{lora:?}");
        // The frozen base in fp32 (4 bytes a weight against a trained weight's 2-byte copy, its
        // fp32 master among the optimizer's 12), and on a CPU its matrices' kept bf16 cast: 32
        // blocks of 4096 x (2 x 4096 + 2 x 1024 + 3 x 14336) and the head's 128256 x 4096.
        let base = full.parameters / 2.0;
        let matrices = 32.0 * 4096.0 * (2.0 * 4096.0 + 2.0 * 1024.0 + 3.0 * 14336.0) + 128256.0 * 4096.0;
        let on_gpu = estimate_step_memory(&model, &train, 1, 0, Device::Cuda(0)).unwrap();
        assert_eq!(on_gpu.parameters - full.parameters, 2.0 * base + 2.0 * adapters, "{on_gpu:?} {full:?}");
        assert_eq!(lora.parameters - on_gpu.parameters, 2.0 * matrices);
        let states = |m: &MemoryEstimate| m.parameters + m.gradients + m.optimizer;
        // About 6 of full fine-tuning's 16 bytes a weight.
        assert!(states(&lora) < 0.4 * states(&full), "{lora:?} {full:?}");
        assert_eq!(lora.activations, full.activations);
    }

    #[test]
    fn zero_3_shards_the_model_states() {
        let model = ModelConfig { preset: "gpt2-124m".into(), ..ModelConfig::default() };
        let train = TrainConfig::default();
        let whole = estimate_step_memory(&model, &train, 4, 0, Device::Cpu).unwrap();
        let sharded = estimate_step_memory(&model, &train, 4, 3, Device::Cpu).unwrap();
        assert!((sharded.optimizer * 4.0 - whole.optimizer).abs() < 1.0, "{whole:?} {sharded:?}");
        assert!(sharded.parameters < whole.parameters);
    }
}
