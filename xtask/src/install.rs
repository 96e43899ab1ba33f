//! `cargo xtask install --prefix DIR [--debug] [--features F] [--no-build] [--wheel]`: an installed
//! stoke that runs with no checkout. `--no-build` takes the binaries target/ already holds (the test
//! task's, built with the test features) instead of building them again; `--wheel` also builds the
//! Python package's wheel into DIR/share/stoke/wheels. DIR/bin holds the binaries, DIR/lib the libtorch libraries they load (and a
//! `libtorch-version` file that `stoke env` reads), and each binary's runpath is `$ORIGIN/../lib`
//! alone, so the folder can be moved or copied into an image whole.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::process::{apt_install, cargo, run_checked};

/// What `install` needs beyond the build: patchelf rewrites the binaries' runpath.
const PATCHELF_PACKAGE: &str = "patchelf";

pub struct InstallArgs {
    pub prefix: PathBuf,
    pub debug: bool,
    pub features: Option<String>,
    pub no_build: bool,
    pub wheel: bool,
}

impl InstallArgs {
    pub fn parse(args: &[String]) -> Result<InstallArgs, String> {
        let mut prefix = None;
        let mut debug = false;
        let mut features = None;
        let mut no_build = false;
        let mut wheel = false;
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--prefix" => prefix = it.next().map(PathBuf::from),
                "--debug" => debug = true,
                "--features" => features = it.next().cloned(),
                "--no-build" => no_build = true,
                "--wheel" => wheel = true,
                other => {
                    return Err(format!(
                        "install: unknown argument `{other}`; usage: install --prefix DIR [--debug] [--features F] [--no-build] [--wheel]"
                    ))
                }
            }
        }
        let prefix = prefix.ok_or("install: --prefix DIR is required")?;
        Ok(InstallArgs { prefix, debug, features, no_build, wheel })
    }
}

/// Builds, copies and patches; then runs the installed `stoke env` with no library path set and
/// checks that it loaded the libtorch under DIR/lib.
pub fn install(root: &Path, args: &InstallArgs) -> Result<(), String> {
    ensure_patchelf()?;
    if !args.no_build {
        let mut build = cargo(root);
        build.args(["build", "--workspace", "--bins"]);
        if !args.debug {
            build.arg("--release");
        }
        if let Some(features) = &args.features {
            build.args(["--features", features]);
        }
        run_checked(&mut build)?;
    }
    let built = root.join("target").join(if args.debug { "debug" } else { "release" });
    let prefix = absolute(&args.prefix)?;
    let (bin, lib) = (prefix.join("bin"), prefix.join("lib"));
    for dir in [&bin, &lib] {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let torch = std::fs::canonicalize(root.join(".stoke/torch"))
        .map_err(|e| format!("no libtorch at .stoke/torch ({e}); run `cargo xtask setup`"))?;
    let mut copied = Vec::new();
    for name in ["stoke", "stoke-trace"] {
        let from = built.join(name);
        let to = bin.join(name);
        copy_file(&from, &to)?;
        for library in torch_libraries(&from, &torch)? {
            let file_name = library.file_name().expect("a library path names a file").to_owned();
            if !copied.contains(&file_name) {
                copy_file(&library, &lib.join(&file_name))?;
                copied.push(file_name);
            }
        }
        run_checked(Command::new("patchelf").args(["--set-rpath", "$ORIGIN/../lib"]).arg(&to))?;
    }
    if args.wheel {
        let wheel = crate::python::wheel(root)?;
        let dir = prefix.join("share/stoke/wheels");
        std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        copy_file(&wheel, &dir.join(wheel.file_name().expect("a wheel path names a file")))?;
    }
    let version = libtorch_version(&torch)?;
    std::fs::write(lib.join("libtorch-version"), format!("{version}\n"))
        .map_err(|e| format!("cannot write {}: {e}", lib.join("libtorch-version").display()))?;
    // The proof: the installed binary, with no LD_LIBRARY_PATH, loads DIR/lib's libtorch.
    let out = Command::new(bin.join("stoke"))
        .args(["env", "--json"])
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .map_err(|e| format!("cannot run the installed stoke: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let loaded = lib.join("libtorch_cpu.so");
    if !out.status.success() || !text.contains(&loaded.display().to_string()) {
        return Err(format!(
            "the installed {} does not load {}: {}{}",
            bin.join("stoke").display(),
            loaded.display(),
            text,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    println!(
        "xtask: installed stoke into {} ({} libraries, libtorch {version}); bin/stoke loads lib/libtorch_cpu.so",
        prefix.display(),
        copied.len()
    );
    Ok(())
}

fn absolute(path: &Path) -> Result<PathBuf, String> {
    if path.is_absolute() {
        return Ok(path.to_path_buf());
    }
    let cwd = std::env::current_dir().map_err(|e| format!("cannot read the current folder: {e}"))?;
    Ok(cwd.join(path))
}

fn copy_file(from: &Path, to: &Path) -> Result<(), String> {
    // A running binary cannot be overwritten in place (ETXTBSY); a new file under the name can.
    let _ = std::fs::remove_file(to);
    std::fs::copy(from, to).map(|_| ()).map_err(|e| format!("cannot copy {} to {}: {e}", from.display(), to.display()))
}

/// The libraries `binary` loads from the PyTorch wheel (libtorch's own folder and the NVIDIA
/// runtime wheels beside it), as `ldd` resolves them through the binary's runpath.
fn torch_libraries(binary: &Path, torch: &Path) -> Result<Vec<PathBuf>, String> {
    let site_packages = torch.parent().ok_or("libtorch's folder has no parent")?;
    let out = Command::new("ldd")
        .arg(binary)
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .map_err(|e| format!("cannot run ldd: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut libraries = Vec::new();
    let mut elsewhere = None;
    for line in text.lines() {
        let Some((name, rest)) = line.split_once("=>") else { continue };
        let path = rest.split_whitespace().next().unwrap_or("");
        if path == "not" {
            return Err(format!("{} needs {} and ldd cannot find it", binary.display(), name.trim()));
        }
        let Ok(path) = std::fs::canonicalize(path) else { continue };
        if path.starts_with(site_packages) {
            libraries.push(path);
        } else if name.trim() == "libtorch_cpu.so" {
            elsewhere = Some(path);
        }
    }
    // A binary built with LIBTORCH pointing at another checkout loads that one's libtorch, and an
    // install of it would copy none: say so here rather than fail later on an empty lib folder.
    if let Some(path) = elsewhere {
        return Err(format!(
            "{} loads libtorch_cpu.so from {}, not from this checkout's {}: it was built against another \
             libtorch (a LIBTORCH set where it was built); build it again here without LIBTORCH set",
            binary.display(),
            path.display(),
            site_packages.display()
        ));
    }
    Ok(libraries)
}

/// `__version__` of the torch wheel libtorch comes from.
fn libtorch_version(torch: &Path) -> Result<String, String> {
    let path = torch.join("version.py");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    text.lines()
        .find(|l| l.starts_with("__version__"))
        .and_then(|l| l.split_once('='))
        .map(|(_, v)| v.trim().trim_matches('\'').trim_matches('"').to_string())
        .ok_or_else(|| format!("{} names no __version__", path.display()))
}

fn ensure_patchelf() -> Result<(), String> {
    if Command::new("patchelf").arg("--version").output().is_ok_and(|o| o.status.success()) {
        return Ok(());
    }
    apt_install(&[PATCHELF_PACKAGE], "install rewrites the binaries' runpath with patchelf")
}
