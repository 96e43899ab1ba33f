//! The run's data sources: the training part and the held-out part of every dataset the config
//! names (`data.path` and `data.blend`), as one prefetching loader for this rank.

use std::path::Path;

use anyhow::Context;
use stoke_data::BatchSource;

use crate::config::StokeConfig;
use crate::exit::UsageError;

/// The data the config names, as a prefetching loader at the start of its order. Every kind of data
/// (the built-in corpus and text files as byte-level tokens in memory, prepared shards, Megatron and
/// raw token files, remote shards through the cache) goes through the same loader.
/// For rank `rank` of `world_size`: its rows of each global batch (`0, 1` for one process).
pub fn batch_source_for(config: &StokeConfig, rank: usize, world_size: usize) -> anyhow::Result<Box<dyn BatchSource>> {
    Ok(sources_for(config, rank, world_size, false)?.expect("the training part always exists"))
}

/// The held-out split's source when `eval.every` > 0 (one batch at a time, no loader threads).
pub fn eval_source_for(
    config: &StokeConfig,
    rank: usize,
    world_size: usize,
) -> anyhow::Result<Option<Box<dyn BatchSource>>> {
    if config.eval.every == 0 {
        return Ok(None);
    }
    sources_for(config, rank, world_size, true)
}

/// The training part (`held_out` false) or the held-out part of the data; with `eval.every` = 0
/// nothing is held out and the training part is all of it.
fn sources_for(
    config: &StokeConfig,
    rank: usize,
    world_size: usize,
    held_out: bool,
) -> anyhow::Result<Option<Box<dyn BatchSource>>> {
    if config.model.family == "vla" {
        return Ok(Some(super::episodes::episode_source(config, rank, world_size, held_out)?));
    }
    let shape = config.model.shape()?;
    let data = &config.data;
    if data.path.ends_with(".jsonl") {
        return instructions_for(config, rank, world_size, held_out);
    }
    let mut datasets = Vec::with_capacity(1 + data.blend.len());
    for (dataset_idx, spec) in std::iter::once(&data.path).chain(&data.blend).enumerate() {
        let store = open_store(config, spec)?;
        if let Some(vocab_size) = store.vocab_size().filter(|&v| v > shape.vocab_size as u64) {
            return Err(anyhow::Error::new(UsageError(format!(
                "data {spec} has a vocabulary of {vocab_size}, the model's (model.vocab_size) is {}",
                shape.vocab_size
            ))));
        }
        let store = if config.eval.every > 0 {
            let min_tokens = ((shape.seq_len + 1) * config.train.micro_batch * world_size) as u64;
            let (train, tail) = store.split_tail(config.eval.holdout, min_tokens).with_context(|| {
                format!("data {spec}: holding out eval.holdout = {} for evaluation", config.eval.holdout)
            })?;
            if held_out {
                tail
            } else {
                train
            }
        } else {
            store
        };
        let weight = data.weights.get(dataset_idx).copied().unwrap_or(1.0);
        datasets.push(stoke_data::WeightedStore { store, weight });
    }
    let loader = stoke_data::LoaderConfig {
        seq_len: shape.seq_len,
        micro_batch: config.train.micro_batch,
        seed: config.train.seed,
        rank,
        world_size,
        n_workers: if held_out { 0 } else { data.workers },
        prefetch_depth: data.prefetch,
        drop_last: data.drop_last,
    };
    Ok(Some(Box::new(stoke_data::Loader::blend(datasets, loader)?)))
}

/// Instruction data (`data.path` ending in `.jsonl`): one example per row, the loss on responses.
fn instructions_for(
    config: &StokeConfig,
    rank: usize,
    world_size: usize,
    held_out: bool,
) -> anyhow::Result<Option<Box<dyn BatchSource>>> {
    let usage = |message: String| anyhow::Error::new(UsageError(message));
    if held_out || !config.data.blend.is_empty() {
        return Err(usage("instruction data (data.path *.jsonl) takes no data.blend and no eval.every yet".into()));
    }
    let shape = config.model.shape()?;
    if config.model.family == "gpt" && config.train.fused_cross_entropy.enabled(shape.vocab_size) {
        return Err(usage(
            "instruction data skips the prompt's targets, which the fused cross-entropy kernel cannot: \
             set train.fused_cross_entropy = \"off\" or use gpt-rms or llama"
                .into(),
        ));
    }
    let path = Path::new(&config.data.path);
    let examples = stoke_data::read_instructions(path, &config.data.tokenizer, &config.data.eos, shape.seq_len)?;
    if let Some(token) = examples.iter().flat_map(|e| &e.tokens).find(|&&t| t as usize >= shape.vocab_size) {
        return Err(usage(format!(
            "data {} holds token {token}, outside the model's vocabulary of {} (model.vocab_size)",
            config.data.path, shape.vocab_size
        )));
    }
    let source = stoke_data::InstructionSource::new(
        std::sync::Arc::new(examples),
        shape.seq_len,
        config.train.micro_batch,
        config.train.seed,
        rank,
        world_size,
    );
    Ok(Some(Box::new(source)))
}

/// One dataset as a token store: "" is the built-in corpus.
fn open_store(config: &StokeConfig, spec: &str) -> anyhow::Result<stoke_data::TokenStore> {
    let data = &config.data;
    let path = Path::new(spec);
    Ok(if spec.is_empty() {
        let corpus = stoke_data::builtin_corpus(config.train.seed, data.builtin_bytes);
        stoke_data::TokenStore::from_bytes(corpus, "built-in corpus")
    } else if stoke_data::is_remote(spec) {
        let budget_bytes = data.cache_budget_bytes;
        let cache = stoke_data::CacheConfig { dir: data.cache_dir.clone().into(), budget_bytes };
        stoke_data::open_cached(spec, &cache)?.0
    } else if path.is_dir() || path.extension().is_some_and(|e| e == "bin" || e == "idx") {
        stoke_data::TokenStore::open(path)?
    } else {
        stoke_data::TokenStore::from_bytes(stoke_data::read_text_bytes(path)?, spec)
    })
}
