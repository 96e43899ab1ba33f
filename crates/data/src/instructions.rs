//! Instruction data: a JSON-lines file of `{"prompt": ..., "response": ...}` examples, each one row
//! of a batch, the loss counted on the response only (supervised fine-tuning).
//!
//! Each example is tokenized once at start (`data.tokenizer`: bytes or a Hugging Face
//! `tokenizer.json`): the prompt's tokens, the response's, then the end-of-sequence token when one
//! is named, cut to the row's `seq_len + 1` tokens and padded with token 0. The batch's
//! `loss_mask` marks the prompt and the padding, so the model predicts only response tokens.
//! Sample order is the loader's: a Feistel permutation of the examples per (seed, epoch), rank `r`
//! taking rows `r * micro_batch..` of each global batch, and the state one integer (the global
//! sample position), so a resumed run reads the same rows.

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;

use crate::batch::{Batch, BatchSource};
use crate::order::Permutation;
use crate::prep::Encoder;
use crate::DataError;

/// One example, tokenized.
#[derive(Debug, Clone, PartialEq)]
pub struct Instruction {
    /// The prompt's tokens, then the response's (and the end token).
    pub tokens: Vec<u32>,
    /// How many of `tokens` are the prompt's.
    pub prompt_len: usize,
}

#[derive(Deserialize)]
struct Line {
    prompt: String,
    response: String,
}

/// Reads and tokenizes the examples of the JSON-lines file `path` with `tokenizer` ("bytes" or a
/// `tokenizer.json`), appending the token `eos` names ("" for none) to each response. An example
/// whose prompt leaves no response token inside `seq_len + 1` is an error naming its line.
pub fn read_instructions(
    path: &Path,
    tokenizer: &str,
    eos: &str,
    seq_len: usize,
) -> Result<Vec<Instruction>, DataError> {
    let encoder = Encoder::load(tokenizer)?;
    let eos = if eos.is_empty() { None } else { Some(encoder.token_id(eos, tokenizer)?) };
    let text = std::fs::read_to_string(path).map_err(|source| DataError::Read { path: path.to_path_buf(), source })?;
    let mut examples = Vec::new();
    for (line_idx, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let bad = |detail: String| DataError::Instruction { path: path.to_path_buf(), line: line_idx + 1, detail };
        let parsed: Line =
            serde_json::from_str(line).map_err(|e| bad(format!("not {{\"prompt\", \"response\"}}: {e}")))?;
        let mut tokens = encoder.encode_text(&parsed.prompt, path)?;
        let prompt_len = tokens.len();
        tokens.extend(encoder.encode_text(&parsed.response, path)?);
        tokens.extend(eos);
        // A row's targets are its tokens 1..=seq_len; one of them must be the response's.
        if prompt_len.max(1) >= (seq_len + 1).min(tokens.len()) {
            return Err(bad(format!(
                "the prompt's {prompt_len} tokens leave no response token in a row of {} (model.seq_len + 1)",
                seq_len + 1
            )));
        }
        examples.push(Instruction { tokens, prompt_len });
    }
    if examples.is_empty() {
        return Err(DataError::Instruction { path: path.to_path_buf(), line: 0, detail: "holds no example".into() });
    }
    Ok(examples)
}

/// Batches of instruction examples for one rank (see the module doc).
pub struct InstructionSource {
    examples: Arc<Vec<Instruction>>,
    seq_len: usize,
    micro_batch: usize,
    seed: u64,
    rank: usize,
    world_size: usize,
    /// Global samples consumed by all ranks.
    position: u64,
}

impl InstructionSource {
    pub fn new(
        examples: Arc<Vec<Instruction>>,
        seq_len: usize,
        micro_batch: usize,
        seed: u64,
        rank: usize,
        world_size: usize,
    ) -> InstructionSource {
        InstructionSource { examples, seq_len, micro_batch, seed, rank, world_size: world_size.max(1), position: 0 }
    }

