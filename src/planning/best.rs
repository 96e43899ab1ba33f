//! `stoke launch --plan best`: the layout `stoke plan` ranks first, among those stoke can run, for
//! the model the command trains on this machine's CPUs, turned into the command's settings.
//!
//! The command's `--config` and `--set` arguments are read as `train` reads them; the planner
//! searches tensor x pipeline x data layouts of `--nproc` devices (the `cpu` cluster as one node
//! with this machine's memory split between the workers and its measured matmul peak, or a
//! calibration's efficiencies), ZeRO stages, recomputation and micro-batches at the run's global
//! batch. Cuts and sequence parallelism run for the families that declare their split, and
//! pipeline stages shard at most the optimizer state and not beside a cut model, so other layouts
//! are passed over. The chosen layout becomes `--set dist.tensor, dist.pipeline,
//! dist.zero, train.micro_batch, train.grad_accum, train.recompute` (and `dist.sequence_parallel`,
//! and for interleaved stages `dist.pipeline_schedule, dist.pipeline_chunks`), which the command
//! must not set itself; a command that sets the schedule gets no interleaving.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use stoke_plan::{search, ClusterConfig, Estimate, PlanConfig, Precision, Recompute, SearchConfig, ZeroStage};

use crate::config::StokeConfig;

/// The keys a plan sets.
const PLANNED: &[&str] = &[
    "dist.tensor",
    "dist.pipeline",
    "dist.zero",
    "train.micro_batch",
    "train.grad_accum",
    "train.recompute",
    "dist.pipeline_chunks",
    "dist.sequence_parallel",
];

/// The chosen layout: the command with its settings added, and a line that says what was chosen.
pub struct BestLayout {
    pub command: Vec<String>,
    pub summary: String,
}

/// The command's config file and `--set` overrides (`train`'s and `doctor`'s arguments).
fn config_args(command: &[String]) -> (Option<PathBuf>, Vec<String>) {
    let (mut file, mut overrides) = (None, Vec::new());
    let mut args = command.iter().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--config" | "-c" => file = args.next().map(PathBuf::from),
            "--set" => overrides.extend(args.next().cloned()),
            other => {
                if let Some(value) = other.strip_prefix("--config=") {
                    file = Some(PathBuf::from(value));
                } else if let Some(value) = other.strip_prefix("--set=") {
                    overrides.push(value.to_string());
                }
            }
        }
    }
    (file, overrides)
}

/// Whether `layout` is one stoke runs for a model of `family`.
fn runnable(layout: &stoke_plan::Layout, family: &str) -> bool {
    let staged = layout.pipeline > 1;
    let cut = layout.tensor > 1;
    let zero_at_most_1 = matches!(layout.zero, ZeroStage::None | ZeroStage::Optimizer);
    (!(cut || layout.sequence_parallel) || stoke_train::TENSOR_PARALLEL_FAMILIES.contains(&family))
        && (!staged || (family != "vla" && zero_at_most_1))
        && !(cut && staged && layout.zero != ZeroStage::None)
}

/// stoke's `train.recompute` for the planner's policy: selective recomputation is the attention's.
fn recompute_name(recompute: Recompute) -> &'static str {
    match recompute {
        Recompute::None => "none",
        Recompute::Selective => "attention",
        Recompute::Full => "block",
    }
}

