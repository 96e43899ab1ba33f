//! On-disk token formats: stoke's own shards, Megatron-LM `.bin/.idx`, and raw token files
//! (nanoGPT `np.uint16` dumps, llm.c files with their 1024-byte header).
//!
//! Parsers take the bytes of a header or index and the path they came from, and return an error that
//! names the path and the byte offset of the first bad field. They check only what start-up needs
//! (O(1) in the dataset size); `check_offsets` walks a whole document index for `stoke prep verify`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::DataError;

/// The integer type of tokens in a file. Every dtype is read little-endian and widened to `i64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    U8,
    U16,
    U32,
    I32,
    I64,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::U8 => 1,
            Dtype::U16 => 2,
            Dtype::U32 | Dtype::I32 => 4,
            Dtype::I64 => 8,
        }
    }

    /// The narrowest unsigned dtype that holds token ids below `vocab_size`.
    pub fn for_vocab(vocab_size: u64) -> Dtype {
        if vocab_size <= 1 << 16 {
            Dtype::U16
        } else {
            Dtype::U32
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::U8 => "u8",
            Dtype::U16 => "u16",
            Dtype::U32 => "u32",
            Dtype::I32 => "i32",
            Dtype::I64 => "i64",
        }
    }

    fn code(self) -> u32 {
        self.size() as u32 + if matches!(self, Dtype::I32 | Dtype::I64) { 16 } else { 0 }
    }

    fn from_code(code: u32) -> Option<Dtype> {
        [Dtype::U8, Dtype::U16, Dtype::U32, Dtype::I32, Dtype::I64].into_iter().find(|d| d.code() == code)
    }

    /// Widens `bytes` (a whole number of tokens) into `out`, one token per element.
    pub fn widen(self, bytes: &[u8], out: &mut [i64]) {
        assert_eq!(bytes.len(), out.len() * self.size(), "whole tokens");
        #[cfg(target_arch = "x86_64")]
        if matches!(self, Dtype::U8 | Dtype::U16 | Dtype::U32) && std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above) and the lengths match (asserted above).
            unsafe { simd::widen_avx2(self.size(), bytes, out) };
            return;
        }
        self.widen_portable(bytes, out);
    }

    fn widen_portable(self, bytes: &[u8], out: &mut [i64]) {
        match self {
            Dtype::U8 => out.iter_mut().zip(bytes).for_each(|(o, &b)| *o = b as i64),
            Dtype::U16 => out
                .iter_mut()
                .zip(bytes.chunks_exact(2))
                .for_each(|(o, b)| *o = u16::from_le_bytes([b[0], b[1]]) as i64),
            Dtype::U32 => out
                .iter_mut()
                .zip(bytes.chunks_exact(4))
                .for_each(|(o, b)| *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64),
            Dtype::I32 => out
                .iter_mut()
                .zip(bytes.chunks_exact(4))
                .for_each(|(o, b)| *o = i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64),
            Dtype::I64 => out
                .iter_mut()
                .zip(bytes.chunks_exact(8))
                .for_each(|(o, b)| *o = i64::from_le_bytes(b.try_into().expect("chunk of 8"))),
        }
    }
}

/// Zero-extension of unsigned tokens with AVX2 (`vpmovzx`): four tokens per instruction, several
/// times faster than the baseline x86-64 build's SSE2 code for the loader's hottest loop.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX2, `token_size` must be 1, 2 or 4, and
    /// `bytes.len() == out.len() * token_size`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn widen_avx2(token_size: usize, bytes: &[u8], out: &mut [i64]) {
        let n = out.len();
        let n_vector = n / 4 * 4;
        let src = bytes.as_ptr();
        let dst = out.as_mut_ptr();
        let mut i = 0;
        // Invariant: out[..i] holds the widened tokens[..i]; every access below is within
        // bytes[..n * token_size] and out[..n] because i + 4 <= n_vector <= n.
        while i < n_vector {
            // SAFETY: see the invariant; unaligned loads and stores are used throughout.
            unsafe {
                let wide = match token_size {
                    1 => _mm256_cvtepu8_epi64(_mm_cvtsi32_si128((src.add(i) as *const i32).read_unaligned())),
                    2 => _mm256_cvtepu16_epi64(_mm_loadl_epi64(src.add(2 * i) as *const __m128i)),
                    _ => _mm256_cvtepu32_epi64(_mm_loadu_si128(src.add(4 * i) as *const __m128i)),
                };
                _mm256_storeu_si256(dst.add(i) as *mut __m256i, wide);
            }
            i += 4;
        }
        for (j, slot) in out.iter_mut().enumerate().skip(n_vector) {
            let at = j * token_size;
            *slot = match token_size {
                1 => bytes[at] as i64,
                2 => u16::from_le_bytes([bytes[at], bytes[at + 1]]) as i64,
                _ => u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]) as i64,
            };
        }
    }
}

