use std::path::PathBuf;

/// What can stop a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("config key `{key}`: {message}")]
    InvalidConfig { key: &'static str, message: String },
    // Transparent: the data error names its file, and a chain printed whole (`{:#}`) would
    // otherwise say it twice.
    #[error(transparent)]
    Data(#[from] stoke_data::DataError),
    #[error(transparent)]
    Checkpoint(#[from] stoke_ckpt::CkptError),
    #[error("loss is {value} at step {step}: training diverged (lower train.lr, raise train.warmup_steps, or check the data)")]
    NonFiniteLoss { step: u64, value: f64 },
    #[error(
        "{} at step {}: training diverged (lower train.lr, raise train.warmup_steps, or check the data); {}, the latest checkpoint ({}) is intact",
        if .0.detected_at == "loss" { "the loss is not finite" } else { "the gradients are not finite" },
        .0.step,
        if .0.detected_at_step == .0.step {
            "the run stopped before the update".to_string()
        } else {
            format!("the device's guard was read at step {} (train.guard_every) and the run stopped there", .0.detected_at_step)
        },
        .0.latest_checkpoint.map_or("none".to_string(), |s| format!("step {s}"))
    )]
    NonFinite(Box<crate::trainer::NanDump>),
    #[error("batch at step {step} holds token {token}, outside the model's vocabulary of {vocab_size} (set model.vocab_size)")]
    TokenOutOfVocab { step: u64, token: i64, vocab_size: usize },
    #[error("checkpoint {path} does not match this model: {message}")]
    CheckpointMismatch { path: PathBuf, message: String },
    #[error("Hugging Face checkpoint {path}: {message}")]
    HfCheckpoint { path: PathBuf, message: String },
    #[error("Hugging Face checkpoint {path}: tensor {tensor:?} {message}")]
    HfTensor { path: PathBuf, tensor: String, message: String },
    #[error("observer: {0}")]
    Observer(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("data-parallel `{op}` failed on rank {rank} of {world_size}")]
    Comm {
        rank: usize,
        world_size: usize,
        op: &'static str,
        #[source]
        source: stoke_comm::CommError,
    },
    #[error("rank {rank} of {world_size}: the ranks must train the same model with the same configuration, but {differences}")]
    RanksDisagree { rank: usize, world_size: usize, differences: crate::dist::Disagreement },
    #[error("compression residual `{name}`: {message}")]
    CompressState { name: String, message: String },
    #[error("model too large for this machine: {message}")]
    TooLarge { message: String },
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}
