// Puts libtorch's folders on the rpath of everything this crate links (its tests too), so they run
// without the user exporting LD_LIBRARY_PATH.
//
// STOKE_LINK_TORCH_CUDA=1 also links libtorch_cuda.so explicitly: nothing in stoke calls into it by
// name, so the linker's --as-needed would drop it, and libtorch would then see no CUDA device even
// on a GPU machine. Its own dependencies (cuDNN, cuBLAS, ...) need not be present at build time;
// they are resolved on the GPU machine when the binary loads.
fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=STOKE_LINK_TORCH_CUDA");
    let Ok(libtorch) = std::env::var("LIBTORCH") else { return };
    let torch = std::fs::canonicalize(&libtorch).unwrap_or_else(|_| libtorch.clone().into());
    for lib in [torch.join("lib"), torch.join("../nvidia/cu13/lib")] {
        if let Ok(lib) = std::fs::canonicalize(&lib) {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
        }
    }
    if std::env::var_os("STOKE_LINK_TORCH_CUDA").is_some_and(|v| v == "1") {
        let lib = torch.join("lib");
        println!("cargo:rustc-link-arg=-L{}", lib.display());
        println!("cargo:rustc-link-arg=-Wl,--allow-shlib-undefined,--no-as-needed,-ltorch_cuda,-lc10_cuda,--as-needed");
    }
}