fn u32_at(bytes: &[u8], offset: usize) -> u32 {
    u32::from_le_bytes(bytes[offset..offset + 4].try_into().expect("4 bytes"))
}

fn u64_at(bytes: &[u8], offset: usize) -> u64 {
    u64::from_le_bytes(bytes[offset..offset + 8].try_into().expect("8 bytes"))
}

fn need(path: &Path, len: u64, what: &'static str, offset: u64, needed: u64) -> Result<(), DataError> {
    if offset.checked_add(needed).is_none_or(|end| end > len) {
        return Err(DataError::Truncated { path: path.to_path_buf(), what, offset, needed, len });
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// stoke token shards: `shard-NNNNN.bin` (raw little-endian tokens, no header, so a u16 shard is also a
// nanoGPT file) and `shard-NNNNN.idx` (header + document offsets in tokens).

/// The first 8 bytes of a stoke token index.
pub const TOKEN_INDEX_MAGIC: &[u8; 8] = b"STOKIDX1";
/// Bytes before the document offsets: magic, dtype code (u32), reserved (u32), n_tokens, n_documents.
pub const TOKEN_INDEX_HEADER: usize = 32;

/// The header of a stoke token index; document offsets follow it as `n_documents + 1` u64 values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenIndexHeader {
    pub dtype: Dtype,
    pub n_tokens: u64,
    pub n_documents: u64,
}

impl TokenIndexHeader {
    /// Parses and size-checks a whole index file (`bytes` is all of it).
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<TokenIndexHeader, DataError> {
        TokenIndexHeader::parse_head(path, bytes, bytes.len() as u64)
    }

    /// Parses the header from the file's first bytes (`head`, at least the header if the file has
    /// it) and checks the sizes against the file's length, without reading the offsets.
    pub fn parse_head(path: &Path, bytes: &[u8], file_len: u64) -> Result<TokenIndexHeader, DataError> {
        need(path, bytes.len().min(file_len as usize) as u64, "index header", 0, TOKEN_INDEX_HEADER as u64)?;
        if &bytes[..8] != TOKEN_INDEX_MAGIC {
            return Err(DataError::BadMagic { path: path.to_path_buf(), offset: 0, expected: "STOKIDX1" });
        }
        let code = u32_at(bytes, 8);
        let dtype = Dtype::from_code(code).ok_or_else(|| DataError::Corrupt {
            path: path.to_path_buf(),
            what: "dtype code",
            offset: 8,
            detail: format!("unknown code {code}"),
        })?;
        let n_tokens = u64_at(bytes, 16);
        let n_documents = u64_at(bytes, 24);
        let offsets_len =
            n_documents.checked_add(1).and_then(|n| n.checked_mul(8)).ok_or_else(|| DataError::Corrupt {
                path: path.to_path_buf(),
                what: "document count",
                offset: 24,
                detail: format!("{n_documents} is too large"),
            })?;
        need(path, file_len, "document offsets", TOKEN_INDEX_HEADER as u64, offsets_len)?;
        if file_len != TOKEN_INDEX_HEADER as u64 + offsets_len {
            return Err(DataError::Corrupt {
                path: path.to_path_buf(),
                what: "index length",
                offset: TOKEN_INDEX_HEADER as u64 + offsets_len,
                detail: format!("{} trailing bytes", file_len - TOKEN_INDEX_HEADER as u64 - offsets_len),
            });
        }
        Ok(TokenIndexHeader { dtype, n_tokens, n_documents })
    }

    /// The token offset where document `doc_idx` starts (`doc_idx == n_documents` gives the end).
    pub fn offset(bytes: &[u8], doc_idx: u64) -> u64 {
        u64_at(bytes, TOKEN_INDEX_HEADER + 8 * doc_idx as usize)
    }

    /// Checks that the offsets start at 0, never decrease and end at `n_tokens` (O(n_documents)).
    pub fn check_offsets(&self, path: &Path, bytes: &[u8]) -> Result<(), DataError> {
        let needed = (self.n_documents.saturating_add(1)).saturating_mul(8);
        need(path, bytes.len() as u64, "document offsets", TOKEN_INDEX_HEADER as u64, needed)?;
        let mut previous = 0u64;
        for doc_idx in 0..=self.n_documents {
            let offset = TokenIndexHeader::offset(bytes, doc_idx);
            let at = (TOKEN_INDEX_HEADER + 8 * doc_idx as usize) as u64;
            let bad = (doc_idx == 0 && offset != 0) || offset < previous || offset > self.n_tokens;
            if bad || (doc_idx == self.n_documents && offset != self.n_tokens) {
                return Err(DataError::Corrupt {
                    path: path.to_path_buf(),
                    what: "document offset",
                    offset: at,
                    detail: format!(
                        "document {doc_idx} starts at token {offset} (previous {previous}, total {})",
                        self.n_tokens
                    ),
                });
            }
            previous = offset;
        }
        Ok(())
    }
}

/// Writes a complete stoke token index.
pub fn encode_token_index(dtype: Dtype, document_ends: &[u64]) -> Vec<u8> {
    let n_tokens = document_ends.last().copied().unwrap_or(0);
    let mut out = Vec::with_capacity(TOKEN_INDEX_HEADER + 8 * (document_ends.len() + 1));
    out.extend_from_slice(TOKEN_INDEX_MAGIC);
    out.extend_from_slice(&dtype.code().to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&n_tokens.to_le_bytes());
    out.extend_from_slice(&(document_ends.len() as u64).to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    for end in document_ends {
        out.extend_from_slice(&end.to_le_bytes());
    }
    out
}

/// `manifest.json` of a prepared token directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenManifest {
    /// Always "stoke-tokens".
    pub format: String,
    pub version: u32,
    pub dtype: Dtype,
    pub vocab_size: u64,
    /// What produced the tokens: "bytes" or the tokenizer file's name.
    pub tokenizer: String,
    pub n_tokens: u64,
    pub n_documents: u64,
    pub shards: Vec<TokenShardEntry>,
}

/// One shard of a prepared token directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenShardEntry {
    pub bin: String,
    pub idx: String,
    pub n_tokens: u64,
    pub n_documents: u64,
    pub bin_crc32: u32,
    pub idx_crc32: u32,
}

