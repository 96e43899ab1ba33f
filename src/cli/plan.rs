//! `stoke plan`: rank parallel layouts of a model on a cluster by predicted memory and step time,
//! or (`--calibrate`) fit this machine's efficiencies from measured runs.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use stoke_plan::{
    calibrate, compare, merge_repeats, model_states, model_units, optimizer_state_buffers, render_table, search,
    zero_rank_bytes, ClusterConfig, Efficiency, MeasuredRun, ModelConfig, PlanConfig, PlanError, Precision, Recompute,
    RunFit, SearchConfig, Slices, ZeroInFlight, ZeroStage, ZERO_FIGURE_1, ZERO_FIGURE_1_DEVICES, ZERO_FIGURE_1_PARAMS,
};

use super::UsageError;

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Model preset: tiny, small, gpt2-124m, gpt3-175b, llama-7b, llama-13b, llama-70b.
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Override the preset's transformer blocks.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Override the preset's width.
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Override the preset's attention heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Override the preset's sequence length.
    #[arg(long)]
    pub seq: Option<usize>,
    /// Override the preset's vocabulary size.
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Sequences per optimizer step over all replicas.
    #[arg(long, default_value_t = 16)]
    pub global_batch: usize,
    /// Cluster preset: a100-80g, h100, h200, cpu (this machine).
    #[arg(long, default_value = "cpu")]
    pub cluster: String,
    /// Devices in all.
    #[arg(long, default_value_t = 1)]
    pub devices: usize,
    /// Override the preset's devices per node.
    #[arg(long)]
    pub devices_per_node: Option<usize>,
    /// Override the preset's memory per device, GiB.
    #[arg(long)]
    pub memory_gib: Option<f64>,
    /// Override the preset's peak TFLOP/s at the chosen precision.
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Override the preset's intra-node bandwidth per device, GB/s.
    #[arg(long)]
    pub intra_gbps: Option<f64>,
    /// Override the preset's inter-node bandwidth per device, GB/s.
    #[arg(long)]
    pub inter_gbps: Option<f64>,
    /// Override the preset's intra-node latency, microseconds.
    #[arg(long)]
    pub intra_latency_us: Option<f64>,
    /// Override the preset's inter-node latency, microseconds.
    #[arg(long)]
    pub inter_latency_us: Option<f64>,
    /// Precision of the matrix multiplies: fp32 or bf16.
    #[arg(long, default_value = "bf16")]
    pub precision: String,
    /// Efficiencies to use instead of the preset's (a JSON file written by `--calibrate --save`).
    #[arg(long)]
    pub efficiency: Option<PathBuf>,
    /// Tensor-parallel sizes to try (comma-separated); default: all that divide evenly.
    #[arg(long, value_delimiter = ',')]
    pub tensor: Vec<usize>,
    /// Pipeline sizes to try (comma-separated); default: all that divide evenly.
    #[arg(long, value_delimiter = ',')]
    pub pipeline: Vec<usize>,
    /// Micro-batch sizes to try (comma-separated); default: all that divide evenly, up to 64.
    #[arg(long, value_delimiter = ',')]
    pub micro_batch: Vec<usize>,
    /// ZeRO stages to try (comma-separated, 0-3); default: all.
    #[arg(long, value_delimiter = ',')]
    pub zero: Vec<u8>,
    /// Recomputation policies to try (comma-separated: none, selective, full); default: all.
    #[arg(long, value_delimiter = ',')]
    pub recompute: Vec<String>,
    /// Most model chunks per pipeline stage (interleaved schedule); 1 disables interleaving.
    #[arg(long, default_value_t = 4)]
    pub max_virtual_stages: usize,
    /// Rows of the table.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Fit this machine's efficiencies from these runs' report.json files.
    #[arg(long, num_args = 1..)]
    pub calibrate: Vec<PathBuf>,
    /// With --calibrate: runs held out of the fit, predicted and compared.
    #[arg(long, num_args = 1..)]
    pub holdout: Vec<PathBuf>,
    /// With --calibrate: merge runs of the same shape into one at their median step time.
    #[arg(long)]
    pub merge_repeats: bool,
    /// With --calibrate: write the fitted efficiencies to this JSON file (for --efficiency).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Print the model states per rank that `stoke train` holds at `dist.zero` 0 to 3 for this model
    /// on --devices ranks (the formula its report.json uses), and the ZeRO paper's Figure 1.
    #[arg(long)]
    pub zero_table: bool,
    /// With --zero-table: the optimizer (adamw, lamb, sgd).
    #[arg(long, default_value = "adamw")]
    pub optimizer: String,
    /// With --zero-table: where the optimizer's slices live: mapped (views of the model's buffers, what
    /// the fused CPU optimizer does) or copied.
    #[arg(long, default_value = "mapped")]
    pub zero_slices: String,
    /// With --zero-table: full gradients alive at once at stages 2 and 3 (units whose backward has run
    /// and whose reduce-scatter has not finished).
    #[arg(long, default_value_t = 2)]
    pub zero_gradient_units: usize,
    /// With --zero-table: gathered parameter units alive at once at stage 3 besides the embedding (whose
    /// weights the tied head reads): 1 + dist.prefetch_blocks.
    #[arg(long, default_value_t = 2)]
    pub zero_gathered_units: usize,
}

