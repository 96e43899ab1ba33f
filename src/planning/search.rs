//! The layouts the planner ranks for one model on one cluster, printed as a table or JSON.

use std::fmt::Write as _;
use std::process::ExitCode;

use stoke_plan::{render_table, search, PlanConfig, PlanError};

use super::output::emit;

/// Searches the layouts of `config` and prints the fastest `top` (as JSON with `json`);
/// `precision_name` is how the command line named the precision. No feasible layout is exit 1.
pub fn print_search(config: &PlanConfig, precision_name: &str, top: usize, json: bool) -> anyhow::Result<ExitCode> {
    let precision = config.precision;
    let outcome = match search(config) {
        Ok(outcome) => outcome,
        Err(err @ PlanError::NoFeasibleLayout { .. }) => {
            eprintln!("error: {err}");
            return Ok(ExitCode::from(1));
        }
        Err(err) => return Err(crate::exit::plan_error(err)),
    };
    let mut out = String::new();
    if json {
        let plans: Vec<_> = outcome.plans.iter().take(top).collect();
        let json = serde_json::json!({
            "config": config,
            "n_considered": outcome.n_considered,
            "n_pruned_by_memory": outcome.n_pruned_by_memory,
            "plans": plans,
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&json)?)?;
        return emit(&out);
    }
    let model = &config.model;
    writeln!(
        out,
        "model: {} layers, d {}, {} heads, seq {}, vocab {} ({:.3}B parameters); global batch {}",
        model.n_layer,
        model.d_model,
        model.n_head,
        model.seq_len,
        model.vocab_size,
        model.n_params() as f64 / 1e9,
        config.global_batch
    )?;
    writeln!(
        out,
        "cluster: {} x {} ({} per node, {:.0} GiB, {:.1} TFLOP/s {}); efficiency: compute {:.2}, memory {:.2}, comm {:.2}",
        config.cluster.n_devices,
        config.cluster.name,
        config.cluster.devices_per_node,
        config.cluster.memory_bytes / (1024.0 * 1024.0 * 1024.0),
        config.cluster.peak_flops(precision) / 1e12,
        precision_name,
        config.cluster.efficiency.compute,
        config.cluster.efficiency.memory,
        config.cluster.efficiency.comm
    )?;
    writeln!(
        out,
        "{} layouts considered, {} pruned by memory, {} fit; the fastest {}:",
        outcome.n_considered,
        outcome.n_pruned_by_memory,
        outcome.plans.len(),
        top.min(outcome.plans.len())
    )?;
    write!(out, "{}", render_table(&outcome.plans, top))?;
    writeln!(out, "layout: d data x t tensor (+sp sequence parallel) x p pipeline (xv interleaved chunks), z ZeRO stage, recomputation, b micro-batch x micro-batches")?;
    emit(&out)
}