pub const TOKEN_MANIFEST: &str = "manifest.json";
pub const TOKEN_FORMAT: &str = "stoke-tokens";

impl TokenManifest {
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<TokenManifest, DataError> {
        let manifest: TokenManifest =
            serde_json::from_slice(bytes).map_err(|source| DataError::Manifest { path: path.to_path_buf(), source })?;
        let corrupt = |what, detail: String| DataError::Corrupt { path: path.to_path_buf(), what, offset: 0, detail };
        if manifest.format != TOKEN_FORMAT || manifest.version != 1 {
            return Err(corrupt(
                "format",
                format!("{} v{} is not {TOKEN_FORMAT} v1", manifest.format, manifest.version),
            ));
        }
        let sum_tokens = manifest.shards.iter().try_fold(0u64, |acc, s| acc.checked_add(s.n_tokens));
        if sum_tokens != Some(manifest.n_tokens) {
            return Err(corrupt("token count", format!("shards do not add up to {}", manifest.n_tokens)));
        }
        for shard in &manifest.shards {
            for name in [&shard.bin, &shard.idx] {
                if name.is_empty() || name.contains('/') || name.contains('\\') || name.starts_with('.') {
                    return Err(corrupt("shard name", format!("{name:?} is not a plain file name")));
                }
            }
        }
        Ok(manifest)
    }
}