    /// The example at global sample `index`: epochs end to end, each a permutation of the examples.
    fn example(&self, index: u64) -> &Instruction {
        let n = self.examples.len() as u64;
        let permutation = Permutation::for_epoch(n, self.seed, index / n);
        &self.examples[permutation.apply(index % n) as usize]
    }
}

impl BatchSource for InstructionSource {
    fn next_batch(&mut self) -> Result<Batch, DataError> {
        let width = self.seq_len + 1;
        let mut tokens = vec![0i64; self.micro_batch * width];
        let mut loss_mask = vec![true; self.micro_batch * width];
        let first = self.position + (self.rank * self.micro_batch) as u64;
        for row in 0..self.micro_batch {
            let example = self.example(first + row as u64);
            let used = example.tokens.len().min(width);
            for (j, &token) in example.tokens[..used].iter().enumerate() {
                tokens[row * width + j] = token as i64;
                // Invariant: a token counts as a target only past the prompt (and never first).
                loss_mask[row * width + j] = j < example.prompt_len.max(1);
            }
        }
        self.position += (self.micro_batch * self.world_size) as u64;
        Ok(Batch { micro_batch: self.micro_batch, seq_len: self.seq_len, tokens, loss_mask, episode: None })
    }

    fn position(&self) -> u64 {
        self.position
    }

    fn seek(&mut self, position: u64) {
        self.position = position;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(lines: &[&str]) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), lines.join("\n")).unwrap();
        file
    }

    #[test]
    fn rows_hold_prompt_then_response_and_mask_all_but_the_response() {
        let file = write(&[r#"{"prompt": "ab", "response": "cde"}"#]);
        let examples = read_instructions(file.path(), "bytes", "", 7).unwrap();
        assert_eq!(examples[0].prompt_len, 2);
        let mut source = InstructionSource::new(Arc::new(examples), 7, 2, 1, 0, 1);
        let batch = source.next_batch().unwrap();
        let row: Vec<i64> = batch.tokens[..8].to_vec();
        assert_eq!(row, [97, 98, 99, 100, 101, 0, 0, 0]);
        // Targets are tokens 1..: b (prompt, masked), c d e (counted), padding (masked).
        assert_eq!(&batch.loss_mask[..8], [true, true, false, false, false, true, true, true]);
        assert_eq!(source.position(), 2);
    }

    #[test]
    fn ranks_take_their_rows_and_a_resume_reads_the_same() {
        let lines: Vec<String> = (0..10).map(|i| format!(r#"{{"prompt": "p{i}", "response": "r{i}"}}"#)).collect();
        let file = write(&lines.iter().map(String::as_str).collect::<Vec<_>>());
        let examples = Arc::new(read_instructions(file.path(), "bytes", "", 8).unwrap());
        let mut one = InstructionSource::new(examples.clone(), 8, 4, 7, 0, 1);
        let (mut r0, mut r1) = (
            InstructionSource::new(examples.clone(), 8, 2, 7, 0, 2),
            InstructionSource::new(examples.clone(), 8, 2, 7, 1, 2),
        );
        for _ in 0..4 {
            let whole = one.next_batch().unwrap();
            let halves = [r0.next_batch().unwrap().tokens, r1.next_batch().unwrap().tokens].concat();
            assert_eq!(whole.tokens, halves);
        }
        let mut resumed = InstructionSource::new(examples, 8, 4, 7, 0, 1);
        resumed.seek(8);
        let mut again = InstructionSource::new(one.examples.clone(), 8, 4, 7, 0, 1);
        again.seek(8);
        assert_eq!(resumed.next_batch().unwrap(), again.next_batch().unwrap());
    }

    #[test]
    fn a_prompt_that_fills_the_row_names_its_line() {
        let file = write(&[r#"{"prompt": "a", "response": "b"}"#, r#"{"prompt": "abcdefgh", "response": "x"}"#]);
        let err = read_instructions(file.path(), "bytes", "", 4).unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains("no response token"), "{err}");
    }
}
