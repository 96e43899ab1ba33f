//! Observers of training events: the metrics file and the progress bar (the profiler is in
//! `profiler.rs`).

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::Context;
use stoke_train::{Observer, ObserverError, TrainEvent};

/// `metrics.jsonl`: one JSON object per logged step, flushed as it is written so an interrupted
/// run keeps every line it reported.
pub struct MetricsWriter {
    out: BufWriter<File>,
    /// The units' names (from `Started`), the keys of the per-block monitors.
    units: Vec<String>,
}

impl MetricsWriter {
    /// A new file, or (when resuming from `resumed_step`) the existing one cut back to the lines
    /// of steps up to `resumed_step` and continued, so no step is ever in the file twice.
    pub fn create(path: &Path, resumed_step: Option<u64>) -> anyhow::Result<MetricsWriter> {
        if let Some(step) = resumed_step {
            truncate_to_step(path, step)?;
        }
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(resumed_step.is_some())
            .truncate(resumed_step.is_none())
            .open(path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        Ok(MetricsWriter { out: BufWriter::new(file), units: Vec::new() })
    }
}

/// Keeps the lines of `path` whose step is at most `step` (a line cut short by a kill has no step
/// and goes too), replacing the file atomically.
fn truncate_to_step(path: &Path, step: u64) -> anyhow::Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let line_step = |line: &str| serde_json::from_str::<serde_json::Value>(line).ok()?.get("step")?.as_u64();
    let kept: String = text
        .lines()
        .filter(|line| line_step(line).is_some_and(|s| s <= step))
        .map(|line| format!("{line}\n"))
        .collect();
    if kept.len() == text.len() {
        return Ok(());
    }
    let tmp = path.with_extension("jsonl.tmp");
    let mut file = File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    file.write_all(kept.as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot replace {}", path.display()))
}

impl Observer for MetricsWriter {
    fn on_event(&mut self, event: &TrainEvent<'_>) -> Result<(), ObserverError> {
        if let TrainEvent::Started(info) = event {
            self.units = info.units.clone();
        }
        if let TrainEvent::Step(record) = event {
            if !record.logged {
                return Ok(());
            }
            let phases: serde_json::Map<String, serde_json::Value> =
                record.phases.iter().map(|(p, ms)| (p.name().to_string(), serde_json::json!(ms))).collect();
            let mut line = serde_json::json!({
                "step": record.step,
                "loss": record.loss,
                "lr": record.lr,
                "grad_norm": record.grad_norm,
                "tokens": record.tokens,
                "tokens_per_s": stoke_prof::tokens_per_s(record.tokens as f64, record.wall_ms),
                "step_ms": record.wall_ms,
                "phases_ms": phases,
            });
            // Data-parallel runs only: all communication time of the step, hidden or exposed.
            if let (true, Some(object)) = (record.comm_total_ms > 0.0, line.as_object_mut()) {
                object.insert("comm_total_ms".into(), serde_json::json!(record.comm_total_ms));
            }
            // fp16 only: the loss scale this step ran at, and whether its update was skipped.
            if let (Some(scale), Some(object)) = (record.loss_scale, line.as_object_mut()) {
                object.insert("loss_scale".into(), serde_json::json!(scale));
                object.insert("skipped".into(), serde_json::json!(record.skipped));
            }
            if let Some(object) = line.as_object_mut() {
                // Monitors: per-block figures on monitored steps, the loss spike z-score, and
                // the held-out evaluation.
                if let Some(monitors) = &record.monitors {
                    let per_unit = |values: &[f64]| -> serde_json::Map<String, serde_json::Value> {
                        self.units.iter().zip(values).map(|(u, v)| (u.clone(), serde_json::json!(v))).collect()
                    };
                    object.insert("block_grad_norm".into(), per_unit(&monitors.grad_norm).into());
                    object.insert("update_ratio".into(), per_unit(&monitors.update_ratio).into());
                }
                if let Some(z) = record.loss_z {
                    object.insert("loss_z".into(), serde_json::json!(z));
                }
                if let Some(noise_scale) = record.noise_scale {
                    object.insert("noise_scale".into(), serde_json::json!(noise_scale));
                }
                if let Some(change) = &record.batch_change {
                    object.insert("event".into(), serde_json::json!("batch_grow"));
                    object.insert("batch_from".into(), serde_json::json!(change.from));
                    object.insert("batch_to".into(), serde_json::json!(change.to));
                }
                if let Some(eval) = &record.eval {
                    object.insert("eval_loss".into(), serde_json::json!(eval.loss));
                    object.insert("eval_ppl".into(), serde_json::json!(eval.perplexity));
                    object.insert("eval_tokens".into(), serde_json::json!(eval.tokens));
                    object.insert("eval_best".into(), serde_json::json!(eval.best));
                    if eval.stop {
                        object.insert("event".into(), serde_json::json!("early_stop"));
                    }
                }
            }
            writeln!(self.out, "{line}")?;
            self.out.flush()?;
        }
        Ok(())
    }
}

/// An indicatif bar: step, loss, tokens/s, ETA.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Progress {
    pub fn new(enabled: bool) -> Progress {
        Progress { bar: enabled.then(indicatif::ProgressBar::hidden) }
    }

    pub fn finish(&mut self) {
        if let Some(bar) = &self.bar {
            bar.finish();
        }
    }
}

impl Observer for Progress {
    fn on_event(&mut self, event: &TrainEvent<'_>) -> Result<(), ObserverError> {
        let Some(bar) = &mut self.bar else { return Ok(()) };
        match event {
            TrainEvent::Started(info) => {
                let fresh = indicatif::ProgressBar::new(info.total_steps);
                fresh.set_style(
                    indicatif::ProgressStyle::with_template(
                        "{bar:30} step {pos}/{len} | {msg} | {elapsed_precise} elapsed, ETA {eta_precise}",
                    )
                    .expect("a valid template"),
                );
                fresh.set_position(info.start_step);
                fresh.reset_eta();
                *bar = fresh;
            }
            TrainEvent::Step(record) => {
                bar.set_position(record.step);
                if record.logged {
                    let tokens_per_s = stoke_prof::tokens_per_s(record.tokens as f64, record.wall_ms);
                    bar.set_message(format!("loss {:.4} | {:.0} tok/s", record.loss, tokens_per_s));
                }
            }
            TrainEvent::CheckpointSaved { step, path } => {
                bar.println(format!("checkpoint at step {step}: {}", path.display()));
            }
            TrainEvent::Finished(_) => {}
        }
        Ok(())
    }
}
