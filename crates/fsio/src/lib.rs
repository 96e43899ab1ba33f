//! stoke-fsio: every file stoke reads whole (a config, a manifest, a job list, a baseline) comes
//! from outside and may be anything: `/dev/zero`, a 50 MB value, a log pointed at by mistake. Such
//! reads go through [`read_capped`], which stops at a cap instead of reading for ever, and errors
//! that quote what was read go through [`clip`], so a bad value is named, not echoed whole.
//!
//! ```
//! let dir = tempfile::tempdir().unwrap();
//! let path = dir.path().join("config.toml");
//! std::fs::write(&path, "[train]\nsteps = 10\n").unwrap();
//! let text = stoke_fsio::read_to_string_capped(&path, stoke_fsio::CONFIG_CAP).unwrap();
//! assert!(text.contains("steps"));
//! let err = stoke_fsio::read_to_string_capped(std::path::Path::new("/dev/zero"), 1024).unwrap_err();
//! assert!(err.to_string().contains("more than 1024 bytes"));
//! ```

use std::borrow::Cow;
use std::io::{self, Read};
use std::path::Path;

/// A configuration file: far more than any real one.
pub const CONFIG_CAP: u64 = 1 << 20;
/// A manifest or index written by stoke (checkpoint, shards, records).
pub const MANIFEST_CAP: u64 = 256 << 20;
/// A table from outside: a job list, a calibration set, a baseline, a CPU list.
pub const TABLE_CAP: u64 = 64 << 20;
/// A run's metrics or events log.
pub const LOG_CAP: u64 = 1 << 30;

/// The whole of `path`, or an `InvalidData` error when it holds more than `cap` bytes. Reads at
/// most `cap + 1` bytes whatever the file is (a device, a pipe, a file still growing), so it
/// always ends.
pub fn read_capped(path: &Path, cap: u64) -> io::Result<Vec<u8>> {
    let file = std::fs::File::open(path)?;
    let mut bytes = Vec::new();
    file.take(cap.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("holds more than {cap} bytes, the most this file may hold; is it the right file?"),
        ));
    }
    Ok(bytes)
}

/// [`read_capped`] as UTF-8 text.
pub fn read_to_string_capped(path: &Path, cap: u64) -> io::Result<String> {
    String::from_utf8(read_capped(path, cap)?)
        .map_err(|err| io::Error::new(io::ErrorKind::InvalidData, format!("is not UTF-8 text: {err}")))
}

/// Characters of a quoted value shown in an error.
pub const QUOTE_CHARS: usize = 120;

/// `text` as an error may quote it: whole when short, else its first [`QUOTE_CHARS`] characters
/// and how long it was.
pub fn clip(text: &str) -> Cow<'_, str> {
    clip_to(text, QUOTE_CHARS)
}

/// `text` cut to its first `max_chars` characters, saying how long it was.
pub fn clip_to(text: &str, max_chars: usize) -> Cow<'_, str> {
    match text.char_indices().nth(max_chars) {
        None => Cow::Borrowed(text),
        Some((end, _)) => Cow::Owned(format!("{}... ({} bytes in all)", &text[..end], text.len())),
    }
}

/// A whole error message, each of its lines clipped to `max_chars` characters: a parser's message
/// keeps its shape (position, caret line) while a megabyte line inside it does not come along.
pub fn clip_lines(message: &str, max_chars: usize) -> String {
    message.lines().map(|line| clip_to(line, max_chars)).collect::<Vec<_>>().join("\n")
}

/// The longest name that may become a path (a run's or a job's folder): room under the 255 bytes
/// of a file name for the suffixes stoke adds.
pub const NAME_MAX_BYTES: usize = 128;

/// Checks a name that becomes a folder or file name (`run.name`, a scheduler job's name): 1 to
/// [`NAME_MAX_BYTES`] characters from `A-Z a-z 0-9 . _ - + = @`, not starting with `.` or `-`.
/// The error says what is wrong, quoting at most the start of the name.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > NAME_MAX_BYTES {
        return Err(format!("is {} bytes long; at most {NAME_MAX_BYTES} ({:?})", name.len(), clip(name)));
    }
    if let Some(bad) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || "._-+=@".contains(*c))) {
        return Err(format!(
            "may hold only letters, digits and . _ - + = @ (it becomes a folder name); {:?} holds {bad:?}",
            clip(name)
        ));
    }
    if name.starts_with(['.', '-']) {
        return Err(format!("must not start with '.' or '-'; got {name:?}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_at_the_cap_reads_and_one_byte_more_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![b'x'; 100]).unwrap();
        assert_eq!(read_capped(&path, 100).unwrap().len(), 100);
        let err = read_capped(&path, 99).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn names_that_become_paths_are_checked() {
        for good in ["tiny-20261204-232927", "a", "run_1.v2+x=y@z"] {
            check_name(good).unwrap();
        }
        let long = "x".repeat(10_000);
        for (bad, says) in [
            ("", "empty"),
            (long.as_str(), "10000 bytes"),
            ("two\nlines", "\'\\n\'"),
            ("a/b", "'/'"),
            ("..", "start"),
            ("-rf", "start"),
            ("naïve", "'ï'"),
        ] {
            let err = check_name(bad).unwrap_err();
            assert!(err.contains(says) && err.len() < 400, "{bad:?}: {err}");
        }
    }

    #[test]
    fn long_values_are_clipped_with_their_length() {
        assert_eq!(clip("short"), "short");
        let long = "é".repeat(1000);
        let clipped = clip(&long);
        assert!(clipped.len() < 400 && clipped.ends_with("(2000 bytes in all)"), "{clipped}");
    }
}
