//! Memory per device: model states under ZeRO, activations under tensor and sequence parallelism
//! and recomputation, the pipeline's micro-batches in flight, communication buffers.

use serde::{Deserialize, Serialize};

use crate::cluster::{ClusterConfig, Precision};
use crate::layout::{Layout, Recompute, ZeroStage};
use crate::model::ModelConfig;

/// Bytes of the data-parallel gradient buckets in flight (two of Megatron-LM's and PyTorch DDP's
/// 25 MB default buckets: one filling, one being reduced).
const DP_BUCKET_BYTES: f64 = 2.0 * 25e6;

/// Weights, gradients and optimizer state of one device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ModelStates {
    pub parameters: f64,
    pub gradients: f64,
    pub optimizer: f64,
}

impl ModelStates {
    pub fn total(&self) -> f64 {
        self.parameters + self.gradients + self.optimizer
    }
}

/// Model states per device for `n_params` parameters replicated over `n_data` ranks, Rajbhandari et
/// al. (2020), "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", section 5.1
/// and Figure 1: (2 + 2 + K)·Ψ for the baseline, 2Ψ + 2Ψ + K·Ψ/N_d for P_os, 2Ψ + (2 + K)·Ψ/N_d
/// for P_os+g and (2 + 2 + K)·Ψ/N_d for P_os+g+p, with K = 12 under mixed precision.
pub fn model_states(n_params: f64, n_data: usize, zero: ZeroStage, precision: Precision) -> ModelStates {
    fine_tune_states(n_params, n_params, n_data, zero, precision)
}

/// [`model_states`] when only `n_trainable` of the `n_params` train (LoRA, frozen weights): every
/// weight is held, gradients and optimizer state only for those that train. A frozen weight is
/// held as stoke holds it, in fp32 and whole on every rank (ZeRO shards the trained ones).
pub fn fine_tune_states(
    n_params: f64,
    n_trainable: f64,
    n_data: usize,
    zero: ZeroStage,
    precision: Precision,
) -> ModelStates {
    let frozen = 4.0 * (n_params - n_trainable);
    let weight = precision.element_bytes() * n_trainable;
    let gradient = precision.element_bytes() * n_trainable;
    let optimizer = precision.optimizer_bytes() * n_trainable;
    let shard = |bytes: f64| bytes / n_data as f64;
    match zero {
        ZeroStage::None => ModelStates { parameters: weight + frozen, gradients: gradient, optimizer },
        ZeroStage::Optimizer => {
            ModelStates { parameters: weight + frozen, gradients: gradient, optimizer: shard(optimizer) }
        }
        ZeroStage::Gradients => {
            ModelStates { parameters: weight + frozen, gradients: shard(gradient), optimizer: shard(optimizer) }
        }
        ZeroStage::Parameters => {
            ModelStates { parameters: shard(weight) + frozen, gradients: shard(gradient), optimizer: shard(optimizer) }
        }
    }
}

/// Which pipeline stage: the first holds the embedding and the most micro-batches in flight; the
/// last holds the output head and the logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    First,
    Last,
}

/// Parameters held by one tensor-parallel rank of a pipeline stage (before ZeRO). Tensor
/// parallelism splits the blocks and the vocabulary; a tied head is a second copy on the last
/// stage when there is more than one stage (Megatron-LM keeps one and all-reduces its gradient).
pub fn stage_params(model: &ModelConfig, layout: &Layout, stage: Stage) -> f64 {
    let t = layout.tensor as f64;
    let layers = (model.n_layer / layout.pipeline) as f64;
    let blocks = layers * (model.params_per_layer() + model.lora_params_per_layer()) as f64 / t;
    let h = model.d_model as f64;
    let token_embedding = model.vocab_size as f64 * h / t;
    let positions = if model.learned_positions { model.seq_len as f64 * h } else { 0.0 };
    let head = token_embedding;
    let embedding = token_embedding + positions;
    let own_head = if model.tied_embeddings { 0.0 } else { head };
    if layout.pipeline == 1 {
        return blocks + embedding + own_head;
    }
    match stage {
        Stage::First => blocks + embedding,
        Stage::Last => blocks + head,
    }
}

/// The parameters of [`stage_params`] that train: all of them, or under LoRA the stage's adapters.
pub fn stage_trainable_params(model: &ModelConfig, layout: &Layout, stage: Stage) -> f64 {
    if model.lora_rank == 0 {
        return stage_params(model, layout, stage);
    }
    let layers = (model.n_layer / layout.pipeline) as f64;
    layers * model.lora_params_per_layer() as f64 / layout.tensor as f64
}

