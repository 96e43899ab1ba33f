//! Project tasks that need set-up before cargo can build stoke: `cargo xtask <task>`.
//!
//! The only set-up is libtorch. tch 0.24 builds against torch 2.11.0, and the leanest way to get it
//! on a fresh machine is PyPI's wheel installed without its dependencies into a project-local
//! virtual environment (`.stoke/venv`), plus the two small NVIDIA wheels that `libtorch_cpu.so`
//! needs at load time. `.cargo/config.toml` points torch-sys at `.stoke/torch`, a link into that
//! wheel, so after set-up a plain `cargo build` works too.
//!
//! Tasks:
//! - `setup`: install libtorch if it is not there yet (idempotent, quick when done).
//! - `train [ARGS]`: set up, then `stoke train ARGS` from a release build, in the precision this
//!   machine is fast in (`train.precision = "auto"`) unless ARGS name one.
//! - `test [ARGS]`: set up, install Open MPI and ffmpeg when missing (apt-get, as root), then
//!   `cargo test --workspace --features stoke-comm/mpi,stoke-comm/nccl ARGS`; without ARGS, then also the
//!   benchmark regression gate (`stoke bench gate`): its self-test (five unchanged series pass,
//!   five injected slowdowns are caught), then this code against the previous commit, built from
//!   a worktree (a flag is checked once more before it fails the run). Between cargo's tests and
//!   the gate: the Python package's tests (`python.rs`: the wheel built by maturin, pip-installed
//!   into a fresh environment, pytest), then `image --check` over the binaries and the wheel just
//!   built. (The Slurm tests install
//!   Slurm, and slurmdbd with MariaDB, themselves.)
//! - `stoke [ARGS]`: set up, then run the release `stoke` binary with ARGS.
//! - `pytest`: set up, then only the Python package's tests (as `test` runs them).
//! - `peers`: set up, then add what the PyTorch peer scripts in `benches/peers/` import.
//! - `install --prefix DIR`: a release build laid out as DIR/bin and DIR/lib that runs with no
//!   checkout (see `install.rs`).
//! - `image [--check] [--full]`: the `Containerfile`'s image, built with buildah (see `image.rs`).
//!
//! `test` also installs what the Hugging Face tests import (transformers, peft, torch's CUDA
//! wheels: Python's `import torch` needs them) when Python cannot import them yet.

mod image;
mod install;
mod process;
mod python;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use process::{apt_install, cargo, python_output, run_checked, status, venv_python};