// ---------------------------------------------------------------------------------------------
// Megatron-LM `MMapIndexedDataset` (`.idx` next to `.bin`).

/// The first 9 bytes of a Megatron-LM index.
pub const MEGATRON_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
pub const MEGATRON_HEADER: usize = 9 + 8 + 1 + 8 + 8;

/// The parts of a Megatron-LM index that reading tokens needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MegatronIndex {
    pub dtype: Dtype,
    pub n_sequences: u64,
    pub n_documents: u64,
}

impl MegatronIndex {
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<MegatronIndex, DataError> {
        MegatronIndex::parse_head(path, bytes, bytes.len() as u64)
    }

    /// Parses the header from the file's first bytes and checks the sizes against its length.
    pub fn parse_head(path: &Path, bytes: &[u8], file_len: u64) -> Result<MegatronIndex, DataError> {
        need(path, bytes.len().min(file_len as usize) as u64, "Megatron index header", 0, MEGATRON_HEADER as u64)?;
        if &bytes[..9] != MEGATRON_MAGIC {
            return Err(DataError::BadMagic { path: path.to_path_buf(), offset: 0, expected: "MMIDIDX" });
        }
        let version = u64_at(bytes, 9);
        if version != 1 {
            return Err(DataError::Corrupt {
                path: path.to_path_buf(),
                what: "version",
                offset: 9,
                detail: format!("version {version}, expected 1"),
            });
        }
        // Megatron's codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16.
        let dtype = match bytes[17] {
            1 => Dtype::U8,
            4 => Dtype::I32,
            5 => Dtype::I64,
            8 => Dtype::U16,
            code => {
                return Err(DataError::DtypeMismatch {
                    path: path.to_path_buf(),
                    offset: 17,
                    expected: "an integer token dtype (uint8, uint16, int32, int64)".into(),
                    found: format!("Megatron dtype code {code}"),
                })
            }
        };
        let n_sequences = u64_at(bytes, 18);
        let n_documents = u64_at(bytes, 26);
        let body = n_sequences.checked_mul(12).and_then(|a| n_documents.checked_mul(8).and_then(|b| a.checked_add(b)));
        let body = body.ok_or_else(|| DataError::Corrupt {
            path: path.to_path_buf(),
            what: "sequence count",
            offset: 18,
            detail: format!("{n_sequences} sequences and {n_documents} documents overflow"),
        })?;
        need(path, file_len, "Megatron sizes, pointers and document index", MEGATRON_HEADER as u64, body)?;
        Ok(MegatronIndex { dtype, n_sequences, n_documents })
    }

    /// Checks that the pointers tile the `.bin` file of `bin_len` bytes in order (O(n_sequences)).
    pub fn check_pointers(&self, path: &Path, bytes: &[u8], bin_len: u64) -> Result<(), DataError> {
        let sizes_at = MEGATRON_HEADER;
        need(
            path,
            bytes.len() as u64,
            "Megatron sizes and pointers",
            sizes_at as u64,
            self.n_sequences.saturating_mul(12),
        )?;
        let pointers_at = sizes_at + 4 * self.n_sequences as usize;
        let mut expected = 0u64;
        for seq_idx in 0..self.n_sequences as usize {
            let size = u32_at(bytes, sizes_at + 4 * seq_idx) as u64;
            let pointer = u64_at(bytes, pointers_at + 8 * seq_idx);
            if pointer != expected {
                return Err(DataError::Corrupt {
                    path: path.to_path_buf(),
                    what: "sequence pointer",
                    offset: (pointers_at + 8 * seq_idx) as u64,
                    detail: format!("sequence {seq_idx} at byte {pointer}, expected {expected}"),
                });
            }
            expected = pointer.saturating_add(size.saturating_mul(self.dtype.size() as u64));
        }
        if expected != bin_len {
            return Err(DataError::Corrupt {
                path: path.to_path_buf(),
                what: "sequence sizes",
                offset: sizes_at as u64,
                detail: format!("sequences cover {expected} bytes, the .bin file has {bin_len}"),
            });
        }
        Ok(())
    }
}

