//! One TOML file plus `--set section.key=value` overrides, checked key by key against the defaults.
//!
//! Every field and its default is documented in `defaults.toml` (what `stoke config --defaults`
//! prints); a test keeps that file and the `Default` impls equal.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use stoke_train::{AdaptiveConfig, CkptConfig, EvalConfig, Injections, ModelConfig, TrainConfig};

pub const DEFAULTS_TOML: &str = include_str!("defaults.toml");

mod dist;
mod precision;

pub use dist::DistConfig;

/// The whole configuration of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StokeConfig {
    pub run: RunConfig,
    pub model: ModelConfig,
    pub train: TrainConfig,
    pub data: DataConfig,
    pub ckpt: CkptConfig,
    pub eval: EvalConfig,
    pub adaptive: AdaptiveConfig,
    pub prof: stoke_prof::ProfConfig,
    pub dist: DistConfig,
}

/// Keys that may differ between the ranks of one job: per-process or per-node resources (threads,
/// loader threads, the cache, the shm folder), what only rank 0 does (profiling), and the run
/// name, which rank 0 decides for all.
fn per_rank_key(key: &str) -> bool {
    key.starts_with("prof.")
        || matches!(
            key,
            "run.name"
                | "train.threads"
                | "train.host_memory"
                | "data.workers"
                | "data.prefetch"
                | "data.cache_dir"
                | "data.cache_budget_bytes"
                | "dist.shm_dir"
        )
}

/// `[run]`: naming and placement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// Run name; "" makes one from the preset and the start time. Default "".
    pub name: String,
    /// Folder that holds the runs. Default "runs".
    pub dir: String,
    /// "auto" (a GPU when libtorch sees one), "cpu", "cuda" (each rank of a job on cuda:LOCAL_RANK of
    /// the devices CUDA_VISIBLE_DEVICES leaves) or "cuda:K". Default "auto".
    pub device: String,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig { name: String::new(), dir: "runs".into(), device: "auto".into() }
    }
}

/// `[data]`: what to train on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// What to train on: "" for the built-in corpus; a directory from `stoke prep text`; a Megatron
    /// `.bin`/`.idx`; a raw token `.bin` (nanoGPT, llm.c); any other file as byte-level text; or a URL
    /// (s3://, gs://, http(s)://) of a prepared directory, read through `cache_dir`. Default "".
    pub path: String,
    /// Size of the built-in corpus in bytes. Default 4194304.
    pub builtin_bytes: usize,
    /// Loader threads that fill batches ahead of the step; 0 assembles each batch on the training
    /// thread when the step asks for it (no prefetch). Default 2.
    pub workers: usize,
    /// Batches prepared ahead of the step (the bound of the prefetch queue). Default 4.
    pub prefetch: usize,
    /// Skip the tail of an epoch that cannot fill a whole batch. Default true.
    pub drop_last: bool,
    /// Local cache directory for remote shards; "" refuses URLs. Default "".
    pub cache_dir: String,
    /// Size budget of the cache in bytes (least recently used shards are evicted). Default 17179869184.
    pub cache_budget_bytes: u64,
    /// More datasets, of the kinds `path` takes, blended with `path` (each sample drawn from one
    /// dataset by weight, each dataset shuffled on its own). Default [].
    pub blend: Vec<String>,
    /// One weight per dataset, `path` first, then `blend`; [] weighs them equally. Default [].
    pub weights: Vec<f64>,
    /// How a `.jsonl` file of instructions (`{"prompt", "response"}` per line; the loss counts
    /// the response only) is tokenized: "bytes" or the path of a Hugging Face `tokenizer.json`.
    /// Default "bytes".
    pub tokenizer: String,
    /// The token (by its text, e.g. "<|eot_id|>") appended to each instruction's response; ""
    /// for none. Default "".
    pub eos: String,
    /// Episodes of the built-in robot set (model.family = "vla" with `path` ""), each of at most
    /// 16 steps (it ends at the move that reaches its block; about 5 on average). Default 8192.
    pub builtin_episodes: usize,
    /// Robot episodes (model.family = "vla"): past frames per camera besides the current one.
    /// Default 0.
    pub history: usize,
    /// Robot episodes: random resized crops and colour jitter on the training frames (never on
    /// the held-out ones). Default true.
    pub augment: bool,
    /// Robot episodes: what an ablation blanks in every sample, training and held-out: "none",
    /// "frames" (black) or "instructions" (empty). Default "none".
    pub blank: String,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            path: String::new(),
            builtin_bytes: 4 << 20,
            workers: 2,
            prefetch: 4,
            drop_last: true,
            cache_dir: String::new(),
            cache_budget_bytes: 16 << 30,
            blend: Vec::new(),
            weights: Vec::new(),
            tokenizer: "bytes".into(),
            eos: String::new(),
            builtin_episodes: 8192,
            history: 0,
            augment: true,
            blank: "none".into(),
        }
    }
}

