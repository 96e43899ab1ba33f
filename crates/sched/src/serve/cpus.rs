//! The slots' cores: `--cpus` lists (`0,2,5-7`), or the CPUs this process may run on.

use crate::SchedError;

/// `0,2,5-7` to [0, 2, 5, 6, 7].
pub fn parse_cpu_list(text: &str) -> Result<Vec<usize>, SchedError> {
    let bad = || SchedError::BadCpuList { text: text.to_string() };
    let mut cpus = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                if a > b {
                    return Err(bad());
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().map_err(|_| bad())?),
        }
    }
    Ok(cpus)
}

/// The CPUs this process may run on, in order.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: sched_getaffinity(2) fills a cpu_set_t of the size given; zeroed is a valid empty set.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        set
    };
    // SAFETY: CPU_ISSET reads the set filled above, for indices below its size.
    (0..libc::CPU_SETSIZE as usize).filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) }).collect()
}

/// The cores of `slots` slots: `cpus` (a list for `parse_cpu_list`), else the first `slots` CPUs
/// this process may run on. Fewer CPUs than slots: slots share cores round-robin (said once).
pub(super) fn slot_cores(cpus: Option<&str>, slots: usize) -> Result<Vec<usize>, SchedError> {
    let cpus = match cpus {
        Some(text) => parse_cpu_list(text)?,
        None => allowed_cpus(),
    };
    if cpus.is_empty() {
        return Err(SchedError::NoCpu);
    }
    if cpus.len() < slots {
        eprintln!(
            "[sched] warning: {} slots on {} CPUs ({:?}): slots share cores, jobs are not kept apart",
            slots,
            cpus.len(),
            cpus
        );
    }
    Ok((0..slots).map(|k| cpus[k % cpus.len()]).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_take_numbers_and_ranges() {
        assert_eq!(parse_cpu_list("0,2,5-7").unwrap(), [0, 2, 5, 6, 7]);
        assert_eq!(parse_cpu_list(" 3 ").unwrap(), [3]);
        for bad in ["a", "3-1", "1-", "-"] {
            assert!(parse_cpu_list(bad).is_err(), "{bad}");
        }
        // This process may run somewhere.
        assert!(!allowed_cpus().is_empty());
    }
}
