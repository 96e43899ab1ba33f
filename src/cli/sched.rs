//! `stoke sched`: `simulate` compares scheduling policies on a job list (`--jobs FILE`, the CSV of
//! `stoke_sched::workload`) or on generated workloads (`--seeds`), and writes a timeline per
//! policy as HTML; `submit` queues a job for a server and `report` compares the simulator with
//! what a server ran. `serve` (the server is `stoke_sched::serve`), `status`, `cancel` and `slots`
//! are in `sched_serve.rs`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use stoke_sched::{report, NewJob, Policy, SimConfig, Store};

use super::sched_serve::{self, open_store, sched_error, CancelArgs, ServeArgs, SlotsArgs, StatusArgs};
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
    /// Run submitted jobs on this machine's slots as `stoke launch` process groups, resizing them
    /// through checkpoint and restart; state in DIR/sched.db.
    Serve(ServeArgs),
    /// Queue a training job (a config file plus `--set` overrides) for `serve`.
    Submit(SubmitArgs),
    /// The jobs: state, workers, progress, throughput (a table, or `--json` with the decisions
    /// and history).
    Status(StatusArgs),
    /// Stop a job: a queued one at once, a running one with a checkpoint (through `serve`).
    Cancel(CancelArgs),
    /// A job's allocation in workers; with `--slot S`, exit 0 when slot S is allocated (a
    /// `stoke launch --slot-check` command).
    Slots(SlotsArgs),
    /// The simulator's predicted completion times for the jobs `serve` ran, against the measured.
    Report(StatusArgs),
}

#[derive(Debug, clap::Args)]
pub struct SubmitArgs {
    /// The scheduler's state folder (as given to `serve`).
    #[arg(long)]
    pub dir: PathBuf,
    /// The training config (TOML); `-` for the defaults.
    pub config: PathBuf,
    /// Fewest workers the job runs on.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub min: usize,
    /// Most workers it can use (default: --min).
    #[arg(long, allow_negative_numbers = true)]
    pub max: Option<usize>,
    /// Job name (default: the config's file name and the job's number).
    #[arg(long)]
    pub name: Option<String>,
    /// Weight in the goodput policy (1 = normal).
    #[arg(long, default_value_t = 1.0)]
    pub priority: f64,
    /// Override one key of the config: `--set train.steps=200` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
}

#[derive(Debug, clap::Args)]
pub struct SimulateArgs {
    /// Jobs CSV (`submit_s,name,work,min_workers,max_workers,scaling[,resize_s[,priority[,noise_scale,batch_per_worker]]]`,
    /// more columns behind a header: see stoke_sched::workload); without it, generated workloads.
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
    /// Policies to compare: fifo, fair, goodput, tiresias, optimus (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "fifo,fair,goodput,tiresias,optimus")]
    pub policy: Vec<String>,
    /// Seconds between the goodput policy's reallocations.
    #[arg(long, default_value_t = 60.0)]
    pub tick_s: f64,
    /// The least seconds between two resizes of one job (goodput policy).
    #[arg(long, default_value_t = 300.0)]
    pub min_resize_interval_s: f64,
    /// The goodput policy's fairness: the p of its p-norm of speed-ups (1: most total goodput).
    #[arg(long, default_value_t = stoke_sched::view::DEFAULT_FAIRNESS_P, allow_hyphen_values = true)]
    pub fairness_p: f64,
    /// Allocate only every --tick-s (as Pollux's simulator does), not also at arrivals and ends.
    #[arg(long)]
    pub on_ticks_only: bool,
    /// Slots per node: jobs are placed on nodes, and a spread placement runs at the step table's
    /// spread speed (default: one node).
    #[arg(long)]
    pub slots_per_node: Option<usize>,
    /// Folder for the timelines (`timeline-<workload>-<policy>.html`), each job's course
    /// (`jobs-<workload>-<policy>.json`: start, finish, every allocation) and `figures.json`.
    #[arg(long, default_value = "runs/sched")]
    pub out: PathBuf,
}

pub fn run(args: SchedArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        SchedCommand::Simulate(args) => simulate(args),
        SchedCommand::Serve(args) => sched_serve::run(args),
        SchedCommand::Submit(args) => submit(args),
        SchedCommand::Status(args) => sched_serve::status(args),
        SchedCommand::Cancel(args) => sched_serve::cancel(args),
        SchedCommand::Slots(args) => sched_serve::slots(args),
        SchedCommand::Report(args) => report_run(args),
    }
}

fn simulate(args: SimulateArgs) -> anyhow::Result<ExitCode> {
    let policies: Vec<Policy> = args
        .policy
        .iter()
        .map(|p| p.parse().map_err(|e: stoke_sched::SchedError| anyhow::Error::new(UsageError(e.to_string()))))
        .collect::<Result<_, _>>()?;
    let workloads: Vec<(String, Vec<stoke_sched::JobSpec>)> = match &args.jobs {
        Some(path) => {
            let text = stoke_fsio::read_to_string_capped(path, stoke_fsio::TABLE_CAP)
                .with_context(|| format!("cannot read {}", path.display()))?;
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
                fairness_p: args.fairness_p,
                on_ticks_only: args.on_ticks_only,
                slots_per_node: args.slots_per_node,
                ..SimConfig::new(args.slots, policy)
            };
            let result = stoke_sched::simulate(jobs, &config).map_err(|e| UsageError(format!("{name}: {e}")))?;
            let f = report::figures(&result);
            let label = policy.name();
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
            let per_job = args.out.join(format!("jobs-{name}-{label}.json"));
            std::fs::write(&per_job, serde_json::to_string(&report::jobs_json(&result))? + "\n")
                .with_context(|| format!("cannot write {}", per_job.display()))?;
            all.push(serde_json::json!({ "workload": name, "policy": label, "figures": f }));
            by_policy.entry(label).or_default().push(f);
        }
    }
    if let (Some(fifo), Some(good)) = (by_policy.get("fifo"), by_policy.get("goodput")) {
        println!("{}", report::against_fifo(fifo, good));
    }
    let path = args.out.join("figures.json");
    std::fs::write(&path, serde_json::to_string_pretty(&all)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))?;
    println!("timelines and figures.json in {}", args.out.display());
    Ok(ExitCode::SUCCESS)
}