const TORCH: &str = "torch==2.11.0";
/// `libtorch_cpu.so` links libcudart and libcupti even in CPU use; these wheels hold them.
const TORCH_RUNTIME_DEPS: &[&str] = &["nvidia-cuda-runtime==13.0.96", "nvidia-cuda-cupti==13.0.85"];
/// What `import torch` and the peer scripts need beyond the wheel itself.
const PEER_DEPS: &[&str] = &[
    "numpy",
    "typing-extensions",
    "sympy",
    "networkx",
    "jinja2",
    "fsspec",
    "filelock",
    "safetensors",
    "HolisticTraceAnalysis",
    // The episode peers' JPEG decoding and augmentation (benches/peers/episodes_torch.py), the
    // release built for TORCH.
    "torchvision==0.26.0",
    // Peer (c) of benches/data_vs_peers.sh; it depends on torch with its CUDA wheels, which also
    // makes `import torch` load (the lean install lacks libcudnn and friends).
    "mosaicml-streaming",
];
/// What the Hugging Face tests (`tests/it/hf.rs`, `tests/it/hf_models.py`) import: transformers
/// writes and reads the checkpoints, peft the adapters. Pinned to the versions the tests were
/// written against; importing torch from Python also needs the wheel's CUDA dependencies, which
/// the lean install leaves out, so TORCH is installed with its dependencies beside them.
const HF_DEPS: &[&str] = &["transformers==5.25.0", "peft==0.21.2", "safetensors==0.8.0"];
/// Bump when the set-up changes, so existing checkouts redo it.
const SETUP_STAMP: &str = "torch 2.11.0 lean v1";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((task, rest)) = args.split_first() else {
        eprintln!("usage: cargo xtask <setup|train|test|pytest|stoke|peers|install|image> [ARGS]");
        return ExitCode::from(2);
    };
    let root = project_root();
    let result = match task.as_str() {
        "setup" => setup(&root).map(|_| 0),
        "train" => setup(&root).and_then(|_| {
            let mut cmd = cargo(&root);
            cmd.args(["run", "--release", "--quiet", "--bin", "stoke", "--", "train"]);
            // The first command a newcomer runs takes the precision this machine is fast in: on a
            // CPU without bf16 instructions the default bf16 made the tiny GPT's step 16x slower
            // (20 s against 1.3 s, hours for its 600 steps). A precision named in ARGS wins.
            if !rest.iter().any(|arg| arg.contains("train.precision")) {
                cmd.args(["--set", "train.precision=\"auto\""]);
            }
            cmd.args(rest);
            status(cmd)
        }),
        "stoke" => setup(&root).and_then(|_| {
            let mut cmd = cargo(&root);
            cmd.args(["run", "--release", "--quiet", "--bin", "stoke", "--"]).args(rest);
            status(cmd)
        }),
        "test" => setup(&root).and_then(|_| ensure_test_tools()).and_then(|_| ensure_hf_deps(&root)).and_then(|_| {
            let mut cmd = cargo(&root);
            cmd.args(["test", "--workspace", "--features", "stoke-comm/mpi,stoke-comm/nccl"]).args(rest);
            let code = status(cmd)?;
            if code != 0 || !rest.is_empty() {
                return Ok(code);
            }
            let code = python::test(&root)?;
            if code != 0 {
                return Ok(code);
            }
            // The installed binary (with the wheel the Python step just built) and the container image, from the binaries the tests just
            // built: an install that runs with no checkout, and an image that trains as its
            // non-root user and records its environment.
            let image_args = image::ImageArgs {
                check: true,
                debug: true,
                features: None,
                no_build: true,
                full: false,
                tag: "localhost/stoke:check".into(),
            };
            image::image(&root, &image_args)?;
            // The regression gate. First its own test: this code against itself, five unchanged
            // series that must pass and five injected slowdowns (forward, backward, optimizer 10%,
            // 2 ms data wait, 10% memory) that must each be caught. Then this code against the
            // previous commit, built from a worktree into the same target folder: a regression
            // of a phase, the step or the peak memory fails the run. Every comparison is of
            // interleaved runs in one invocation, so no baseline from another machine or hour is
            // involved; a flag is checked once more (a real regression repeats, a disturbed pair
            // rarely does).
            let gate = |args: &[&str]| {
                let mut gate = cargo(&root);
                gate.args(["run", "--quiet", "--bin", "stoke", "--", "bench", "gate"]).args(args);
                status(gate)
            };
            let twice = |args: &[&str], what: &str| -> Result<i32, String> {
                println!("xtask: {what}");
                let code = gate(args)?;
                if code != 4 {
                    return Ok(code);
                }
                println!("xtask: {what}: flagged; once more");
                gate(args)
            };
            // Fourteen rounds, two runs side by side (the gate's model trains on one thread): a
            // run's speed moves by 3-5% on a shared machine, a whole run at a time, and a 10%
            // injection must read above the tolerance in the median of the rounds.
            let code = twice(&["--self-test", "--pairs", "14"], "the gate's self-test")?;
            if code != 0 {
                return Err(format!("the gate's self-test failed (exit {code})"));
            }
            let previous =
                Command::new("git").args(["rev-parse", "--verify", "--quiet", "HEAD~1"]).current_dir(&root).output();
            if !previous.is_ok_and(|out| out.status.success()) {
                println!("xtask: no previous commit here (a shallow clone?): the gate against it is left out");
                return Ok(0);
            }
            twice(&["--against", "HEAD~1", "--pairs", "10"], "the gate against the previous commit")
        }),
        "pytest" => setup(&root).and_then(|_| python::test(&root)),
        "peers" => setup(&root).and_then(|_| install_peer_deps(&root)).map(|_| 0),
        "install" => install::InstallArgs::parse(rest)
            .and_then(|args| setup(&root).and_then(|_| install::install(&root, &args)))
            .map(|_| 0),
        "image" => image::ImageArgs::parse(rest)
            .and_then(|args| setup(&root).and_then(|_| image::image(&root, &args)))
            .map(|_| 0),
        other => {
            Err(format!("unknown task `{other}`; tasks: setup, train, test, pytest, stoke, peers, install, image"))
        }
    };
    match result {
        Ok(0) => ExitCode::SUCCESS,
        Ok(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        Err(message) => {
            eprintln!("xtask: {message}");
            ExitCode::from(1)
        }
    }
}

fn project_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the project root").to_path_buf()
}

