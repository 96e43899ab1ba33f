//! What a policy sees: the policies' names, their settings, and one active job's view. A leaf,
//! so that each policy's file and the one allocation function (`policy::allocate`) share it.

use crate::model::{BatchChoice, JobSpec};

/// How slots are shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// First come, first served, static: a job gets the workers it asks for or waits (the head of the
    /// queue blocks the rest); never resized.
    Fifo,
    /// Every active job gets an equal share (within its min/max), recomputed at arrivals and
    /// completions.
    Fair,
    /// Goodput-maximizing, as Pollux defines it: every job's workers and global batch chosen
    /// together for the most goodput (throughput x statistical efficiency at its current noise
    /// scale); jobs admitted at their minimum, then the slots left go by a search over whole
    /// jumps in workers (past a dip in a throughput curve) to the largest gain in a p-norm of
    /// speed-ups (`PolicyConfig::fairness_p`), a resize's cost amortised over the job's expected
    /// remaining time. A job resized less than `min_resize_interval_s` ago is not shrunk, except
    /// to admit a waiting job; free slots go to any job they speed up. Where the cluster has
    /// nodes, a job gets more than a node only in whole nodes.
    Goodput,
    /// Tiresias (Gu et al., NSDI 2019), discretised two-queue least-attained-service: jobs run on
    /// the workers they ask for (`JobSpec::asked`), those with under `LAS_THRESHOLD_SLOT_S`
    /// slot-seconds first, in submission order within a queue; a job that no longer fits is
    /// preempted (its restart costs a resize). No queue head blocks the jobs behind it.
    Tiresias,
    /// Optimus-style (Peng et al., EuroSys 2018): every job at its minimum, then slots one by one
    /// to the job whose remaining time falls most, at the batch it asks for; reallocated on every
    /// tick.
    Optimus,
}

/// Tiresias's queue threshold: a job with this many slot-seconds of service moves to the second
/// queue (16 GPU-hours, the value of the Pollux artifact's Tiresias).
pub const LAS_THRESHOLD_SLOT_S: f64 = 16.0 * 3600.0;

impl Policy {
    pub const ALL: &'static [Policy] =
        &[Policy::Fifo, Policy::Fair, Policy::Goodput, Policy::Tiresias, Policy::Optimus];

    /// Whether the policy reallocates on its own clock as well as at arrivals and completions.
    pub fn ticks(self) -> bool {
        matches!(self, Policy::Goodput | Policy::Tiresias | Policy::Optimus)
    }

    /// The batch its jobs run: only the goodput policy chooses it.
    pub fn batch_choice(self) -> BatchChoice {
        match self {
            Policy::Goodput => BatchChoice::Best,
            _ => BatchChoice::Asked,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Policy::Fifo => "fifo",
            Policy::Fair => "fair",
            Policy::Goodput => "goodput",
            Policy::Tiresias => "tiresias",
            Policy::Optimus => "optimus",
        }
    }
}

impl std::str::FromStr for Policy {
    type Err = crate::SchedError;
    fn from_str(s: &str) -> Result<Policy, crate::SchedError> {
        match s {
            "fifo" => Ok(Policy::Fifo),
            "fair" => Ok(Policy::Fair),
            "goodput" => Ok(Policy::Goodput),
            "tiresias" => Ok(Policy::Tiresias),
            "optimus" => Ok(Policy::Optimus),
            other => Err(crate::SchedError::BadPolicy { name: other.into() }),
        }
    }
}

/// What a policy needs to know: the slots, the policy, and the goodput policy's minimum interval
/// between two resizes of one job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyConfig {
    pub slots: usize,
    pub policy: Policy,
    /// Seconds a running job keeps its allocation after a resize or its start (goodput policy),
    /// unless it must shrink to admit a waiting job. Default 300 in the simulator.
    pub min_resize_interval_s: f64,
    /// The goodput policy's fairness: it maximises the sum of `priority * S^p / p` over the jobs'
    /// speed-ups `S` (`ln S` at p = 0): 1 is the most total goodput, lower values favour the jobs
    /// that have least (Pollux's p; its default is -1).
    pub fairness_p: f64,
    /// Slots per node where the cluster has nodes: the goodput policy then gives a job more than
    /// a node only in whole nodes, so that it is not spread over the remnants of others.
    pub slots_per_node: Option<usize>,
}

impl PolicyConfig {
    pub fn new(slots: usize, policy: Policy) -> PolicyConfig {
        PolicyConfig {
            slots,
            policy,
            min_resize_interval_s: 300.0,
            fairness_p: DEFAULT_FAIRNESS_P,
            slots_per_node: None,
        }
    }
}

/// The goodput policy's fairness p unless told.
pub const DEFAULT_FAIRNESS_P: f64 = -1.0;

/// One active job as the policy sees it.
#[derive(Debug, Clone, Copy)]
pub struct JobView<'a> {
    pub spec: &'a JobSpec,
    /// Workers it holds now (0: waiting).
    pub workers: usize,
    /// When it last started or was resized (the policy's clock; `-inf` never).
    pub last_resize_s: f64,
    /// Work done (its `work`'s unit; 0 where unknown, which counts all its work as remaining).
    pub done: f64,
    /// Slot-seconds it has held (Tiresias's attained service; 0 where unknown).
    pub attained_slot_s: f64,
}

/// A job's workers after `allocate`, and why they changed (empty when they did not).
#[derive(Debug, Clone, PartialEq)]
pub struct Allocation {
    pub workers: usize,
    pub reason: String,
}

/// Each job's workers, and the reason for each change (empty when none).
pub(crate) type Plan = (Vec<usize>, Vec<String>);
