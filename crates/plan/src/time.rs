//! Step time: compute from FLOPs and bytes at calibrated efficiencies, collectives from bytes,
//! bandwidth and latency, the pipeline's bubble, and the part of data-parallel communication the
//! backward does not hide.

use serde::{Deserialize, Serialize};

use crate::cluster::{ClusterConfig, Precision};
use crate::layout::{Layout, Recompute, ZeroStage};
use crate::memory::{layer_activation_bytes, logits_bytes, stage_params, stage_trainable_params, Stage};
use crate::model::ModelConfig;
use crate::stages::stage_units;

/// Bytes the optimizer moves per parameter it updates: Adam reads the weight (or fp32 master),
/// gradient and two moments and writes the weight and the moments, 7 four-byte words.
const OPTIMIZER_BYTES_PER_PARAM: f64 = 28.0;

/// Passes over a block's activations in one training step: the forward writes them, the backward
/// reads them and writes gradients of the same size.
const ACTIVATION_PASSES: f64 = 3.0;

/// Passes over a block's weights per micro-batch outside the matrix multiplies: the weight
/// gradient added into the step's gradient. The multiplies' own reads of the weights are part of
/// their time at the compute efficiency; counting them here as well charged small micro-batches
/// twice (a pipeline of 8 micro-batches of one row was predicted 18% slow, 2% with one pass).
const WEIGHT_PASSES: f64 = 1.0;

/// A link a collective runs over.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Bytes per second one rank reaches (peak times the comm efficiency).
    pub bandwidth: f64,
    /// Seconds per step of the collective's algorithm.
    pub latency_s: f64,
}

impl Link {
    /// The link of a group that covers `span` consecutive ranks: inside a node when the span
    /// tiles the node (so no group straddles two), else the network.
    pub fn for_group(cluster: &ClusterConfig, span: usize) -> Link {
        let comm = cluster.efficiency.comm;
        if span <= cluster.devices_per_node && cluster.devices_per_node % span == 0 {
            Link { bandwidth: cluster.intra_node_bandwidth * comm, latency_s: cluster.intra_node_latency_s }
        } else {
            Link { bandwidth: cluster.inter_node_bandwidth * comm, latency_s: cluster.inter_node_latency_s }
        }
    }

    /// Ring all-reduce of `bytes` over `n` ranks: each rank sends and receives 2(n-1)/n of the
    /// bytes in 2(n-1) steps (Patarasuk and Yuan, 2009).
    pub fn all_reduce_s(&self, n: usize, bytes: f64) -> f64 {
        if n <= 1 {
            return 0.0;
        }
        let n_f = n as f64;
        2.0 * (n_f - 1.0) / n_f * bytes / self.bandwidth + 2.0 * (n_f - 1.0) * self.latency_s
    }

    /// Ring reduce-scatter or all-gather of `bytes` (the full tensor) over `n` ranks: half an
    /// all-reduce.
    pub fn gather_or_scatter_s(&self, n: usize, bytes: f64) -> f64 {
        self.all_reduce_s(n, bytes) / 2.0
    }

    /// One point-to-point transfer.
    pub fn send_s(&self, bytes: f64) -> f64 {
        bytes / self.bandwidth + self.latency_s
    }
}

/// Where the time of one optimizer step goes, in seconds. The parts add up to `step_s`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepTime {
    /// Matrix multiplies at the calibrated share of peak, recomputation included.
    pub compute_s: f64,
    /// Element-wise work bound by memory bandwidth.
    pub memory_s: f64,
    /// Framework overhead per block and per step.
    pub overhead_s: f64,
    /// Tensor-parallel all-reduces (or reduce-scatter/all-gather pairs), not overlapped.
    pub tensor_comm_s: f64,
    /// Pipeline sends and receives between stages.
    pub pipeline_comm_s: f64,
    /// Idle time of the pipeline's fill and drain.
    pub bubble_s: f64,
    /// Data-parallel (and ZeRO) communication the step waits for, with the all-reduce of tied
    /// embeddings' gradients between the first and the last pipeline stage.
    pub data_comm_exposed_s: f64,
    /// All data-parallel communication, hidden or not.
    pub data_comm_total_s: f64,
    /// The optimizer's update of this device's shard.
    pub optimizer_s: f64,
    /// Wall time of one step.
    pub step_s: f64,
}

