//! The gate's reference: the model's matrix multiplies alone, timed right after every step, and
//! the figures of one run (each time over its own reference).

use std::collections::BTreeMap;
use std::time::Instant;

use stoke_prof::{Phase, PhaseTimes, Precision, RunReport};
use stoke_train::{GptShape, Observer, ObserverError, TrainEvent};
use tch::{Device, Kind, Tensor};

use super::baseline::Check;

/// The model's matrix multiplies alone, forward and backward, in the run's precision on its
/// device and threads: per block the four linear layers and the attention's two batched
/// multiplies, then the tied head. Forward is `x @ W^T`; backward `dY @ W` and `dY^T @ X` per
/// linear layer and four batched multiplies per attention. Weights are distinct per block;
/// activations of one shape are shared, as their values do not matter.
pub struct GemmReference {
    forward: Vec<(Tensor, Tensor)>,
    backward: Vec<(Tensor, Tensor)>,
    device: Device,
}

/// Milliseconds of one pass of each part of a `GemmReference`.
#[derive(Debug, Clone, Copy)]
pub struct ReferenceTimes {
    pub forward_ms: f64,
    pub backward_ms: f64,
}

impl GemmReference {
    pub fn new(shape: GptShape, micro_batch: usize, precision: Precision, device: Device) -> GemmReference {
        let kind = match precision {
            Precision::Fp32 => Kind::Float,
            Precision::Bf16 => Kind::BFloat16,
            Precision::Fp16 => Kind::Half,
        };
        let _guard = tch::no_grad_guard();
        let randn = |dims: &[i64]| Tensor::randn(dims, (kind, device));
        let (d, t, heads) = (shape.d_model as i64, shape.seq_len as i64, shape.n_head as i64);
        let (bt, bh, head_dim) = (micro_batch as i64 * t, micro_batch as i64 * heads, d / heads);
        let mut activations: BTreeMap<i64, (Tensor, Tensor)> = BTreeMap::new();
        let (mut forward, mut backward) = (Vec::new(), Vec::new());
        let mut linear = |n_in: i64, n_out: i64| {
            let x =
                activations.entry(n_in).or_insert_with(|| (randn(&[bt, n_in]), randn(&[bt, n_in]))).0.shallow_clone();
            let dy = activations
                .entry(n_out)
                .or_insert_with(|| (randn(&[bt, n_out]), randn(&[bt, n_out])))
                .1
                .shallow_clone();
            let w = randn(&[n_out, n_in]);
            forward.push((x.shallow_clone(), w.tr()));
            backward.push((dy.shallow_clone(), w));
            backward.push((dy.tr(), x));
        };
        for _ in 0..shape.n_layer {
            linear(d, 3 * d);
            linear(d, d);
            linear(d, 4 * d);
            linear(4 * d, d);
        }
        linear(d, shape.vocab_size as i64);
        let (q, k, v) = (randn(&[bh, t, head_dim]), randn(&[bh, t, head_dim]), randn(&[bh, t, head_dim]));
        let (probs, grad_out) = (randn(&[bh, t, t]), randn(&[bh, t, head_dim]));
        for _ in 0..shape.n_layer {
            forward.push((q.shallow_clone(), k.transpose(1, 2)));
            forward.push((probs.shallow_clone(), v.shallow_clone()));
            backward.push((grad_out.shallow_clone(), v.transpose(1, 2)));
            backward.push((probs.transpose(1, 2), grad_out.shallow_clone()));
            backward.push((probs.shallow_clone(), k.shallow_clone()));
            backward.push((probs.transpose(1, 2), q.shallow_clone()));
        }
        let reference = GemmReference { forward, backward, device };
        reference.time(); // warm-up: first-touch pages and libtorch's kernel choice
        reference
    }

    fn sync(&self) {
        if let Device::Cuda(ordinal) = self.device {
            tch::Cuda::synchronize(ordinal as i64);
        }
    }

    /// One pass of each part.
    pub fn time(&self) -> ReferenceTimes {
        let _guard = tch::no_grad_guard();
        let pass = |pairs: &[(Tensor, Tensor)]| {
            let start = Instant::now();
            for (a, b) in pairs {
                drop(a.matmul(b));
            }
            self.sync();
            start.elapsed().as_secs_f64() * 1e3
        };
        ReferenceTimes { forward_ms: pass(&self.forward), backward_ms: pass(&self.backward) }
    }
}

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
                self.reference = Some(GemmReference::new(info.shape, info.micro_batch, info.precision, info.device));
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
