//! `stoke launch`: the arguments of the launcher (`crate::launch`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use crate::launch::{Launch, Nodes};

#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Worker processes to start on this machine: N, or MIN:MAX for an elastic job that goes on
    /// with fewer workers (down to MIN) when slots are lost and grows back when they return.
    /// Default 1, or what `--layout` makes.
    #[arg(long)]
    pub nproc: Option<String>,
    /// T,P,D: T ranks per model copy cut by tensor parallelism (`dist.tensor`), P pipeline stages
    /// (`dist.pipeline`), D data-parallel copies; T x P x D workers.
    #[arg(long, value_name = "T,P,D")]
    pub layout: Option<String>,
    /// `best`: the layout `stoke plan` ranks first for the command's model on --nproc workers of
    /// this machine, among those stoke runs (tensor x data, ZeRO, recomputation, micro-batch).
    #[arg(long, value_name = "best", conflicts_with = "layout")]
    pub plan: Option<String>,
    /// With --plan: a calibration's efficiencies (`stoke plan --calibrate --save FILE`).
    #[arg(long, value_name = "FILE", requires = "plan")]
    pub efficiency: Option<PathBuf>,
    /// Restarts after a failed or hung worker before the job gives up (exit code of the last
    /// failure). Each one resumes from the run's latest committed checkpoint.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: u32,
    /// A shell command that says whether slot STOKE_SLOT (0..MAX) can run a worker: exit 0 for
    /// yes. Checked before every start and, while fewer than MAX workers run, every
    /// `--slot-poll-s`. Without it every slot is available.
    #[arg(long, value_name = "COMMAND")]
    pub slot_check: Option<String>,
    /// Seconds between checks of the missing slots while the job runs short of MAX.
    #[arg(long, default_value_t = 2.0)]
    pub slot_poll_s: f64,
    /// Seconds to wait for MIN slots before a (re)start gives up.
    #[arg(long, default_value_t = 60.0)]
    pub slot_wait_s: f64,
    /// Seconds a worker may go without a heartbeat (one per finished step; the first one counted
    /// from its start) before the job counts it hung.
    #[arg(long, default_value_t = 300.0)]
    pub hang_timeout_s: f64,
    /// A file listing CPUs (`2,3`), read at every (re)start: worker RANK runs pinned to the
    /// RANK-th CPU of the list (`sched_setaffinity` before it starts; ranks past the list's end are
    /// not pinned). `stoke sched serve` writes the cores of the job's slots there.
    #[arg(long, value_name = "FILE")]
    pub cpus_file: Option<PathBuf>,
    /// Port of the rendezvous store on 127.0.0.1 (default: a free port, a new one per start).
    #[arg(long, conflicts_with = "master_addr")]
    pub master_port: Option<u16>,
    /// Machines ("nodes") of the job: one `stoke launch` on each, with the same --nproc (workers
    /// per node), --nnodes and --master-addr, and its own --node-rank. The workers talk over TCP
    /// between nodes and shared memory inside one (`dist.backend = "tcp"`, added to the command
    /// unless it names a backend). The run folder (`run.dir`) must be one every node sees: pipeline
    /// stages and ZeRO write their pieces of a checkpoint from every rank.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This machine's place among the --nnodes: its workers are ranks R x nproc onwards.
    #[arg(long, default_value_t = 0, value_name = "R")]
    pub node_rank: usize,
    /// HOST:PORT of node 0, where rank 0 serves the rendezvous (every node gives the same).
    #[arg(long, value_name = "HOST:PORT")]
    pub master_addr: Option<String>,
    /// Run this program instead of this `stoke` binary (for scripts that start their own
    /// workers, like torchrun's `--no-python`).
    #[arg(long)]
    pub program: Option<PathBuf>,
    /// Seconds the other workers get to exit after one failed before they are killed.
    #[arg(long, default_value_t = 10.0)]
    pub grace_s: f64,
    /// Run each start of the job as a Slurm job step instead of on this machine: an allocation of
    /// as many tasks as slots (salloc, held until the step ends or the launcher dies), the workers as one `srun` step on its nodes,
    /// the allocation released when the step ends. Slurm's input variables (`SALLOC_PARTITION`,
    /// `SLURM_CONF`, ...) apply.
    #[arg(long)]
    pub slurm: bool,
    /// The Slurm job name of the allocations (`--slurm`).
    #[arg(long, default_value = "stoke")]
    pub job_name: String,
    /// Where the launcher keeps its folder (heartbeats, the run folder's name); default the
    /// temporary directory. With `--slurm`, a folder every node sees.
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// The command each worker runs, after `--` (for example `-- train --config run.toml`).
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

