//! The Python package's tests, as a user meets the package: the wheel built by maturin, installed
//! with pip into a virtual environment made afresh (no system site-packages), then pytest on
//! `crates/py/python/tests/` against the installed copy.
//!
//! torch is not downloaded again for it: the fresh environment reads `.stoke/venv`'s
//! site-packages (where set-up put torch) through a `.pth` file, after its own, so what pip
//! installs into it (the wheel, pytest, pandas) comes first, and the stoke package can only come from the
//! wheel (`.stoke/venv` never holds one; the tests check where `stoke` was imported from).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::process::{cargo, python_output, run_checked, status, venv_python};

/// maturin builds the wheel; installed into `.stoke/venv` beside the set-up's torch.
const MATURIN: &str = "maturin>=1.5,<2";
/// What the tests import besides the wheel and torch (pandas for `stoke.trace.frames`).
const TEST_DEPS: &[&str] = &["pytest", "pandas"];
/// The fresh environment, made again on every run.
const TEST_VENV: &str = "target/py-venv";

/// Builds the wheel, installs it into a fresh environment and runs pytest; returns pytest's exit
/// code.
pub fn test(root: &Path) -> Result<i32, String> {
    let python = venv_python(root);
    let wheel = wheel(root)?;
    let test_python = fresh_venv(root, &python)?;
    run_checked(
        Command::new(&test_python).args(["-m", "pip", "install", "--quiet", "--no-input"]).args(TEST_DEPS).arg(&wheel),
    )?;
    // The trace tests compare against the binary `cargo test` has just built; a checkpoint test
    // reads what `stoke train` writes.
    let mut build = cargo(root);
    build.args(["build", "--quiet", "--bin", "stoke-trace", "--bin", "stoke"]);
    run_checked(&mut build)?;
    println!("xtask: pytest crates/py/python/tests (the wheel {} in {TEST_VENV})", wheel.display());
    let mut pytest = Command::new(&test_python);
    pytest
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "crates/py/python/tests"])
        .env("STOKE_TRACE_BIN", root.join("target/debug/stoke-trace"))
        .env("STOKE_BIN", root.join("target/debug/stoke"))
        .current_dir(root);
    status(pytest)
}

/// The wheel, built now with maturin (installed into `.stoke/venv` when missing) into
/// `target/wheels`; returns its path.
pub fn wheel(root: &Path) -> Result<PathBuf, String> {
    let python = venv_python(root);
    if python_output(&python, "import maturin").is_err() {
        eprintln!("xtask: installing {MATURIN} into .stoke/venv (builds the Python wheel)");
        run_checked(Command::new(&python).args(["-m", "pip", "install", "--quiet", "--no-input", MATURIN]))?;
    }
    build_wheel(root, &python)
}

/// `maturin build --release` into `target/wheels`; returns the wheel it wrote.
fn build_wheel(root: &Path, python: &Path) -> Result<PathBuf, String> {
    let out = root.join("target/wheels");
    // Old wheels go first, so the one installed is the one built now.
    if let Ok(entries) = std::fs::read_dir(&out) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("stoke-") && name.ends_with(".whl") {
                std::fs::remove_file(entry.path()).map_err(|e| format!("cannot remove {name}: {e}"))?;
            }
        }
    }
    run_checked(
        Command::new(python)
            .args([
                "-m",
                "maturin",
                "build",
                "--release",
                "--quiet",
                "--manifest-path",
                "crates/py/Cargo.toml",
                "--out",
            ])
            .arg(&out)
            .current_dir(root),
    )?;
    std::fs::read_dir(&out)
        .map_err(|e| format!("cannot list {}: {e}", out.display()))?
        .flatten()
        .map(|entry| entry.path())
        .find(|path| path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("stoke-")))
        .ok_or_else(|| format!("maturin wrote no stoke wheel into {}", out.display()))
}

/// A new virtual environment from the interpreter `.stoke/venv` was made with (so torch's
/// compiled modules match), reading `.stoke/venv`'s site-packages after its own.
fn fresh_venv(root: &Path, python: &Path) -> Result<PathBuf, String> {
    let dir = root.join(TEST_VENV);
    run_checked(Command::new(python).args(["-m", "venv", "--clear"]).arg(&dir))?;
    let site = |python: &Path| {
        python_output(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])").map(|s| s.trim().to_string())
    };
    let test_python = dir.join("bin/python");
    let (torch_site, own_site) = (site(python)?, site(&test_python)?);
    let pth = Path::new(&own_site).join("stoke-torch.pth");
    std::fs::write(&pth, format!("{torch_site}\n")).map_err(|e| format!("cannot write {}: {e}", pth.display()))?;
    Ok(test_python)
}