/// Writes a Megatron-LM index for `sizes` (tokens per sequence, one document each); for tests and
/// for exporting.
pub fn encode_megatron_index(dtype_code: u8, token_size: u64, sizes: &[u32]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(MEGATRON_MAGIC);
    out.extend_from_slice(&1u64.to_le_bytes());
    out.push(dtype_code);
    out.extend_from_slice(&(sizes.len() as u64).to_le_bytes());
    out.extend_from_slice(&(sizes.len() as u64 + 1).to_le_bytes());
    sizes.iter().for_each(|s| out.extend_from_slice(&s.to_le_bytes()));
    let mut pointer = 0u64;
    for &s in sizes {
        out.extend_from_slice(&pointer.to_le_bytes());
        pointer += s as u64 * token_size;
    }
    (0..=sizes.len() as u64).for_each(|d| out.extend_from_slice(&d.to_le_bytes()));
    out
}

// ---------------------------------------------------------------------------------------------
// Raw token files.

/// llm.c's magic number, the first i32 of its 256-i32 header.
pub const LLMC_MAGIC: i32 = 20240520;
pub const LLMC_HEADER: usize = 1024;

/// Where the tokens of a raw file start and what they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawLayout {
    pub data_offset: u64,
    pub dtype: Dtype,
    pub n_tokens: u64,
}

/// Reads the layout of a raw token file from its first bytes and its length: an llm.c header if the
/// magic is there (version 1: u16, version 2: u32), else headerless tokens of `default_dtype`.
pub fn raw_layout(path: &Path, head: &[u8], file_len: u64, default_dtype: Dtype) -> Result<RawLayout, DataError> {
    if head.len() >= 4 && i32::from_le_bytes(head[..4].try_into().expect("4 bytes")) == LLMC_MAGIC {
        need(path, head.len() as u64, "llm.c header", 0, 12)?;
        let version = u32_at(head, 4);
        let dtype = match version {
            1 => Dtype::U16,
            2 => Dtype::U32,
            _ => {
                return Err(DataError::DtypeMismatch {
                    path: path.to_path_buf(),
                    offset: 4,
                    expected: "llm.c version 1 (u16) or 2 (u32)".into(),
                    found: format!("version {version}"),
                })
            }
        };
        let n_tokens = u32_at(head, 8) as u64;
        let needed = LLMC_HEADER as u64 + n_tokens * dtype.size() as u64;
        if file_len < needed {
            return Err(DataError::Truncated {
                path: path.to_path_buf(),
                what: "llm.c tokens",
                offset: LLMC_HEADER as u64,
                needed: n_tokens * dtype.size() as u64,
                len: file_len,
            });
        }
        return Ok(RawLayout { data_offset: LLMC_HEADER as u64, dtype, n_tokens });
    }
    let size = default_dtype.size() as u64;
    if file_len % size != 0 {
        return Err(DataError::DtypeMismatch {
            path: path.to_path_buf(),
            offset: file_len - file_len % size,
            expected: format!("a whole number of {} tokens", default_dtype.name()),
            found: format!("{file_len} bytes"),
        });
    }
    Ok(RawLayout { data_offset: 0, dtype: default_dtype, n_tokens: file_len / size })
}