fn usage(message: String) -> anyhow::Error {
    anyhow::Error::new(UsageError(message))
}

/// Preset and configuration mistakes are the user's: exit 2.
fn usage_if_config(err: PlanError) -> anyhow::Error {
    match err {
        PlanError::UnknownPreset { .. } | PlanError::InvalidConfig { .. } | PlanError::TooFewRuns { .. } => {
            usage(err.to_string())
        }
        other => anyhow::Error::new(other),
    }
}

fn read_efficiency(path: &PathBuf) -> anyhow::Result<Efficiency> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let efficiency: Efficiency = serde_json::from_str(&text)
        .map_err(|err| usage(format!("{}: not an efficiency file: {err}", path.display())))?;
    efficiency.validate().map_err(usage_if_config)?;
    Ok(efficiency)
}

fn cluster_from_args(args: &PlanArgs, precision: Precision) -> anyhow::Result<ClusterConfig> {
    let mut cluster = ClusterConfig::preset(&args.cluster, args.devices).map_err(usage_if_config)?;
    if let Some(per_node) = args.devices_per_node {
        cluster.devices_per_node = per_node;
    }
    if let Some(gib) = args.memory_gib {
        cluster.memory_bytes = gib * 1024.0 * 1024.0 * 1024.0;
    }
    if let Some(tflops) = args.peak_tflops {
        match precision {
            Precision::Fp32 => cluster.peak_flops_fp32 = tflops * 1e12,
            Precision::Bf16 => cluster.peak_flops_bf16 = tflops * 1e12,
        }
    }
    if let Some(gbps) = args.intra_gbps {
        cluster.intra_node_bandwidth = gbps * 1e9;
    }
    if let Some(gbps) = args.inter_gbps {
        cluster.inter_node_bandwidth = gbps * 1e9;
    }
    if let Some(us) = args.intra_latency_us {
        cluster.intra_node_latency_s = us * 1e-6;
    }
    if let Some(us) = args.inter_latency_us {
        cluster.inter_node_latency_s = us * 1e-6;
    }
    if let Some(path) = &args.efficiency {
        cluster.efficiency = read_efficiency(path)?;
    }
    cluster.validate().map_err(usage_if_config)?;
    Ok(cluster)
}

fn model_from_args(args: &PlanArgs) -> anyhow::Result<ModelConfig> {
    let mut model = ModelConfig::preset(&args.model).map_err(usage_if_config)?;
    let overrides = [
        (&mut model.n_layer, args.layers),
        (&mut model.d_model, args.hidden),
        (&mut model.n_head, args.heads),
        (&mut model.seq_len, args.seq),
        (&mut model.vocab_size, args.vocab),
    ];
    for (field, value) in overrides {
        if let Some(value) = value {
            *field = value;
        }
    }
    model.validate().map_err(usage_if_config)?;
    Ok(model)
}

fn search_from_args(args: &PlanArgs) -> anyhow::Result<SearchConfig> {
    let mut search = SearchConfig { max_virtual_stages: args.max_virtual_stages, ..SearchConfig::default() };
    search.tensor = args.tensor.clone();
    search.pipeline = args.pipeline.clone();
    search.micro_batch = args.micro_batch.clone();
    if !args.zero.is_empty() {
        search.zero = args.zero.iter().map(|&n| ZeroStage::try_from(n).map_err(usage)).collect::<Result<_, _>>()?;
    }
    if !args.recompute.is_empty() {
        search.recompute = args
            .recompute
            .iter()
            .map(|name| {
                Recompute::ALL
                    .into_iter()
                    .find(|r| r.name() == name)
                    .ok_or_else(|| usage(format!("--recompute must be none, selective or full; got {name:?}")))
            })
            .collect::<Result<_, _>>()?;
    }
    Ok(search)
}

pub fn run(args: PlanArgs) -> anyhow::Result<ExitCode> {
    if args.zero_table {
        if !args.calibrate.is_empty() {
            return Err(usage("--zero-table and --calibrate are separate uses of stoke plan".into()));
        }
        return run_zero_table(&args);
    }
    let precision = Precision::parse(&args.precision).map_err(usage_if_config)?;
    let cluster = cluster_from_args(&args, precision)?;
    if !args.calibrate.is_empty() {
        return run_calibration(&args, &cluster);
    }
    if !args.holdout.is_empty() || args.save.is_some() || args.merge_repeats {
        return Err(usage("--holdout, --save and --merge-repeats go with --calibrate".into()));
    }
    let config = PlanConfig {
        model: model_from_args(&args)?,
        cluster,
        precision,
        global_batch: args.global_batch,
        search: search_from_args(&args)?,
    };
    let outcome = match search(&config) {
        Ok(outcome) => outcome,
        Err(err @ PlanError::NoFeasibleLayout { .. }) => {
            eprintln!("error: {err}");
            return Ok(ExitCode::from(1));
        }
        Err(err) => return Err(usage_if_config(err)),
    };
    let mut out = String::new();
    if args.json {
        let plans: Vec<_> = outcome.plans.iter().take(args.top).collect();
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
        args.precision,
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
        args.top.min(outcome.plans.len())
    )?;
    write!(out, "{}", render_table(&outcome.plans, args.top))?;
    writeln!(out, "layout: d data x t tensor (+sp sequence parallel) x p pipeline (xv interleaved chunks), z ZeRO stage, recomputation, b micro-batch x micro-batches")?;
    emit(&out)
}

