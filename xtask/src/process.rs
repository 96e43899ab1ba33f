//! Running the tools the tasks drive (cargo, the project's Python), with their failures as
//! messages.

use std::path::{Path, PathBuf};
use std::process::Command;

pub fn cargo(root: &Path) -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root);
    cmd
}

pub fn status(mut cmd: Command) -> Result<i32, String> {
    let status = cmd.status().map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    Ok(status.code().unwrap_or(1))
}

pub fn venv_python(root: &Path) -> PathBuf {
    root.join(".stoke/venv/bin/python")
}

pub fn python_output(python: &Path, code: &str) -> Result<String, String> {
    let out = Command::new(python)
        .args(["-c", code])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if !out.status.success() {
        return Err(format!("{} failed: {}", python.display(), String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn run_checked(cmd: &mut Command) -> Result<(), String> {
    let status = cmd.status().map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed with {status}"))
    }
}
