//! `cargo xtask image [--check] [--debug] [--features F] [--no-build] [--full] [--tag T]`: the container
//! image of the `Containerfile`, built with buildah (daemonless, from Debian's packages). Its runtime
//! stage is built over an install made here (`cargo xtask install`, passed as the `build` stage with
//! `--build-context`), so the image holds what this checkout built. `--full` runs the build stage
//! instead: the checkout compiled inside the image by this machine's Rust toolchain (passed as the
//! `rust` stage), crates and torch fetched from their registries, trusting the extra CA
//! certificates this machine trusts (`/usr/local/share/ca-certificates`, passed as `certs`). The base is
//! `STOKE_IMAGE_BASE` when set, else Debian 12 made from Debian's packages with debootstrap
//! (`localhost/stoke-base:bookworm`, made once and kept).
//!
//! `--check` then starts a container of the image as its non-root user, trains a small model on
//! the built-in data, reads the run's report.json (its `environment` must name the image's own
//! libtorch), imports the Python package when the image has it, and removes the container and the
//! image it built.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::install::{install, InstallArgs};
use crate::process::{apt_install, run_checked};

const BASE_IMAGE: &str = "localhost/stoke-base:bookworm";
const DEBIAN_MIRROR: &str = "http://deb.debian.org/debian";

pub struct ImageArgs {
    pub check: bool,
    pub debug: bool,
    pub features: Option<String>,
    pub no_build: bool,
    pub full: bool,
    pub tag: String,
}

impl ImageArgs {
    pub fn parse(args: &[String]) -> Result<ImageArgs, String> {
        let mut parsed = ImageArgs {
            check: false,
            debug: false,
            features: None,
            no_build: false,
            full: false,
            tag: "localhost/stoke:latest".into(),
        };
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--check" => parsed.check = true,
                "--debug" => parsed.debug = true,
                "--features" => parsed.features = it.next().cloned(),
                "--no-build" => parsed.no_build = true,
                "--full" => parsed.full = true,
                "--tag" => parsed.tag = it.next().cloned().ok_or("image: --tag needs a name")?,
                other => {
                    return Err(format!(
                        "image: unknown argument `{other}`; usage: image [--check] [--debug] [--features F] [--no-build] [--full] [--tag T]"
                    ))
                }
            }
        }
        if parsed.full && (parsed.debug || parsed.no_build || parsed.features.is_some()) {
            return Err("image: --full builds in the image with the Containerfile's own settings; \
                        --debug, --no-build and --features apply to the build made here"
                .into());
        }
        Ok(parsed)
    }
}

pub fn image(root: &Path, args: &ImageArgs) -> Result<(), String> {
    let have = |tool: &str| Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success());
    if !have("buildah") {
        apt_install(&["buildah"], "the image is built with buildah")?;
    }
    let base = match std::env::var("STOKE_IMAGE_BASE") {
        Ok(base) if !base.is_empty() => base,
        _ => debian_base(root)?,
    };
    let work = root.join("target/image");
    if args.full {
        return full_image(root, &work, &base, args);
    }
    let dist = work.join("dist");
    let _ = std::fs::remove_dir_all(&dist);
    let prefix = dist.join("opt/stoke");
    let install_args = InstallArgs {
        prefix: prefix.clone(),
        debug: args.debug,
        features: args.features.clone(),
        no_build: args.no_build,
        wheel: false,
    };
    install(root, &install_args)?;
    if args.debug {
        // A debug build's symbols are most of its size; the image is measured without them.
        run_checked(Command::new("strip").arg("--strip-debug").arg(prefix.join("bin/stoke")))?;
    }
    copy_wheels(root, &prefix)?;
    let commit = git_commit(root);
    let mut bud = Command::new("buildah");
    bud.args(["bud", "--isolation", "chroot", "--network", "host"])
        .arg("--build-context")
        .arg(format!("build={}", dist.display()))
        .args(["--build-arg", &format!("BASE={base}"), "--build-arg", &format!("STOKE_COMMIT={commit}")])
        .args(["-t", &args.tag, "-f"])
        .arg(root.join("Containerfile"))
        .arg(root);
    enough_disk_for_layers()?;
    let has_wheel = prefix.join("share/stoke/wheels").is_dir();
    let built = run_checked(&mut bud);
    // The staging tree is in the image now (or the build failed): its copy goes either way.
    let _ = std::fs::remove_dir_all(&dist);
    built?;
    finish(args, has_wheel)
}

