//! The filesystem steps the commit protocol is made of: synced writes, synced folders, and an
//! atomic exchange of two names.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

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

/// Why [`into_fresh_dir`] failed.
#[derive(Debug)]
pub enum FreshDirError<E> {
    /// `out` holds this many entries and `force` was not given.
    Occupied(usize),
    /// `out` could not be read.
    ReadOut(std::io::Error),
    /// The preparation failed; the new folder is removed and `out` untouched.
    Prepare(E),
    /// The new folder could not be renamed to `out` (none was there).
    Move(std::io::Error),
    /// The new folder could not be swapped with the old `out`.
    Swap(std::io::Error),
    /// The old dataset, swapped out to `PathBuf`, could not be removed.
    RemoveOld(PathBuf, std::io::Error),
}

/// Runs `prepare` into a new folder beside `out` and puts it in `out`'s place only once it has
/// succeeded: a folder that holds anything is refused without `force`, and with it the old one is
/// swapped out whole ([`rename_exchange`]) and removed. A failure removes the new folder and leaves
/// `out` untouched. What `stoke prep --out` and `stoke.prep` do.
pub fn into_fresh_dir<T, E>(
    out: &Path,
    force: bool,
    prepare: impl FnOnce(&Path) -> Result<T, E>,
) -> Result<T, FreshDirError<E>> {
    let existing = match std::fs::read_dir(out) {
        Ok(entries) => Some(entries.count()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(FreshDirError::ReadOut(e)),
    };
    if let (Some(n), false) = (existing.filter(|&n| n > 0), force) {
        return Err(FreshDirError::Occupied(n));
    }
    let name = out.file_name().map_or("out".into(), |n| n.to_string_lossy().into_owned());
    let fresh = out.with_file_name(format!(".{name}.prep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&fresh);
    let value = prepare(&fresh).map_err(|err| {
        let _ = std::fs::remove_dir_all(&fresh);
        FreshDirError::Prepare(err)
    })?;
    match existing {
        None => std::fs::rename(&fresh, out).map_err(FreshDirError::Move)?,
        Some(_) => {
            rename_exchange(&fresh, out).map_err(FreshDirError::Swap)?;
            // `fresh` now names the old dataset.
            std::fs::remove_dir_all(&fresh).map_err(|e| FreshDirError::RemoveOld(fresh.clone(), e))?;
        }
    }
    Ok(value)
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