/// A configuration problem; its message names the key and what is allowed.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config file {path} is not valid TOML: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("--set {arg:?}: expected section.key=value")]
    BadOverride { arg: String },
    #[error("unknown config key `{key}`{hint}")]
    UnknownKey { key: String, hint: String },
    #[error("config key `{key}` expects {expected}, got {got}")]
    WrongType { key: String, expected: &'static str, got: String },
    #[error("config key `{key}`: {message}")]
    Invalid { key: String, message: String },
}

fn type_name(value: &toml::Value) -> &'static str {
    match value {
        toml::Value::String(_) => "a string",
        toml::Value::Integer(_) => "an integer",
        toml::Value::Float(_) => "a number",
        toml::Value::Boolean(_) => "a boolean",
        toml::Value::Datetime(_) => "a date",
        toml::Value::Array(_) => "an array",
        toml::Value::Table(_) => "a table",
    }
}

/// Levenshtein distance, for "did you mean".
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (prev + usize::from(ca != cb)).min(row[j] + 1).min(row[j + 1] + 1);
            prev = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

fn unknown_key(key: String, known: &toml::Table, leaf: &str) -> ConfigError {
    let mut names: Vec<&str> = known.keys().map(String::as_str).collect();
    names.sort_unstable();
    let closest = names.iter().map(|n| (edit_distance(leaf, n), *n)).min();
    let hint = match closest {
        Some((distance, name)) if distance <= 2 => {
            let prefix = key.rsplit_once('.').map(|(p, _)| format!("{p}.")).unwrap_or_default();
            format!("; did you mean `{prefix}{name}`?")
        }
        _ => format!("; known keys here: {}", names.join(", ")),
    };
    ConfigError::UnknownKey { key, hint }
}

/// Checks that every key of `user` exists in `defaults` with a compatible type; integers are
/// accepted (and converted) where a number is expected.
fn check_table(user: &mut toml::Table, defaults: &toml::Table, prefix: &str) -> Result<(), ConfigError> {
    for (name, value) in user.iter_mut() {
        let key = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
        if OPEN_TABLES.contains(&key.as_str()) {
            check_open_table(value, &key)?;
            continue;
        }
        let Some(default) = defaults.get(name) else {
            return Err(unknown_key(key, defaults, name));
        };
        match (default, &*value) {
            (toml::Value::Table(d), toml::Value::Table(_)) => {
                let toml::Value::Table(u) = value else { unreachable!() };
                check_table(u, d, &key)?;
            }
            (toml::Value::Float(_), toml::Value::Integer(i)) => *value = toml::Value::Float(*i as f64),
            (d, u) if std::mem::discriminant(d) == std::mem::discriminant(u) => {}
            (d, u) => {
                return Err(ConfigError::WrongType {
                    key,
                    expected: type_name(d),
                    got: format!("{} ({u})", type_name(u)),
                })
            }
        }
    }
    Ok(())
}

