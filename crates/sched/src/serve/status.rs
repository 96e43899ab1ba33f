//! What `stoke sched status --json` shows of a folder: each job with its progress, slots,
//! noise scale and measured throughput, then the server's settings, decisions and history.

use super::layout::{last_step, noise_scale, Layout};
use crate::store::{JobRow, Store};
use crate::SchedError;

/// One job as JSON: its row, its step (from its run folder), its noise scale and throughput points.
pub fn job_json(layout: &Layout, job: &JobRow, throughput: &[(usize, f64, usize)]) -> serde_json::Value {
    serde_json::json!({
        "id": job.id,
        "name": job.job.name,
        "state": job.state.name(),
        "workers": job.alloc,
        "min_workers": job.job.min_workers,
        "max_workers": job.job.max_workers,
        "priority": job.job.priority,
        "step": last_step(&layout.run_dir(job)),
        "steps": job.job.steps,
        "submit_s": job.submit_s,
        "start_s": job.start_s,
        "finish_s": job.finish_s,
        "resizes": job.resizes,
        "launches": job.launches,
        "pid": job.pid.map(|p| p.0),
        "pid_start": job.pid.map(|p| p.1),
        "exit_code": job.exit_code,
        "cancel_requested": job.cancel_requested,
        "detail": job.detail,
        "run_dir": layout.run_dir(job),
        "slots": job.slots,
        "noise_scale": noise_scale(&layout.run_dir(job)),
        "throughput": throughput.iter().map(|&(w, t, n)| serde_json::json!({"workers": w, "steps_per_s": t, "steps": n})).collect::<Vec<_>>(),
    })
}

/// The folder's state as JSON: settings (slots, cores, policy, metrics address), jobs, decisions
/// and history.
pub fn status_json(store: &Store, layout: &Layout) -> Result<serde_json::Value, SchedError> {
    let jobs = store.jobs()?;
    let mut out = Vec::new();
    for job in &jobs {
        out.push(job_json(layout, job, &store.throughput(job.id)?));
    }
    Ok(serde_json::json!({
        "slots": store.meta("slots")?.and_then(|s| s.parse::<usize>().ok()),
        "cores": store.meta("cores")?,
        "policy": store.meta("policy")?,
        "prometheus_addr": store.meta("prometheus_addr")?,
        "jobs": out,
        "decisions": store.decisions()?,
        "history": store.history()?,
    }))
}
