//! What `stoke launch` is asked to run: the job's settings, as plain data.

use std::path::PathBuf;

/// One job to launch (`stoke launch`'s arguments).
#[derive(Debug, Clone)]
pub struct Launch {
    /// Worker processes: N, or MIN:MAX for an elastic job.
    pub nproc: String,
    /// Restarts after a failed or hung worker before the job gives up.
    pub max_restarts: u32,
    /// A shell command that says whether slot STOKE_SLOT can run a worker (exit 0 for yes).
    pub slot_check: Option<String>,
    /// Seconds between checks of the missing slots while the job runs short of MAX.
    pub slot_poll_s: f64,
    /// Seconds to wait for MIN slots before a (re)start gives up.
    pub slot_wait_s: f64,
    /// Seconds a worker may go without a heartbeat before the job counts it hung.
    pub hang_timeout_s: f64,
    /// A file listing CPUs: worker RANK runs pinned to the RANK-th.
    pub cpus_file: Option<PathBuf>,
    /// Port of the rendezvous store on 127.0.0.1 (default: a free port, a new one per start).
    pub master_port: Option<u16>,
    /// Run this program instead of this `stoke` binary.
    pub program: Option<PathBuf>,
    /// Seconds the other workers get to exit after one failed before they are killed.
    pub grace_s: f64,
    /// Run each start as a Slurm job step (salloc, then `srun`) instead of workers
    /// on this machine.
    pub slurm: bool,
    /// The Slurm job name of the allocations (default `stoke`).
    pub job_name: String,
    /// The launcher's folder for heartbeats and the run folder's name (default a new folder under
    /// the temporary directory, removed at the end); under Slurm, one every node sees.
    pub state_dir: Option<PathBuf>,
    /// This launcher's place in a job over several machines (`--nnodes`).
    pub nodes: Nodes,
    /// The command each worker runs.
    pub command: Vec<String>,
}

/// One launcher per machine ("node"): node `rank` of `count` starts its `--nproc` workers as the
/// ranks `rank * nproc ..`, and every worker meets the others at `master` (served by rank 0, on
/// node 0). One node: `master` is `None` and the store is on 127.0.0.1.
#[derive(Debug, Clone, PartialEq)]
pub struct Nodes {
    pub count: usize,
    pub rank: usize,
    pub master: Option<(String, u16)>,
}

impl Nodes {
    /// `--nnodes N --node-rank R --master-addr HOST:PORT`, checked: R below N, and an address
    /// with a port whenever there is more than one node.
    pub fn parse(count: usize, rank: usize, master: Option<&str>) -> Result<Nodes, String> {
        if count == 0 || rank >= count {
            return Err(format!("--node-rank {rank} must be below --nnodes {count}"));
        }
        let master = match master {
            None if count > 1 => {
                return Err(format!(
                "--nnodes {count} needs --master-addr HOST:PORT: node 0's address, where rank 0 serves the rendezvous"
            ))
            }
            None => None,
            Some(text) => {
                let (host, port) = text
                    .rsplit_once(':')
                    .and_then(|(h, p)| Some((h.trim_matches(|c| c == '[' || c == ']'), p.parse::<u16>().ok()?)))
                    .filter(|(h, p)| !h.is_empty() && *p > 0)
                    .ok_or_else(|| format!("--master-addr takes HOST:PORT, got `{text}`"))?;
                Some((host.to_string(), port))
            }
        };
        Ok(Nodes { count, rank, master })
    }
}

/// A job over several nodes talks between them over TCP (shared memory inside each node): the
/// command gets `--set dist.backend="tcp"` unless it names a backend itself.
pub fn across_nodes(command: &[String]) -> Vec<String> {
    let mut command = command.to_vec();
    let sets_backend = command.iter().any(|a| a.trim_start().starts_with("dist.backend"));
    if command.first().map(String::as_str) == Some("train") && !sets_backend {
        command.extend(["--set".to_string(), "dist.backend=\"tcp\"".to_string()]);
    }
    command
}