impl StepTime {
    /// The largest part of the step and its name.
    pub fn bottleneck(&self) -> (&'static str, f64) {
        let parts = [
            ("compute", self.compute_s),
            ("memory", self.memory_s),
            ("overhead", self.overhead_s),
            ("tensor-comm", self.tensor_comm_s),
            ("pipeline-comm", self.pipeline_comm_s),
            ("bubble", self.bubble_s),
            ("data-comm", self.data_comm_exposed_s),
            ("optimizer", self.optimizer_s),
        ];
        parts.into_iter().fold(("compute", f64::MIN), |best, part| if part.1 > best.1 { part } else { best })
    }
}

/// What one pipeline stage runs for a micro-batch: its blocks (all its chunks') and whether it
/// holds the head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StageWork {
    pub blocks: usize,
    pub head: bool,
}

impl StageWork {
    /// The even cut (Megatron-LM's): n_layer / p blocks a stage, the head on the last.
    pub fn even(model: &ModelConfig, layout: &Layout, stage: Stage) -> StageWork {
        StageWork { blocks: model.n_layer / layout.pipeline, head: stage == Stage::Last || layout.pipeline == 1 }
    }
}

/// Each stage's work as stoke's trainer cuts the model: the units (the embedding, each block, the
/// head) in p·v contiguous chunks balanced by their training FLOPs as if every weight trained
/// (`stage_units`, the trainer's own cut), stage s holding chunks s, s + p, ... With a large
/// vocabulary the head weighs several blocks, and the last stage gets fewer blocks than the first.
pub fn stage_works(model: &ModelConfig, layout: &Layout) -> Vec<StageWork> {
    let (n, p) = (model.n_layer, layout.pipeline.max(1));
    if p == 1 {
        return vec![StageWork { blocks: n, head: true }];
    }
    let costs: Vec<f64> = std::iter::once(0.0)
        .chain(std::iter::repeat_n(3.0 * model.layer_forward_flops(1), n))
        .chain(std::iter::once(3.0 * model.head_forward_flops(1)))
        .collect();
    let chunks = p * layout.virtual_stages.max(1);
    let Ok(ranges) = stage_units(&costs, chunks, &[]) else {
        // More chunks than units: no cut exists (the search never proposes one).
        return (0..p)
            .map(|s| StageWork::even(model, layout, if s + 1 == p { Stage::Last } else { Stage::First }))
            .collect();
    };
    (0..p)
        .map(|stage| {
            let mut work = StageWork { blocks: 0, head: false };
            for chunk in (stage..chunks).step_by(p) {
                work.blocks += ranges[chunk].clone().filter(|&unit| (1..=n).contains(&unit)).count();
                work.head |= ranges[chunk].contains(&(n + 1));
            }
            work
        })
        .collect()
}

/// FLOPs a device runs for one micro-batch on `stage` of the even cut, recomputation included.
pub fn stage_flops_per_micro_batch(model: &ModelConfig, layout: &Layout, stage: Stage) -> f64 {
    work_flops(model, layout, StageWork::even(model, layout, stage))
}

/// FLOPs a device runs for one micro-batch of `work`, recomputation included.
fn work_flops(model: &ModelConfig, layout: &Layout, work: StageWork) -> f64 {
    let b = layout.micro_batch;
    let layers = work.blocks as f64;
    let forward = model.layer_forward_flops(b);
    let training = model.layer_training_flops(b);
    // Fused attention recomputes the scores in its backward, whatever the policy; selective
    // recomputation of unfused attention does the same by hand.
    let core = model.attention_core_forward_flops(b);
    let fused = if model.flash_attention { core } else { 0.0 };
    let recompute = match layout.recompute {
        Recompute::None => fused,
        Recompute::Selective => core,
        Recompute::Full => forward + fused,
    };
    let mut flops = layers * (training + recompute);
    if work.head {
        flops += model.head_training_flops(b);
    }
    flops / layout.tensor as f64
}

/// FLOPs of one step over all devices, recomputation included (what Megatron-LM's papers call
/// achieved FLOPs: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) with full recomputation).
pub fn hardware_flops_per_step(model: &ModelConfig, layout: &Layout) -> f64 {
    let whole = Layout { tensor: 1, pipeline: 1, ..*layout };
    stage_flops_per_micro_batch(model, &whole, Stage::Last) * layout.global_batch() as f64 / layout.micro_batch as f64
}

