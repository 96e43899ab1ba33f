//! The server's dealings with processes and files outside its database: a launcher's liveness
//! from `/proc` (pid and start time, so a reused pid is not mistaken for it), finding a launcher by
//! its job tag, the folder's lock, and the allocation files the launchers read.

use std::io::{Read, Write};
use std::path::Path;

use super::layout::Layout;
use crate::SchedError;

/// The environment variable that tags a launcher with its job (`<database>#<id>`), so a server
/// that died between starting a launcher and recording its pid finds it again.
pub(super) const JOB_TAG_VAR: &str = "STOKE_SCHED_JOB";

pub(super) enum ProcessState {
    Alive,
    Exited(i32),
    Gone,
}

/// (state, start time) of a pid from `/proc/PID/stat`; None when there is no such process.
pub(super) fn proc_stat(pid: i32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state); start time is field 22.
    Some((fields.first()?.chars().next()?, fields.get(19)?.parse().ok()?))
}

pub(super) fn alive(pid: i32, start: u64) -> bool {
    matches!(proc_stat(pid), Some((state, s)) if s == start && state != 'Z' && state != 'X')
}

/// A process group leader tagged with `tag` (a launcher this folder's server started).
pub(super) fn find_tagged(tag: &str) -> Option<(i32, u64)> {
    let wanted = format!("{JOB_TAG_VAR}={tag}");
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        // SAFETY: getpgid(2) on any pid only reads; an exited one returns -1.
        if unsafe { libc::getpgid(pid) } != pid {
            continue;
        }
        let Ok(env) = std::fs::read(entry.path().join("environ")) else { continue };
        if env.split(|&b| b == 0).any(|var| var == wanted.as_bytes()) {
            if let Some((_, start)) = proc_stat(pid).filter(|(s, _)| *s != 'Z') {
                return Some((pid, start));
            }
        }
    }
    None
}

/// One server per folder: an exclusive `flock` on `D/serve.lock`, held while the process lives (the
/// kernel drops it when the process dies, SIGKILL included). The file names the holder's pid.
pub(super) fn lock_folder(dir: &Path) -> Result<std::fs::File, SchedError> {
    use std::os::fd::AsRawFd;
    let path = dir.join("serve.lock");
    let file_error = |what: &'static str| {
        let path = path.clone();
        move |source| SchedError::File { path, what, source }
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(&path)
        .map_err(file_error("open"))?;
    // SAFETY: flock(2) on a descriptor this function owns (the file lives as long as the lock).
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        return Err(SchedError::FolderLocked { dir: dir.to_path_buf(), holder: holder.trim().to_string() });
    }
    file.set_len(0).map_err(file_error("write"))?;
    file.write_all(std::process::id().to_string().as_bytes()).map_err(file_error("write"))?;
    Ok(file)
}

/// Writes a job's allocation file, the cores its workers may run on (`2,3`), when it says
/// something else (write + rename: the launcher never reads half a list).
pub(super) fn write_alloc(layout: &Layout, id: i64, cores: &[usize]) -> Result<(), SchedError> {
    let path = layout.alloc_file(id);
    let text = cores.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    if std::fs::read_to_string(&path).is_ok_and(|old| old == text) {
        return Ok(());
    }
    let dir = path.parent().expect("alloc files sit in a folder");
    std::fs::create_dir_all(dir).map_err(|source| SchedError::File {
        path: dir.to_path_buf(),
        what: "create",
        source,
    })?;
    let tmp = dir.join(format!(".{id}.tmp"));
    std::fs::write(&tmp, &text).map_err(|source| SchedError::File { path: tmp.clone(), what: "write", source })?;
    std::fs::rename(&tmp, &path).map_err(|source| SchedError::File { path: path.clone(), what: "write", source })
}

/// A shell word holding `text` as is.
pub(super) fn shell_quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}
