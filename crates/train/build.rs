// Puts libtorch's folders on the rpath of everything this crate links (its tests too), so they run
// without the user exporting LD_LIBRARY_PATH.
fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let Ok(libtorch) = std::env::var("LIBTORCH") else { return };
    let torch = std::fs::canonicalize(&libtorch).unwrap_or_else(|_| libtorch.clone().into());
    for lib in [torch.join("lib"), torch.join("../nvidia/cu13/lib")] {
        if let Ok(lib) = std::fs::canonicalize(&lib) {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        }
    }
}
