//! The slots a job may run on (`--slot-check`) and the CPUs its workers are pinned to
//! (`--cpus-file`).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

use super::spec::Launch;

/// The slots that may run a worker now, at most `max` of them; waits up to `--slot-wait-s` for
/// `min`.
pub fn wait_for_slots(
    args: &Launch,
    min: usize,
    max: usize,
    stop: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<Vec<usize>> {
    let deadline = Instant::now() + Duration::from_secs_f64(args.slot_wait_s.max(0.0));
    loop {
        let slots = available_slots(args, max);
        if slots.len() >= min {
            return Ok(slots);
        }
        if Instant::now() >= deadline || stop.load(std::sync::atomic::Ordering::Relaxed) {
            anyhow::bail!(
                "only {} of the {max} slots are available ({:?}; --slot-check `{}`), fewer than the {min} the job needs, \
                 after waiting {} s",
                slots.len(),
                slots,
                args.slot_check.as_deref().unwrap_or(""),
                args.slot_wait_s
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

pub fn available_slots(args: &Launch, max: usize) -> Vec<usize> {
    let Some(check) = &args.slot_check else { return (0..max).collect() };
    (0..max)
        .filter(|slot| {
            Command::new("sh")
                .args(["-c", check])
                .env("STOKE_SLOT", slot.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .collect()
}

/// The CPUs listed in `path` (numbers separated by commas, spaces or lines).
pub fn read_cpus(path: &Path) -> anyhow::Result<Vec<usize>> {
    let text = stoke_fsio::read_to_string_capped(path, stoke_fsio::TABLE_CAP)
        .with_context(|| format!("cannot read --cpus-file {}", path.display()))?;
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .ok()
                .filter(|&cpu| cpu < libc::CPU_SETSIZE as usize)
                .with_context(|| format!("--cpus-file {}: `{s}` is not a CPU number", path.display()))
        })
        .collect()
}

/// Makes the worker `cmd` starts run on `cpu` only, from before its first instruction (so every
/// thread it creates inherits the mask).
pub fn pin_to(cmd: &mut Command, cpu: usize) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and only calls sched_setaffinity(2),
    // which is async-signal-safe, on a mask built on its own stack; no allocation, no lock.
    unsafe {
        cmd.pre_exec(move || {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