fn finish(args: &ImageArgs, has_wheel: bool) -> Result<(), String> {
    println!("xtask: image {} built: {}", args.tag, image_size(&args.tag)?);
    if args.check {
        let result = check(&args.tag, has_wheel);
        let _ = Command::new("buildah").args(["rmi", "-f", &args.tag]).output();
        result?;
    }
    Ok(())
}

/// Every stage of the `Containerfile` built by buildah: the checkout compiled in the build stage.
/// Its `rust` stage is this machine's toolchain (hard links to `rustc --print sysroot`'s files
/// where the file system allows, else a copy), its `certs` stage the CA certificates this machine
/// adds to Debian's.
fn full_image(root: &Path, work: &Path, base: &str, args: &ImageArgs) -> Result<(), String> {
    let sysroot = output_of(Command::new("rustc").args(["--print", "sysroot"]))?;
    let rust = work.join("rust");
    let certs = work.join("certs");
    for dir in [&rust, &certs] {
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let linked = Command::new("cp").arg("-al").arg(sysroot.trim()).arg(rust.join("rust")).status();
    if !linked.is_ok_and(|s| s.success()) {
        let _ = std::fs::remove_dir_all(rust.join("rust"));
        run_checked(Command::new("cp").arg("-a").arg(sysroot.trim()).arg(rust.join("rust")))?;
    }
    std::fs::create_dir_all(certs.join("certs")).map_err(|e| format!("{}: {e}", certs.display()))?;
    if let Ok(entries) = std::fs::read_dir("/usr/local/share/ca-certificates") {
        for cert in entries.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "crt")) {
            let to = certs.join("certs").join(cert.file_name().unwrap_or_default());
            std::fs::copy(&cert, &to).map_err(|e| format!("{}: {e}", cert.display()))?;
        }
    }
    let mut bud = Command::new("buildah");
    bud.args(["bud", "--isolation", "chroot", "--network", "host"])
        .arg("--build-context")
        .arg(format!("rust={}", rust.display()))
        .arg("--build-context")
        .arg(format!("certs={}", certs.display()))
        .args(["--build-arg", &format!("BASE={base}"), "--build-arg", &format!("STOKE_COMMIT={}", git_commit(root))])
        .args(["-t", &args.tag, "-f"])
        .arg(root.join("Containerfile"))
        .arg(root);
    enough_disk_for_layers()?;
    let built = run_checked(&mut bud);
    // The build contexts are in the image now (or the build failed): they go either way.
    let _ = std::fs::remove_dir_all(&rust);
    let _ = std::fs::remove_dir_all(&certs);
    built?;
    finish(args, true)
}

/// Debian 12 from Debian's packages: debootstrap's minimal variant, committed as an image once.
fn debian_base(root: &Path) -> Result<String, String> {
    let exists = Command::new("buildah").args(["inspect", "--type", "image", BASE_IMAGE]).output();
    if exists.is_ok_and(|o| o.status.success()) {
        return Ok(BASE_IMAGE.into());
    }
    if !Command::new("debootstrap").arg("--version").output().is_ok_and(|o| o.status.success()) {
        apt_install(&["debootstrap"], "the image's base is made with debootstrap")?;
    }
    let rootfs = root.join("target/image/rootfs");
    let _ = std::fs::remove_dir_all(&rootfs);
    let mirror = std::env::var("STOKE_DEBIAN_MIRROR").unwrap_or_else(|_| DEBIAN_MIRROR.into());
    eprintln!("xtask: making the image's base (Debian 12, minbase) with debootstrap from {mirror}");
    run_checked(Command::new("debootstrap").args(["--variant=minbase", "bookworm"]).arg(&rootfs).arg(&mirror))?;
    let ctr = output_of(Command::new("buildah").args(["from", "scratch"]))?;
    let result = (|| {
        run_checked(Command::new("buildah").args(["copy", "--quiet", &ctr]).arg(&rootfs).arg("/"))?;
        run_checked(Command::new("buildah").args(["config", "--cmd", "/bin/bash", &ctr]))?;
        run_checked(Command::new("buildah").args(["commit", "--quiet", &ctr, BASE_IMAGE]))
    })();
    let _ = Command::new("buildah").args(["rm", &ctr]).output();
    let _ = std::fs::remove_dir_all(&rootfs);
    result.map(|_| BASE_IMAGE.into())
}