/// Installs the lean libtorch once; later calls only check the stamp file.
fn setup(root: &Path) -> Result<(), String> {
    let stoke_dir = root.join(".stoke");
    let stamp = stoke_dir.join("setup-done");
    let link = stoke_dir.join("torch");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s.trim() == SETUP_STAMP) && link.join("lib").is_dir() {
        return Ok(());
    }
    eprintln!("xtask: first use: installing libtorch ({TORCH}, CPU-lean, about 1.3 GB) into .stoke/venv");
    std::fs::create_dir_all(&stoke_dir).map_err(|e| format!("cannot create {}: {e}", stoke_dir.display()))?;
    let python = venv_python(root);
    if !python.exists() {
        let host_python = find_host_python()?;
        run_checked(Command::new(&host_python).args(["-m", "venv"]).arg(stoke_dir.join("venv")))?;
    }
    let mut pip = Command::new(&python);
    pip.args(["-m", "pip", "install", "--quiet", "--no-input", "--no-deps", TORCH]).args(TORCH_RUNTIME_DEPS);
    run_checked(&mut pip)?;
    let purelib = python_output(&python, "import sysconfig; print(sysconfig.get_paths()['purelib'])")?;
    let torch_dir = PathBuf::from(purelib.trim()).join("torch");
    if !torch_dir.join("lib/libtorch_cpu.so").exists() {
        return Err(format!("torch was installed but {} has no lib/libtorch_cpu.so", torch_dir.display()));
    }
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&torch_dir, &link).map_err(|e| format!("cannot link {}: {e}", link.display()))?;
    std::fs::write(&stamp, SETUP_STAMP).map_err(|e| format!("cannot write {}: {e}", stamp.display()))?;
    eprintln!("xtask: libtorch ready at .stoke/torch");
    Ok(())
}

/// Debian packages the `mpi` feature needs to build (mpi.h, libmpi, libclang for bindgen) and its
/// test needs to run (`mpirun`).
const OPEN_MPI_PACKAGES: &[&str] = &["openmpi-bin", "libopenmpi-dev", "libclang-dev"];

/// Installs Open MPI with apt-get when `mpirun` or `mpicc` is missing (as root, non-interactive).
fn ensure_open_mpi() -> Result<(), String> {
    let present = |tool: &str| Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success());
    let has_libclang =
        ["/usr/lib/llvm-14/lib", "/usr/lib/llvm-15/lib", "/usr/lib/llvm-16/lib", "/usr/lib/x86_64-linux-gnu"]
            .iter()
            .any(|dir| {
                std::fs::read_dir(dir)
                    .is_ok_and(|d| d.flatten().any(|e| e.file_name().to_string_lossy().starts_with("libclang")))
            });
    if present("mpirun") && present("mpicc") && has_libclang {
        return Ok(());
    }
    apt_install(OPEN_MPI_PACKAGES, "the tests need Open MPI")
}

/// The system packages the tests need: Open MPI, and ffmpeg (stoke decodes LeRobot datasets'
/// videos with it, and stoke-data's LeRobot tests encode theirs with it).
fn ensure_test_tools() -> Result<(), String> {
    ensure_open_mpi()?;
    if Command::new("ffmpeg").arg("-version").output().is_ok_and(|o| o.status.success()) {
        return Ok(());
    }
    apt_install(&["ffmpeg"], "the tests need ffmpeg")
}

/// Installs `HF_DEPS` (and torch's own dependencies) when Python cannot import them yet.
fn ensure_hf_deps(root: &Path) -> Result<(), String> {
    let python = venv_python(root);
    let check = "import torch, transformers, peft, safetensors; print(transformers.__version__, peft.__version__)";
    let wanted = "5.25.0 0.21.2";
    if python_output(&python, check).is_ok_and(|v| v.trim() == wanted) {
        return Ok(());
    }
    eprintln!(
        "xtask: installing what the Hugging Face tests import ({}, about 3 GB with torch's CUDA wheels)",
        HF_DEPS.join(" ")
    );
    let mut pip = Command::new(&python);
    pip.args(["-m", "pip", "install", "--quiet", "--no-input", TORCH]).args(HF_DEPS);
    run_checked(&mut pip)
}

fn install_peer_deps(root: &Path) -> Result<(), String> {
    let mut pip = Command::new(venv_python(root));
    // TORCH is named with them so the resolver keeps it: mosaicml-streaming pulls torchvision, whose
    // newest release wants a newer torch, and libtorch must stay the version tch builds against.
    pip.args(["-m", "pip", "install", "--quiet", "--no-input", TORCH]).args(PEER_DEPS);
    run_checked(&mut pip)
}

fn find_host_python() -> Result<String, String> {
    for candidate in ["python3", "python"] {
        let probe = Command::new(candidate)
            .args(["-c", "import sys, venv; assert sys.version_info >= (3, 10); print(sys.version)"])
            .output();
        if probe.is_ok_and(|out| out.status.success()) {
            return Ok(candidate.to_string());
        }
    }
    Err("stoke needs Python 3.10 or newer with the venv module to install libtorch from PyPI; none found on PATH"
        .into())
}
