//! Offline preparation of text: tokenize in parallel once, write packed token shards.
//!
//! Inputs are read in order; a `.jsonl` file holds one document per line (its `"text"` field),
//! any other file is one document. Documents are tokenized on `n_threads` threads in chunks of about
//! `chunk_bytes` of text, and appended in input order to shards of about `shard_tokens` tokens,
//! never splitting a document. Every file is written under a temporary name and renamed when
//! complete, the manifest last, so a directory with a manifest is a complete dataset.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::format::{encode_token_index, Dtype, TokenManifest, TokenShardEntry, TOKEN_FORMAT, TOKEN_MANIFEST};
use crate::DataError;

/// How `prepare_text` tokenizes and shards. Plain data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrepTextConfig {
    /// "bytes" for byte-level tokens (vocabulary 256), or the path of a HuggingFace `tokenizer.json`.
    /// Default "bytes".
    pub tokenizer: String,
    /// A token (by its text, e.g. "<|endoftext|>") appended after every document; empty for none.
    /// Default "".
    pub eos: String,
    /// Tokens per shard; documents are never split, so a shard may run over by one document.
    /// Default 268435456 (2^28).
    pub shard_tokens: u64,
    /// Tokenizer threads. Default 2.
    pub n_threads: usize,
    /// Text per parallel chunk, in bytes (bounds memory). Default 67108864 (64 MiB).
    pub chunk_bytes: usize,
}

impl Default for PrepTextConfig {
    fn default() -> PrepTextConfig {
        PrepTextConfig {
            tokenizer: "bytes".into(),
            eos: String::new(),
            shard_tokens: 1 << 28,
            n_threads: 2,
            chunk_bytes: 64 << 20,
        }
    }
}

pub(crate) enum Encoder {
    Bytes,
    Hf(Box<tokenizers::Tokenizer>),
}

impl Encoder {
    pub(crate) fn load(spec: &str) -> Result<Encoder, DataError> {
        if spec == "bytes" {
            return Ok(Encoder::Bytes);
        }
        let tokenizer = tokenizers::Tokenizer::from_file(spec)
            .map_err(|err| DataError::Tokenizer { path: spec.into(), detail: err.to_string() })?;
        Ok(Encoder::Hf(Box::new(tokenizer)))
    }

    pub(crate) fn vocab_size(&self) -> u64 {
        match self {
            Encoder::Bytes => 256,
            Encoder::Hf(tokenizer) => tokenizer.get_vocab_size(true) as u64,
        }
    }

    pub(crate) fn token_id(&self, text: &str, spec: &str) -> Result<u32, DataError> {
        let id = match self {
            Encoder::Bytes => text.parse::<u8>().ok().map(u32::from),
            Encoder::Hf(tokenizer) => tokenizer.token_to_id(text),
        };
        id.ok_or_else(|| DataError::Tokenizer { path: spec.into(), detail: format!("no token {text:?} for --eos") })
    }

    fn encode(&self, document: &Document) -> Result<Vec<u32>, DataError> {
        self.encode_text(&document.text, &document.source)
    }

    /// `text`'s tokens; `source` names it in an error.
    pub(crate) fn encode_text(&self, text: &str, source: &Path) -> Result<Vec<u32>, DataError> {
        match self {
            Encoder::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Encoder::Hf(tokenizer) => tokenizer
                .encode(text, false)
                .map(|encoding| encoding.get_ids().to_vec())
                .map_err(|err| DataError::Tokenize { path: source.to_path_buf(), detail: err.to_string() }),
        }
    }
}

struct Document {
    source: PathBuf,
    text: String,
}

#[derive(Deserialize)]
struct JsonLine {
    text: String,
}