fn submit(args: SubmitArgs) -> anyhow::Result<ExitCode> {
    let config = (args.config.as_os_str() != "-").then(|| args.config.clone());
    let config = match config {
        Some(path) => Some(std::fs::canonicalize(&path).map_err(|e| UsageError(format!("{}: {e}", path.display())))?),
        None => None,
    };
    let resolved =
        crate::config::StokeConfig::load(config.as_deref(), &args.overrides).map_err(|e| UsageError(e.to_string()))?;
    let max = args.max.unwrap_or(args.min);
    if args.min == 0 || args.min > max {
        return Err(UsageError(format!("--min {} --max {max}: needs 1 <= min <= max", args.min)).into());
    }
    if !(args.priority > 0.0 && args.priority.is_finite()) {
        return Err(UsageError(format!("--priority {}: needs a positive number", args.priority)).into());
    }
    if resolved.adaptive.enabled && max > 1 {
        return Err(UsageError(format!(
            "adaptive.enabled runs on one process only (the trainer refuses it on more): submit it with --max 1, not {max}"
        ))
        .into());
    }
    if resolved.ckpt.every == 0 {
        eprintln!("warning: ckpt.every = 0: a job whose launcher is lost starts again from its last resize's checkpoint or from scratch");
    }
    let mut store = Store::open(&args.dir)?;
    let name = match args.name {
        Some(name) => name,
        None => {
            let stem =
                config.as_ref().and_then(|p| p.file_stem()).map_or("job".into(), |s| s.to_string_lossy().into_owned());
            format!("{stem}-{}", store.jobs()?.len() + 1)
        }
    };
    stoke_fsio::check_name(&name).map_err(|why| UsageError(format!("--name: the job name {why}")))?;
    let job = NewJob {
        name: name.clone(),
        config,
        overrides: args.overrides,
        min_workers: args.min,
        max_workers: max,
        priority: args.priority,
        steps: resolved.train.steps,
        ckpt_every: resolved.ckpt.every,
        batch_per_worker: resolved.train.micro_batch * resolved.train.grad_accum.max(1),
        batch_grows: resolved.train.global_batch == 0,
    };
    let id = store.submit(&job, stoke_sched::serve::unix_now()).map_err(|e| match e {
        stoke_sched::SchedError::BadJob { .. } => anyhow::Error::new(UsageError(e.to_string())),
        e => e.into(),
    })?;
    println!("submitted job {id}: {name} ({} steps, {}..{} workers)", job.steps, job.min_workers, job.max_workers);
    Ok(ExitCode::SUCCESS)
}

/// Predicted (the simulator, on the jobs' measured throughput, submission times and resize
/// cost, under the server's policy and settings) against measured completion times.
fn report_run(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let store = open_store(&args.dir)?;
    let prediction = stoke_sched::serve::predict(&store, &args.dir).map_err(sched_error)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&prediction.to_json())?);
        return Ok(ExitCode::SUCCESS);
    }
    let (measured_mean, predicted_mean) = (prediction.mean_measured_s, prediction.mean_predicted_s);
    let (mean_abs_error, policy, slots, resize_s) =
        (prediction.mean_abs_error, prediction.policy, prediction.slots, prediction.resize_s);
    println!(
        "{:<16} {:>9} {:>6} {:>8} {:>10} {:>12} {:>13} {:>8} {:>9}",
        "job", "submit s", "steps", "start s", "profile s", "measured s", "predicted s", "error", "resizes"
    );
    for r in &prediction.rows {
        println!(
            "{:<16} {:>9.1} {:>6} {:>8.1} {:>10.1} {:>12.1} {:>13.1} {:>+7.1}% {:>4}/{:<4}",
            r["job"].as_str().unwrap_or(""),
            r["submit_s"].as_f64().unwrap_or(0.0),
            r["steps"],
            r["start_s"].as_f64().unwrap_or(0.0),
            r["profile_s"].as_f64().unwrap_or(0.0),
            r["measured_s"].as_f64().unwrap_or(f64::NAN),
            r["predicted_s"].as_f64().unwrap_or(f64::NAN),
            100.0 * r["error"].as_f64().unwrap_or(f64::NAN),
            r["measured_resizes"],
            r["predicted_resizes"],
        );
    }
    println!(
        "mean completion time: measured {measured_mean:.1} s, predicted {predicted_mean:.1} s ({:+.1}%); mean absolute error per job {:.1}%; \
         policy {}, {slots} slots, resize cost {resize_s:.1} s (measured median); start s includes profile s; \
         resizes measured/predicted",
        100.0 * (predicted_mean - measured_mean) / measured_mean,
        100.0 * mean_abs_error,
        policy.name()
    );
    Ok(ExitCode::SUCCESS)
}