/// Bytes a device moves through memory for one micro-batch of `work`, outside the matrix
/// multiplies' own traffic: activations written and read, the weight gradients added, logits.
fn stage_bytes_per_micro_batch(model: &ModelConfig, layout: &Layout, precision: Precision, work: StageWork) -> f64 {
    let layers = work.blocks as f64;
    let scale = precision.element_bytes() / 2.0;
    let kept = layer_activation_bytes(model, layout, Recompute::None) * scale;
    let recomputed = match layout.recompute {
        Recompute::None => 0.0,
        Recompute::Selective => {
            model.layer_activations(layout.micro_batch).attention_core_bytes / layout.tensor as f64 * scale
        }
        Recompute::Full => kept,
    };
    let weights = model.params_per_layer() as f64 / layout.tensor as f64 * precision.element_bytes();
    let mut bytes = layers * (ACTIVATION_PASSES * kept + recomputed + WEIGHT_PASSES * weights);
    if work.head {
        let head_weights = (model.vocab_size * model.d_model) as f64 / layout.tensor as f64 * precision.element_bytes();
        bytes += 2.0 * logits_bytes(model, layout, precision) + WEIGHT_PASSES * head_weights;
    }
    bytes
}

/// Time of one micro-batch on one stage, split by cause.
#[derive(Debug, Clone, Copy, Default)]
struct MicroBatchTime {
    compute_s: f64,
    memory_s: f64,
    overhead_s: f64,
    tensor_comm_s: f64,
    pipeline_comm_s: f64,
}

impl MicroBatchTime {
    fn total(&self) -> f64 {
        self.compute_s + self.memory_s + self.overhead_s + self.tensor_comm_s + self.pipeline_comm_s
    }
}

fn micro_batch_time(
    model: &ModelConfig,
    cluster: &ClusterConfig,
    precision: Precision,
    layout: &Layout,
    work: StageWork,
) -> MicroBatchTime {
    let eff = &cluster.efficiency;
    let layers = work.blocks as f64;
    let compute_s = work_flops(model, layout, work) / (cluster.peak_flops(precision) * eff.compute);
    let memory_s =
        stage_bytes_per_micro_batch(model, layout, precision, work) / (cluster.memory_bandwidth * eff.memory);
    let overhead_s = layers * eff.layer_overhead_s;
    let element = precision.element_bytes();
    let sbh_bytes = (model.seq_len * layout.micro_batch * model.d_model) as f64 * element;
    let mut tensor_comm_s = 0.0;
    if layout.tensor > 1 {
        // Two all-reduces per block in the forward and two in the backward (Shoeybi et al., 2019,
        // Figure 4), two more when full recomputation repeats the forward. Under sequence
        // parallelism each becomes a reduce-scatter and an all-gather: the same bytes.
        let per_layer = 4.0 + if layout.recompute == Recompute::Full { 2.0 } else { 0.0 };
        let link = Link::for_group(cluster, layout.tensor);
        tensor_comm_s = layers * per_layer * link.all_reduce_s(layout.tensor, sbh_bytes);
    }
    let mut pipeline_comm_s = 0.0;
    if layout.pipeline > 1 {
        // Each chunk sends its output forward and receives its gradient back; Megatron-LM's
        // scatter/gather splits the message over the t tensor ranks.
        // Neighbouring stages are t·d ranks apart: inside a node only when a whole replica is.
        let link = Link::for_group(cluster, layout.tensor * layout.data * layout.pipeline);
        let messages = 2.0 * layout.virtual_stages as f64;
        pipeline_comm_s = messages * link.send_s(sbh_bytes / layout.tensor as f64);
        if layout.tensor > 1 {
            // The receiving tensor ranks all-gather the t pieces back into the whole activation
            // (or gradient) before using it, once per message (Narayanan et al., 2021, section 4.1).
            let tensor_link = Link::for_group(cluster, layout.tensor);
            pipeline_comm_s += messages * tensor_link.gather_or_scatter_s(layout.tensor, sbh_bytes);
        }
    }
    MicroBatchTime { compute_s, memory_s, overhead_s, tensor_comm_s, pipeline_comm_s }
}

