//! The model against Narayanan et al. (2021), "Efficient Large-Scale Language Model Training on GPU
//! Clusters Using Megatron-LM", Table 1 (weak scaling on Selene: DGX A100 80 GB nodes of 8 GPUs,
//! NVLink inside, eight 200 Gb/s HDR InfiniBand ports per node; sequence 2048, vocabulary 51,200,
//! mixed precision, full activation recomputation). Micro-batch sizes are those of the runs, from
//! `examples/sc21/run_table_1.sh` in the NVIDIA/Megatron-LM repository (the paper's artifact).

use stoke_plan::{
    search, ClusterConfig, Efficiency, Estimate, ModelConfig, PlanConfig, Precision, Recompute, SearchConfig, ZeroStage,
};

/// One row of Table 1.
struct Row {
    billions: f64,
    n_head: usize,
    d_model: usize,
    n_layer: usize,
    tensor: usize,
    pipeline: usize,
    n_gpus: usize,
    /// MBS of the row in Megatron-LM's examples/sc21/run_table_1.sh.
    micro_batch: usize,
    global_batch: usize,
    /// "Achieved teraFLOP/s per GPU", recomputation's FLOPs included.
    tflops_per_gpu: f64,
}

const TABLE_1: &[Row] = &[
    Row {
        billions: 1.7,
        micro_batch: 16,
        n_head: 24,
        d_model: 2304,
        n_layer: 24,
        tensor: 1,
        pipeline: 1,
        n_gpus: 32,
        global_batch: 512,
        tflops_per_gpu: 137.0,
    },
    Row {
        billions: 3.6,
        micro_batch: 16,
        n_head: 32,
        d_model: 3072,
        n_layer: 30,
        tensor: 2,
        pipeline: 1,
        n_gpus: 64,
        global_batch: 512,
        tflops_per_gpu: 138.0,
    },
    Row {
        billions: 7.5,
        micro_batch: 16,
        n_head: 32,
        d_model: 4096,
        n_layer: 36,
        tensor: 4,
        pipeline: 1,
        n_gpus: 128,
        global_batch: 512,
        tflops_per_gpu: 142.0,
    },
    Row {
        billions: 18.4,
        micro_batch: 8,
        n_head: 48,
        d_model: 6144,
        n_layer: 40,
        tensor: 8,
        pipeline: 1,
        n_gpus: 256,
        global_batch: 1024,
        tflops_per_gpu: 135.0,
    },
    Row {
        billions: 39.1,
        micro_batch: 4,
        n_head: 64,
        d_model: 8192,
        n_layer: 48,
        tensor: 8,
        pipeline: 2,
        n_gpus: 512,
        global_batch: 1536,
        tflops_per_gpu: 138.0,
    },
    Row {
        billions: 76.1,
        micro_batch: 2,
        n_head: 80,
        d_model: 10240,
        n_layer: 60,
        tensor: 8,
        pipeline: 4,
        n_gpus: 1024,
        global_batch: 1792,
        tflops_per_gpu: 140.0,
    },
    Row {
        billions: 145.6,
        micro_batch: 2,
        n_head: 96,
        d_model: 12288,
        n_layer: 80,
        tensor: 8,
        pipeline: 8,
        n_gpus: 1536,
        global_batch: 2304,
        tflops_per_gpu: 148.0,
    },
    Row {
        billions: 310.1,
        micro_batch: 1,
        n_head: 128,
        d_model: 16384,
        n_layer: 96,
        tensor: 8,
        pipeline: 16,
        n_gpus: 1920,
        global_batch: 2160,
        tflops_per_gpu: 155.0,
    },
    Row {
        billions: 529.6,
        micro_batch: 1,
        n_head: 128,
        d_model: 20480,
        n_layer: 105,
        tensor: 8,
        pipeline: 35,
        n_gpus: 2520,
        global_batch: 2520,
        tflops_per_gpu: 163.0,
    },
    Row {
        billions: 1008.0,
        micro_batch: 1,
        n_head: 160,
        d_model: 25600,
        n_layer: 128,
        tensor: 8,
        pipeline: 64,
        n_gpus: 3072,
        global_batch: 3072,
        tflops_per_gpu: 163.0,
    },
];

/// What the paper's runs fixed: the global batch and the micro-batch of the row, no ZeRO, full
/// recomputation, no sequence parallelism (it came a year later). The search is left the splits,
/// the interleaving depth and the accumulation.
fn config(row: &Row) -> PlanConfig {
    let mut config = free_micro_batch_config(row);
    config.search.micro_batch = vec![row.micro_batch];
    config
}

/// As `config`, with the micro-batch left to the search too.
fn free_micro_batch_config(row: &Row) -> PlanConfig {
    let mut cluster = ClusterConfig::preset("a100-80g", row.n_gpus).unwrap();
    // Megatron-LM of 2021 all-reduced gradients after the backward, overlapping none of it.
    cluster.efficiency = Efficiency { dp_overlap: 0.0, ..cluster.efficiency };
    PlanConfig {
        model: ModelConfig::gpt(row.n_layer, row.d_model, row.n_head, 2048, 51200),
        cluster,
        precision: Precision::Bf16,
        global_batch: row.global_batch,
        search: SearchConfig {
            zero: vec![ZeroStage::None],
            recompute: vec![Recompute::Full],
            sequence_parallel: vec![false],
            ..SearchConfig::default()
        },
    }
}

