//! Running the tools the tasks drive (cargo, the project's Python, apt-get as root), with their
//! failures as messages.

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

/// Installs Debian `packages` with apt-get (as root, non-interactive); `why` names the need in
/// the error a non-root user gets.
pub fn apt_install(packages: &[&str], why: &str) -> Result<(), String> {
    let is_root = Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    if !is_root {
        return Err(format!("{why}; install it as root: apt-get install -y {}", packages.join(" ")));
    }
    eprintln!("xtask: installing {}", packages.join(" "));
    run_checked(Command::new("apt-get").args(["update", "-q"]).env("DEBIAN_FRONTEND", "noninteractive"))?;
    run_checked(
        Command::new("apt-get").args(["install", "-y", "-q"]).args(packages).env("DEBIAN_FRONTEND", "noninteractive"),
    )
}
