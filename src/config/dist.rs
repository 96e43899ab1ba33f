//! `[dist]`: how the processes of a job share the work (data, tensor and pipeline parallelism,
//! ZeRO, the communicator).

use serde::{Deserialize, Serialize};

/// `[dist]`: data-parallel training, used when a launcher (`stoke launch`, torchrun, mpirun,
/// srun) starts more than one process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// "shm" (processes on one machine, no system dependency), "tcp" (several machines: shared
    /// memory inside a node, TCP between nodes; what `stoke launch --nnodes` sets), "mpi" (Open
    /// MPI; a binary built with the `mpi` feature) or "nccl" (GPUs; the `nccl` feature). Default
    /// "shm".
    pub backend: String,
    /// Seconds any wait for another rank may take before the run fails naming that rank.
    /// Default 300.
    pub timeout_s: f64,
    /// Folder for the shm backend's shared-memory segments (a tmpfs). Default "/dev/shm".
    pub shm_dir: String,
    /// Size of a gradient bucket in MiB: consecutive units, in backward order, reduced as one
    /// message as soon as all their gradients are final. Default 25.
    pub bucket_mb: f64,
    /// Size of the first bucket in MiB (the last units: smaller, so the reduction starts early).
    /// Default 1.
    pub first_bucket_mb: f64,
    /// Reduce each bucket while backward goes on (true), or only after backward has finished
    /// (false: the reference the overlap is measured against). Default true.
    pub overlap: bool,
    /// ZeRO stage: 0 (every rank holds the whole model state), 1 (optimizer state sharded), 2
    /// (and gradients: reduce-scattered, only this rank's slice kept), 3 (and parameters: each
    /// unit gathered around its forward and backward). Default 0.
    pub zero: u8,
    /// Stage 3: units whose parameter gathers start ahead of the unit that runs. Default 1.
    pub prefetch_blocks: usize,
    /// Stages 2 and 3: full gradients alive at once (the one backward is filling, and the ones
    /// whose reduce-scatter has not finished; the oldest is waited for beyond that). At least 1.
    /// Default 2.
    pub gradient_units: usize,
    /// Gradient reductions: "none" (fp32, the communicator's collectives), "bf16" or "int8"
    /// (block-wise: a scale per `compress_block` values), each an all-to-all of the encoded
    /// shards, then (all-reduce) an all-gather of the encoded averages. Host memory only.
    /// Default "none".
    pub compress: String,
    /// Values per int8 block (one f32 scale each). Default 256.
    pub compress_block: usize,
    /// Add each encoding's error to the next step's gradient before encoding it (error
    /// feedback; the residuals are per rank). Default true.
    pub error_feedback: bool,
    /// Ranks one model is cut over (tensor parallelism, Megatron-LM's split of heads and the
    /// MLP's inner dimension): consecutive ranks hold one model's parts, and data parallelism
    /// runs over the copies. Default 1 (no cut).
    pub tensor: usize,
    /// With `tensor` above 1: the residual stream between the branches as each rank's piece of
    /// the sequence (norms and residual additions on pieces; all-gather and reduce-scatter in
    /// place of the branches' all-reduces). Families gpt, gpt-rms and llama, beside any ZeRO stage
    /// and pipeline stages. Default false.
    pub sequence_parallel: bool,
    /// Pipeline stages one model copy is cut into (consecutive units per stage, balanced by their
    /// FLOPs; one rank a stage, consecutive ranks a copy). Default 1.
    pub pipeline: usize,
    /// "1f1b" (one forward, one backward once the pipeline is full), "gpipe" (every forward,
    /// then every backward) or "interleaved" (1F1B over `pipeline_chunks` chunks a stage,
    /// Megatron-LM's virtual stages; micro-batches a multiple of the stages). Default "1f1b".
    pub pipeline_schedule: String,
    /// Model chunks per stage under "interleaved": the model is cut into stages x chunks
    /// pieces, stage s holding pieces s, s + stages, ... Default 2.
    pub pipeline_chunks: usize,
    /// Units per stage (per chunk when interleaved), comma-separated (the embedding and the head
    /// are units), overriding the balance; empty: balanced. Default "".
    pub pipeline_split: String,
}

impl Default for DistConfig {
    fn default() -> Self {
        DistConfig {
            backend: "shm".into(),
            timeout_s: 300.0,
            shm_dir: "/dev/shm".into(),
            bucket_mb: 25.0,
            first_bucket_mb: 1.0,
            overlap: true,
            zero: 0,
            prefetch_blocks: 1,
            gradient_units: 2,
            compress: "none".into(),
            compress_block: 256,
            error_feedback: true,
            tensor: 1,
            sequence_parallel: false,
            pipeline: 1,
            pipeline_schedule: "1f1b".into(),
            pipeline_chunks: 2,
            pipeline_split: String::new(),
        }
    }
}

impl DistConfig {
    /// `dist.pipeline_schedule`, parsed.
    pub fn schedule(&self) -> Result<stoke_train::Schedule, String> {
        match self.pipeline_schedule.parse()? {
            stoke_train::Schedule::Interleaved { .. } => {
                Ok(stoke_train::Schedule::Interleaved { chunks: self.pipeline_chunks })
            }
            other => Ok(other),
        }
    }

    /// `dist.pipeline_split`, parsed (empty: balanced).
    pub fn split(&self) -> Result<Vec<usize>, String> {
        let text = self.pipeline_split.trim();
        if text.is_empty() {
            return Ok(Vec::new());
        }
        text.split(',')
            .map(|part| {
                part.trim().parse::<usize>().map_err(|_| {
                    format!(
                        "is {:?}; give units per stage as whole numbers separated by commas, e.g. \"3,3\"",
                        self.pipeline_split
                    )
                })
            })
            .collect()
    }

    /// The trainer's data-parallel settings.
    pub fn data_parallel(&self) -> stoke_train::DataParallelConfig {
        let bytes = |mib: f64| (mib * 1024.0 * 1024.0).round() as u64;
        stoke_train::DataParallelConfig {
            buckets: stoke_train::BucketSizes {
                first_bytes: bytes(self.first_bucket_mb),
                bytes: bytes(self.bucket_mb),
            },
            overlap: self.overlap,
            zero: stoke_train::ZeroConfig {
                stage: self.zero,
                prefetch_units: self.prefetch_blocks,
                gradient_units: self.gradient_units,
            },
            compress: stoke_train::CompressConfig {
                compression: match self.compress.as_str() {
                    "bf16" => stoke_train::Compression::Bf16,
                    "int8" => stoke_train::Compression::Int8 { block: self.compress_block },
                    _ => stoke_train::Compression::None,
                },
                error_feedback: self.error_feedback,
            },
        }
    }
}
