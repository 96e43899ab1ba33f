//! Evaluating one layout and searching all of them.

use serde::{Deserialize, Serialize};

use crate::cluster::{ClusterConfig, Precision};
use crate::layout::{Layout, Recompute, ZeroStage};
use crate::memory::{memory_per_device, MemoryBreakdown};
use crate::model::ModelConfig;
use crate::time::{hardware_flops_per_step, step_time, StepTime};
use crate::PlanError;

/// Which layouts the search may try. Empty lists mean "every value that divides evenly".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SearchConfig {
    /// Tensor-parallel sizes to try; empty tries every divisor of the heads up to `max_tensor`.
    /// Default empty.
    pub tensor: Vec<usize>,
    /// Largest tensor-parallel size; 0 means the devices of one node. Default 0.
    pub max_tensor: usize,
    /// Pipeline sizes to try; empty tries every divisor of the layers. Default empty.
    pub pipeline: Vec<usize>,
    /// Sequence parallelism choices (only tried with tensor parallelism). Default [false, true].
    pub sequence_parallel: Vec<bool>,
    /// Most model chunks per pipeline stage (interleaved schedule); 1 disables it. Default 4.
    pub max_virtual_stages: usize,
    /// ZeRO stages to try (2 and 3 only without a pipeline, as in DeepSpeed). Default [0, 1, 2, 3].
    pub zero: Vec<ZeroStage>,
    /// Recomputation policies to try. Default [none, selective, full].
    pub recompute: Vec<Recompute>,
    /// Micro-batch sizes to try; empty tries every divisor of the per-replica batch up to
    /// `max_micro_batch`. Default empty.
    pub micro_batch: Vec<usize>,
    /// Largest micro-batch when `micro_batch` is empty. Default 64.
    pub max_micro_batch: usize,
}

impl Default for SearchConfig {
    fn default() -> Self {
        SearchConfig {
            tensor: Vec::new(),
            max_tensor: 0,
            pipeline: Vec::new(),
            sequence_parallel: vec![false, true],
            max_virtual_stages: 4,
            zero: ZeroStage::ALL.to_vec(),
            recompute: Recompute::ALL.to_vec(),
            micro_batch: Vec::new(),
            max_micro_batch: 64,
        }
    }
}

/// Everything a plan needs: what to train, on what, and which layouts to consider.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlanConfig {
    /// The model. Default: the "tiny" preset.
    pub model: ModelConfig,
    /// The cluster. Default: the "cpu" preset, one device.
    pub cluster: ClusterConfig,
    /// Precision of the matrix multiplies and activations. Default bf16.
    pub precision: Precision,
    /// Sequences per optimizer step over all replicas. Default 16.
    pub global_batch: usize,
    /// Which layouts to try. Default: all.
    pub search: SearchConfig,
}

impl Default for PlanConfig {
    fn default() -> Self {
        PlanConfig {
            model: ModelConfig::default(),
            cluster: ClusterConfig::default(),
            precision: Precision::Bf16,
            global_batch: 16,
            search: SearchConfig::default(),
        }
    }
}

impl PlanConfig {
    /// Checks the model, the cluster and the batch.
    pub fn validate(&self) -> Result<(), PlanError> {
        self.model.validate()?;
        self.cluster.validate()?;
        if self.global_batch == 0 {
            return Err(PlanError::InvalidConfig { key: "global_batch", message: "must be positive".into() });
        }
        Ok(())
    }
}

