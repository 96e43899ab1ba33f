//! `stoke plan --zero-table`: the model states per rank that `stoke train` holds at each ZeRO
//! stage (the formula its report.json uses), beside the ZeRO paper's, and the paper's Figure 1.

use std::fmt::Write as _;
use std::process::ExitCode;

use stoke_plan::{
    model_states, model_units, optimizer_state_buffers, zero_rank_bytes, ModelConfig, Precision, Slices, ZeroInFlight,
    ZeroStage, ZERO_FIGURE_1, ZERO_FIGURE_1_DEVICES, ZERO_FIGURE_1_PARAMS,
};

use super::output::emit;

/// What to tabulate.
#[derive(Debug, Clone)]
pub struct ZeroTable {
    pub model: ModelConfig,
    /// Ranks.
    pub devices: usize,
    /// The optimizer (adamw, lamb, sgd).
    pub optimizer: String,
    /// Where the optimizer's slices live: mapped or copied.
    pub zero_slices: String,
    /// Full gradients alive at once at stages 2 and 3.
    pub zero_gradient_units: usize,
    /// Gathered parameter units alive at once at stage 3 besides the embedding.
    pub zero_gathered_units: usize,
    /// Print JSON instead of a table.
    pub json: bool,
}

/// Bytes as MiB below a GiB, else GiB.
fn format_bytes(bytes: u64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if (bytes as f64) < 1024.0 * MIB {
        format!("{:.2} MiB", bytes as f64 / MIB)
    } else {
        format!("{:.2} GiB", bytes as f64 / (1024.0 * MIB))
    }
}

/// `--zero-table`: stoke's model states per rank at each ZeRO stage, then Figure 1 of the ZeRO paper.
pub fn run_zero_table(args: &ZeroTable) -> anyhow::Result<ExitCode> {
    let model = &args.model;
    let world = args.devices;
    let optimizer_buffers = optimizer_state_buffers(&args.optimizer).ok_or_else(|| {
        crate::exit::usage(format!("--optimizer must be adamw, lamb or sgd; got {:?}", args.optimizer))
    })?;
    let slices = Slices::parse(&args.zero_slices).ok_or_else(|| {
        crate::exit::usage(format!("--zero-slices must be mapped or copied; got {:?}", args.zero_slices))
    })?;
    let units = model_units(model);
    let n_params: u64 = units.iter().sum();
    let in_flight = ZeroInFlight { gradient_units: args.zero_gradient_units, gathered_units: args.zero_gathered_units };
    let mut stages = Vec::new();
    for stage in ZeroStage::ALL {
        let mut ranks = Vec::new();
        for rank in 0..world {
            let peak = zero_rank_bytes(&units, world, rank, stage, optimizer_buffers, slices, in_flight)
                .map_err(crate::exit::plan_error)?;
            let between_steps =
                zero_rank_bytes(&units, world, rank, stage, optimizer_buffers, slices, ZeroInFlight::NONE)
                    .map_err(crate::exit::plan_error)?;
            ranks.push((rank, peak, between_steps));
        }
        stages.push((stage, ranks));
    }
    let mut out = String::new();
    if args.json {
        let json = serde_json::json!({
            "model": model,
            "world": world,
            "optimizer": args.optimizer,
            "optimizer_buffers": optimizer_buffers,
            "slices": slices,
            "in_flight": in_flight,
            "units": units,
            "n_params": n_params,
            "stages": stages.iter().map(|(stage, ranks)| serde_json::json!({
                "stage": stage,
                "ranks": ranks.iter().map(|(rank, peak, between)| serde_json::json!({
                    "rank": rank,
                    "parameters": peak.parameters,
                    "gradients": peak.gradients,
                    "optimizer": peak.optimizer,
                    "comm_buffers": peak.comm_buffers,
                    "total": peak.total(),
                    "between_steps": between,
                    "between_steps_total": between.total(),
                })).collect::<Vec<_>>(),
                "paper_model_states_fp32_adamw": model_states(n_params as f64, world, *stage, Precision::Fp32),
            })).collect::<Vec<_>>(),
            "zero_figure_1": ZERO_FIGURE_1.iter().map(|bar| serde_json::json!({
                "stage": bar.stage,
                "published_gb": bar.published_gb,
                "computed_gb": bar.computed_gb(),
                "agrees": bar.agrees(),
            })).collect::<Vec<_>>(),
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&json)?)?;
        return emit(&out);
    }
    writeln!(
        out,
        "stoke's model states per rank, fp32, {} (state buffers: {}): {} layers, d {}, vocab {}, seq {} ({} parameters) on {} ranks;",
        args.optimizer, optimizer_buffers, model.n_layer, model.d_model, model.vocab_size, model.seq_len, n_params, world
    )?;
    writeln!(
        out,
        "optimizer slices {}; in flight at the peak: {} full gradient units (stages 2, 3), the embedding and {} more gathered units (stage 3)",
        args.zero_slices, in_flight.gradient_units, in_flight.gathered_units
    )?;
    let header =
        ["stage", "rank", "parameters", "gradients", "optimizer", "comm", "peak", "between steps", "paper (fp32)"];
    let mut rows = vec![header.map(String::from)];
    for (stage, ranks) in &stages {
        // The paper's fp32 model states with K = 4 bytes per state buffer (its Fp32 K counts AdamW's two).
        let states = model_states(n_params as f64, world, *stage, Precision::Fp32);
        let paper = (states.parameters + states.gradients + states.optimizer * optimizer_buffers as f64 / 2.0) as u64;
        for (rank, peak, between) in ranks {
            rows.push([
                stage.number().to_string(),
                rank.to_string(),
                format_bytes(peak.parameters),
                format_bytes(peak.gradients),
                format_bytes(peak.optimizer),
                format_bytes(peak.comm_buffers),
                format_bytes(peak.total()),
                format_bytes(between.total()),
                format_bytes(paper),
            ]);
        }
    }
    let widths: Vec<usize> =
        (0..header.len()).map(|col| rows.iter().map(|row| row[col].chars().count()).max().unwrap_or(0)).collect();
    for row in &rows {
        let cells: Vec<String> = row.iter().zip(&widths).map(|(cell, width)| format!("{cell:>width$}")).collect();
        writeln!(out, "{}", cells.join("  "))?;
    }
    writeln!(
        out,
        "paper (fp32): Rajbhandari et al.'s model states with 4-byte weights and gradients, K = {}",
        4 * optimizer_buffers
    )?;
    writeln!(
        out,
        "\nZeRO paper, Figure 1 (Ψ = {}B parameters, N_d = {}, mixed-precision Adam, K = 12), from the same model_states:",
        ZERO_FIGURE_1_PARAMS / 1e9,
        ZERO_FIGURE_1_DEVICES
    )?;
    writeln!(out, "  {:>5}  {:>10}  {:>10}", "stage", "computed", "published")?;
    for bar in ZERO_FIGURE_1 {
        writeln!(
            out,
            "  {:>5}  {:>7.1} GB  {:>7} GB{}",
            bar.stage.number(),
            bar.computed_gb(),
            format!("{:.*}", bar.published_decimals as usize, bar.published_gb),
            if bar.agrees() { "" } else { "  (disagrees)" }
        )?;
    }
    emit(&out)
}