/// Reads documents from `inputs` in order and calls `sink` with chunks of about `chunk_bytes`.
fn for_each_chunk(
    inputs: &[PathBuf],
    chunk_bytes: usize,
    mut sink: impl FnMut(Vec<Document>) -> Result<(), DataError>,
) -> Result<(), DataError> {
    let mut chunk = Vec::new();
    let mut chunk_len = 0usize;
    let mut push = |document: Document, chunk: &mut Vec<Document>, chunk_len: &mut usize| {
        *chunk_len += document.text.len();
        chunk.push(document);
        if *chunk_len >= chunk_bytes {
            *chunk_len = 0;
            return sink(std::mem::take(chunk));
        }
        Ok(())
    };
    for input in inputs {
        let file = File::open(input).map_err(DataError::read(input))?;
        if input.extension().is_some_and(|e| e == "jsonl") {
            let mut offset = 0u64;
            for line in BufReader::new(file).lines() {
                let line = line.map_err(DataError::read(input))?;
                let line_len = line.len() as u64 + 1;
                if !line.trim().is_empty() {
                    let parsed: JsonLine = serde_json::from_str(&line).map_err(|err| DataError::Corrupt {
                        path: input.clone(),
                        what: "JSON line",
                        offset,
                        detail: err.to_string(),
                    })?;
                    push(Document { source: input.clone(), text: parsed.text }, &mut chunk, &mut chunk_len)?;
                }
                offset += line_len;
            }
        } else {
            let bytes = std::fs::read(input).map_err(DataError::read(input))?;
            let text = String::from_utf8(bytes).map_err(|err| DataError::Corrupt {
                path: input.clone(),
                what: "UTF-8 text",
                offset: err.utf8_error().valid_up_to() as u64,
                detail: "invalid UTF-8".into(),
            })?;
            push(Document { source: input.clone(), text }, &mut chunk, &mut chunk_len)?;
        }
    }
    if !chunk.is_empty() {
        sink(chunk)?;
    }
    Ok(())
}

/// Writes shards one after another; each file goes under a `.tmp` name until complete.
struct ShardWriter {
    out_dir: PathBuf,
    dtype: Dtype,
    shard_tokens: u64,
    shards: Vec<TokenShardEntry>,
    current: Option<OpenShard>,
}

struct OpenShard {
    writer: BufWriter<File>,
    tmp_path: PathBuf,
    crc: crc32fast::Hasher,
    document_ends: Vec<u64>,
    n_tokens: u64,
}

fn tmp_name(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    path.with_file_name(name)
}

/// Writes `bytes` to `path` through a temporary file, fsync and rename.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), DataError> {
    let tmp = tmp_name(path);
    let mut file = File::create(&tmp).map_err(DataError::write(&tmp))?;
    file.write_all(bytes).and_then(|()| file.sync_all()).map_err(DataError::write(&tmp))?;
    std::fs::rename(&tmp, path).map_err(DataError::write(path))
}

impl ShardWriter {
    fn shard_path(&self, extension: &str) -> PathBuf {
        self.out_dir.join(format!("shard-{:05}.{extension}", self.shards.len()))
    }

    fn append(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        if self.current.is_none() {
            let tmp_path = tmp_name(&self.shard_path("bin"));
            let file = File::create(&tmp_path).map_err(DataError::write(&tmp_path))?;
            self.current = Some(OpenShard {
                writer: BufWriter::with_capacity(1 << 20, file),
                tmp_path,
                crc: crc32fast::Hasher::new(),
                document_ends: Vec::new(),
                n_tokens: 0,
            });
        }
        let dtype = self.dtype;
        let shard = self.current.as_mut().expect("opened above");
        let bytes: Vec<u8> = match dtype {
            Dtype::U16 => tokens.iter().flat_map(|&t| (t as u16).to_le_bytes()).collect(),
            _ => tokens.iter().flat_map(|&t| t.to_le_bytes()).collect(),
        };
        shard.crc.update(&bytes);
        shard.writer.write_all(&bytes).map_err(DataError::write(&shard.tmp_path))?;
        shard.n_tokens += tokens.len() as u64;
        shard.document_ends.push(shard.n_tokens);
        if shard.n_tokens >= self.shard_tokens {
            self.finish_shard()?;
        }
        Ok(())
    }

