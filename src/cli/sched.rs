//! `stoke sched`: `simulate` compares scheduling policies on a job list (`--jobs FILE`, the CSV of
//! `stoke_sched::workload`) or on generated workloads (`--seeds`), and writes a timeline per
//! policy as HTML; `serve` (in `sched_serve.rs`) runs jobs for real, and `submit`, `status`,
//! `cancel`, `slots` and `report` talk to it through its database.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use stoke_sched::{report, JobRow, JobState, NewJob, Policy, SimConfig, Store};

use super::sched_serve::{last_step, Layout};
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
    Serve(super::sched_serve::ServeArgs),
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
    #[arg(long, default_value_t = 1)]
    pub min: usize,
    /// Most workers it can use (default: --min).
    #[arg(long)]
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
pub struct StatusArgs {
    /// The scheduler's state folder.
    #[arg(long)]
    pub dir: PathBuf,
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct CancelArgs {
    /// The scheduler's state folder.
    #[arg(long)]
    pub dir: PathBuf,
    /// The job's name or number.
    pub job: String,
}

#[derive(Debug, clap::Args)]
pub struct SlotsArgs {
    /// The scheduler's state folder.
    #[arg(long)]
    pub dir: PathBuf,
    /// The job's name or number.
    #[arg(long)]
    pub job: String,
    /// Exit 0 when this slot (0-based, within the job) is allocated, 1 when not.
    #[arg(long)]
    pub slot: Option<usize>,
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
        SchedCommand::Serve(args) => super::sched_serve::run(args),
        SchedCommand::Submit(args) => submit(args),
        SchedCommand::Status(args) => status(args),
        SchedCommand::Cancel(args) => cancel(args),
        SchedCommand::Slots(args) => slots(args),
        SchedCommand::Report(args) => report_run(args),
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

/// An existing state folder's database (status, cancel and report do not create one).
fn open_store(dir: &Path) -> anyhow::Result<Store> {
    if !dir.join(stoke_sched::store::DB_FILE).is_file() {
        return Err(UsageError(format!(
            "{} holds no scheduler database (sched.db); start `stoke sched serve --dir {}`",
            dir.display(),
            dir.display()
        ))
        .into());
    }
    Ok(Store::open(dir)?)
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
    if name.is_empty() || name.contains(['/', '\\']) || name.starts_with('.') {
        return Err(UsageError(format!("job name `{name}`: needs a plain file name")).into());
    }
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
    let id = store.submit(&job, super::sched_serve::unix_now()).map_err(|e| match e {
        stoke_sched::SchedError::BadJob { .. } => anyhow::Error::new(UsageError(e.to_string())),
        e => e.into(),
    })?;
    println!("submitted job {id}: {name} ({} steps, {}..{} workers)", job.steps, job.min_workers, job.max_workers);
    Ok(ExitCode::SUCCESS)
}

fn job_json(layout: &Layout, job: &JobRow, throughput: &[(usize, f64, usize)]) -> serde_json::Value {
    serde_json::json!({
        "id": job.id,
        "name": job.job.name,
        "state": job.state.name(),
        "workers": job.alloc,
        "min_workers": job.job.min_workers,
        "max_workers": job.job.max_workers,
        "priority": job.job.priority,
        "step": last_step(&layout.run_dir(job)),
        "steps": job.job.steps,
        "submit_s": job.submit_s,
        "start_s": job.start_s,
        "finish_s": job.finish_s,
        "resizes": job.resizes,
        "launches": job.launches,
        "pid": job.pid.map(|p| p.0),
        "pid_start": job.pid.map(|p| p.1),
        "exit_code": job.exit_code,
        "cancel_requested": job.cancel_requested,
        "detail": job.detail,
        "run_dir": layout.run_dir(job),
        "slots": job.slots,
        "noise_scale": super::sched_serve::noise_scale(&layout.run_dir(job)),
        "throughput": throughput.iter().map(|&(w, t, n)| serde_json::json!({"workers": w, "steps_per_s": t, "steps": n})).collect::<Vec<_>>(),
    })
}

fn status(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let store = open_store(&args.dir)?;
    let layout = Layout { dir: std::fs::canonicalize(&args.dir)? };
    let jobs = store.jobs()?;
    if args.json {
        let mut out = Vec::new();
        for job in &jobs {
            out.push(job_json(&layout, job, &store.throughput(job.id)?));
        }
        let value = serde_json::json!({
            "slots": store.meta("slots")?.and_then(|s| s.parse::<usize>().ok()),
            "cores": store.meta("cores")?,
            "policy": store.meta("policy")?,
            "prometheus_addr": store.meta("prometheus_addr")?,
            "jobs": out,
            "decisions": store.decisions()?,
            "history": store.history()?,
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:>3} {:<16} {:<10} {:>7} {:>7} {:>11} {:>9} {:>7} {:>8}  {}",
        "id", "name", "state", "workers", "min:max", "step", "steps/s", "resizes", "launches", "detail"
    );
    for job in &jobs {
        let points = store.throughput(job.id)?;
        let rate =
            points.iter().find(|p| p.0 == job.alloc).or(points.last()).map_or("-".into(), |p| format!("{:.2}", p.1));
        println!(
            "{:>3} {:<16} {:<10} {:>7} {:>7} {:>11} {:>9} {:>7} {:>8}  {}",
            job.id,
            job.job.name,
            job.state.name(),
            job.alloc,
            format!("{}:{}", job.job.min_workers, job.job.max_workers),
            format!("{}/{}", last_step(&layout.run_dir(job)), job.job.steps),
            rate,
            job.resizes,
            job.launches,
            job.detail
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn cancel(args: CancelArgs) -> anyhow::Result<ExitCode> {
    let mut store = open_store(&args.dir)?;
    let job =
        store.job(&args.job)?.ok_or_else(|| UsageError(format!("no job `{}` in {}", args.job, args.dir.display())))?;
    if !job.state.is_active() {
        println!("job {}: already {}", job.job.name, job.state.name());
        return Ok(ExitCode::SUCCESS);
    }
    match store.request_cancel(job.id, super::sched_serve::unix_now())? {
        JobState::Cancelled => println!("job {}: cancelled", job.job.name),
        _ => println!("job {}: cancel requested; the server stops it with a checkpoint", job.job.name),
    }
    Ok(ExitCode::SUCCESS)
}

fn slots(args: SlotsArgs) -> anyhow::Result<ExitCode> {
    let store = open_store(&args.dir)?;
    let job =
        store.job(&args.job)?.ok_or_else(|| UsageError(format!("no job `{}` in {}", args.job, args.dir.display())))?;
    match args.slot {
        Some(slot) => Ok(if slot < job.alloc { ExitCode::SUCCESS } else { ExitCode::from(1) }),
        None => {
            println!("{}", job.alloc);
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// Predicted (the simulator, on the jobs' measured throughput, submission times and resize
/// cost, under the server's policy and settings) against measured completion times.
fn report_run(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let store = open_store(&args.dir)?;
    let jobs: Vec<JobRow> = store.jobs()?.into_iter().filter(|j| j.state == JobState::Finished).collect();
    if jobs.is_empty() {
        return Err(UsageError(format!("{}: no finished job to compare", args.dir.display())).into());
    }
    let meta = |key: &str, default: f64| -> anyhow::Result<f64> {
        Ok(store.meta(key)?.and_then(|v| v.parse().ok()).unwrap_or(default))
    };
    let slots = meta("slots", 1.0)? as usize;
    let policy: Policy = store.meta("policy")?.unwrap_or_else(|| "goodput".into()).parse()?;
    let history = store.history()?;
    let resize_s = super::sched_serve::resize_cost(&history);
    let t0 = jobs.iter().map(|j| j.submit_s).fold(f64::INFINITY, f64::min);
    let layout = Layout { dir: std::fs::canonicalize(&args.dir)? };
    let mut specs = Vec::new();
    let mut profile_costs = Vec::new();
    for job in &jobs {
        // A start-up profile's cost (the slower steps on one worker while two slots were held, and
        // its resize) is charged to the job's start.
        let profile_s = history
            .iter()
            .filter(|h| h.job == job.id && h.event == "profiled")
            .filter_map(|h| serde_json::from_str::<serde_json::Value>(&h.detail).ok()?["cost_s"].as_f64())
            .fold(0.0, |sum, cost| sum + cost);
        profile_costs.push(profile_s);
        let start_s = super::sched_serve::startup_cost(&history, job.id) + profile_s;
        let noise = super::sched_serve::noise_scale(&layout.run_dir(job));
        specs.push(super::sched_serve::job_spec(job, &store.throughput(job.id)?, noise, resize_s, start_s, t0));
    }
    let config = SimConfig {
        tick_s: meta("tick_s", 10.0)?,
        min_resize_interval_s: meta("min_resize_interval_s", 30.0)?,
        ..SimConfig::new(slots, policy)
    };
    let sim = stoke_sched::simulate(&specs, &config)?;
    let mut rows = Vec::new();
    for (((job, spec), predicted), profile_s) in jobs.iter().zip(&specs).zip(&sim.jobs).zip(&profile_costs) {
        let measured = job.finish_s.unwrap_or(f64::NAN) - job.submit_s;
        let predicted_s = predicted.completion_s();
        rows.push(serde_json::json!({
            "job": job.job.name,
            "submit_s": job.submit_s - t0,
            "steps": job.job.steps,
            "scaling": format!("{:?}", spec.scaling),
            "start_s": spec.start_s,
            "profile_s": profile_s,
            "measured_s": measured,
            "predicted_s": predicted_s,
            "error": (predicted_s - measured) / measured,
            "measured_resizes": job.resizes,
            "predicted_resizes": predicted.resizes,
        }));
    }
    let mean = |key: &str| rows.iter().map(|r| r[key].as_f64().unwrap_or(f64::NAN)).sum::<f64>() / rows.len() as f64;
    let (measured_mean, predicted_mean) = (mean("measured_s"), mean("predicted_s"));
    let mean_abs_error =
        rows.iter().map(|r| r["error"].as_f64().unwrap_or(f64::NAN).abs()).sum::<f64>() / rows.len() as f64;
    if args.json {
        let value = serde_json::json!({
            "policy": policy.name(), "slots": slots, "resize_s": resize_s, "jobs": rows,
            "mean_measured_s": measured_mean, "mean_predicted_s": predicted_mean, "mean_abs_error": mean_abs_error,
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<16} {:>9} {:>6} {:>8} {:>10} {:>12} {:>13} {:>8} {:>9}",
        "job", "submit s", "steps", "start s", "profile s", "measured s", "predicted s", "error", "resizes"
    );
    for r in &rows {
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
