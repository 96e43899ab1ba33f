//! One finding type and one table of rules for both analyses: the step report (`stoke doctor`,
//! every `stoke train`) and the trace analyzer (`stoke trace`). A rule's id, scope, cause and fix
//! live here; the code that measures each rule's evidence lives with the numbers it reads
//! (`rules.rs` for a run's step report, `ranks.rs` for a data-parallel run's ranks,
//! `trace/diagnose.rs` and `trace/ranks.rs` for traces).
//!
//! Ids shared by both analyses mean the same thing (`data_wait`, `comm_exposed`, `ckpt_stall`,
//! `low_compute_ratio`, `memory_pressure`, `step_outliers`, `small_batch`); their cause and fix are
//! worded for what the user runs: stoke's configuration keys, or PyTorch's.

use serde::{Deserialize, Serialize};

/// One diagnosis.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Finding {
    pub id: String,
    /// The rule's threshold, in words ("> 5% of step").
    pub threshold: String,
    /// The measured value the threshold applies to.
    pub value: f64,
    /// The numbers behind the finding.
    pub evidence: String,
    pub cause: String,
    pub fix: String,
    /// Upper bound on the step's speed-up from acting on the finding; None for risks and where no
    /// bound follows from the numbers.
    pub bound: Option<f64>,
}

impl Finding {
    /// A finding of `rule`, with its cause and fix from the table.
    pub fn new(rule: RuleId, threshold: String, value: f64, evidence: String, bound: Option<f64>) -> Finding {
        let rule = rule.rule();
        Finding {
            id: rule.id.into(),
            threshold,
            value,
            evidence,
            cause: rule.cause.into(),
            fix: rule.fix.into(),
            bound,
        }
    }
}

/// What a rule reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// A stoke run's step report.
    StepReport,
    /// One rank's PyTorch profiler trace.
    Trace,
    /// Several ranks together: their traces, or the step reports of a data-parallel run's ranks.
    CrossRank,
}

/// A row of `RULES`.
#[derive(Clone, Copy, Debug)]
pub struct Rule {
    pub key: RuleId,
    pub id: &'static str,
    pub scope: Scope,
    pub cause: &'static str,
    pub fix: &'static str,
}

/// Every rule, named; `RuleId::rule` finds its row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuleId {
    StepDataWait,
    StepCommExposed,
    StepCkptStall,
    StepFp32OnBf16Hardware,
    StepBf16SlowerThanFp32,
    StepLossScaleThrashing,
    StepOutliers,
    StepSmallBatch,
    StepLowComputeRatio,
    StepMemoryPressure,
    TraceDataWait,
    TraceDataloader,
    TraceCommunication,
    TraceCommExposed,
    TraceLowGpuUtilization,
    TraceLowComputeRatio,
    TraceCkptStall,
    TraceMemoryPressure,
    TraceNoTensorCores,
    TraceStepOutliers,
    TraceSmallBatch,
    StragglerSlowSteps,
    StragglerLastArrival,
    StepStraggler,
    DynLossSpike,
    DynUpdateRatio,
    DynEarlyStopped,
}

impl RuleId {
    pub fn rule(self) -> &'static Rule {
        &RULES[self as usize]
    }
}

const fn row(key: RuleId, id: &'static str, scope: Scope, cause: &'static str, fix: &'static str) -> Rule {
    Rule { key, id, scope, cause, fix }
}

use RuleId as R;
use Scope::{CrossRank, StepReport, Trace};