/// Keys whose value is a table of the user's own keys to numbers (not a section of known keys):
/// checked by `check_open_table`, and replaced whole, never merged key by key.
const OPEN_TABLES: [&str; 1] = ["train.lr_multipliers"];

/// An open table's value: a table whose every value is a number (integers become floats).
fn check_open_table(value: &mut toml::Value, key: &str) -> Result<(), ConfigError> {
    let toml::Value::Table(table) = value else {
        return Err(ConfigError::WrongType { key: key.into(), expected: "a table", got: type_name(value).into() });
    };
    for (name, entry) in table.iter_mut() {
        match entry {
            toml::Value::Integer(i) => *entry = toml::Value::Float(*i as f64),
            toml::Value::Float(_) => {}
            other => {
                return Err(ConfigError::WrongType {
                    key: format!("{key}.{name}"),
                    expected: "a float",
                    got: format!("{} ({other})", type_name(other)),
                })
            }
        }
    }
    Ok(())
}

/// Parses `section.key=value`; a value that is not TOML is taken as a bare string.
fn parse_override(arg: &str) -> Result<(Vec<String>, toml::Value), ConfigError> {
    let bad = || ConfigError::BadOverride { arg: arg.to_string() };
    let (key, raw) = arg.split_once('=').ok_or_else(bad)?;
    let path: Vec<String> = key.trim().split('.').map(str::to_string).collect();
    if path.len() < 2 || path.iter().any(String::is_empty) {
        return Err(bad());
    }
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut table) => table.remove("v").expect("the key we just wrote"),
        // A run of digits that TOML refuses is an integer out of range, not a string.
        Err(_) if is_integer_literal(raw.trim()) => {
            return Err(ConfigError::Invalid {
                key: path.join("."),
                message: format!(
                    "{} does not fit in a 64-bit integer (from {} to {})",
                    stoke_fsio::clip(raw.trim()),
                    i64::MIN,
                    i64::MAX
                ),
            })
        }
        Err(_) => toml::Value::String(raw.to_string()),
    };
    Ok((path, value))
}

/// An optional sign, then digits (with TOML's underscores between them).
fn is_integer_literal(text: &str) -> bool {
    let digits = text.strip_prefix(['+', '-']).unwrap_or(text);
    !digits.is_empty()
        && digits.starts_with(|c: char| c.is_ascii_digit())
        && digits.chars().all(|c| c.is_ascii_digit() || c == '_')
}

/// Deep-merges `user` into `base`: tables merge key by key, any other value replaces.
fn merge(base: &mut toml::Table, user: toml::Table) {
    merge_at(base, user, "");
}

fn merge_at(base: &mut toml::Table, user: toml::Table, prefix: &str) {
    for (name, value) in user {
        let key = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
        match (base.get_mut(&name), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(u)) if !OPEN_TABLES.contains(&key.as_str()) => {
                merge_at(b, u, &key)
            }
            (_, value) => {
                base.insert(name, value);
            }
        }
    }
}

/// Every leaf of `table` as (`section.key`, value).
fn flatten(table: &toml::Table, prefix: &str, out: &mut Vec<(String, toml::Value)>) {
    for (name, value) in table {
        let key = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
        match value {
            toml::Value::Table(t) => flatten(t, &key, out),
            other => out.push((key, other.clone())),
        }
    }
}

