//! Model-state memory against Rajbhandari et al. (2020), "ZeRO: Memory Optimizations Toward Training
//! Trillion Parameter Models", Figure 1: Ψ = 7.5B parameters, N_d = 64 data-parallel devices,
//! mixed-precision Adam (K = 12). Published per-device figures: baseline 120 GB, P_os 31.4 GB,
//! P_os+g 16.6 GB, P_os+g+p 1.9 GB.

use stoke_plan::{model_states, Precision, ZeroStage};

fn check(n_params: f64, n_data: usize, zero: ZeroStage, published_gb: f64, published_decimals: i32) {
    let got_gb = model_states(n_params, n_data, zero, Precision::Bf16).total() / 1e9;
    // The paper rounds to the digits it prints; we must agree to within half of the last one.
    let half_ulp = 0.5 * 10f64.powi(-published_decimals);
    assert!((got_gb - published_gb).abs() <= half_ulp, "{zero:?}: {got_gb:.3} GB vs published {published_gb} GB");
}

#[test]
fn zero_figure_1_7_5b_on_64_devices() {
    check(7.5e9, 64, ZeroStage::None, 120.0, 0);
    check(7.5e9, 64, ZeroStage::Optimizer, 31.4, 1);
    check(7.5e9, 64, ZeroStage::Gradients, 16.6, 1);
    check(7.5e9, 64, ZeroStage::Parameters, 1.9, 1);
}

#[test]
fn one_data_parallel_rank_partitions_nothing() {
    for zero in ZeroStage::ALL {
        check(7.5e9, 1, zero, 120.0, 0);
    }
}

#[test]
fn the_table_stoke_plan_prints_is_figure_1() {
    let published: Vec<_> = stoke_plan::ZERO_FIGURE_1.iter().map(|bar| (bar.stage, bar.published_gb)).collect();
    assert_eq!(
        published,
        [
            (ZeroStage::None, 120.0),
            (ZeroStage::Optimizer, 31.4),
            (ZeroStage::Gradients, 16.6),
            (ZeroStage::Parameters, 1.9)
        ]
    );
    assert_eq!((stoke_plan::ZERO_FIGURE_1_PARAMS, stoke_plan::ZERO_FIGURE_1_DEVICES), (7.5e9, 64));
    assert!(stoke_plan::ZERO_FIGURE_1.iter().all(|bar| bar.agrees()));
}
