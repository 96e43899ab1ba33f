//! `stoke train`: its arguments, and what it prints at the end of a run; the run itself is
//! `crate::run`.

use std::path::PathBuf;
use std::process::ExitCode;

use super::args::ConfigArgs;
use crate::exit::EXIT_PREEMPTED;
use crate::run::{AlreadyDone, Job, MemoryCheck, RunSpec, Start};

#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Train on this text file (byte-level tokens) instead of the built-in corpus; same as
    /// `--set data.path=PATH`.
    #[arg(long, value_name = "PATH")]
    pub data: Option<PathBuf>,
    /// Continue the named run (run.name; default: the most recent run) from its latest checkpoint,
    /// with the configuration saved in it (`--set` may change only keys that keep the trajectory).
    #[arg(long)]
    pub resume: bool,
    /// With --resume: when the latest checkpoint fails its checks, resume from the newest one
    /// before it that passes.
    #[arg(long, requires = "resume")]
    pub fallback: bool,
    /// No progress bar (for logs and tests).
    #[arg(long)]
    pub quiet: bool,
    /// Do not train: find the largest train.micro_batch whose step fits the memory budget (CPU),
    /// with the configured train.recompute, and print it.
    #[arg(long)]
    pub find_batch: bool,
    /// The budget for --find-batch, in bytes (suffixes K, M, G, T for powers of 1024). Default:
    /// 80% of the memory available now.
    #[arg(long, value_name = "BYTES", requires = "find_batch")]
    pub memory_budget: Option<String>,
    /// Build the model even when its step is estimated beyond this machine's memory (the
    /// planner's formula against MemAvailable, the cgroup's limit, ulimit -v or free device memory).
    #[arg(long)]
    pub force: bool,
}

pub fn run(args: TrainArgs) -> anyhow::Result<ExitCode> {
    let mut extra = Vec::new();
    if let Some(data) = &args.data {
        extra.push(format!("data.path={}", toml::Value::String(data.display().to_string())));
    }
    if args.find_batch {
        return super::find_batch::run(&args.config.load(&extra)?, args.memory_budget.as_deref());
    }
    let stop = crate::signals::install();
    let mut source = args.config.source(&extra);
    let mut job = Job::join(&mut source, args.resume)?;
    let writer = job.is_writer();
    let start = if args.resume { Start::Resume { fallback: args.fallback } } else { Start::Fresh };
    let memory = if args.force { MemoryCheck::Skip } else { MemoryCheck::Enforce };
    let mut spec = match RunSpec::for_job(&source, &job, start, memory) {
        Err(err) if err.downcast_ref::<AlreadyDone>().is_some() => {
            println!("{err}");
            return Ok(ExitCode::SUCCESS);
        }
        other => other?,
    };
    spec.progress = !args.quiet && writer;
    let (run_dir, run_name) = (spec.run_dir.clone(), spec.config.run.name.clone());
    let outcome = spec.train(stop, job.dist_mut())?;
    outcome.print_report();
    let summary = outcome.summary;
    if !writer {
        return Ok(if summary.interrupted { ExitCode::from(EXIT_PREEMPTED) } else { ExitCode::SUCCESS });
    }
    println!(
        "\n{} {} steps in {:.1}s | {:.0} tokens/s over the wall time | loss: first {:.4}, final {:.4}, best {:.4} | run: {}",
        if summary.interrupted { "interrupted after" } else { "done:" },
        summary.steps_run,
        summary.wall_s,
        summary.tokens_per_s,
        summary.first_loss,
        summary.final_loss,
        summary.best_loss,
        run_dir.display()
    );
    if summary.early_stopped {
        let best = summary
            .best_eval
            .map_or(String::new(), |(step, loss)| format!("; best evaluation loss {loss:.4} at step {step}"));
        println!("early stopping: the evaluation loss stopped improving (eval.patience){best}");
    }
    if summary.interrupted {
        let signal = crate::signals::received().map(|s| format!(" by signal {s}")).unwrap_or_default();
        eprintln!(
            "stoke: stopped{signal} with a checkpoint at step {}; continue with `stoke train --resume --set run.name={}` \
             (exit code {EXIT_PREEMPTED}: preempted, resumable)",
            summary.last_step, run_name
        );
        return Ok(ExitCode::from(EXIT_PREEMPTED));
    }
    Ok(ExitCode::SUCCESS)
}