/// Activation bytes of one block for one micro-batch kept until its backward, on one rank, at
/// 16-bit precision. Korthikanti et al. (2022), Table 2: s·b·h·(34 + 5·a·s/h) without parallelism;
/// s·b·h·(10 + 24/t + 5·a·s/(h·t)) under tensor parallelism; s·b·h/t·(34 + 5·a·s/h) adding
/// sequence parallelism; selective recomputation drops the 5·a·s²·b term; full recomputation keeps
/// only the block's input, 2·s·b·h (divided by t under sequence parallelism).
pub fn layer_activation_bytes(model: &ModelConfig, layout: &Layout, recompute: Recompute) -> f64 {
    let act = model.layer_activations(layout.micro_batch);
    let t = layout.tensor as f64;
    let replicated = if layout.sequence_parallel { act.replicated_bytes / t } else { act.replicated_bytes };
    match recompute {
        Recompute::None => replicated + (act.split_bytes + act.attention_core_bytes) / t,
        Recompute::Selective => replicated + act.split_bytes / t,
        Recompute::Full => {
            if layout.sequence_parallel {
                act.input_bytes / t
            } else {
                act.input_bytes
            }
        }
    }
}

/// Bytes of the logits and the loss's copies of them on the last stage: the logits in the run's
/// precision, an fp32 copy and the fp32 softmax the loss keeps (Korthikanti et al. count 4·s·b·V/t
/// for fp16 logits and an fp32 loss).
pub fn logits_bytes(model: &ModelConfig, layout: &Layout, precision: Precision) -> f64 {
    let elements = (model.seq_len * layout.micro_batch * model.vocab_size) as f64 / layout.tensor as f64;
    let fp32_copy = if precision == Precision::Fp32 { 0.0 } else { 4.0 };
    elements * (precision.element_bytes() + fp32_copy + 4.0)
}

/// Micro-batches whose activations the first stage holds at once. With the 1F1B schedule the
/// first of p stages holds p (Narayanan et al., 2021, section 2.2.1); the interleaved schedule with
/// v chunks holds L·(1 + (p-1)/(p·v)) layers' worth in all (Korthikanti et al., 2022, section 4.2.3).
pub fn layers_in_flight(model: &ModelConfig, layout: &Layout, stage: Stage) -> f64 {
    let p = layout.pipeline as f64;
    let layers_per_stage = (model.n_layer / layout.pipeline) as f64;
    if layout.pipeline == 1 || stage == Stage::Last {
        return layers_per_stage;
    }
    let in_flight = layout.pipeline.min(layout.n_micro_batches) as f64;
    let interleave = if layout.virtual_stages > 1 { 1.0 + (p - 1.0) / (p * layout.virtual_stages as f64) } else { 1.0 };
    layers_per_stage * in_flight * interleave
}

/// Memory of one device, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    /// The stage this is for (the one needing more).
    pub stage: Stage,
    pub parameters: f64,
    pub gradients: f64,
    pub optimizer: f64,
    pub activations: f64,
    pub comm_buffers: f64,
    pub reserved: f64,
    pub total: f64,
}

/// Memory of the device that needs the most: the larger of the first and the last stage.
pub fn memory_per_device(
    model: &ModelConfig,
    cluster: &ClusterConfig,
    precision: Precision,
    layout: &Layout,
) -> MemoryBreakdown {
    let first = stage_memory(model, cluster, precision, layout, Stage::First);
    if layout.pipeline == 1 {
        return first;
    }
    let last = stage_memory(model, cluster, precision, layout, Stage::Last);
    if last.total > first.total {
        last
    } else {
        first
    }
}