fn insert(table: &mut toml::Table, path: &[String], value: toml::Value) -> Result<(), ConfigError> {
    let (last, sections) = path.split_last().expect("overrides have at least two parts");
    let mut current = table;
    for (depth, section) in sections.iter().enumerate() {
        let entry = current.entry(section.clone()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        current = match entry {
            toml::Value::Table(t) => t,
            other => {
                return Err(ConfigError::WrongType {
                    key: path[..=depth].join("."),
                    expected: "a table",
                    got: type_name(other).to_string(),
                })
            }
        };
    }
    current.insert(last.clone(), value);
    Ok(())
}

/// The hidden test switches of `TrainConfig::test_inject` (`stoke bench gate`'s self-test): the
/// variable, what it sets, the largest value, and what the value is.
pub const INJECTIONS: [(&str, fn(&mut Injections) -> &mut f64, f64, &str); 5] = [
    ("STOKE_TEST_SLOW_FORWARD", |i| &mut i.slow_forward, 10.0, "a fraction of the forward's time"),
    ("STOKE_TEST_SLOW_BACKWARD", |i| &mut i.slow_backward, 10.0, "a fraction of the backward's time"),
    ("STOKE_TEST_SLOW_OPTIMIZER", |i| &mut i.slow_optimizer, 10.0, "a fraction of the optimizer's time"),
    ("STOKE_TEST_DATA_WAIT_MS", |i| &mut i.data_wait_ms, 1000.0, "milliseconds more data wait per batch"),
    ("STOKE_TEST_MORE_MEMORY", |i| &mut i.more_memory, 10.0, "a fraction of the peak resident memory"),
];

/// `STOKE_TEST_SLOW_FORWARD=0.10` makes every forward 10% slower (a busy-wait), and so on for
/// `INJECTIONS`; unset is 0.
fn test_injections() -> Result<Injections, ConfigError> {
    let mut inject = Injections::default();
    for (var, field, max, what) in INJECTIONS {
        let Some(raw) = std::env::var_os(var) else { continue };
        let raw = raw.to_string_lossy();
        *field(&mut inject) = match raw.trim().parse::<f64>() {
            Ok(value) if value.is_finite() && (0.0..=max).contains(&value) => value,
            _ => {
                return Err(ConfigError::Invalid {
                    key: var.into(),
                    message: format!("must be a number from 0 to {max} ({what}); got {raw:?}"),
                })
            }
        };
    }
    Ok(inject)
}

impl StokeConfig {
    /// Loads `file` (if any), applies `overrides`, and checks every key, type and value.
    pub fn load(file: Option<&Path>, overrides: &[String]) -> Result<StokeConfig, ConfigError> {
        StokeConfig::load_over(toml::Table::new(), file, overrides)
    }

    /// `load` on top of a run's saved config instead of the defaults (what `--resume` does): keys
    /// the file and overrides do not name keep their saved values.
    pub fn load_resumed(
        saved: &StokeConfig,
        file: Option<&Path>,
        overrides: &[String],
    ) -> Result<StokeConfig, ConfigError> {
        let base = toml::Table::try_from(saved).expect("a config serializes");
        StokeConfig::load_over(base, file, overrides)
    }

    fn load_over(mut base: toml::Table, file: Option<&Path>, overrides: &[String]) -> Result<StokeConfig, ConfigError> {
        let mut user = match file {
            Some(path) => {
                let text = stoke_fsio::read_to_string_capped(path, stoke_fsio::CONFIG_CAP)
                    .map_err(|source| ConfigError::Read { path: path.into(), source })?;
                text.parse::<toml::Table>()
                    .map_err(|e| ConfigError::Parse { path: path.into(), message: e.to_string() })?
            }
            None => toml::Table::new(),
        };
        for arg in overrides {
            let (path, value) = parse_override(arg)?;
            insert(&mut user, &path, value)?;
        }
        let defaults = toml::Table::try_from(StokeConfig::default()).expect("defaults serialize");
        check_table(&mut user, &defaults, "")?;
        merge(&mut base, user);
        precision::resolve_auto_precision(&mut base, &RunConfig::default().device)
            .map_err(|message| ConfigError::Invalid { key: "run.device".into(), message })?;
        let config: StokeConfig = serde_path_to_error::deserialize(toml::Value::Table(base)).map_err(|e| {
            let key = e.path().to_string();
            let message = e.into_inner().to_string();
            let message = message.split(" for key").next().unwrap_or(&message).to_string();
            ConfigError::Invalid { key, message }
        })?;
        let mut config = config;
        config.train.test_inject = test_injections()?;
        // A checkpoint made elsewhere fixes the family and shape: they are read from its
        // config.json here, so the run folder's config.toml and every rank hold them explicitly.
        config.model = stoke_train::resolve_from(&config.model).map_err(|e| match e {
            stoke_train::TrainError::InvalidConfig { key, message } => {
                ConfigError::Invalid { key: key.into(), message }
            }
            other => ConfigError::Invalid { key: "model.from".into(), message: other.to_string() },
        })?;
        // A vla model's input sizes come from its dataset's manifest, so they are explicit too.
        let data = crate::run::EpisodeData {
            path: &config.data.path,
            history: config.data.history,
            blank: &config.data.blank,
        };
        config.model = crate::run::resolve_episode_dims(&config.model, &data)
            .map_err(|(key, message)| ConfigError::Invalid { key: key.into(), message })?;
        config.validate()?;
        Ok(config)
    }

    /// `dist.tensor`: at least 1, and above 1 a family that declares its split and an optimizer
    /// whose update needs no whole tensor (not LAMB).
    fn check_tensor_parallel(&self) -> Result<(), ConfigError> {
        let (tensor, family, families) = (self.dist.tensor, &self.model.family, stoke_train::TENSOR_PARALLEL_FAMILIES);
        if self.dist.sequence_parallel {
            let why = if tensor < 2 {
                Some("needs dist.tensor above 1 (it cuts the sequence over the model's cut)".to_string())
            } else if !families.contains(&family.as_str()) {
                let families: Vec<String> = families.iter().map(|f| format!("{f:?}")).collect();
                Some(format!("runs with model.family {}, not {family:?}", families.join(" or ")))
            } else {
                None
            };
            if let Some(why) = why {
                return Err(ConfigError::Invalid {
                    key: "dist.sequence_parallel".into(),
                    message: format!("is true, but {why}"),
                });
            }
        }
        let message = match tensor {
            0 => "must be at least 1".to_string(),
            1 => return Ok(()),
            _ if self.train.optimizer == stoke_train::OptimizerKind::Lamb => format!(
                "is {tensor} with train.optimizer = \"lamb\": LAMB's per-tensor trust ratios need whole tensors, which a cut model's ranks do not hold; use AdamW or dist.tensor = 1"
            ),
            _ if families.contains(&family.as_str()) => return Ok(()),
            _ => format!(
                "is {tensor}, but model.family {family:?} declares no tensor-parallel split (those that do: {})",
                families.join(", ")
            ),
        };
        Err(ConfigError::Invalid { key: "dist.tensor".into(), message })
    }

    /// `dist.pipeline`, its schedule and split: at least one stage, and above one a family whose
    /// embedding keeps no state for the blocks (every family but vla).
    fn check_pipeline(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| Err(ConfigError::Invalid { key: key.into(), message });
        match self.dist.schedule() {
            Err(message) => return invalid("dist.pipeline_schedule", message),
            Ok(stoke_train::Schedule::Interleaved { chunks }) if chunks < 2 => {
                return invalid(
                    "dist.pipeline_chunks",
                    format!("is {chunks}; the interleaved schedule needs at least 2 chunks a stage (\"1f1b\" is one)"),
                )
            }
            Ok(_) => {}
        }
        if let Err(message) = self.dist.split() {
            return invalid("dist.pipeline_split", message);
        }
        match self.dist.pipeline {
            0 => invalid("dist.pipeline", "must be at least 1".into()),
            1 => Ok(()),
            stages if self.dist.zero == 1 && self.train.optimizer == stoke_train::OptimizerKind::Lamb => invalid(
                "dist.zero",
                format!("is 1 with dist.pipeline = {stages}: LAMB's per-tensor ratios need whole tensors; use AdamW or dist.zero = 0"),
            ),
            stages if self.model.family == "vla" => invalid(
                "dist.pipeline",
                format!("is {stages}, but a vla model's blocks read masks its embedding makes; keep dist.pipeline = 1"),
            ),
            _ => Ok(()),
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |e: stoke_train::TrainError| match e {
            stoke_train::TrainError::InvalidConfig { key, message } => {
                ConfigError::Invalid { key: key.into(), message }
            }
            other => ConfigError::Invalid { key: "?".into(), message: other.to_string() },
        };
        self.train.validate().map_err(invalid)?;
        self.eval.validate().map_err(invalid)?;
        self.prof.validate().map_err(|e| match e {
            stoke_prof::ProfError::InvalidConfig { key, message } => {
                ConfigError::Invalid { key: format!("prof.{key}"), message }
            }
            other => ConfigError::Invalid { key: "prof".into(), message: other.to_string() },
        })?;
        self.model.shape().map_err(invalid)?;
        self.check_tensor_parallel()?;
        self.check_pipeline()?;
        stoke_train::parse_device(&self.run.device).map_err(invalid)?;
        if self.run.dir.is_empty() {
            return Err(ConfigError::Invalid { key: "run.dir".into(), message: "must not be empty".into() });
        }
        // Empty means "made up from the preset and the time".
        if !self.run.name.is_empty() {
            stoke_fsio::check_name(&self.run.name)
                .map_err(|message| ConfigError::Invalid { key: "run.name".into(), message })?;
        }
        let blend = self.data.blend.iter().map(|p| ("data.blend", p));
        let data_paths = std::iter::once(("data.path", &self.data.path)).chain(blend);
        for (key, path) in data_paths {
            let remote = stoke_data::is_remote(path);
            let missing = if path.is_empty() { key == "data.blend" } else { !remote && !Path::new(path).exists() };
            if missing {
                return Err(ConfigError::Invalid {
                    key: key.into(),
                    message: format!("no such file or folder: {path}"),
                });
            }
            if remote && self.data.cache_dir.is_empty() {
                return Err(ConfigError::Invalid {
                    key: "data.cache_dir".into(),
                    message: format!("a remote {key} ({path}) needs a cache directory"),
                });
            }
        }
        let n_datasets = 1 + self.data.blend.len();
        let bad_weight = self.data.weights.iter().any(|w| !(w.is_finite() && *w > 0.0));
        if bad_weight || !(self.data.weights.is_empty() || self.data.weights.len() == n_datasets) {
            return Err(ConfigError::Invalid {
                key: "data.weights".into(),
                message: format!(
                    "[] or {n_datasets} positive numbers (data.path, then data.blend); got {:?}",
                    self.data.weights
                ),
            });
        }
        if self.data.prefetch == 0 {
            return Err(ConfigError::Invalid { key: "data.prefetch".into(), message: "must be at least 1".into() });
        }
        for (key, mib) in [("dist.bucket_mb", self.dist.bucket_mb), ("dist.first_bucket_mb", self.dist.first_bucket_mb)]
        {
            if !(mib.is_finite() && mib > 0.0 && mib <= 1024.0 * 1024.0) {
                return Err(ConfigError::Invalid {
                    key: key.into(),
                    message: format!("must be a positive number of MiB; got {mib}"),
                });
            }
        }
        if !matches!(self.dist.compress.as_str(), "none" | "bf16" | "int8") {
            return Err(ConfigError::Invalid {
                key: "dist.compress".into(),
                message: format!("must be one of none, bf16, int8; got {:?}", self.dist.compress),
            });
        }
        if self.dist.gradient_units == 0 {
            return Err(ConfigError::Invalid {
                key: "dist.gradient_units".into(),
                message: "must be at least 1 (the gradient backward is filling)".into(),
            });
        }
        if self.dist.compress_block == 0 {
            return Err(ConfigError::Invalid {
                key: "dist.compress_block".into(),
                message: "must be at least 1".into(),
            });
        }
        if self.dist.zero > 3 {
            return Err(ConfigError::Invalid {
                key: "dist.zero".into(),
                message: format!("must be 0, 1, 2 or 3; got {}", self.dist.zero),
            });
        }
        if self.ckpt.host_buffers == 0 {
            return Err(ConfigError::Invalid { key: "ckpt.host_buffers".into(), message: "must be at least 1".into() });
        }
        Ok(())
    }

    /// The value of `section.key` as TOML text ("?" when there is no such key).
    pub fn value_of(&self, key: &str) -> String {
        let mut leaves = Vec::new();
        flatten(&toml::Table::try_from(self).expect("a config serializes"), "", &mut leaves);
        leaves.into_iter().find(|(k, _)| k == key).map(|(_, v)| v.to_string()).unwrap_or_else(|| "?".into())
    }

    /// Keys whose values differ between `self` and `other`, as `section.key`, sorted.
    pub fn differing_keys(&self, other: &StokeConfig) -> Vec<String> {
        let mut a = Vec::new();
        let mut b = Vec::new();
        flatten(&toml::Table::try_from(self).expect("a config serializes"), "", &mut a);
        flatten(&toml::Table::try_from(other).expect("a config serializes"), "", &mut b);
        let b: std::collections::BTreeMap<String, toml::Value> = b.into_iter().collect();
        let mut keys: Vec<String> = a.into_iter().filter(|(k, v)| b.get(k) != Some(v)).map(|(k, _)| k).collect();
        keys.sort();
        keys
    }

    /// What every rank of a data-parallel job must agree on, as `key = value` entries: every key
    /// but the per-rank ones, the model's resolved shape and its parameter count.
    pub fn agreement_entries(&self) -> Vec<(String, String)> {
        let mut leaves = Vec::new();
        flatten(&toml::Table::try_from(self).expect("a config serializes"), "", &mut leaves);
        let mut entries: Vec<(String, String)> =
            leaves.into_iter().filter(|(k, _)| !per_rank_key(k)).map(|(k, v)| (k, v.to_string())).collect();
        if let Ok(shape) = self.model.shape() {
            entries.push(("model.shape".into(), format!("{shape:?}")));
            entries.push(("model.n_params".into(), shape.n_params().to_string()));
        }
        entries
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("the config serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(table: &toml::Table, prefix: &str, out: &mut Vec<String>) {
        for (name, value) in table {
            let key = if prefix.is_empty() { name.clone() } else { format!("{prefix}.{name}") };
            match value {
                toml::Value::Table(t) => keys(t, &key, out),
                _ => out.push(key),
            }
        }
    }

    #[test]
    fn documented_defaults_equal_the_code() {
        let documented: StokeConfig = toml::from_str(DEFAULTS_TOML).expect("defaults.toml parses");
        assert_eq!(documented, StokeConfig::default());
        let (mut from_file, mut from_code) = (Vec::new(), Vec::new());
        keys(&DEFAULTS_TOML.parse::<toml::Table>().unwrap(), "", &mut from_file);
        keys(&toml::Table::try_from(StokeConfig::default()).unwrap(), "", &mut from_code);
        from_file.sort();
        from_code.sort();
        assert_eq!(from_file, from_code, "every key is documented in defaults.toml, and only those");
    }

    fn check_err(overrides: &[&str], expected: &str) {
        let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
        let err = StokeConfig::load(None, &overrides).unwrap_err().to_string();
        assert!(err.contains(expected), "{overrides:?}: {err}");
    }

    #[test]
    fn errors_name_the_key() {
        check_err(&["train.stepz=3"], "unknown config key `train.stepz`; did you mean `train.steps`?");
        check_err(&["trian.steps=3"], "unknown config key `trian`");
        check_err(&["train.steps=abc"], "config key `train.steps` expects an integer, got a string");
        check_err(&["train.lr=-1"], "config key `train.lr`: must be a finite number > 0");
        check_err(&["train.precision=fp8"], "config key `train.precision`: unknown variant `fp8`");
        check_err(&["train.recompute=all"], "config key `train.recompute`");
        check_err(&["model.preset=huge"], "config key `model.preset`: must be one of");
        check_err(&["train.steps"], "expected section.key=value");
        check_err(&["data.path=/no/such/file.txt"], "config key `data.path`: no such file");
        check_err(&["train=3"], "expected section.key=value");
    }

    #[test]
    fn resumed_load_keeps_saved_values_and_reports_differences() {
        let saved = StokeConfig::load(None, &["train.steps=20".into(), "train.seed=5".into()]).unwrap();
        let resumed = StokeConfig::load_resumed(&saved, None, &["train.steps=30".into()]).unwrap();
        assert_eq!((resumed.train.steps, resumed.train.seed), (30, 5));
        assert_eq!(saved.differing_keys(&resumed), ["train.steps"]);
        let same = StokeConfig::load_resumed(&saved, None, &["train.seed=5".into()]).unwrap();
        assert!(saved.differing_keys(&same).is_empty());
        assert!(StokeConfig::load_resumed(&saved, None, &["train.sead=5".into()]).is_err());
    }

    /// `train.lr_multipliers` is a table of the user's globs: numbers only, integers taken as
    /// floats, and an override or a resume replaces the whole table.
    #[test]
    fn learning_rate_multipliers_are_a_table_of_globs_to_numbers() {
        let config = StokeConfig::load(None, &[r#"train.lr_multipliers={"vision.*"=0.1, "head"=2}"#.into()]).unwrap();
        let expected = [("head".to_string(), 2.0), ("vision.*".to_string(), 0.1)].into_iter().collect();
        assert_eq!(config.train.lr_multipliers, expected);
        let resumed =
            StokeConfig::load_resumed(&config, None, &[r#"train.lr_multipliers={"backbone.*"=0.5}"#.into()]).unwrap();
        assert_eq!(resumed.train.lr_multipliers.keys().collect::<Vec<_>>(), ["backbone.*"]);
        check_err(
            &[r#"train.lr_multipliers={"vision.*"="slow"}"#],
            "config key `train.lr_multipliers.vision.*` expects a float, got a string",
        );
        check_err(&["train.lr_multipliers=3"], "config key `train.lr_multipliers` expects a table");
        check_err(&[r#"train.lr_multipliers={"vision.*"=-1}"#], "a factor must be finite and at least 0");
    }

    #[test]
    fn overrides_apply() {
        let overrides = ["train.steps=20", "train.lr=1", "train.precision=fp32", "run.name=x"].map(String::from);
        let config = StokeConfig::load(None, &overrides).unwrap();
        assert_eq!(config.train.steps, 20);
        assert_eq!(config.train.lr, 1.0);
        assert_eq!(config.train.precision, stoke_train::Precision::Fp32);
        assert_eq!(config.run.name, "x");
    }
}

/// Config files and `--set` values come from users: any mutation or truncation of a valid config,
/// and any override text, loads or is refused with an error, never a panic, and the error names
/// a key or the file. Failing cases are kept by proptest in `proptest-regressions/`.
#[cfg(test)]
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn fuzz_mutated_config_files(
            cuts in proptest::collection::vec((0usize..20_000, any::<u8>()), 1..6),
            truncate in proptest::option::of(0usize..20_000),
        ) {
            let mut bytes = StokeConfig::default().to_toml().into_bytes();
            for (at, byte) in &cuts {
                let i = at % bytes.len();
                bytes[i] = *byte;
            }
            if let Some(len) = truncate {
                bytes.truncate(len % (bytes.len() + 1));
            }
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("fuzzed.toml");
            std::fs::write(&path, &bytes).unwrap();
            if let Err(err) = StokeConfig::load(Some(&path), &[]) {
                prop_assert!(!err.to_string().is_empty());
            }
        }

        #[test]
        fn fuzz_overrides(key in "[a-z_.]{0,24}", value in "\\PC{0,40}") {
            let _ = StokeConfig::load(None, &[format!("{key}={value}")]);
            let _ = StokeConfig::load(None, &[value]);
        }
    }
}