/// The Python package's wheels that `cargo xtask wheel` left in target/wheels, into the install.
fn copy_wheels(root: &Path, prefix: &Path) -> Result<(), String> {
    let Ok(entries) = std::fs::read_dir(root.join("target/wheels")) else { return Ok(()) };
    let wheels: Vec<PathBuf> =
        entries.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "whl")).collect();
    let Some(newest) = wheels.iter().max_by_key(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok()) else {
        return Ok(());
    };
    let dir = prefix.join("share/stoke/wheels");
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let to = dir.join(newest.file_name().expect("a wheel path names a file"));
    std::fs::copy(newest, &to).map(|_| ()).map_err(|e| format!("cannot copy {}: {e}", newest.display()))
}

/// A container of the image, as its non-root user: `stoke env`, a short training run whose
/// report records the image's libtorch, and the Python import.
fn check(tag: &str, has_wheel: bool) -> Result<(), String> {
    let ctr = output_of(Command::new("buildah").args(["from", "--pull-never", tag]))?;
    let run = |args: &[&str]| -> Result<String, String> {
        let mut cmd = Command::new("buildah");
        cmd.args(["run", "--isolation", "chroot", "--user", "stoke", "--workingdir", "/home/stoke", &ctr, "--"])
            .args(args);
        output_of(&mut cmd)
    };
    let result = (|| {
        let env = run(&["stoke", "env"])?;
        println!("xtask: `stoke env` in the image:\n{env}");
        if !env.contains("/opt/stoke/lib/libtorch_cpu.so") {
            return Err(format!("stoke in the image does not load /opt/stoke/lib's libtorch:\n{env}"));
        }
        let train = run(&[
            "stoke",
            "train",
            "--quiet",
            "--set",
            "run.name=image-check",
            "--set",
            "train.steps=4",
            "--set",
            "model.n_layer=2",
            "--set",
            "model.d_model=64",
            "--set",
            "model.n_head=2",
            "--set",
            "model.seq_len=32",
            "--set",
            "train.micro_batch=4",
            "--set",
            "data.builtin_bytes=200000",
        ])?;
        if !train.contains("step report") {
            return Err(format!("stoke train in the image printed no step report:\n{train}"));
        }
        let report = run(&["cat", "runs/image-check/report.json"])?;
        let report: serde_json::Value =
            serde_json::from_str(&report).map_err(|e| format!("the image's report.json is not JSON: {e}"))?;
        let loaded = report["environment"]["libtorch"]["path"].as_str().unwrap_or("");
        if loaded != "/opt/stoke/lib/libtorch_cpu.so" {
            return Err(format!("report.json's environment names libtorch {loaded:?}, not the image's"));
        }
        println!("xtask: stoke train ran in the image as user stoke; report.json records its environment");
        if has_wheel {
            let imported = run(&["python3", "-c", "import stoke; print(stoke.__file__)"])?;
            println!("xtask: the Python package imports in the image: {}", imported.trim());
        }
        Ok(())
    })();
    let _ = Command::new("buildah").args(["rm", &ctr]).output();
    result
}

/// buildah writes each layer as a file under `$TMPDIR` (or /var/tmp) before it commits it to
/// its store: the runtime layer is about 1.2 GB, so a fuller disk fails mid-commit with ENOSPC.
/// This says so before the build starts, with the place and the figures.
fn enough_disk_for_layers() -> Result<(), String> {
    const NEEDED: u64 = 3 << 30;
    let tmp = std::env::var("TMPDIR").ok().filter(|t| !t.is_empty()).unwrap_or_else(|| "/var/tmp".into());
    let out = Command::new("df").args(["--output=avail", "-B1", &tmp]).output();
    let free = out
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8_lossy(&o.stdout).lines().nth(1).and_then(|l| l.trim().parse::<u64>().ok()));
    match free {
        Some(free) if free < NEEDED => Err(format!(
            "the image needs about {} GiB free under {tmp} for buildah's layers; {:.1} GiB are free there",
            NEEDED >> 30,
            free as f64 / (1u64 << 30) as f64
        )),
        _ => Ok(()),
    }
}

fn image_size(tag: &str) -> Result<String, String> {
    let text = output_of(Command::new("buildah").args(["images", "--json", tag]))?;
    let images: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("buildah images: {e}"))?;
    Ok(images[0]["size"].as_str().unwrap_or("unknown size").to_string())
}

fn git_commit(root: &Path) -> String {
    Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(root)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// Runs `cmd`; its standard output, or an error with both outputs.
fn output_of(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?} failed with {}:\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}
