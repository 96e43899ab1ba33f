//! Observers of training events: the metrics file, the progress bar and the end-of-run report.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::Context;
use stoke_train::{Observer, ObserverError, Phase, PhaseTimes, RunInfo, TrainEvent};

/// `metrics.jsonl`: one JSON object per logged step, flushed as it is written so an interrupted
/// run keeps every line it reported.
pub struct MetricsWriter {
    out: BufWriter<File>,
}

impl MetricsWriter {
    /// A new file, or (when resuming) the existing one continued.
    pub fn create(path: &Path, append: bool) -> anyhow::Result<MetricsWriter> {
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        Ok(MetricsWriter { out: BufWriter::new(file) })
    }
}

impl Observer for MetricsWriter {
    fn on_event(&mut self, event: &TrainEvent<'_>) -> Result<(), ObserverError> {
        if let TrainEvent::Step(record) = event {
            if !record.logged {
                return Ok(());
            }
            let phases: serde_json::Map<String, serde_json::Value> =
                record.phases.iter().map(|(p, ms)| (p.name().to_string(), serde_json::json!(ms))).collect();
            let line = serde_json::json!({
                "step": record.step,
                "loss": record.loss,
                "lr": record.lr,
                "grad_norm": record.grad_norm,
                "tokens": record.tokens,
                "tokens_per_s": record.tokens as f64 / (record.wall_ms / 1e3),
                "step_ms": record.wall_ms,
                "phases_ms": phases,
            });
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
                    let tokens_per_s = record.tokens as f64 / (record.wall_ms / 1e3);
                    bar.set_message(format!("loss {:.4} | {:.0} tok/s", record.loss, tokens_per_s));
                }
            }
            TrainEvent::CheckpointSaved { step, path, .. } => {
                bar.println(format!("checkpoint at step {step}: {}", path.display()));
            }
            TrainEvent::Finished(_) => {}
        }
        Ok(())
    }
}

/// Mean time per phase over the run, printed at the end.
#[derive(Default)]
pub struct StepReport {
    info: Option<RunInfo>,
    sum: PhaseTimes,
    wall_ms: f64,
    n_steps: u64,
}

impl Observer for StepReport {
    fn on_event(&mut self, event: &TrainEvent<'_>) -> Result<(), ObserverError> {
        match event {
            TrainEvent::Started(info) => self.info = Some((*info).clone()),
            // The first step pays one-time costs (allocator warm-up, lazy initialization); leave
            // it out of the steady-state figures.
            TrainEvent::Step(record) if self.info.as_ref().is_some_and(|i| record.step > i.start_step + 1) => {
                for (phase, ms) in record.phases.iter() {
                    self.sum.add(phase, ms);
                }
                self.wall_ms += record.wall_ms;
                self.n_steps += 1;
            }
            _ => {}
        }
        Ok(())
    }
}

impl StepReport {
    pub fn print(&self) {
        let Some(info) = &self.info else { return };
        if self.n_steps == 0 {
            return;
        }
        let n = self.n_steps as f64;
        let step_ms = self.wall_ms / n;
        println!("\nstep report ({} steps, first step excluded): {step_ms:.1} ms/step", self.n_steps);
        let compute: f64 = self.sum.iter().filter(|(p, _)| p.is_compute()).map(|(_, ms)| ms).sum::<f64>() / n;
        for (phase, ms) in self.sum.iter() {
            let ms = ms / n;
            if ms == 0.0 && !matches!(phase, Phase::DataWait) {
                continue;
            }
            println!("  {:<13} {:>9.2} ms  {:>5.1}%", phase.name(), ms, 100.0 * ms / step_ms);
        }
        let tokens_per_s = info.tokens_per_step as f64 / (step_ms / 1e3);
        println!(
            "  effective compute ratio {:.3} | {:.0} tokens/s | {:.2} GFLOP/s of model math",
            compute / step_ms,
            tokens_per_s,
            info.shape.flops_per_token() * tokens_per_s / 1e9
        );
    }
}
