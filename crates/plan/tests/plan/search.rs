//! The search's contract: what it returns fits, is ranked, and responds to the cluster the way
//! the physics says it must.

use stoke_plan::{
    evaluate, memory_per_device, search, ClusterConfig, Layout, ModelConfig, PlanConfig, Precision, Recompute,
    SearchConfig, ZeroStage,
};

fn config(model: &str, cluster: &str, n_devices: usize, global_batch: usize) -> PlanConfig {
    PlanConfig {
        model: ModelConfig::preset(model).unwrap(),
        cluster: ClusterConfig::preset(cluster, n_devices).unwrap(),
        precision: Precision::Bf16,
        global_batch,
        search: SearchConfig::default(),
    }
}

fn check_ranked_and_fitting(config: &PlanConfig) {
    let outcome = search(config).unwrap();
    assert_eq!(outcome.plans.len() + outcome.n_pruned_by_memory, outcome.n_considered);
    for plan in &outcome.plans {
        assert!(plan.fits && plan.memory.total <= config.cluster.memory_bytes, "{}", plan.layout);
        assert_eq!(plan.layout.n_devices(), config.cluster.n_devices);
        assert_eq!(plan.layout.global_batch(), config.global_batch);
    }
    for pair in outcome.plans.windows(2) {
        assert!(pair[0].time.step_s <= pair[1].time.step_s);
    }
}

#[test]
fn plans_fit_and_are_ranked() {
    check_ranked_and_fitting(&config("tiny", "cpu", 1, 16));
    check_ranked_and_fitting(&config("gpt2-124m", "h100", 8, 64));
    check_ranked_and_fitting(&config("llama-13b", "a100-80g", 32, 128));
    check_ranked_and_fitting(&config("gpt3-175b", "h200", 256, 512));
}

#[test]
fn a_model_that_needs_sharding_gets_it() {
    // LLaMA-70B's model states alone are 16 bytes x 69B = 1.1 TB: on 16 H100s nothing fits
    // without sharding them over at least 14 devices one way or another.
    let outcome = search(&config("llama-70b", "h100", 16, 64)).unwrap();
    for plan in &outcome.plans {
        let l = plan.layout;
        let sharded = l.tensor * l.pipeline * if l.zero == ZeroStage::Parameters { l.data } else { 1 };
        assert!(sharded >= 8 || l.zero >= ZeroStage::Optimizer, "{l}");
    }
}

fn best_step_s(config: &PlanConfig) -> f64 {
    search(config).unwrap().plans[0].time.step_s
}

#[test]
fn fused_attention_keeps_no_square_matrices_and_recomputes_the_scores() {
    let mut model = ModelConfig::gpt(2, 256, 4, 1024, 256);
    let layout = Layout::single(1);
    let unfused = stoke_plan::layer_activation_bytes(&model, &layout, Recompute::None);
    let unfused_flops = stoke_plan::stage_flops_per_micro_batch(&model, &layout, stoke_plan::Stage::Last);
    model.flash_attention = true;
    let fused = stoke_plan::layer_activation_bytes(&model, &layout, Recompute::None);
    let fused_flops = stoke_plan::stage_flops_per_micro_batch(&model, &layout, stoke_plan::Stage::Last);
    // s·b·h·(34 + 5·a·s/h) against 34·s·b·h: 5·4·1024/256 = 80 units of s·b·h fewer.
    assert_eq!((unfused - fused) / (1024.0 * 256.0), 80.0);
    // The backward recomputes Q·Kᵀ and the product with V: 4·b·s²·h per layer.
    assert_eq!(fused_flops - unfused_flops, 2.0 * 4.0 * 1024.0 * 1024.0 * 256.0);
}

#[test]
fn better_hardware_is_never_slower() {
    let base = config("llama-7b", "a100-80g", 64, 256);
    let base_s = best_step_s(&base);
    let faster_network = |c: &mut ClusterConfig| c.inter_node_bandwidth *= 2.0;
    let more_memory = |c: &mut ClusterConfig| c.memory_bytes *= 2.0;
    let bigger_nodes = |c: &mut ClusterConfig| c.devices_per_node = 16;
    let more_flops = |c: &mut ClusterConfig| c.peak_flops_bf16 *= 2.0;
    for (name, change) in [
        ("network", &faster_network as &dyn Fn(&mut ClusterConfig)),
        ("memory", &more_memory),
        ("nodes", &bigger_nodes),
        ("flops", &more_flops),
    ] {
        let mut better = base.clone();
        change(&mut better.cluster);
        assert!(best_step_s(&better) <= base_s * (1.0 + 1e-12), "{name}");
    }
}

#[test]
fn zero_stages_and_recomputation_only_ever_save_memory() {
    let config = config("llama-13b", "a100-80g", 64, 256);
    let base = Layout { data: 64, n_micro_batches: 4, ..Layout::single(1) };
    let memory = |layout: Layout| memory_per_device(&config.model, &config.cluster, config.precision, &layout);
    let mut previous = f64::INFINITY;
    for zero in ZeroStage::ALL {
        let states = memory(Layout { zero, ..base });
        let total = states.parameters + states.gradients + states.optimizer;
        assert!(total < previous, "{zero:?}");
        previous = total;
    }
    // With fused attention (the preset's) selective recomputation has nothing left to drop.
    let activations = |recompute| memory(Layout { recompute, ..base }).activations;
    assert_eq!(activations(Recompute::Selective), activations(Recompute::None));
    assert!(activations(Recompute::Full) < activations(Recompute::None));
}

#[test]
fn recomputation_costs_time_in_proportion_to_what_it_repeats() {
    // Unfused attention, as in Korthikanti et al.
    let mut config = config("gpt3-175b", "a100-80g", 64, 64);
    config.model.flash_attention = false;
    let layout = |recompute| Layout { tensor: 8, pipeline: 8, recompute, n_micro_batches: 64, ..Layout::single(1) };
    let compute = |recompute| evaluate(&config, &layout(recompute)).time.compute_s;
    let none = compute(Recompute::None);
    // Full recomputation runs the forward again: 4 passes' worth instead of 3, less the head.
    let full_ratio = compute(Recompute::Full) / none;
    assert!(full_ratio > 1.30 && full_ratio < 4.0 / 3.0, "{full_ratio}");
    // Selective recomputation repeats only the attention products, 4·b·s²·h per layer against
    // 72·b·s·h²·(1 + s/(6h)) for the layer's three passes: s/(18h)/(1 + s/(6h)) = 0.90% more for
    // GPT-3 175B at sequence 2048 (a little less with the output head on the last stage).
    let selective_ratio = compute(Recompute::Selective) / none;
    assert!(selective_ratio > 1.0085 && selective_ratio < 1.0091, "{selective_ratio}");
}