/// The prediction for one layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    pub layout: Layout,
    /// Memory of the device that needs the most.
    pub memory: MemoryBreakdown,
    /// Whether that fits in the device's memory.
    pub fits: bool,
    /// Where the step's time goes.
    pub time: StepTime,
    /// One standard deviation of the step time, from the efficiency's relative error.
    pub step_s_error: f64,
    /// Tokens per second over all devices.
    pub tokens_per_s: f64,
    /// Model FLOPs utilisation: model FLOPs (no recomputation) per second over all devices'
    /// peak.
    pub mfu: f64,
    /// FLOP/s each device runs, recomputation included (the "achieved teraFLOP/s per GPU" of
    /// Megatron-LM's papers).
    pub hardware_flops_per_device: f64,
    /// The largest part of the step: compute, memory, overhead, tensor-comm, pipeline-comm,
    /// bubble, data-comm or optimizer.
    pub bottleneck: String,
}

/// Predicts memory and time of one layout.
pub fn evaluate(config: &PlanConfig, layout: &Layout) -> Estimate {
    let model = &config.model;
    let cluster = &config.cluster;
    let memory = memory_per_device(model, cluster, config.precision, layout);
    let time = step_time(model, cluster, config.precision, layout);
    let n_devices = layout.n_devices() as f64;
    let tokens = (layout.global_batch() * model.seq_len) as f64;
    let peak = cluster.peak_flops(config.precision);
    Estimate {
        layout: *layout,
        fits: memory.total <= cluster.memory_bytes,
        memory,
        step_s_error: time.step_s * cluster.efficiency.relative_error,
        tokens_per_s: tokens / time.step_s,
        mfu: model.model_flops_per_token() * tokens / (time.step_s * n_devices * peak),
        hardware_flops_per_device: hardware_flops_per_step(model, layout) / (time.step_s * n_devices),
        bottleneck: time.bottleneck().0.to_string(),
        time,
    }
}

/// The ranked layouts that fit, and how many were considered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchOutcome {
    /// Layouts that fit, fastest first.
    pub plans: Vec<Estimate>,
    /// Layouts evaluated.
    pub n_considered: usize,
    /// Layouts dropped because they do not fit in memory.
    pub n_pruned_by_memory: usize,
}

impl SearchOutcome {
    /// Distinct (tensor, pipeline) pairs in the order of their best plan.
    pub fn tensor_pipeline_ranking(&self) -> Vec<(usize, usize)> {
        let mut ranking: Vec<(usize, usize)> = Vec::new();
        for plan in &self.plans {
            let pair = (plan.layout.tensor, plan.layout.pipeline);
            if !ranking.contains(&pair) {
                ranking.push(pair);
            }
        }
        ranking
    }
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|k| n % k == 0).collect()
}

/// Every layout of `config.cluster.n_devices` devices the search config allows, fitting or not.
pub fn candidate_layouts(config: &PlanConfig) -> Vec<Layout> {
    let model = &config.model;
    let search = &config.search;
    let n_devices = config.cluster.n_devices;
    let max_tensor = if search.max_tensor == 0 { config.cluster.devices_per_node } else { search.max_tensor };
    let tensors: Vec<usize> = if search.tensor.is_empty() {
        divisors(n_devices)
            .into_iter()
            .filter(|&t| t <= max_tensor && model.n_head % t == 0 && model.ffn() % t == 0)
            .collect()
    } else {
        search.tensor.clone()
    };
    let pipelines: Vec<usize> =
        if search.pipeline.is_empty() { divisors(model.n_layer) } else { search.pipeline.clone() };
    let mut layouts = Vec::new();
    for &tensor in &tensors {
        for &pipeline in &pipelines {
            if tensor == 0 || pipeline == 0 || n_devices % (tensor * pipeline) != 0 || model.n_layer % pipeline != 0 {
                continue;
            }
            let data = n_devices / (tensor * pipeline);
            if config.global_batch % data != 0 {
                continue;
            }
            let per_replica = config.global_batch / data;
            let micro_batches: Vec<usize> = if search.micro_batch.is_empty() {
                divisors(per_replica).into_iter().filter(|&b| b <= search.max_micro_batch.max(1)).collect()
            } else {
                search.micro_batch.iter().copied().filter(|&b| b > 0 && per_replica % b == 0).collect()
            };
            for micro_batch in micro_batches {
                let n_micro_batches = per_replica / micro_batch;
                for virtual_stages in 1..=search.max_virtual_stages.max(1) {
                    if virtual_stages > 1
                        && (pipeline == 1
                            || model.n_layer % (pipeline * virtual_stages) != 0
                            || n_micro_batches % pipeline != 0)
                    {
                        continue;
                    }
                    for &sequence_parallel in &search.sequence_parallel {
                        if sequence_parallel && tensor == 1 {
                            continue;
                        }
                        for &zero in &search.zero {
                            if zero != ZeroStage::None && data == 1 {
                                continue;
                            }
                            if zero > ZeroStage::Optimizer && pipeline > 1 {
                                continue;
                            }
                            for &recompute in &search.recompute {
                                layouts.push(Layout {
                                    data,
                                    tensor,
                                    pipeline,
                                    virtual_stages,
                                    sequence_parallel,
                                    zero,
                                    recompute,
                                    micro_batch,
                                    n_micro_batches,
                                });
                            }
                        }
                    }
                }
            }
        }
    }
    layouts
}

