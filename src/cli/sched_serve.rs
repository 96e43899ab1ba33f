//! `stoke sched serve` and the commands that read or change a server's folder: `status`, `cancel`
//! and `slots`. The server itself is `stoke_sched::serve`; this file turns flags into its settings
//! and prints what the library computes.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use stoke_sched::serve::{self as server, last_step, Layout};
use stoke_sched::{JobState, Policy, SchedError, Store};

use super::UsageError;
use crate::signals::EXIT_PREEMPTED;

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// State folder: `sched.db`, the jobs' run folders (`runs/`), logs (`logs/`) and allocations
    /// (`alloc/`).
    #[arg(long)]
    pub dir: PathBuf,
    /// Slots to share (cores here; one worker per slot). With `--slurm`, Slurm CPUs, by default
    /// all of the cluster's (`sinfo`); else required.
    #[arg(long)]
    pub slots: Option<usize>,
    /// Run the jobs through Slurm rather than on this machine: each start of a job is a Slurm
    /// allocation (salloc) with its workers as one `srun` step; a resize ends the
    /// step with a checkpoint and starts one of the new size in a new allocation. `--dir` must be
    /// on a file system every node sees (the run folders and the launchers' heartbeats are there).
    #[arg(long)]
    pub slurm: bool,
    /// goodput, fair or fifo.
    #[arg(long, default_value = "goodput")]
    pub policy: String,
    /// Serve Prometheus metrics on 127.0.0.1:PORT/metrics (0: a free port, written to the
    /// database's meta table as `prometheus_addr`).
    #[arg(long)]
    pub prometheus_port: Option<u16>,
    /// Seconds between two looks at the jobs.
    #[arg(long, default_value_t = 0.5)]
    pub poll_s: f64,
    /// Seconds between the goodput policy's reallocations (it also reallocates at arrivals and
    /// completions).
    #[arg(long, default_value_t = 10.0)]
    pub tick_s: f64,
    /// The least seconds between two resizes of one job (goodput policy).
    #[arg(long, default_value_t = 30.0)]
    pub min_resize_interval_s: f64,
    /// `--max-restarts` of each job's launcher (failed workers brought back from the checkpoint).
    #[arg(long, default_value_t = 2)]
    pub max_restarts: u32,
    /// Launchers lost (killed, or gone without saying how they ended) before a job counts failed.
    #[arg(long, default_value_t = 3)]
    pub max_lost: u64,
    /// The cores of the slots, in slot order (`0,1`; `0-3` ranges too). Default: the first
    /// `--slots` CPUs this process may run on.
    #[arg(long)]
    pub cpus: Option<String>,
    /// Goodput policy: steps measured on one worker, then on two, when a job first starts on two
    /// slots or more (after `observe::WARMUP_STEPS` per start); 0 skips the profile.
    #[arg(long, default_value_t = 10)]
    pub profile_steps: u64,
    /// Exit once jobs were submitted and none is queued or running (scripts and tests); without it the server runs until
    /// killed. Killing it leaves the jobs running; the next `serve` on the folder re-adopts them.
    #[arg(long)]
    pub exit_when_idle: bool,
}

/// A library error as the binary reports it: the user's mistakes exit 2.
pub(super) fn sched_error(err: SchedError) -> anyhow::Error {
    if err.is_usage() {
        UsageError(err.to_string()).into()
    } else {
        err.into()
    }
}

pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let policy: Policy = args.policy.parse().map_err(|e: SchedError| anyhow::Error::new(UsageError(e.to_string())))?;
    let exe = std::env::current_exe().context("cannot locate the stoke binary")?;
    let slots = match (args.slots, args.slurm) {
        (Some(slots), _) => slots,
        (None, true) => slurm_cpus()?,
        (None, false) => return Err(UsageError("--slots is required (without --slurm)".into()).into()),
    };
    let settings = stoke_sched::ServeConfig {
        dir: args.dir,
        slots,
        policy,
        prometheus_port: args.prometheus_port,
        poll_s: args.poll_s,
        tick_s: args.tick_s,
        min_resize_interval_s: args.min_resize_interval_s,
        max_restarts: args.max_restarts,
        max_lost: args.max_lost,
        cpus: args.cpus,
        profile_steps: args.profile_steps,
        exit_when_idle: args.exit_when_idle,
        slurm: args.slurm,
        launcher: stoke_sched::Launcher { exe, preempted_exit_code: i32::from(EXIT_PREEMPTED) },
    };
    stoke_sched::serve(&settings).map_err(sched_error)?;
    Ok(ExitCode::SUCCESS)
}

/// The CPUs of the Slurm cluster (`sinfo -o %C`: allocated/idle/other/total).
fn slurm_cpus() -> anyhow::Result<usize> {
    let out = std::process::Command::new("sinfo")
        .args(["-h", "-o", "%C"])
        .output()
        .context("cannot run sinfo to count the Slurm cluster's CPUs (give --slots)")?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .rsplit('/')
        .next()
        .and_then(|t| t.parse::<usize>().ok())
        .filter(|&n| out.status.success() && n > 0)
        .with_context(|| format!("sinfo did not say how many CPUs the cluster has ({}): {text}", out.status))
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

/// An existing state folder's database (status, cancel and report do not create one).
pub(super) fn open_store(dir: &Path) -> anyhow::Result<Store> {
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

pub fn status(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let store = open_store(&args.dir)?;
    let layout = Layout { dir: std::fs::canonicalize(&args.dir)? };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&server::status_json(&store, &layout)?)?);
        return Ok(ExitCode::SUCCESS);
    }
    let jobs = store.jobs()?;
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

pub fn cancel(args: CancelArgs) -> anyhow::Result<ExitCode> {
    let mut store = open_store(&args.dir)?;
    let job =
        store.job(&args.job)?.ok_or_else(|| UsageError(format!("no job `{}` in {}", args.job, args.dir.display())))?;
    if !job.state.is_active() {
        println!("job {}: already {}", job.job.name, job.state.name());
        return Ok(ExitCode::SUCCESS);
    }
    match store.request_cancel(job.id, server::unix_now())? {
        JobState::Cancelled => println!("job {}: cancelled", job.job.name),
        _ => println!("job {}: cancel requested; the server stops it with a checkpoint", job.job.name),
    }
    Ok(ExitCode::SUCCESS)
}

pub fn slots(args: SlotsArgs) -> anyhow::Result<ExitCode> {
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
