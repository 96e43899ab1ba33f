//! Activation memory against the formulas of Korthikanti et al. (2022), "Reducing Activation
//! Recomputation in Large Transformer Models", Table 2 (bytes per layer), for the four model
//! configurations of their Table 3 (sequence 2048, tensor parallelism 8): 22B (a 64, h 6144,
//! L 48), GPT-3 175B (a 96, h 12288, L 96), MT-NLG 530B (a 128, h 20480, L 105) and 1T (a 160,
//! h 25600, L 128). Expected figures are the table's formulas times L, per sequence (b = 1), in GB:
//! what the first pipeline stage holds, since it keeps p micro-batches of L/p layers (section 4.2.3).

use stoke_plan::{layer_activation_bytes, layers_in_flight, Layout, ModelConfig, Recompute, Stage};

struct Paper {
    name: &'static str,
    n_head: usize,
    d_model: usize,
    n_layer: usize,
    pipeline: usize,
}

const CONFIGS: &[Paper] = &[
    Paper { name: "22B", n_head: 64, d_model: 6144, n_layer: 48, pipeline: 1 },
    Paper { name: "175B", n_head: 96, d_model: 12288, n_layer: 96, pipeline: 8 },
    Paper { name: "530B", n_head: 128, d_model: 20480, n_layer: 105, pipeline: 35 },
    Paper { name: "1T", n_head: 160, d_model: 25600, n_layer: 128, pipeline: 64 },
];

/// (technique, sequence parallel, recomputation)
const TECHNIQUES: [(&str, bool, Recompute); 5] = [
    // s·b·h·(10 + 24/t + 5·a·s/(h·t))
    ("tensor parallel", false, Recompute::None),
    // s·b·h/t·(34 + 5·a·s/h)
    ("tensor + sequence parallel", true, Recompute::None),
    // s·b·h·(10 + 24/t)
    ("tensor parallel + selective recompute", false, Recompute::Selective),
    // s·b·h/t·34
    ("tensor + sequence parallel + selective recompute", true, Recompute::Selective),
    // 2·s·b·h
    ("full recompute", false, Recompute::Full),
];

fn check(paper: &Paper, technique_idx: usize, expected_gb: f64) {
    let (technique, sequence_parallel, recompute) = TECHNIQUES[technique_idx];
    let model = ModelConfig::gpt(paper.n_layer, paper.d_model, paper.n_head, 2048, 51200);
    let layout = Layout {
        tensor: 8,
        pipeline: paper.pipeline,
        sequence_parallel,
        recompute,
        n_micro_batches: paper.pipeline.max(1) * 4,
        ..Layout::single(1)
    };
    let per_layer = layer_activation_bytes(&model, &layout, recompute);
    let first_stage = per_layer * layers_in_flight(&model, &layout, Stage::First);
    let got_gb = first_stage / 1e9;
    assert!(
        (got_gb - expected_gb).abs() < 0.0005 + 1e-6 * expected_gb,
        "{} {technique}: {got_gb:.4} GB vs formula {expected_gb} GB",
        paper.name
    );
}

#[test]
fn korthikanti_table_2_formulas_for_their_configurations() {
    // Columns: the five techniques above. Computed from the formulas with s = 2048, b = 1, t = 8.
    let expected = [
        [15.905, 10.620, 7.852, 2.567, 1.208],
        [55.566, 34.427, 31.407, 10.268, 4.832],
        [92.484, 53.949, 57.252, 18.717, 8.808],
        [140.929, 82.208, 87.242, 28.521, 13.422],
    ];
    for (paper, row) in CONFIGS.iter().zip(expected) {
        for (technique_idx, gb) in row.into_iter().enumerate() {
            check(paper, technique_idx, gb);
        }
    }
}

#[test]
fn selective_recompute_with_sequence_parallelism_saves_five_as_over_h() {
    // Korthikanti et al., section 5: for GPT-3 175B the attention core is 5·a·s/h = 80 of the
    // 34 + 80 units per s·b·h, so selective recomputation keeps 34/114 = 30% of the activations.
    let model = ModelConfig::gpt(96, 12288, 96, 2048, 51200);
    let layout = |recompute| Layout { tensor: 8, sequence_parallel: true, recompute, ..Layout::single(1) };
    let none = layer_activation_bytes(&model, &layout(Recompute::None), Recompute::None);
    let selective = layer_activation_bytes(&model, &layout(Recompute::Selective), Recompute::Selective);
    assert!((selective / none - 34.0 / 114.0).abs() < 1e-12);
}
