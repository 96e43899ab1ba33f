//! `stoke plan`: rank parallel layouts of a model on a cluster by predicted memory and step time,
//! or (`--calibrate`) fit this machine's efficiencies from measured runs.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use stoke_plan::{ClusterConfig, ModelConfig, PlanConfig, Precision, Recompute, SearchConfig, ZeroStage};

use crate::exit::{plan_error, usage};
use crate::planning::{Calibration, ZeroTable};

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// Model preset: tiny, small, gpt2-124m, llama-tiny, llama3-8b, llama3-70b, vla-tiny, vla-small
    /// (stoke's own; a vla preset with the built-in robot set's input sizes), gpt3-175b, llama-7b,
    /// llama-13b, llama-70b (published shapes).
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Model family (`model.family`) of stoke's own presets: gpt, gpt-rms, llama, vla. Default:
    /// llama for the llama presets, vla for the vla presets, else gpt.
    #[arg(long)]
    pub family: Option<String>,
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
    /// Fine-tune with LoRA adapters of this rank, every other weight frozen (`train.lora.rank`).
    #[arg(long)]
    pub lora_rank: Option<usize>,
    /// With --lora-rank: the matrices with adapters (q_proj, k_proj, v_proj, o_proj, gate_proj,
    /// up_proj, down_proj); default q_proj,v_proj.
    #[arg(long, value_delimiter = ',')]
    pub lora_targets: Vec<String>,
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

fn cluster_from_args(args: &PlanArgs, precision: Precision) -> anyhow::Result<ClusterConfig> {
    let mut cluster = ClusterConfig::preset(&args.cluster, args.devices).map_err(plan_error)?;
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
        cluster.efficiency = crate::planning::read_efficiency(path)?;
    }
    cluster.validate().map_err(plan_error)?;
    Ok(cluster)
}

fn model_from_args(args: &PlanArgs) -> anyhow::Result<ModelConfig> {
    // stoke's own shapes are described by their family, from the model config `stoke train`
    // builds them from; the published shapes come from the planner's presets.
    let family = match &args.family {
        Some(family) => family.clone(),
        None if args.model.starts_with("llama-") || args.model.starts_with("llama3-") => "llama".into(),
        None if args.model.starts_with("vla-") => "vla".into(),
        None => "gpt".into(),
    };
    let mut model = if stoke_train::ModelConfig::PRESETS.contains(&args.model.as_str()) {
        let trained = stoke_train::ModelConfig { family, preset: args.model.clone(), ..Default::default() };
        // A vla preset's input sizes are those of the built-in robot set, as `stoke train` takes
        // them without a dataset.
        let builtin = crate::run::EpisodeData { path: "", history: 0, blank: "none" };
        let trained = crate::run::resolve_episode_dims(&trained, &builtin)
            .map_err(|(key, message)| usage(format!("{key}: {message}")))?;
        stoke_train::plan_model(&trained).map_err(|err| usage(err.to_string()))?
    } else if args.family.is_some() {
        return Err(usage(format!("--family applies to stoke's own presets; {} is a published shape", args.model)));
    } else {
        ModelConfig::preset(&args.model).map_err(plan_error)?
    };
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
    if let Some(rank) = args.lora_rank {
        model.lora_rank = rank;
        if !args.lora_targets.is_empty() {
            model.lora_targets = args.lora_targets.clone();
        }
    } else if !args.lora_targets.is_empty() {
        return Err(usage("--lora-targets needs --lora-rank".to_string()));
    }
    model.validate().map_err(plan_error)?;
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
        return crate::planning::run_zero_table(&ZeroTable {
            model: model_from_args(&args)?,
            devices: args.devices,
            optimizer: args.optimizer,
            zero_slices: args.zero_slices,
            zero_gradient_units: args.zero_gradient_units,
            zero_gathered_units: args.zero_gathered_units,
            json: args.json,
        });
    }
    let precision = Precision::parse(&args.precision).map_err(plan_error)?;
    let cluster = cluster_from_args(&args, precision)?;
    if !args.calibrate.is_empty() {
        let calibration = Calibration {
            calibrate: args.calibrate,
            holdout: args.holdout,
            merge_repeats: args.merge_repeats,
            save: args.save,
            json: args.json,
        };
        return crate::planning::run_calibration(&calibration, &cluster);
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
    crate::planning::print_search(&config, &args.precision, args.top, args.json)
}