/// The table, in `RuleId` order.
pub const RULES: [Rule; 27] = [
    row(
        R::StepDataWait,
        "data_wait",
        StepReport,
        "the trainer waits for batches: the loader prepares them slower than the model consumes them",
        "raise data.workers and data.prefetch (load ahead on more threads), move expensive per-sample work \
         offline (stoke prep), or put the data on faster storage",
    ),
    row(
        R::StepCommExposed,
        "comm_exposed",
        StepReport,
        "the step waits for gradient communication that is not hidden behind backward",
        "overlap buckets with backward (smaller buckets start earlier), accumulate more micro-batches per \
         all-reduce, or compress gradients",
    ),
    row(
        R::StepCkptStall,
        "ckpt_stall",
        StepReport,
        "the loop waits while a checkpoint is written",
        "checkpoint less often (ckpt.every) or write asynchronously (copy to host, persist in the background)",
    ),
    row(
        R::StepFp32OnBf16Hardware,
        "fp32_on_bf16_hardware",
        StepReport,
        "the run multiplies matrices in fp32 on hardware with faster bf16 units",
        "set train.precision = \"bf16\" (bf16 matrix multiplies, fp32 master weights)",
    ),
    row(
        R::StepBf16SlowerThanFp32,
        "bf16_slower_than_fp32",
        StepReport,
        "the run multiplies matrices in 16 bits on a CPU without bf16 instructions, which converts every \
         operand to fp32 and multiplies slower than fp32 itself",
        "set train.precision = \"fp32\", or \"auto\" (fp32 on such a CPU, bf16 where it pays)",
    ),
    row(
        R::StepLossScaleThrashing,
        "loss_scale_thrashing",
        StepReport,
        "the dynamic loss scale keeps overflowing and growing back; every overflow wastes a step",
        "use bf16 (no loss scale needed), or lengthen the growth interval / lower the initial scale",
    ),
    row(
        R::StepOutliers,
        "step_outliers",
        StepReport,
        "some steps are much slower than the rest: other processes on the machine, page faults, allocator \
         growth, garbage in the data pipeline, or periodic work (logging, evaluation)",
        "open trace.json at the outlier steps and see which phase grew; pin threads (train.threads) and keep \
         the machine to this run",
    ),
    row(
        R::StepSmallBatch,
        "small_batch",
        StepReport,
        "the matrices are too small to keep the device's arithmetic units busy; fixed per-operation costs dominate",
        "raise train.micro_batch (and lower train.grad_accum to keep the global batch), or train a wider model",
    ),
    row(
        R::StepLowComputeRatio,
        "low_compute_ratio",
        StepReport,
        "the step spends too much time outside its matrix multiplies: waiting, copying, casting, launching, \
         element-wise work between the products",
        "act on the other findings first; what remains (casts and copies inside forward and backward, h2d, \
         framework overhead, logging) shrinks with fused kernels (train.fused_*), larger micro-batches and less \
         frequent logging (train.log_every)",
    ),
    row(
        R::StepMemoryPressure,
        "memory_pressure",
        StepReport,
        "the run is close to running out of memory; allocator retries and fragmentation slow steps first",
        "lower train.micro_batch and raise train.grad_accum, recompute activations, or shard optimizer state",
    ),
    row(
        R::TraceDataWait,
        "data_wait",
        Trace,
        "the input pipeline does not keep up: the training loop blocks on the next batch with no GPU work queued",
        "more DataLoader workers, pin_memory and prefetch_factor, or pre-tokenised shards (stoke's loader \
         prefetches on its own threads)",
    ),
    row(
        R::TraceDataloader,
        "dataloader",
        Trace,
        "data loading runs on the critical path (TensorBoard profiler rule)",
        "set num_workers > 0 on the DataLoader and enable pin_memory; move preprocessing offline",
    ),
    row(
        R::TraceCommunication,
        "communication",
        Trace,
        "collectives dominate the step (TensorBoard profiler rule)",
        "larger gradient buckets, gradient accumulation (fewer all-reduces), compression, or a faster interconnect",
    ),
    row(
        R::TraceCommExposed,
        "comm_exposed",
        Trace,
        "communication is not overlapped with computation",
        "overlap gradient all-reduce with backward (DDP buckets, FSDP prefetch), put collectives on their own stream",
    ),
    row(
        R::TraceLowGpuUtilization,
        "low_gpu_utilization",
        Trace,
        "the GPU waits for the host (launches, data, Python) more than it computes (TensorBoard profiler rule)",
        "bigger batches, CUDA graphs or torch.compile to cut launches, move host work off the step",
    ),
    row(
        R::TraceLowComputeRatio,
        "low_compute_ratio",
        Trace,
        "most of the step is spent outside compute: waiting, copying or communicating",
        "remove the largest non-compute category first (see the breakdown); its Amdahl bound is the most to gain",
    ),
    row(
        R::TraceCkptStall,
        "ckpt_stall",
        Trace,
        "checkpointing blocks training",
        "save asynchronously (copy to host, persist on a background thread), or checkpoint less often",
    ),
    row(
        R::TraceMemoryPressure,
        "memory_pressure",
        Trace,
        "the caching allocator is near the device limit: fragmentation, retries and OOM risk",
        "activation checkpointing, a smaller micro-batch with accumulation, sharded optimizer state, or \
         expandable_segments",
    ),
    row(
        R::TraceNoTensorCores,
        "no_tensor_cores",
        Trace,
        "matrix math runs in fp32 on CUDA cores (TensorBoard profiler rule)",
        "autocast to bf16/fp16, or allow TF32 (torch.backends.cuda.matmul.allow_tf32 = True)",
    ),
    row(
        R::TraceStepOutliers,
        "step_outliers",
        Trace,
        "some steps are much slower than the rest: warm-up, allocator growth, checkpoints, or host interference",
        "look at the slow steps' breakdown; exclude warm-up from measurements",
    ),
    row(
        R::TraceSmallBatch,
        "small_batch",
        Trace,
        "kernels are too small to hide their launch cost: the step is launch-bound",
        "raise the batch size (with gradient accumulation if memory allows), fuse ops (torch.compile), CUDA graphs",
    ),
    row(
        R::StragglerSlowSteps,
        "straggler",
        CrossRank,
        "one rank is slower, and synchronous collectives make every rank wait for it",
        "compare this rank's breakdown with the others': data skew, a slow host, thermal throttling, a bad link",
    ),
    row(
        R::StragglerLastArrival,
        "straggler",
        CrossRank,
        "this rank reaches collectives last; the others wait for it",
        "look at what this rank does before its collectives (data loading, extra work, a slow host)",
    ),
    row(
        R::StepStraggler,
        "straggler",
        CrossRank,
        "one rank works longer per step than the others, and every gradient all-reduce waits for it: the \
         others spend the difference in comm_exposed",
        "compare the ranks' phases in report.json's ranks section (a larger data_wait: that rank's loader or \
         storage; larger forward/backward: a slower or busier core, fewer threads); keep other work off that \
         rank's cores, or give every rank the same train.threads",
    ),
    row(
        R::DynLossSpike,
        "loss_spike",
        StepReport,
        "the training loss jumped far above its recent mean: a bad batch, a learning rate too high for the \
         batch, or the start of a divergence",
        "look at the spike's step in metrics.jsonl (block_grad_norm, update_ratio); lower train.lr or \
         raise train.warmup_steps, keep train.grad_clip on, or use train.optimizer = \"lamb\" at large batches",
    ),
    row(
        R::DynUpdateRatio,
        "update_ratio",
        StepReport,
        "a block's update is a large fraction of its weights in one step, which often precedes instability",
        "lower train.lr (or the batch-size rule's factor, train.lr_scaling), lengthen the warmup, or use \
         train.optimizer = \"lamb\", whose trust ratio bounds each tensor's step",
    ),
    row(
        R::DynEarlyStopped,
        "early_stopped",
        StepReport,
        "the evaluation loss stopped improving (eval.patience evaluations without a gain of eval.min_delta), \
         so the run ended early",
        "the best checkpoint is kept; train longer only with more data, regularization or a lower learning rate",
    ),
];

