//! The server's Prometheus text: slots, jobs by state, and per job its allocation, the world it
//! runs on, its modelled throughput and goodput there, its step.

use std::collections::BTreeMap;

use super::estimate::{job_spec, DEFAULT_RESIZE_S};
use super::layout::noise_scale;
use super::server::Server;
use crate::store::JobRow;
use crate::SchedError;

impl Server<'_> {
    /// Prometheus text: slots, jobs by state, and per job its allocation, the world it runs on,
    /// its modelled throughput and goodput there (steps/s) and its step.
    pub(super) fn prometheus(&self) -> Result<String, SchedError> {
        let jobs = self.store.jobs()?;
        let mut out = String::new();
        let mut family = |name: &str, kind: &str, help: &str, samples: Vec<(String, f64)>| {
            out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
            for (labels, value) in samples {
                out.push_str(&format!("{name}{labels} {value}\n"));
            }
        };
        let label = |job: &JobRow| format!("{{job=\"{}\"}}", job.job.name.replace('\\', "\\\\").replace('"', "\\\""));
        family(
            "stoke_sched_slots",
            "gauge",
            "Slots the scheduler shares.",
            vec![(String::new(), self.config.slots as f64)],
        );
        let mut by_state: BTreeMap<&str, usize> = BTreeMap::new();
        for state in ["queued", "starting", "running", "finished", "failed", "cancelled"] {
            by_state.insert(state, 0);
        }
        for job in &jobs {
            *by_state.entry(job.state.name()).or_default() += 1;
        }
        family(
            "stoke_sched_jobs",
            "gauge",
            "Jobs by state.",
            by_state.iter().map(|(s, n)| (format!("{{state=\"{s}\"}}"), *n as f64)).collect(),
        );
        let active: Vec<&JobRow> = jobs.iter().filter(|j| j.state.is_active()).collect();
        family(
            "stoke_sched_job_workers",
            "gauge",
            "Workers the policy allocates to the job.",
            active.iter().map(|j| (label(j), j.alloc as f64)).collect(),
        );
        family(
            "stoke_sched_job_running_workers",
            "gauge",
            "Workers the job runs on now.",
            active.iter().map(|j| (label(j), self.live.get(&j.id).map_or(0, |l| l.world) as f64)).collect(),
        );
        let mut throughput = Vec::new();
        let mut goodput = Vec::new();
        for job in &active {
            let noise = noise_scale(&self.layout.run_dir(job));
            let spec = job_spec(job, &self.store.throughput(job.id)?, noise, DEFAULT_RESIZE_S, 0.0, 0.0);
            let world = self.live.get(&job.id).map_or(0, |l| l.world);
            throughput.push((label(job), spec.scaling.throughput(world)));
            goodput.push((label(job), spec.goodput(world)));
        }
        family("stoke_sched_job_throughput_steps_per_second", "gauge", "Modelled steps/s on its workers.", throughput);
        family("stoke_sched_job_goodput_steps_per_second", "gauge", "Throughput x statistical efficiency.", goodput);
        family(
            "stoke_sched_job_step",
            "gauge",
            "The job's last step.",
            active.iter().map(|j| (label(j), self.live.get(&j.id).map_or(0, |l| l.last_step) as f64)).collect(),
        );
        Ok(out)
    }
}