fn stage_memory(
    model: &ModelConfig,
    cluster: &ClusterConfig,
    precision: Precision,
    layout: &Layout,
    stage: Stage,
) -> MemoryBreakdown {
    let params = stage_params(model, layout, stage);
    let trainable = stage_trainable_params(model, layout, stage);
    let states = fine_tune_states(params, trainable, layout.data, layout.zero, precision);
    let precision_scale = precision.element_bytes() / 2.0;
    let per_layer = layer_activation_bytes(model, layout, layout.recompute) * precision_scale;
    let mut activations = per_layer * layers_in_flight(model, layout, stage);
    if layout.recompute == Recompute::Full {
        // Recomputing a block rebuilds all of its activations for one micro-batch at a time.
        activations += layer_activation_bytes(model, layout, Recompute::None) * precision_scale;
    }
    if stage == Stage::Last || layout.pipeline == 1 {
        activations += logits_bytes(model, layout, precision);
    }
    let element = precision.element_bytes();
    let sbh = (model.seq_len * layout.micro_batch * model.d_model) as f64;
    let mut comm_buffers = 0.0;
    if layout.data > 1 {
        comm_buffers += DP_BUCKET_BYTES;
    }
    if layout.zero == ZeroStage::Parameters && layout.data > 1 {
        // The gathered weights of the block being run and of the one being prefetched.
        comm_buffers += 2.0 * model.params_per_layer() as f64 / layout.tensor as f64 * element;
    }
    if layout.tensor > 1 {
        comm_buffers += 2.0 * sbh * element;
    }
    if layout.pipeline > 1 {
        // A send and a receive buffer for activations and for their gradients.
        comm_buffers += 4.0 * sbh * element / layout.tensor as f64;
    }
    let reserved = cluster.reserved_bytes;
    MemoryBreakdown {
        stage,
        parameters: states.parameters,
        gradients: states.gradients,
        optimizer: states.optimizer,
        activations,
        comm_buffers,
        reserved,
        total: states.total() + activations + comm_buffers + reserved,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(tensor: usize, sequence_parallel: bool) -> Layout {
        Layout { tensor, sequence_parallel, ..Layout::single(1) }
    }

    fn check(recompute: Recompute, tensor: usize, sequence_parallel: bool, expected_sbh_units: f64) {
        // s = 64, h = 128, a = 4, b = 1: 5·a·s/h = 10.
        let model = ModelConfig::gpt(2, 128, 4, 64, 100);
        let sbh = 64.0 * 128.0;
        let bytes = layer_activation_bytes(&model, &layout(tensor, sequence_parallel), recompute);
        assert_eq!(bytes / sbh, expected_sbh_units, "{recompute:?} t={tensor} sp={sequence_parallel}");
    }

    #[test]
    fn activation_cases_of_korthikanti_table_2() {
        check(Recompute::None, 1, false, 34.0 + 10.0);
        check(Recompute::None, 4, false, 10.0 + 24.0 / 4.0 + 10.0 / 4.0);
        check(Recompute::None, 4, true, (34.0 + 10.0) / 4.0);
        check(Recompute::Selective, 4, false, 10.0 + 24.0 / 4.0);
        check(Recompute::Selective, 4, true, 34.0 / 4.0);
        check(Recompute::Full, 4, false, 2.0);
        check(Recompute::Full, 4, true, 2.0 / 4.0);
    }

    #[test]
    fn lora_holds_every_weight_but_gradients_and_optimizer_state_of_the_adapters_alone() {
        let mut model = ModelConfig::preset("llama-7b").unwrap();
        model.lora_rank = 16;
        let cluster = ClusterConfig::preset("h100", 4).unwrap();
        let layout = Layout { data: 4, zero: ZeroStage::Optimizer, ..Layout::single(1) };
        let memory = memory_per_device(&model, &cluster, Precision::Bf16, &layout);
        let full = memory_per_device(&ModelConfig::preset("llama-7b").unwrap(), &cluster, Precision::Bf16, &layout);
        let adapters = 8_388_608.0;
        // The frozen base in fp32 (4 bytes a weight against a trained weight's 2-byte copy).
        let base = full.parameters / 2.0;
        assert_eq!(memory.parameters - full.parameters, 2.0 * base + 2.0 * adapters);
        assert_eq!(memory.gradients, 2.0 * adapters);
        assert_eq!(memory.optimizer, 12.0 * adapters / 4.0);
    }

    #[test]
    fn first_stage_holds_p_micro_batches() {
        let model = ModelConfig::gpt(8, 128, 4, 64, 100);
        let mut layout = Layout { pipeline: 4, n_micro_batches: 16, ..Layout::single(1) };
        assert_eq!(layers_in_flight(&model, &layout, Stage::First), 8.0);
        assert_eq!(layers_in_flight(&model, &layout, Stage::Last), 2.0);
        layout.n_micro_batches = 2;
        assert_eq!(layers_in_flight(&model, &layout, Stage::First), 4.0);
    }
}
