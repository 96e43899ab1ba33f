//! Printing a subcommand's whole output at once.

use std::io::Write as _;
use std::process::ExitCode;

/// Writes the output in one go; a reader that went away (`stoke plan | head`) is not an error.
pub fn emit(text: &str) -> anyhow::Result<ExitCode> {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(err) if err.kind() == std::io::ErrorKind::BrokenPipe => Ok(ExitCode::SUCCESS),
        Err(err) => Err(anyhow::Error::new(err).context("writing to stdout")),
    }
}