pub fn run(args: LaunchArgs) -> anyhow::Result<ExitCode> {
    let usage = |m: String| crate::usage::UsageError(m);
    let nodes = Nodes::parse(args.nnodes, args.node_rank, args.master_addr.as_deref()).map_err(usage)?;
    if nodes.count > 1 {
        if args.nproc.as_deref().is_some_and(|n| n.contains(':')) || args.slot_check.is_some() || args.slurm {
            return Err(usage(format!(
                "--nnodes {} runs a fixed --nproc on each node: not with MIN:MAX, --slot-check or --slurm",
                nodes.count
            ))
            .into());
        }
        if args.plan.is_some() {
            return Err(
                usage("--plan best plans for this machine's workers; give --layout T,P,D over nodes".into()).into()
            );
        }
    }
    let (nproc, command) = match (&args.layout, &args.plan) {
        (Some(layout), _) if nodes.count > 1 => {
            // The layout covers every node; --nproc is this node's share of it.
            let whole = args.nproc.as_deref().map(|n| n.parse::<usize>().map(|n| (n * nodes.count).to_string()));
            let whole = whole.transpose().map_err(|_| usage(format!("--nproc takes N, got {:?}", args.nproc)))?;
            let (world, command) =
                crate::launch::apply_layout(layout, whole.as_deref(), &args.command).map_err(usage)?;
            let world: usize = world.parse().expect("apply_layout gives a count");
            if !world.is_multiple_of(nodes.count) {
                return Err(usage(format!(
                    "--layout {layout} runs {world} workers, which {} nodes cannot share evenly",
                    nodes.count
                ))
                .into());
            }
            ((world / nodes.count).to_string(), command)
        }
        (Some(layout), _) => crate::launch::apply_layout(layout, args.nproc.as_deref(), &args.command)
            .map_err(crate::usage::UsageError)?,
        (None, Some(plan)) => {
            if plan != "best" {
                return Err(usage(format!("--plan takes `best`, got `{plan}`")).into());
            }
            let nproc = args.nproc.clone().ok_or_else(|| usage("--plan best needs --nproc N".into()))?;
            let n = nproc.parse::<usize>().ok().filter(|&n| n >= 1);
            let n = n.ok_or_else(|| usage(format!("--plan best needs a worker count, got --nproc {nproc}")))?;
            let best = crate::planning::best_layout(n, &args.command, args.efficiency.as_deref())?;
            println!("[launch] {}", best.summary);
            (nproc, best.command)
        }
        (None, None) => (args.nproc.unwrap_or_else(|| "1".into()), args.command),
    };
    let command = if nodes.count > 1 { crate::launch::across_nodes(&command) } else { command };
    crate::launch::launch(&Launch {
        nproc,
        max_restarts: args.max_restarts,
        slot_check: args.slot_check,
        slot_poll_s: args.slot_poll_s,
        slot_wait_s: args.slot_wait_s,
        hang_timeout_s: args.hang_timeout_s,
        cpus_file: args.cpus_file,
        master_port: args.master_port,
        program: args.program,
        grace_s: args.grace_s,
        slurm: args.slurm,
        job_name: args.job_name,
        state_dir: args.state_dir,
        nodes,
        command,
    })
}
