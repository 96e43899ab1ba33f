//! `stoke sched simulate`: compares scheduling policies on a job list (`--jobs FILE`, the CSV of
//! `stoke_sched::workload`) or on generated workloads (`--seeds`), and writes a timeline per
//! policy as HTML.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use stoke_sched::{report, Policy, SimConfig};

use super::UsageError;

#[derive(Debug, clap::Args)]
pub struct SchedArgs {
    #[command(subcommand)]
    pub command: SchedCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum SchedCommand {
    /// Simulate policies on a job list or generated workloads: mean and p99 completion time,
    /// makespan, utilization, resizes; one HTML timeline per policy and workload.
    Simulate(SimulateArgs),
}

#[derive(Debug, clap::Args)]
pub struct SimulateArgs {
    /// Jobs CSV (`submit_s,name,work,min_workers,max_workers,scaling[,resize_s[,priority[,noise_scale,batch_per_worker]]]`);
    /// without it, generated workloads, one per seed.
    #[arg(long)]
    pub jobs: Option<PathBuf>,
    /// Seeds of the generated workloads.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    pub seeds: Vec<u64>,
    /// Jobs per generated workload.
    #[arg(long, default_value_t = 160)]
    pub n_jobs: usize,
    /// Slots (devices or cores) to share.
    #[arg(long, default_value_t = 16)]
    pub slots: usize,
    /// Policies to compare: fifo, fair, goodput (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "fifo,fair,goodput")]
    pub policy: Vec<String>,
    /// Seconds between the goodput policy's reallocations.
    #[arg(long, default_value_t = 60.0)]
    pub tick_s: f64,
    /// The least seconds between two resizes of one job (goodput policy).
    #[arg(long, default_value_t = 300.0)]
    pub min_resize_interval_s: f64,
    /// Folder for the timelines (`timeline-<workload>-<policy>.html`) and `figures.json`.
    #[arg(long, default_value = "runs/sched")]
    pub out: PathBuf,
}

pub fn run(args: SchedArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        SchedCommand::Simulate(args) => simulate(args),
    }
}

fn simulate(args: SimulateArgs) -> anyhow::Result<ExitCode> {
    let policies: Vec<Policy> = args
        .policy
        .iter()
        .map(|p| p.parse().map_err(|e: stoke_sched::SchedError| anyhow::Error::new(UsageError(e.to_string()))))
        .collect::<Result<_, _>>()?;
    if args.slots == 0 {
        return Err(UsageError("--slots must be at least 1".into()).into());
    }
    let workloads: Vec<(String, Vec<stoke_sched::JobSpec>)> = match &args.jobs {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
            let jobs = stoke_sched::parse_csv(&text).map_err(|e| UsageError(format!("{}: {e}", path.display())))?;
            vec![(path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default(), jobs)]
        }
        None => args
            .seeds
            .iter()
            .map(|&seed| {
                let spec = stoke_sched::WorkloadSpec { jobs: args.n_jobs, max_slots: args.slots, ..Default::default() };
                (format!("seed{seed}"), stoke_sched::generate(&spec, seed))
            })
            .collect(),
    };
    std::fs::create_dir_all(&args.out).with_context(|| format!("cannot create {}", args.out.display()))?;
    println!(
        "{:<10} {:<8} {:>6} {:>12} {:>12} {:>12} {:>7} {:>8}",
        "workload", "policy", "jobs", "mean JCT s", "p99 JCT s", "makespan s", "util", "resizes"
    );
    let mut all = Vec::new();
    let mut by_policy: std::collections::BTreeMap<&str, Vec<report::Figures>> = Default::default();
    for (name, jobs) in &workloads {
        for &policy in &policies {
            let config = SimConfig {
                tick_s: args.tick_s,
                min_resize_interval_s: args.min_resize_interval_s,
                ..SimConfig::new(args.slots, policy)
            };
            let result = stoke_sched::simulate(jobs, &config).map_err(|e| UsageError(format!("{name}: {e}")))?;
            let f = report::figures(&result);
            let label = policy_name(policy);
            println!(
                "{name:<10} {label:<8} {:>6} {:>12.0} {:>12.0} {:>12.0} {:>6.1}% {:>8}",
                f.jobs,
                f.mean_completion_s,
                f.p99_completion_s,
                f.makespan_s,
                100.0 * f.utilization,
                f.resizes
            );
            let html = args.out.join(format!("timeline-{name}-{label}.html"));
            std::fs::write(&html, report::timeline_html(&format!("{name}, {label}, {} slots", args.slots), &result))
                .with_context(|| format!("cannot write {}", html.display()))?;
            all.push(serde_json::json!({ "workload": name, "policy": label, "figures": f }));
            by_policy.entry(label).or_default().push(f);
        }
    }
    if let (Some(fifo), Some(good)) = (by_policy.get("fifo"), by_policy.get("goodput")) {
        let ratio = |f: fn(&report::Figures) -> f64| {
            let r: Vec<f64> = fifo.iter().zip(good).map(|(a, b)| f(b) / f(a)).collect();
            let mut sorted = r.clone();
            sorted.sort_by(f64::total_cmp);
            (sorted[sorted.len() / 2], sorted[0], sorted[sorted.len() - 1])
        };
        let (jct, jct_lo, jct_hi) = ratio(|f| f.mean_completion_s);
        let (p99, ..) = ratio(|f| f.p99_completion_s);
        let (span, ..) = ratio(|f| f.makespan_s);
        println!(
            "goodput / fifo over {} workload(s): mean completion time {:.2}x (min {:.2}, max {:.2}; {:.0}% lower), p99 {:.2}x, makespan {:.2}x (throughput {:.2}x)",
            fifo.len(),
            jct,
            jct_lo,
            jct_hi,
            100.0 * (1.0 - jct),
            p99,
            span,
            1.0 / span
        );
    }
    let path = args.out.join("figures.json");
    std::fs::write(&path, serde_json::to_string_pretty(&all)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    println!("timelines and figures.json in {}", args.out.display());
    Ok(ExitCode::SUCCESS)
}

fn policy_name(policy: Policy) -> &'static str {
    match policy {
        Policy::Fifo => "fifo",
        Policy::Fair => "fair",
        Policy::Goodput => "goodput",
    }
}