/// The best plan with the published tensor x pipeline split, its rank among the distinct splits,
/// and the best plan overall.
fn published_split(row: &Row, config: &PlanConfig) -> (Estimate, usize, Estimate) {
    let outcome = search(config).unwrap();
    let ranking = outcome.tensor_pipeline_ranking();
    let rank = ranking.iter().position(|&pair| pair == (row.tensor, row.pipeline)).expect("published split fits");
    let plan = outcome
        .plans
        .iter()
        .find(|plan| (plan.layout.tensor, plan.layout.pipeline) == (row.tensor, row.pipeline))
        .unwrap()
        .clone();
    (plan, rank, outcome.plans[0].clone())
}

#[test]
fn published_split_is_among_the_top_three() {
    for row in TABLE_1 {
        let (_, rank, best) = published_split(row, &config(row));
        assert!(
            rank < 3,
            "{}B: published t{} p{} ranks {}; best {}",
            row.billions,
            row.tensor,
            row.pipeline,
            rank + 1,
            best.layout
        );
    }
}

/// Rows where, with the micro-batch also free, the model ranks the published split below third.
/// It then prefers tensor parallelism 4 with an interleaved pipeline at micro-batch 2, about 6%
/// faster: eight-way tensor parallelism of a 6144- or 8192-wide layer spends 15-22% of its
/// compute time in its six all-reduces per layer (two forward, two backward, two in the
/// recomputed forward) on b·s·h fp16 activations; halving t halves that share, and small
/// micro-batches shrink the bubble the pipeline costs. The model charges a GEMM the same share of
/// peak whatever its size, so it does not see what the paper's section 3.4 measures (per-GPU
/// throughput grows with the micro-batch), the reason the runs used micro-batches of 8 and 4 here.
const FREE_MICRO_BATCH_DISAGREEMENTS: &[f64] = &[18.4, 39.1];

#[test]
fn with_the_micro_batch_free_the_published_split_is_within_ten_percent_of_the_best() {
    for row in TABLE_1 {
        let (plan, rank, best) = published_split(row, &free_micro_batch_config(row));
        let disagrees = FREE_MICRO_BATCH_DISAGREEMENTS.contains(&row.billions);
        assert_eq!(rank >= 3, disagrees, "{}B: published split ranks {}; update the list", row.billions, rank + 1);
        let slower = plan.time.step_s / best.time.step_s - 1.0;
        assert!(slower < 0.10, "{}B: published split {:.1}% slower than {}", row.billions, 100.0 * slower, best.layout);
    }
}

#[test]
fn predicted_throughput_per_gpu_is_within_20_percent_of_published() {
    for row in TABLE_1 {
        let (plan, _, _) = published_split(row, &config(row));
        let predicted = plan.hardware_flops_per_device / 1e12;
        let error = predicted / row.tflops_per_gpu - 1.0;
        assert!(
            error.abs() < 0.20,
            "{}B: predicted {predicted:.1} vs published {} TFLOP/s",
            row.billions,
            row.tflops_per_gpu
        );
    }
}

#[test]
fn model_sizes_match_the_table() {
    // The "number of parameters (billion)" column, to the digit printed.
    for row in TABLE_1 {
        let billions = config(row).model.n_params() as f64 / 1e9;
        assert!((billions - row.billions).abs() <= 0.05 + 0.001 * row.billions, "{billions} vs {}", row.billions);
    }
}

/// Prints the comparison (run with --nocapture --ignored).
#[test]
#[ignore]
fn print_comparison() {
    for row in TABLE_1 {
        let (plan, rank, best) = published_split(row, &config(row));
        let (_, free_rank, free_best) = published_split(row, &free_micro_batch_config(row));
        println!(
            "{:>7}B t{} p{:<2} b{:<2} published {:5.1} predicted {:5.1} TFLOP/s ({:+5.1}%), split rank {} (best {}); \
             micro-batch free: rank {} (best {})",
            row.billions,
            row.tensor,
            row.pipeline,
            row.micro_batch,
            row.tflops_per_gpu,
            plan.hardware_flops_per_device / 1e12,
            100.0 * (plan.hardware_flops_per_device / 1e12 / row.tflops_per_gpu - 1.0),
            rank + 1,
            best.layout,
            free_rank + 1,
            free_best.layout,
        );
    }
}

#[test]
fn with_the_micro_batch_free_the_disagreement_holds_even_at_the_links_full_peak() {
    // NVLink 3 moves 300 GB/s per direction per GPU; a ring all-reduce sends and receives at
    // once, so that is the ceiling of its bus bandwidth. Charging the tensor all-reduces that
    // ceiling, with no loss to NCCL, still leaves the published split outside the top three:
    // the disagreement is not an artefact of a pessimistic communication efficiency.
    for row in TABLE_1.iter().filter(|row| FREE_MICRO_BATCH_DISAGREEMENTS.contains(&row.billions)) {
        let mut config = free_micro_batch_config(row);
        config.cluster.intra_node_bandwidth = 300e9 / config.cluster.efficiency.comm;
        let ranking = search(&config).unwrap().tensor_pipeline_ranking();
        let rank = ranking.iter().position(|&pair| pair == (row.tensor, row.pipeline)).unwrap();
        assert!(rank >= 3, "{}B: published split ranks {} at NVLink's peak", row.billions, rank + 1);
    }
}
