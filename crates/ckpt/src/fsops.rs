//! The filesystem steps the commit protocol is made of: synced writes, synced folders, and an
//! atomic exchange of two names.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use crate::error::io;
use crate::CkptError;

/// Writes `bytes` to a new file and fsyncs it.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CkptError> {
    let mut file = File::create(path).map_err(io("create", path))?;
    file.write_all(bytes).map_err(io("write", path))?;
    file.sync_all().map_err(io("fsync", path))
}

/// Fsyncs a folder, so the names created, renamed or removed in it are durable.
pub(crate) fn sync_dir(path: &Path) -> Result<(), CkptError> {
    File::open(path).and_then(|dir| dir.sync_all()).map_err(io("fsync", path))
}

/// Swaps the names `a` and `b` (both must exist) in one atomic step: there is no moment at which
/// either name is missing. Linux's `renameat2(RENAME_EXCHANGE)`.
#[cfg(target_os = "linux")]
pub fn rename_exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let to_c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes()).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
    };
    let (a, b) = (to_c(a)?, to_c(b)?);
    // SAFETY: both pointers are NUL-terminated strings that live across the call; the syscall
    // reads them and touches no other memory of ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(not(target_os = "linux"))]
pub fn rename_exchange(_a: &Path, _b: &Path) -> std::io::Result<()> {
    Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "atomic rename exchange is implemented for Linux only"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exchange_swaps_two_folders() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        std::fs::write(a.join("x"), b"from a").unwrap();
        std::fs::write(b.join("x"), b"from b").unwrap();
        rename_exchange(&a, &b).unwrap();
        assert_eq!(std::fs::read(a.join("x")).unwrap(), b"from b");
        assert_eq!(std::fs::read(b.join("x")).unwrap(), b"from a");
        assert!(rename_exchange(&a, &dir.path().join("missing")).is_err());
    }
}