fn load_runs(paths: &[PathBuf], cluster: &ClusterConfig) -> anyhow::Result<Vec<MeasuredRun>> {
    paths
        .iter()
        .map(|path| {
            MeasuredRun::from_report_file(path, cluster).map_err(|err| match err {
                PlanError::ReadReport { .. } => anyhow::Error::new(err),
                other => usage(other.to_string()),
            })
        })
        .collect()
}

fn write_fits(out: &mut String, title: &str, fits: &[RunFit]) -> std::fmt::Result {
    writeln!(out, "{title}")?;
    writeln!(out, "  {:<24} {:>12} {:>12} {:>8}", "run", "measured", "predicted", "error")?;
    for fit in fits {
        writeln!(
            out,
            "  {:<24} {:>9.1} ms {:>9.1} ms {:>+7.1}%",
            fit.name,
            fit.measured_step_s * 1e3,
            fit.predicted_step_s * 1e3,
            100.0 * fit.relative_error
        )?;
    }
    Ok(())
}

fn run_calibration(args: &PlanArgs, cluster: &ClusterConfig) -> anyhow::Result<ExitCode> {
    let mut runs = load_runs(&args.calibrate, cluster)?;
    let mut held_out = load_runs(&args.holdout, cluster)?;
    if args.merge_repeats {
        runs = merge_repeats(runs);
        held_out = merge_repeats(held_out);
    }
    let calibration = calibrate(&runs, &cluster.efficiency).map_err(usage_if_config)?;
    let held_out_fits = compare(&held_out, &calibration.efficiency);
    let worst_held_out = held_out_fits.iter().map(|fit| fit.relative_error.abs()).fold(0.0, f64::max);
    let mut out = String::new();
    if let Some(path) = &args.save {
        let text = serde_json::to_string_pretty(&calibration.efficiency)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    if args.json {
        let json = serde_json::json!({
            "efficiency": calibration.efficiency,
            "calibration": calibration.fits,
            "held_out": held_out_fits,
            "worst_held_out_error": if held_out_fits.is_empty() { None } else { Some(worst_held_out) },
        });
        writeln!(out, "{}", serde_json::to_string_pretty(&json)?)?;
        return emit(&out);
    }
    let eff = &calibration.efficiency;
    writeln!(
        out,
        "fitted on {} runs: compute {:.3}, memory {:.3}, optimizer {:.3} of peak; {:.3} ms per block pass, {:.2} ms per step; leave-one-out error {:.1}%",
        runs.len(),
        eff.compute,
        eff.memory,
        eff.optimizer,
        eff.layer_overhead_s * 1e3,
        eff.step_overhead_s * 1e3,
        100.0 * eff.relative_error
    )?;
    write_fits(&mut out, "calibration runs:", &calibration.fits)?;
    if !held_out_fits.is_empty() {
        write_fits(&mut out, "held-out runs:", &held_out_fits)?;
        writeln!(out, "worst held-out error: {:.1}%", 100.0 * worst_held_out)?;
    }
    if let Some(path) = &args.save {
        writeln!(out, "efficiency written to {} (use with --efficiency)", path.display())?;
    }
    emit(&out)
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
fn run_zero_table(args: &PlanArgs) -> anyhow::Result<ExitCode> {
    let model = model_from_args(args)?;
    let world = args.devices;
    let optimizer_buffers = optimizer_state_buffers(&args.optimizer)
        .ok_or_else(|| usage(format!("--optimizer must be adamw, lamb or sgd; got {:?}", args.optimizer)))?;
    let slices = Slices::parse(&args.zero_slices)
        .ok_or_else(|| usage(format!("--zero-slices must be mapped or copied; got {:?}", args.zero_slices)))?;
    let units = model_units(&model);
    let n_params: u64 = units.iter().sum();
    let in_flight = ZeroInFlight { gradient_units: args.zero_gradient_units, gathered_units: args.zero_gathered_units };
    let mut stages = Vec::new();
    for stage in ZeroStage::ALL {
        let mut ranks = Vec::new();
        for rank in 0..world {
            let peak = zero_rank_bytes(&units, world, rank, stage, optimizer_buffers, slices, in_flight)
                .map_err(usage_if_config)?;
            let between_steps =
                zero_rank_bytes(&units, world, rank, stage, optimizer_buffers, slices, ZeroInFlight::NONE)
                    .map_err(usage_if_config)?;
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

/// Writes the output in one go; a reader that went away (`stoke plan | head`) is not an error.
fn emit(text: &str) -> anyhow::Result<ExitCode> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => Ok(ExitCode::SUCCESS),
        Err(err) => Err(anyhow::Error::new(err).context("writing to stdout")),
    }
}