/// `--layout T,P,D`: T ranks per model copy cut by tensor parallelism, P pipeline stages, D data
/// copies. Gives the worker count T x P x D and the command with `--set dist.tensor=T` and
/// `--set dist.pipeline=P` added. Refused: a layout beside an `--nproc` that says otherwise, or a
/// command that sets `dist.tensor` or `dist.pipeline` itself.
pub fn apply_layout(layout: &str, nproc: Option<&str>, command: &[String]) -> Result<(String, Vec<String>), String> {
    let parts: Vec<usize> = layout
        .split(',')
        .map(|p| p.trim().parse::<usize>().ok().filter(|&n| n >= 1))
        .collect::<Option<Vec<_>>>()
        .filter(|parts| parts.len() == 3)
        .ok_or_else(|| format!("--layout takes T,P,D (tensor, pipeline, data; each at least 1), got `{layout}`"))?;
    let (tensor, pipeline, data) = (parts[0], parts[1], parts[2]);
    let world = tensor * pipeline * data;
    if let Some(nproc) = nproc.filter(|n| *n != world.to_string()) {
        return Err(format!("--layout {layout} runs {world} workers, but --nproc says {nproc}; give one of the two"));
    }
    for key in ["dist.tensor", "dist.pipeline"] {
        // `dist.pipeline_schedule` and `dist.pipeline_split` are the command's to set.
        let sets =
            |arg: &String| arg.trim_start().strip_prefix(key).is_some_and(|rest| rest.trim_start().starts_with('='));
        if command.iter().any(sets) {
            return Err(format!("--layout {layout} sets {key}; the command sets it too"));
        }
    }
    let mut command = command.to_vec();
    command.extend(["--set".to_string(), format!("dist.tensor={tensor}")]);
    command.extend(["--set".to_string(), format!("dist.pipeline={pipeline}")]);
    Ok((world.to_string(), command))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_layout_gives_the_workers_and_the_tensor_split() {
        let (nproc, cmd) = apply_layout("2,1,3", None, &command(&["train", "--quiet"])).unwrap();
        assert_eq!(nproc, "6");
        assert_eq!(cmd, command(&["train", "--quiet", "--set", "dist.tensor=2", "--set", "dist.pipeline=1"]));
        let (nproc, cmd) =
            apply_layout("1,2,2", None, &command(&["train", "--set", "dist.pipeline_schedule=\"gpipe\""])).unwrap();
        assert_eq!(nproc, "4");
        assert!(cmd.ends_with(&command(&["--set", "dist.tensor=1", "--set", "dist.pipeline=2"])), "{cmd:?}");
        assert_eq!(apply_layout("2,1,2", Some("4"), &command(&["train"])).unwrap().0, "4");
    }

    #[test]
    fn nodes_need_an_address_and_a_rank_below_their_count() {
        assert_eq!(Nodes::parse(1, 0, None).unwrap(), Nodes { count: 1, rank: 0, master: None });
        let two = Nodes::parse(2, 1, Some("10.0.0.2:29500")).unwrap();
        assert_eq!(two.master, Some(("10.0.0.2".to_string(), 29500)));
        assert_eq!(Nodes::parse(2, 0, Some("[::1]:7")).unwrap().master.unwrap().0, "::1");
        for (count, rank, master, why) in [
            (2, 0, None, "needs --master-addr"),
            (2, 2, Some("h:1"), "must be below --nnodes 2"),
            (0, 0, None, "must be below"),
            (2, 0, Some("h"), "HOST:PORT"),
            (2, 0, Some(":29500"), "HOST:PORT"),
            (2, 0, Some("h:0"), "HOST:PORT"),
        ] {
            let err = Nodes::parse(count, rank, master).unwrap_err();
            assert!(err.contains(why), "{count} {rank} {master:?}: {err}");
        }
        let cmd = across_nodes(&command(&["train", "--quiet"]));
        assert_eq!(cmd, command(&["train", "--quiet", "--set", "dist.backend=\"tcp\""]));
        let own = command(&["train", "--set", "dist.backend=\"mpi\""]);
        assert_eq!(across_nodes(&own), own);
    }

    #[test]
    fn what_a_layout_cannot_run_is_refused_naming_why() {
        let train = command(&["train"]);
        for (layout, nproc, cmd, why) in [
            ("1,2,1", None, &command(&["train", "--set", "dist.pipeline=4"]), "sets dist.pipeline; the command"),
            ("2,1", None, &train, "takes T,P,D"),
            ("0,1,2", None, &train, "takes T,P,D"),
            ("2,1,2", Some("2"), &train, "runs 4 workers, but --nproc says 2"),
            ("2,1,1", None, &command(&["train", "--set", "dist.tensor=4"]), "the command sets it too"),
        ] {
            let err = apply_layout(layout, nproc, cmd).unwrap_err();
            assert!(err.contains(why), "{layout}: {err}");
        }
    }
}