/// Evaluates every candidate, drops those that do not fit, and ranks the rest by step time
/// (then by memory).
pub fn search(config: &PlanConfig) -> Result<SearchOutcome, PlanError> {
    config.validate()?;
    let candidates = candidate_layouts(config);
    let n_considered = candidates.len();
    let mut plans = Vec::new();
    let mut n_pruned_by_memory = 0;
    for layout in &candidates {
        let estimate = evaluate(config, layout);
        if estimate.fits {
            plans.push(estimate);
        } else {
            n_pruned_by_memory += 1;
        }
    }
    if plans.is_empty() {
        let reason = if n_considered == 0 {
            format!(
                "no layout divides the model ({} layers, {} heads) and the global batch {} evenly",
                config.model.n_layer, config.model.n_head, config.global_batch
            )
        } else {
            format!("all {n_considered} candidate layouts exceed the device memory")
        };
        return Err(PlanError::NoFeasibleLayout { n_devices: config.cluster.n_devices, reason });
    }
    plans.sort_by(|a, b| a.time.step_s.total_cmp(&b.time.step_s).then(a.memory.total.total_cmp(&b.memory.total)));
    Ok(SearchOutcome { plans, n_considered, n_pruned_by_memory })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_cpu_device_searches_micro_batch_and_recomputation_only() {
        let config = PlanConfig { global_batch: 8, ..PlanConfig::default() };
        let layouts = candidate_layouts(&config);
        // Micro-batches 1, 2, 4, 8 times three recomputation policies.
        assert_eq!(layouts.len(), 12);
        assert!(layouts.iter().all(|l| l.n_devices() == 1 && l.global_batch() == 8));
    }

    #[test]
    fn every_candidate_covers_the_cluster_and_the_batch() {
        let config = PlanConfig {
            model: ModelConfig::preset("gpt3-175b").unwrap(),
            cluster: ClusterConfig::preset("a100-80g", 1024).unwrap(),
            global_batch: 1536,
            ..PlanConfig::default()
        };
        let layouts = candidate_layouts(&config);
        assert!(!layouts.is_empty());
        for layout in layouts {
            assert_eq!(layout.n_devices(), 1024, "{layout}");
            assert_eq!(layout.global_batch(), 1536, "{layout}");
            assert_eq!(config.model.n_layer % (layout.pipeline * layout.virtual_stages), 0, "{layout}");
        }
    }

    #[test]
    fn a_model_too_big_for_the_cluster_is_an_error() {
        let config = PlanConfig {
            model: ModelConfig::preset("gpt3-175b").unwrap(),
            cluster: ClusterConfig::preset("a100-80g", 8).unwrap(),
            global_batch: 8,
            ..PlanConfig::default()
        };
        assert!(matches!(search(&config), Err(PlanError::NoFeasibleLayout { .. })));
    }
}