    fn finish_shard(&mut self) -> Result<(), DataError> {
        let Some(shard) = self.current.take() else { return Ok(()) };
        let bin_path = self.shard_path("bin");
        let idx_path = self.shard_path("idx");
        let file = shard
            .writer
            .into_inner()
            .map_err(|err| DataError::Write { path: shard.tmp_path.clone(), source: err.into_error() })?;
        file.sync_all().map_err(DataError::write(&shard.tmp_path))?;
        std::fs::rename(&shard.tmp_path, &bin_path).map_err(DataError::write(&bin_path))?;
        let index = encode_token_index(self.dtype, &shard.document_ends);
        write_atomically(&idx_path, &index)?;
        self.shards.push(TokenShardEntry {
            bin: file_name(&bin_path),
            idx: file_name(&idx_path),
            n_tokens: shard.n_tokens,
            n_documents: shard.document_ends.len() as u64,
            bin_crc32: shard.crc.finalize(),
            idx_crc32: crc32fast::hash(&index),
        });
        Ok(())
    }
}

fn file_name(path: &Path) -> String {
    path.file_name().unwrap_or_default().to_string_lossy().into_owned()
}

/// Tokenizes `inputs` into a prepared directory `out_dir` (created if missing) and returns its
/// manifest.
pub fn prepare_text(inputs: &[PathBuf], config: &PrepTextConfig, out_dir: &Path) -> Result<TokenManifest, DataError> {
    if config.n_threads == 0 || config.shard_tokens == 0 {
        return Err(DataError::Config { field: "n_threads/shard_tokens", reason: "must be at least 1".into() });
    }
    let encoder = Encoder::load(&config.tokenizer)?;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(config.n_threads).build().map_err(|e| {
        DataError::Config { field: "n_threads", reason: format!("cannot start the tokenizer threads: {e}") }
    })?;
    let eos = if config.eos.is_empty() { None } else { Some(encoder.token_id(&config.eos, &config.tokenizer)?) };
    let vocab_size = encoder.vocab_size();
    let dtype = Dtype::for_vocab(vocab_size);
    std::fs::create_dir_all(out_dir).map_err(DataError::write(out_dir))?;
    let mut writer = ShardWriter {
        out_dir: out_dir.to_path_buf(),
        dtype,
        shard_tokens: config.shard_tokens,
        shards: Vec::new(),
        current: None,
    };
    for_each_chunk(inputs, config.chunk_bytes.max(1), |documents| {
        let encoded = encode_parallel(&pool, &encoder, &documents)?;
        for mut tokens in encoded {
            tokens.extend(eos);
            writer.append(&tokens)?;
        }
        Ok(())
    })?;
    writer.finish_shard()?;
    let manifest = TokenManifest {
        format: TOKEN_FORMAT.into(),
        version: 1,
        dtype,
        vocab_size,
        tokenizer: if config.tokenizer == "bytes" { "bytes".into() } else { file_name(Path::new(&config.tokenizer)) },
        n_tokens: writer.shards.iter().map(|s| s.n_tokens).sum(),
        n_documents: writer.shards.iter().map(|s| s.n_documents).sum(),
        shards: writer.shards,
    };
    let json = serde_json::to_vec_pretty(&manifest).expect("manifest serializes");
    write_atomically(&out_dir.join(TOKEN_MANIFEST), &json)?;
    Ok(manifest)
}

/// Encodes documents on the pool's threads; the result is in input order.
fn encode_parallel(
    pool: &rayon::ThreadPool,
    encoder: &Encoder,
    documents: &[Document],
) -> Result<Vec<Vec<u32>>, DataError> {
    use rayon::prelude::*;
    let encoded: Vec<Result<Vec<u32>, DataError>> =
        pool.install(|| documents.par_iter().map(|document| encoder.encode(document)).collect());
    // The first document's error in input order, as encoding them one by one would report.
    encoded.into_iter().collect()
}