/// Step time of `layout` for `model` on `cluster`.
pub fn step_time(model: &ModelConfig, cluster: &ClusterConfig, precision: Precision, layout: &Layout) -> StepTime {
    let eff = &cluster.efficiency;
    // The pipeline runs at the pace of its slowest stage, as stoke cuts it.
    let (slow, work) = stage_works(model, layout)
        .into_iter()
        .map(|work| (micro_batch_time(model, cluster, precision, layout, work), work))
        .reduce(|slowest, other| if other.0.total() > slowest.0.total() { other } else { slowest })
        .expect("a layout has at least one stage");
    // Model states and their reductions: the stage with the head, or the first (the even cut's).
    let stage = if work.head { Stage::Last } else { Stage::First };
    let m = layout.n_micro_batches as f64;
    let p = layout.pipeline as f64;
    let bubble_units = (p - 1.0) / layout.virtual_stages as f64;
    let bubble_s = bubble_units * slow.total();
    // The backward's share of a micro-batch, the window gradients' reduction can hide in.
    let mut flops_forward = work.blocks as f64 * model.layer_forward_flops(layout.micro_batch);
    if work.head {
        flops_forward += model.head_forward_flops(layout.micro_batch);
    }
    let flops_forward = flops_forward / layout.tensor as f64;
    let flops_all = work_flops(model, layout, work);
    let backward_s = slow.total() * (flops_all - flops_forward) / flops_all;

    let params = stage_params(model, layout, stage);
    // Only the parameters that train have gradients to reduce.
    let grad_bytes = stage_trainable_params(model, layout, stage) * precision.element_bytes();
    let weight_bytes = params * precision.element_bytes();
    let d = layout.data;
    let link = Link::for_group(cluster, layout.tensor * layout.data);
    let hide = |comm_s: f64, window_s: f64| (comm_s - eff.dp_overlap * window_s).max(0.0);
    let (data_comm_total_s, data_comm_exposed_s) = if d <= 1 {
        (0.0, 0.0)
    } else {
        match layout.zero {
            // One all-reduce (or, for P_os, a reduce-scatter of gradients and an all-gather of
            // updated weights: the same bytes) after the last micro-batch's backward.
            ZeroStage::None | ZeroStage::Optimizer => {
                let total = link.all_reduce_s(d, grad_bytes);
                (total, hide(total, backward_s))
            }
            // Gradients reduce-scattered after every micro-batch, weights all-gathered once.
            ZeroStage::Gradients => {
                let scatter = link.gather_or_scatter_s(d, grad_bytes);
                let gather = link.gather_or_scatter_s(d, weight_bytes);
                (m * scatter + gather, m * hide(scatter, backward_s) + gather)
            }
            // Weights gathered for the forward, the backward (and the recomputation), gradients
            // reduce-scattered, every micro-batch.
            ZeroStage::Parameters => {
                let gathers = if layout.recompute == Recompute::Full { 3.0 } else { 2.0 };
                let per_micro_batch = (gathers + 1.0) * link.gather_or_scatter_s(d, weight_bytes);
                (m * per_micro_batch, m * hide(per_micro_batch, slow.total()))
            }
        }
    };
    // With a pipeline, tied input and output embeddings live on the first and the last stage;
    // Megatron-LM all-reduces their gradient between the two after the data-parallel reduction.
    // Their ranks are t·d·(p-1) apart: inside a node only when the whole layout is.
    let embedding_comm_s = if layout.pipeline > 1 && model.tied_embeddings {
        let embedding_bytes =
            (model.vocab_size * model.d_model) as f64 / layout.tensor as f64 * precision.element_bytes();
        Link::for_group(cluster, layout.n_devices()).all_reduce_s(2, embedding_bytes)
    } else {
        0.0
    };
    let data_comm_total_s = data_comm_total_s + embedding_comm_s;
    let data_comm_exposed_s = data_comm_exposed_s + embedding_comm_s;
    let updated = if layout.zero == ZeroStage::None { params } else { params / d as f64 };
    let optimizer_s = updated * OPTIMIZER_BYTES_PER_PARAM / (cluster.memory_bandwidth * eff.optimizer);
    let scale = m + bubble_units;
    let pipeline_s = scale * slow.total();
    let step_s = pipeline_s + data_comm_exposed_s + optimizer_s + eff.step_overhead_s;
    debug_assert!(
        ((m * slow.total() + bubble_s) - pipeline_s).abs() <= 1e-9 * pipeline_s.max(1.0),
        "pipeline time splits into busy and bubble"
    );
    StepTime {
        compute_s: m * slow.compute_s,
        memory_s: m * slow.memory_s,
        overhead_s: m * slow.overhead_s + eff.step_overhead_s,
        tensor_comm_s: m * slow.tensor_comm_s,
        pipeline_comm_s: m * slow.pipeline_comm_s,
        bubble_s,
        data_comm_exposed_s,
        data_comm_total_s,
        optimizer_s,
        step_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_all_reduce(n: usize, bytes: f64, expected_s: f64) {
        let link = Link { bandwidth: 1e9, latency_s: 0.0 };
        let got = link.all_reduce_s(n, bytes);
        assert!((got - expected_s).abs() < 1e-12, "n={n}: {got} vs {expected_s}");
    }

    #[test]
    fn ring_all_reduce_moves_2_n_minus_1_over_n_of_the_bytes() {
        check_all_reduce(1, 1e9, 0.0);
        check_all_reduce(2, 1e9, 1.0);
        check_all_reduce(4, 1e9, 1.5);
        check_all_reduce(8, 1e9, 1.75);
    }

    #[test]
    fn bubble_share_is_p_minus_1_over_m_plus_p_minus_1() {
        let model = ModelConfig::gpt(8, 256, 4, 128, 256);
        let cluster = ClusterConfig::preset("a100-80g", 4).unwrap();
        for (p, m, v) in [(4, 8, 1), (4, 16, 1), (2, 3, 1), (4, 8, 2)] {
            let layout = Layout { pipeline: p, n_micro_batches: m, virtual_stages: v, ..Layout::single(1) };
            let time = step_time(&model, &cluster, Precision::Bf16, &layout);
            let busy = time.step_s - time.data_comm_exposed_s - time.optimizer_s;
            let units = (p as f64 - 1.0) / v as f64;
            let expected = units / (m as f64 + units);
            assert!((time.bubble_s / busy - expected).abs() < 1e-9, "p={p} m={m} v={v}");
        }
    }

    #[test]
    fn stages_are_cut_as_stoke_cuts_them() {
        // GPT-2's width and vocabulary: a block costs 6·7.1M + 12·1024·768 = 51.9M FLOPs a token,
        // the head 6·50257·768 = 231.6M, about 4.5 blocks; the head's stage gets 4 blocks, not 6.
        let model = ModelConfig::gpt(12, 768, 12, 1024, 50257);
        let layout = Layout { pipeline: 2, n_micro_batches: 8, ..Layout::single(1) };
        let works = stage_works(&model, &layout);
        assert_eq!(works, vec![StageWork { blocks: 8, head: false }, StageWork { blocks: 4, head: true }]);
        // Interleaved, 2 chunks a stage: chunks of 5, 4, 2 blocks and 1 with the head (the
        // smallest largest chunk), stage 0 holding the first and third.
        let interleaved = Layout { virtual_stages: 2, ..layout };
        let works = stage_works(&model, &interleaved);
        assert_eq!(works.iter().map(|w| w.blocks).sum::<usize>(), 12);
        assert!(works[1].head && !works[0].head, "{works:?}");
        // The even cut's last stage (6 blocks and the head) is slower than either stage here.
        let cluster = ClusterConfig::preset("a100-80g", 2).unwrap();
        let even_last =
            micro_batch_time(&model, &cluster, Precision::Bf16, &layout, StageWork::even(&model, &layout, Stage::Last));
        let time = step_time(&model, &cluster, Precision::Bf16, &layout);
        assert!(time.step_s - time.optimizer_s - time.data_comm_exposed_s < (8.0 + 1.0) * even_last.total());
        // A byte vocabulary: the head is tiny, and the cut is the even one.
        let small = ModelConfig::gpt(4, 256, 8, 256, 256);
        let works = stage_works(&small, &layout);
        assert_eq!(works, vec![StageWork { blocks: 2, head: false }, StageWork { blocks: 2, head: true }]);
    }

    #[test]
    fn megatron_flop_formula_is_hardware_flops_under_full_recomputation() {
        // Narayanan et al. (2021), section 5.1: F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)).
        let model = ModelConfig::gpt(24, 2304, 24, 2048, 51200);
        let layout = Layout { recompute: Recompute::Full, data: 32, n_micro_batches: 16, ..Layout::single(1) };
        let (b, s, l, h, v) = (512.0, 2048.0, 24.0, 2304.0, 51200.0);
        let expected = 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h));
        let got = hardware_flops_per_step(&model, &layout);
        assert!((got / expected - 1.0).abs() < 1e-12, "{got} vs {expected}");
    }
}
