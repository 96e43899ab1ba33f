//! Page-locked host buffers for a state on a GPU: the CUDA runtime's `cudaHostRegister` pins a
//! snapshot's host buffer, so the device-to-host copy into it is one DMA instead of a copy staged
//! through the driver's own pinned bounce buffers. The runtime is loaded at run time (`dlopen` of
//! `libcudart`), so this crate builds and runs without CUDA; asking for pinning where the library
//! or a device is missing is a clear error.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::Arc;

/// The runtime's names, newest first (the one libtorch loaded is found under its soname).
const CUDART_NAMES: &[&str] = &["libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"];

type RegisterFn = unsafe extern "C" fn(*mut c_void, usize, u32) -> c_int;
type UnregisterFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type ErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;

/// The CUDA runtime's host-registration functions.
pub(crate) struct Pinner {
    library: String,
    register: RegisterFn,
    unregister: UnregisterFn,
    error_string: ErrorStringFn,
}

impl std::fmt::Debug for Pinner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pinner").field("library", &self.library).finish()
    }
}

impl Pinner {
    /// Loads the CUDA runtime.
    pub(crate) fn load() -> Result<Arc<Pinner>, String> {
        Pinner::load_from(CUDART_NAMES)
    }

    /// Loads the first of `names` that the dynamic loader finds.
    pub(crate) fn load_from(names: &[&str]) -> Result<Arc<Pinner>, String> {
        let mut failures = Vec::new();
        for name in names {
            let c_name = CString::new(*name).map_err(|e| format!("library name {name:?}: {e}"))?;
            // SAFETY: dlopen reads the NUL-terminated name; the handle is never closed, so the
            // function pointers taken from it stay valid for the life of the process.
            let handle = unsafe { libc::dlopen(c_name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if handle.is_null() {
                failures.push(dl_error());
                continue;
            }
            let symbol = |symbol: &str| -> Result<*mut c_void, String> {
                let c_symbol = CString::new(symbol).expect("symbol names have no NUL");
                // SAFETY: a live handle and a NUL-terminated name.
                let ptr = unsafe { libc::dlsym(handle, c_symbol.as_ptr()) };
                if ptr.is_null() {
                    Err(format!("{name} has no {symbol}: {}", dl_error()))
                } else {
                    Ok(ptr)
                }
            };
            let (register, unregister, error_string) =
                (symbol("cudaHostRegister")?, symbol("cudaHostUnregister")?, symbol("cudaGetErrorString")?);
            // SAFETY: the CUDA runtime's documented signatures:
            // cudaError_t cudaHostRegister(void*, size_t, unsigned int);
            // cudaError_t cudaHostUnregister(void*); const char* cudaGetErrorString(cudaError_t).
            let pinner = unsafe {
                Pinner {
                    library: name.to_string(),
                    register: std::mem::transmute::<*mut c_void, RegisterFn>(register),
                    unregister: std::mem::transmute::<*mut c_void, UnregisterFn>(unregister),
                    error_string: std::mem::transmute::<*mut c_void, ErrorStringFn>(error_string),
                }
            };
            return Ok(Arc::new(pinner));
        }
        Err(format!("the CUDA runtime is not loadable ({})", failures.join("; ")))
    }

    /// Pins `len` bytes at `ptr` until the returned guard is dropped.
    pub(crate) fn pin(self: &Arc<Self>, ptr: *mut u8, len: usize) -> Result<Pinned, String> {
        // SAFETY: the caller passes a mapping it owns of at least `len` bytes; registration
        // changes how the pages are held, not their content. Flags 0: cudaHostRegisterDefault.
        let rc = unsafe { (self.register)(ptr.cast(), len, 0) };
        if rc != 0 {
            return Err(format!(
                "cudaHostRegister of {len} bytes ({}) failed: error {rc}, {}",
                self.library,
                self.describe(rc)
            ));
        }
        Ok(Pinned { pinner: self.clone(), ptr, len })
    }

    fn describe(&self, rc: c_int) -> String {
        // SAFETY: cudaGetErrorString returns a static NUL-terminated string (or null).
        let text = unsafe { (self.error_string)(rc) };
        if text.is_null() {
            return "unknown error".into();
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
    }
}

/// A pinned range; unpinned on drop (before its memory is unmapped or moved).
pub(crate) struct Pinned {
    pinner: Arc<Pinner>,
    ptr: *mut u8,
    len: usize,
}

impl Pinned {
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

// SAFETY: the guard only holds the range's address for the unregister call; the runtime's
// registration functions may be called from any thread.
unsafe impl Send for Pinned {}
// SAFETY: as above; `&Pinned` allows nothing.
unsafe impl Sync for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: `ptr` was registered by `Pinner::pin` and is unregistered exactly once, while
        // its mapping still exists (HostBuf drops the guard before unmapping or moving it).
        let rc = unsafe { (self.pinner.unregister)(self.ptr.cast()) };
        if rc != 0 {
            eprintln!("stoke: cudaHostUnregister failed: {}", self.pinner.describe(rc));
        }
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns a thread-local NUL-terminated message or null.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null and NUL-terminated, valid until the next dl* call on this thread.
        unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_runtime_is_a_clear_error() {
        let err = Pinner::load_from(&["libstoke-test-no-such-cudart.so"]).unwrap_err();
        assert!(err.contains("CUDA runtime") && err.contains("libstoke-test-no-such-cudart.so"), "{err}");
    }

    #[test]
    fn pinning_a_host_buffer_succeeds_or_names_the_cuda_error() {
        // The runtime from the loader's path, or the one beside the project's libtorch
        // (`.stoke/torch`'s wheel brings it), or STOKE_TEST_CUDART; where none is, this says so.
        let beside_torch =
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../.stoke/torch/../nvidia/cu13/lib/libcudart.so.13");
        let mut names: Vec<String> = CUDART_NAMES.iter().map(|s| s.to_string()).collect();
        names.push(beside_torch.into());
        if let Ok(path) = std::env::var("STOKE_TEST_CUDART") {
            names.insert(0, path);
        }
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let pinner = match Pinner::load_from(&names) {
            Ok(pinner) => pinner,
            Err(e) => {
                eprintln!("skipped: no CUDA runtime to pin with here ({e})");
                return;
            }
        };
        let mut buf = crate::hostbuf::HostBuf::new();
        buf.grow_to(3 << 20).unwrap();
        buf[..4].copy_from_slice(b"abcd");
        match buf.pin_with(&pinner) {
            Ok(()) => {
                assert!(buf.is_pinned());
                assert_eq!(buf.pinned_bytes(), 3 << 20);
                // Growing may move the mapping: the old range is unpinned first, the content kept.
                buf.grow_to(9 << 20).unwrap();
                assert!(!buf.is_pinned());
                buf.pin_with(&pinner).unwrap();
                assert_eq!((buf.pinned_bytes(), &buf[..4]), (9 << 20, &b"abcd"[..]));
            }
            Err(e) => {
                // No GPU here: the runtime's own error, named.
                assert!(e.contains("cudaHostRegister") && e.contains("error"), "{e}");
                assert!(!buf.is_pinned());
                eprintln!("pinning refused as expected without a GPU: {e}");
            }
        }
    }
}
