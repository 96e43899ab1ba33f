//! The start-up check of a data-parallel job: every rank must train the same model with the same
//! configuration, or the ranks' gradients would not average into one step.
//!
//! Each rank describes itself as sorted `key = value` entries (the caller's choice: the config
//! without the keys that may differ per rank, the model's shape and parameter count, the backend).
//! The ranks all-gather a 64-bit digest and the length of that text (one 16-byte record each); only
//! when a digest differs from rank 0's do they all-gather the texts themselves, so that every rank
//! can name the differing ranks and keys. All ranks see the same records, so they take the same
//! path (the exchange stays collective) and fail with the same error.

use std::collections::BTreeMap;
use std::fmt;

use stoke_comm::{CommError, Communicator, CommunicatorExt};

/// One key whose value differs between rank 0 and another rank (`None`: the rank lacks the key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyDifference {
    pub key: String,
    pub rank0: Option<String>,
    pub other: Option<String>,
}

/// How one rank differs from rank 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankDifference {
    pub rank: usize,
    pub keys: Vec<KeyDifference>,
}

impl RankDifference {
    /// The sections (`model`, `train`, ...: what comes before a key's first dot) that differ.
    pub fn sections(&self) -> Vec<&str> {
        let mut sections: Vec<&str> = self.keys.iter().map(|k| k.key.split('.').next().unwrap_or("")).collect();
        sections.dedup();
        sections
    }
}

/// Every rank that differs from rank 0, in rank order, for an error message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disagreement(pub Vec<RankDifference>);

impl fmt::Display for Disagreement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "(absent)".into());
        for (idx, diff) in self.0.iter().enumerate() {
            if idx > 0 {
                write!(f, "; ")?;
            }
            write!(f, "rank {} differs from rank 0 in [{}]:", diff.rank, diff.sections().join("], ["))?;
            for (key_idx, key) in diff.keys.iter().enumerate() {
                let sep = if key_idx == 0 { " " } else { ", " };
                write!(f, "{sep}{} = {} (rank 0: {})", key.key, show(&key.other), show(&key.rank0))?;
            }
        }
        Ok(())
    }
}

/// What the check can end with besides agreement.
#[derive(Debug)]
pub enum AgreeError {
    Comm(CommError),
    Disagree(Disagreement),
}

/// The entries as one text, `key = value` per line, sorted by key (newlines in values escaped).
fn canonical_text(entries: &[(String, String)]) -> String {
    let sorted: BTreeMap<&str, &str> = entries.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut text = String::new();
    for (key, value) in sorted {
        text.push_str(key);
        text.push_str(" = ");
        text.push_str(&value.replace('\\', "\\\\").replace('\n', "\\n"));
        text.push('\n');
    }
    text
}

fn parse_text(text: &str) -> BTreeMap<&str, &str> {
    text.lines().filter_map(|line| line.split_once(" = ")).collect()
}

/// FNV-1a, 64 bits: the same on every build and machine (std's hasher promises neither).
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for &byte in bytes {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The keys of `other` that differ from `rank0`, sorted.
fn differences(rank0: &str, other: &str) -> Vec<KeyDifference> {
    let (a, b) = (parse_text(rank0), parse_text(other));
    let mut keys: Vec<&str> = a.keys().chain(b.keys()).copied().collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .filter(|k| a.get(k) != b.get(k))
        .map(|k| KeyDifference {
            key: k.to_string(),
            rank0: a.get(k).map(|v| v.to_string()),
            other: b.get(k).map(|v| v.to_string()),
        })
        .collect()
}

const RECORD: usize = 16;

/// Checks that every rank of `comm` passed the same `entries`. Collective.
pub fn check(comm: &dyn Communicator, entries: &[(String, String)]) -> Result<(), AgreeError> {
    let (rank, world_size) = (comm.rank(), comm.world_size());
    if world_size == 1 {
        return Ok(());
    }
    let text = canonical_text(entries);
    let mut records = vec![0u8; RECORD * world_size];
    records[rank * RECORD..rank * RECORD + 8].copy_from_slice(&fnv1a64(text.as_bytes()).to_le_bytes());
    records[rank * RECORD + 8..(rank + 1) * RECORD].copy_from_slice(&(text.len() as u64).to_le_bytes());
    comm.all_gather(&mut records).map_err(AgreeError::Comm)?;
    let field =
        |r: usize, at: usize| u64::from_le_bytes(records[r * RECORD + at..r * RECORD + at + 8].try_into().unwrap());
    if (1..world_size).all(|r| field(r, 0) == field(0, 0)) {
        return Ok(());
    }
    // Some rank differs: gather every rank's text to name what differs.
    let lengths: Vec<usize> = (0..world_size).map(|r| field(r, 8) as usize).collect();
    let longest = lengths.iter().copied().max().unwrap_or(0).max(1);
    let mut texts = vec![0u8; longest * world_size];
    texts[rank * longest..rank * longest + text.len()].copy_from_slice(text.as_bytes());
    comm.all_gather(&mut texts).map_err(AgreeError::Comm)?;
    let text_of = |r: usize| String::from_utf8_lossy(&texts[r * longest..r * longest + lengths[r]]).into_owned();
    let rank0 = text_of(0);
    let differing = (1..world_size)
        .filter(|&r| field(r, 0) != field(0, 0))
        .map(|r| RankDifference { rank: r, keys: differences(&rank0, &text_of(r)) })
        .collect();
    Err(AgreeError::Disagree(Disagreement(differing)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn the_text_is_sorted_and_differences_name_keys_and_sections() {
        let a =
            canonical_text(&entries(&[("train.lr", "0.001"), ("model.d_model", "64"), ("dist.backend", "\"shm\"")]));
        assert_eq!(a, "dist.backend = \"shm\"\nmodel.d_model = 64\ntrain.lr = 0.001\n");
        let b = canonical_text(&entries(&[("model.d_model", "128"), ("train.lr", "0.001"), ("model.extra", "1")]));
        let diff = RankDifference { rank: 1, keys: differences(&a, &b) };
        assert_eq!(diff.sections(), ["dist", "model"]);
        let shown = Disagreement(vec![diff]).to_string();
        assert_eq!(
            shown,
            "rank 1 differs from rank 0 in [dist], [model]: dist.backend = (absent) (rank 0: \"shm\"), \
             model.d_model = 128 (rank 0: 64), model.extra = 1 (rank 0: (absent))"
        );
        assert_ne!(fnv1a64(a.as_bytes()), fnv1a64(b.as_bytes()));
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    }

    #[test]
    fn one_rank_always_agrees() {
        let comm = stoke_comm::connect(
            &stoke_comm::CommConfig::default(),
            &stoke_comm::DistEnv::from_vars(&std::collections::HashMap::new()).unwrap(),
        )
        .unwrap();
        assert!(check(comm.as_ref(), &entries(&[("model.d_model", "64")])).is_ok());
    }
}
