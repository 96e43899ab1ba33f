//! The gate's reference: the model's matrix multiplies alone (`crate::gemm::GemmReference`), timed
//! right after every step, and the figures of one run (each time over its own reference).

use std::collections::BTreeMap;

use stoke_prof::{Phase, PhaseTimes, RunReport};
use stoke_train::{Observer, ObserverError, TrainEvent};

use super::baseline::Check;
use crate::gemm::{GemmReference, ReferenceTimes};

/// One step and the reference timed right after it.
#[derive(Debug, Clone, Copy)]
pub struct Pair {
    pub wall_ms: f64,
    pub phases: PhaseTimes,
    pub reference: ReferenceTimes,
}

/// Times the reference after every step past the first `skip`.
pub struct PairedReference {
    skip: u64,
    reference: Option<GemmReference>,
    first_step: u64,
    pub pairs: Vec<Pair>,
}

impl PairedReference {
    /// Pairs every step after the first `skip` (the profiler's warm-up steps) with a reference.
    pub fn new(skip: u64) -> PairedReference {
        PairedReference { skip, reference: None, first_step: 1, pairs: Vec::new() }
    }
}

impl Observer for PairedReference {
    fn on_event(&mut self, event: &TrainEvent<'_>) -> Result<(), ObserverError> {
        match event {
            TrainEvent::Started(info) => {
                self.first_step = info.start_step + 1;
                self.reference = Some(GemmReference::new(
                    &info.matmuls,
                    info.micro_batch,
                    info.precision,
                    info.widened_products,
                    info.device,
                ));
            }
            TrainEvent::Step(record) if record.step >= self.first_step + self.skip && record.timed => {
                let reference = self.reference.as_ref().ok_or("a step before the run started")?;
                self.pairs.push(Pair { wall_ms: record.wall_ms, phases: record.phases, reference: reference.time() });
            }
            _ => {}
        }
        Ok(())
    }
}

/// The figures of one run, with how each is compared. Each time is its fastest instance over the
/// run's steps: on a shared machine the noise in a wall time is only ever added (a step that loses
/// its core is late by whole scheduler ticks; measured here, a 4 ms backward was interrupted in
/// over 90% of the steps of some runs while other builds ran), so the fastest instance is the one
/// that measures the code. The median over runs then discards a run in which none was clean.
pub fn run_figures(pairs: &[Pair], report: &RunReport) -> BTreeMap<String, (Check, f64)> {
    // NaN when there are no steps or any time is NaN: a missing figure, never a plausible one.
    let low = |f: &dyn Fn(&Pair) -> f64| {
        let values: Vec<f64> = pairs.iter().map(f).collect();
        if values.is_empty() || values.iter().any(|v| v.is_nan()) {
            f64::NAN
        } else {
            values.into_iter().fold(f64::INFINITY, f64::min)
        }
    };
    let gemm_forward = low(&|p| p.reference.forward_ms);
    let gemm_backward = low(&|p| p.reference.backward_ms);
    let gemm = low(&|p| p.reference.forward_ms + p.reference.backward_ms);
    let mut figures = BTreeMap::new();
    let mut put = |key: &str, check: Check, value: f64| {
        figures.insert(key.to_string(), (check, value));
    };
    // The phases partition the step, and each is short enough to run uninterrupted now and then on
    // a busy machine, where a whole step rarely does: the step's figure is the sum of its phases'.
    let step: f64 = Phase::ALL.iter().map(|&phase| low(&|p| p.phases.get(phase))).sum();
    put("step_over_gemm", Check::Relative, step / gemm);
    put("forward_over_gemm", Check::Relative, low(&|p| p.phases.get(Phase::Forward)) / gemm_forward);
    put("backward_over_gemm", Check::Relative, low(&|p| p.phases.get(Phase::Backward)) / gemm_backward);
    put("optimizer_over_gemm", Check::Relative, low(&|p| p.phases.get(Phase::Optimizer)) / gemm);
    for phase in [Phase::DataWait, Phase::CkptStall, Phase::Other] {
        let share = report.phase_shares.get(&phase).copied().unwrap_or(f64::NAN);
        put(&format!("{phase}_share"), Check::Share, share);
    }
    figures
}
