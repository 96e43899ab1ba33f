//! The `stoke` binaries need libtorch on their runpath too (the same function as `crates/train`'s
//! build script), and record the commit they were built from for `stoke env` and every run's
//! environment.json: `STOKE_COMMIT` when set (a build without .git, such as an image's), else
//! `git rev-parse` in release builds. A debug build records "debug build": following HEAD there
//! would recompile the crate and relink every test binary on each commit.

#[path = "crates/train/build.rs"]
mod libtorch;

fn main() {
    libtorch::link_libtorch();
    // The libtorch version built against, for `stoke env` when the loaded one cannot say.
    if let Ok(libtorch) = std::env::var("LIBTORCH") {
        let version_py = std::path::Path::new(&libtorch).join("version.py");
        let version = std::fs::read_to_string(version_py).ok().and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("__version__"))?.to_string();
            Some(line.split_once('=')?.1.trim().trim_matches('\'').to_string())
        });
        if let Some(version) = version {
            println!("cargo:rustc-env=STOKE_LIBTORCH_VERSION={version}");
        }
    }
    println!("cargo:rerun-if-env-changed=STOKE_COMMIT");
    let explicit = std::env::var("STOKE_COMMIT").ok().filter(|c| !c.is_empty());
    if std::env::var("PROFILE").as_deref() != Ok("release") {
        println!("cargo:rustc-env=STOKE_COMMIT={}", explicit.unwrap_or_else(|| "debug build".into()));
        return;
    }
    // HEAD names a branch whose ref file changes on commit; packed refs change on gc.
    for path in [".git/HEAD", ".git/packed-refs"] {
        if std::path::Path::new(path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    if let Ok(head) = std::fs::read_to_string(".git/HEAD") {
        if let Some(reference) = head.strip_prefix("ref: ") {
            let reference = format!(".git/{}", reference.trim());
            if std::path::Path::new(&reference).exists() {
                println!("cargo:rerun-if-changed={reference}");
            }
        }
    }
    let commit = explicit.or_else(|| {
        let out = std::process::Command::new("git").args(["rev-parse", "--short=12", "HEAD"]).output().ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    });
    println!("cargo:rustc-env=STOKE_COMMIT={}", commit.unwrap_or_else(|| "unknown".into()));
}