/// Plans `command` (`train ...` or `doctor ...`) on `nproc` workers of this machine.
pub fn best_layout(nproc: usize, command: &[String], efficiency: Option<&Path>) -> anyhow::Result<BestLayout> {
    if !matches!(command.first().map(String::as_str), Some("train" | "doctor")) {
        bail!("--plan best plans a `train` or `doctor` command; got `{}`", command.join(" "));
    }
    let (file, overrides) = config_args(command);
    if let Some(key) = PLANNED.iter().find(|key| overrides.iter().any(|o| o.trim_start().starts_with(*key))) {
        bail!("--plan best sets {key}; the command sets it too");
    }
    let config = StokeConfig::load(file.as_deref(), &overrides).context("--plan best reads the command's config")?;
    let sets_schedule = overrides.iter().any(|o| o.trim_start().starts_with("dist.pipeline_schedule"));
    let device = stoke_train::parse_device(&config.run.device)?;
    if device.is_cuda() {
        bail!("--plan best plans this machine's CPUs; on a GPU, name the layout (--layout T,P,D)");
    }
    let model = stoke_train::plan_model_for(&config.model, &config.train)?;
    let train = &config.train;
    let precision = if train.precision == stoke_train::Precision::Fp32 { Precision::Fp32 } else { Precision::Bf16 };
    // The workers share this one machine: one node, its memory split between them.
    let mut cluster = ClusterConfig { devices_per_node: nproc, ..ClusterConfig::preset("cpu", nproc)? };
    if let Some(bytes) = stoke_train::memory_capacity_bytes(device) {
        cluster.memory_bytes = bytes as f64 / nproc as f64;
    }
    // This machine's peak at the run's precision and threads, measured once and cached.
    let peak = stoke_train::matmul_peak_flops_cached(train.precision, device, &crate::profiler::cache_dir())?;
    match precision {
        Precision::Fp32 => cluster.peak_flops_fp32 = peak,
        Precision::Bf16 => cluster.peak_flops_bf16 = peak,
    }
    if let Some(path) = efficiency {
        cluster.efficiency = super::calibration::read_efficiency(path)?;
    }
    let global_batch =
        if train.global_batch > 0 { train.global_batch } else { train.micro_batch * train.grad_accum * nproc };
    let plan = PlanConfig {
        model,
        cluster,
        precision,
        global_batch,
        search: SearchConfig {
            sequence_parallel: vec![false, true],
            max_virtual_stages: if sets_schedule { 1 } else { SearchConfig::default().max_virtual_stages },
            ..Default::default()
        },
    };
    let outcome = search(&plan)?;
    let ranked = outcome.plans.len();
    let best: &Estimate = outcome
        .plans
        .iter()
        .find(|estimate| runnable(&estimate.layout, &config.model.family))
        .with_context(|| format!("--plan best: none of the {ranked} layouts that fit {nproc} workers runs here"))?;
    let layout = &best.layout;
    let mut settings = vec![
        format!("dist.tensor={}", layout.tensor),
        format!("dist.pipeline={}", layout.pipeline),
        format!("dist.zero={}", layout.zero.number()),
        format!("train.micro_batch={}", layout.micro_batch),
        format!("train.recompute=\"{}\"", recompute_name(layout.recompute)),
    ];
    if layout.sequence_parallel {
        settings.push("dist.sequence_parallel=true".to_string());
    }
    if layout.virtual_stages > 1 {
        settings.push("dist.pipeline_schedule=\"interleaved\"".to_string());
        settings.push(format!("dist.pipeline_chunks={}", layout.virtual_stages));
    }
    // A run that fixes its global batch derives the accumulation from it.
    if train.global_batch == 0 {
        settings.push(format!("train.grad_accum={}", layout.n_micro_batches));
    }
    let mut planned = command.to_vec();
    for setting in &settings {
        planned.extend(["--set".to_string(), setting.clone()]);
    }
    let summary = format!(
        "plan best of {ranked}: tensor {}{} x pipeline {}{} x data {}, ZeRO {}, recompute {}, micro-batch {} x {} \
         (predicted {:.1} ms a step)",
        layout.tensor,
        if layout.sequence_parallel { " (sequence parallel)" } else { "" },
        layout.pipeline,
        if layout.virtual_stages > 1 { format!(" ({} chunks a stage)", layout.virtual_stages) } else { String::new() },
        layout.data,
        layout.zero.number(),
        layout.recompute.name(),
        layout.micro_batch,
        layout.n_micro_batches,
        best.time.step_s * 1e3
    );
    Ok(BestLayout { command: planned, summary })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_command_config_is_read_as_train_reads_it() {
        let (file, sets) =
            config_args(&args(&["train", "--quiet", "--config", "run.toml", "--set", "a=1", "--set=b=2"]));
        assert_eq!(file, Some(PathBuf::from("run.toml")));
        assert_eq!(sets, args(&["a=1", "b=2"]));
    }

    #[test]
    fn only_layouts_stoke_runs_are_picked() {
        let layout = |tensor, pipeline, zero, sequence_parallel| stoke_plan::Layout {
            tensor,
            pipeline,
            zero,
            sequence_parallel,
            ..stoke_plan::Layout::single(4)
        };
        assert!(runnable(&layout(2, 1, ZeroStage::None, false), "gpt"));
        assert!(runnable(&layout(1, 1, ZeroStage::Parameters, false), "vla"));
        assert!(!runnable(&layout(2, 1, ZeroStage::None, false), "vla"), "vla declares no split");
        assert!(runnable(&layout(1, 2, ZeroStage::None, false), "gpt"));
        assert!(runnable(&layout(1, 2, ZeroStage::Optimizer, false), "gpt"));
        assert!(runnable(&layout(2, 2, ZeroStage::None, false), "llama"));
        assert!(!runnable(&layout(1, 2, ZeroStage::Gradients, false), "gpt"), "ZeRO-2 beside stages");
        assert!(!runnable(&layout(1, 2, ZeroStage::None, false), "vla"), "vla in stages");
        let interleaved = stoke_plan::Layout { virtual_stages: 2, ..layout(1, 2, ZeroStage::None, false) };
        assert!(runnable(&interleaved, "gpt"), "interleaved stages");
        assert!(runnable(&layout(2, 1, ZeroStage::None, true), "gpt"), "sequence parallelism");
        assert!(runnable(&layout(2, 1, ZeroStage::None, true), "llama"), "llama's sequence parallelism");
        assert!(!runnable(&layout(2, 1, ZeroStage::None, true), "vla"), "vla's sequence parallelism");
        assert!(runnable(&layout(2, 1, ZeroStage::Gradients, true), "gpt"), "sequence parallelism beside ZeRO-2");
        assert!(runnable(&layout(2, 1, ZeroStage::Parameters, true), "llama"), "sequence parallelism beside ZeRO-3");
        assert!(runnable(&layout(2, 2, ZeroStage::None, true), "gpt-rms"), "sequence parallelism in stages");
        assert!(runnable(&layout(2, 1, ZeroStage::Optimizer, false), "gpt"), "ZeRO-1 beside a cut model");
        assert!(runnable(&layout(2, 1, ZeroStage::Gradients, false), "gpt"), "ZeRO-2 beside a cut model");
        assert!(runnable(&layout(2, 1, ZeroStage::Parameters, false), "gpt"), "ZeRO-3 beside a cut model");
        assert!(!runnable(&layout(2, 2, ZeroStage::Optimizer, false), "gpt"), "ZeRO beside a cut model in stages");
    }

    #[test]
    fn a_command_that_sets_what_the_plan_sets_is_refused() {
        let err = best_layout(2, &args(&["train", "--set", "dist.tensor=2"]), None).err().unwrap().to_string();
        assert!(err.contains("sets dist.tensor"), "{err}");
        let err = best_layout(2, &args(&["prep", "x"]), None).err().unwrap().to_string();
        assert!(err.contains("plans a `train` or `doctor` command"), "{err}");
    }
}