/// Amdahl's bound of removing `part` ms (or ns) from a `whole` step: whole / (whole - part); 1 when
/// there is nothing to remove, infinite when the part is the whole step.
pub fn amdahl(whole: f64, part: f64) -> f64 {
    if whole <= 0.0 || part <= 0.0 {
        1.0
    } else if part >= whole {
        f64::INFINITY
    } else {
        whole / (whole - part)
    }
}

/// Amdahl's bound as a finding states it: None when there is nothing to gain or no finite bound.
pub fn amdahl_bound(whole: f64, part: f64) -> Option<f64> {
    Some(amdahl(whole, part)).filter(|b| b.is_finite() && *b > 1.0)
}

/// A share as findings print it: "12.5%".
pub fn pct(share: f64) -> String {
    format!("{:.1}%", 100.0 * share)
}

/// Sorts findings by bound, largest first; findings without a bound last, in their order.
pub fn sort_by_bound(findings: &mut [Finding]) {
    findings.sort_by(|a, b| b.bound.unwrap_or(0.0).total_cmp(&a.bound.unwrap_or(0.0)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_in_rule_id_order_and_ids_are_snake_case() {
        for (i, rule) in RULES.iter().enumerate() {
            assert_eq!(rule.key as usize, i, "{} is out of place", rule.id);
            assert!(rule.id.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'), "{}", rule.id);
        }
        assert_eq!(RuleId::StragglerLastArrival.rule().scope, Scope::CrossRank);
        assert_eq!(amdahl(10.0, 2.0), 1.25);
        assert_eq!((amdahl(10.0, 0.0), amdahl(10.0, 10.0)), (1.0, f64::INFINITY));
        assert_eq!((amdahl_bound(10.0, 0.0), amdahl_bound(10.0, 10.0)), (None, None));
    }
}
