// Puts libtorch's folders on the runpath of everything this crate links (its tests too), so they
// run without the user exporting LD_LIBRARY_PATH; the root crate's build script uses the same
// function through a `#[path]` module.
//
// The runpath is relative to the binary (`$ORIGIN`) wherever it can be, so a checkout that is
// moved keeps working binaries:
// - `$ORIGIN/../lib`: the layout `cargo xtask install --prefix DIR` writes (bin/ beside lib/);
// - libtorch inside the workspace (`.stoke/`, set up by `cargo xtask setup`): the path from
//   `target/<profile>/` (binaries) and from `target/<profile>/deps/` (tests) to it;
// - libtorch outside the workspace (a system-wide install): its absolute path.
// LD_LIBRARY_PATH, searched before the runpath, points a binary at another libtorch.
//
// STOKE_LINK_TORCH_CUDA=1 also links libtorch_cuda.so explicitly: nothing in stoke calls into it by
// name, so the linker's --as-needed would drop it, and libtorch would then see no CUDA device even
// on a GPU machine. Its own dependencies (cuDNN, cuBLAS, ...) need not be present at build time;
// they are resolved on the GPU machine when the binary loads.
#[allow(dead_code)]
fn main() {
    link_libtorch();
}

pub fn link_libtorch() {
    use std::path::{Component, Path, PathBuf};
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=STOKE_LINK_TORCH_CUDA");
    let Ok(libtorch) = std::env::var("LIBTORCH") else { return };
    let torch = std::fs::canonicalize(&libtorch).unwrap_or_else(|_| libtorch.clone().into());
    // OUT_DIR is target/<profile>/build/<crate>-<hash>/out: three folders up is target/<profile>.
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let profile_dir = out.ancestors().nth(3).and_then(|p| std::fs::canonicalize(p).ok());
    let workspace = workspace_root();
    // The path from `from` to `to`, both absolute and canonical.
    let relative = |from: &Path, to: &Path| -> PathBuf {
        let from: Vec<Component> = from.components().collect();
        let to: Vec<Component> = to.components().collect();
        let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
        let mut path = PathBuf::new();
        for _ in common..from.len() {
            path.push("..");
        }
        for part in &to[common..] {
            path.push(part.as_os_str());
        }
        path
    };
    let mut runpath = vec!["$ORIGIN/../lib".to_string()];
    for lib in [torch.join("lib"), torch.join("../nvidia/cu13/lib")] {
        let Ok(lib) = std::fs::canonicalize(&lib) else { continue };
        match (&profile_dir, &workspace) {
            (Some(profile_dir), Some(workspace)) if lib.starts_with(workspace) => {
                let rel = relative(profile_dir, &lib);
                runpath.push(format!("$ORIGIN/{}", rel.display()));
                runpath.push(format!("$ORIGIN/../{}", rel.display()));
            }
            _ => runpath.push(lib.display().to_string()),
        }
    }
    // One entry: `-rpath` given twice would make two DT_RUNPATH strings, of which the loader
    // reads only the first.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", runpath.join(":"));
    println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags");
    if std::env::var_os("STOKE_LINK_TORCH_CUDA").is_some_and(|v| v == "1") {
        let lib = torch.join("lib");
        println!("cargo:rustc-link-arg=-L{}", lib.display());
        println!("cargo:rustc-link-arg=-Wl,--allow-shlib-undefined,--no-as-needed,-ltorch_cuda,-lc10_cuda,--as-needed");
    }
}

/// The workspace root: the nearest folder above the package with a Cargo.lock.
fn workspace_root() -> Option<std::path::PathBuf> {
    let manifest_dir = std::path::PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").ok()?);
    let root = manifest_dir.ancestors().find(|dir| dir.join("Cargo.lock").is_file())?.to_path_buf();
    std::fs::canonicalize(root).ok()
}