/// A path with its extension replaced (`x.bin` -> `x.idx`).
pub(crate) fn sibling(path: &Path, extension: &str) -> PathBuf {
    path.with_extension(extension)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("t.idx")
    }

    #[test]
    fn token_index_round_trips_and_checks() {
        let bytes = encode_token_index(Dtype::U16, &[3, 3, 10]);
        let header = TokenIndexHeader::parse(p(), &bytes).unwrap();
        assert_eq!(header, TokenIndexHeader { dtype: Dtype::U16, n_tokens: 10, n_documents: 3 });
        header.check_offsets(p(), &bytes).unwrap();
        assert_eq!(TokenIndexHeader::offset(&bytes, 2), 3);
    }

    #[test]
    fn token_index_errors_name_the_offset() {
        let good = encode_token_index(Dtype::U32, &[4, 9]);
        let check = |bytes: &[u8], expected_offset: u64| {
            let err = TokenIndexHeader::parse(p(), bytes).and_then(|h| h.check_offsets(p(), bytes)).unwrap_err();
            let offset = match err {
                DataError::BadMagic { offset, .. }
                | DataError::Truncated { offset, .. }
                | DataError::Corrupt { offset, .. } => offset,
                other => panic!("unexpected {other}"),
            };
            assert_eq!(offset, expected_offset, "{err:?}");
            assert!(err.to_string().contains("t.idx"));
        };
        check(&good[..good.len() - 1], 32);
        check(&good[..10], 0);
        let mut bad_magic = good.clone();
        bad_magic[0] = b'X';
        check(&bad_magic, 0);
        let mut bad_dtype = good.clone();
        bad_dtype[8] = 3;
        check(&bad_dtype, 8);
        let mut decreasing = good.clone();
        decreasing[40..48].copy_from_slice(&100u64.to_le_bytes());
        check(&decreasing, 40);
        let mut trailing = good.clone();
        trailing.push(0);
        check(&trailing, good.len() as u64);
    }

    #[test]
    fn megatron_index_parses_and_checks_pointers() {
        let bytes = encode_megatron_index(8, 2, &[5, 7]);
        let index = MegatronIndex::parse(p(), &bytes).unwrap();
        assert_eq!(index, MegatronIndex { dtype: Dtype::U16, n_sequences: 2, n_documents: 3 });
        index.check_pointers(p(), &bytes, 24).unwrap();
        assert!(index.check_pointers(p(), &bytes, 26).is_err());
        let float = encode_megatron_index(6, 8, &[5]);
        assert!(matches!(MegatronIndex::parse(p(), &float), Err(DataError::DtypeMismatch { offset: 17, .. })));
    }

    #[test]
    fn raw_layouts() {
        let mut llmc = vec![0u8; 1024];
        llmc[..4].copy_from_slice(&LLMC_MAGIC.to_le_bytes());
        llmc[4..8].copy_from_slice(&1u32.to_le_bytes());
        llmc[8..12].copy_from_slice(&5u32.to_le_bytes());
        let layout = raw_layout(p(), &llmc, 1024 + 10, Dtype::U16).unwrap();
        assert_eq!(layout, RawLayout { data_offset: 1024, dtype: Dtype::U16, n_tokens: 5 });
        assert!(matches!(raw_layout(p(), &llmc, 1024 + 9, Dtype::U16), Err(DataError::Truncated { .. })));
        assert_eq!(raw_layout(p(), &[1, 2], 6, Dtype::U16).unwrap().n_tokens, 3);
        assert!(matches!(raw_layout(p(), &[1, 2], 7, Dtype::U16), Err(DataError::DtypeMismatch { offset: 6, .. })));
    }

    #[test]
    fn vector_and_portable_widening_agree() {
        let bytes: Vec<u8> = (0..4 * 37u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        for dtype in [Dtype::U8, Dtype::U16, Dtype::U32] {
            for n in 0..37 {
                let mut fast = vec![-1; n];
                let mut slow = vec![-2; n];
                dtype.widen(&bytes[..n * dtype.size()], &mut fast);
                dtype.widen_portable(&bytes[..n * dtype.size()], &mut slow);
                assert_eq!(fast, slow, "{dtype:?} n {n}");
            }
        }
    }

    #[test]
    fn widen_every_dtype() {
        let check = |dtype: Dtype, bytes: &[u8], expected: &[i64]| {
            let mut out = vec![0; expected.len()];
            dtype.widen(bytes, &mut out);
            assert_eq!(out, expected);
        };
        check(Dtype::U8, &[1, 255], &[1, 255]);
        check(Dtype::U16, &[1, 1, 255, 255], &[257, 65535]);
        check(Dtype::U32, &[0, 0, 1, 0], &[65536]);
        check(Dtype::I32, &[255, 255, 255, 255], &[-1]);
        check(Dtype::I64, &[2, 0, 0, 0, 0, 0, 0, 0], &[2]);
    }
}
