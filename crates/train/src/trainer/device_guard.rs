//! The NaN guard kept on the device (`train.guard_every`). A step whose gradient norm never leaves
//! the device (`Optimizer::step_on_device`) folds its loss's and norm's finiteness into flags
//! there; the host reads them every `guard_every` steps, on every logged step and before any
//! checkpoint, so a GPU is not synchronized every step by the guard. The flags keep the first
//! step that went wrong, with its loss and norm and the loss before it, so the run still stops
//! naming that step, however late it is read. No checkpoint holds a step after it: a checkpoint
//! reads the flags first. Data-parallel ranks read at the same steps and agree on the first bad
//! step any of them holds (`StepHooks::agree_first_bad`), so they stop together.

use tch::{Device, Kind, Tensor};

/// The device-side record of the first non-finite step since the run started.
pub(super) struct DeviceGuard {
    every: u64,
    /// [first bad step (0: none), its loss, its squared gradient norm, the loss of the last
    /// finite step before it (NaN: none)], f64 on the device.
    flags: Tensor,
    /// (step, the data position before it, after it) of every step recorded since the last read.
    positions: Vec<(u64, u64, u64)>,
}

/// What a read of the flags found: the first step whose loss or gradient norm was not finite.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Caught {
    pub(super) step: u64,
    pub(super) loss: f64,
    pub(super) grad_norm: f64,
    pub(super) last_finite_loss: f64,
    pub(super) position_before: u64,
    pub(super) position_after: u64,
}

impl DeviceGuard {
    /// A guard read every `every` steps (at least 1), its flags on `device`.
    pub(super) fn new(every: u64, device: Device) -> DeviceGuard {
        let flags = Tensor::from_slice(&[0.0, f64::NAN, f64::NAN, f64::NAN]).to_device(device);
        DeviceGuard { every: every.max(1), flags, positions: Vec::new() }
    }

    /// Whether step `step` is one the host reads the flags on by the interval alone.
    pub(super) fn due(&self, step: u64) -> bool {
        step.is_multiple_of(self.every)
    }

    /// Steps recorded since the last read.
    pub(super) fn unread(&self) -> bool {
        !self.positions.is_empty()
    }

    /// Folds step `step`'s loss (0-dim) and squared gradient norm (0-dim f64) into the flags, on
    /// the device: a few element-wise ops on four numbers, nothing read back.
    pub(super) fn record(&mut self, step: u64, loss: &Tensor, sq_sum: &Tensor, before: u64, after: u64) {
        tch::no_grad(|| {
            let loss = loss.to_kind(Kind::Double).reshape([1]);
            let sq_sum = sq_sum.to_kind(Kind::Double).reshape([1]);
            let first = self.flags.narrow(0, 0, 1);
            let ok = loss.isfinite().logical_and(&sq_sum.isfinite());
            let clean_before = first.eq(0.0);
            // This step is the first bad one: its number, loss and norm are kept.
            let fresh = clean_before.logical_and(&ok.logical_not());
            // A fill on the device: a copy from host memory would wait for the device's queue.
            let step_t = Tensor::full([1], step as f64, (Kind::Double, loss.device()));
            let found = Tensor::cat(&[step_t, loss.shallow_clone(), sq_sum], 0);
            let kept = found.where_self(&fresh, &self.flags.narrow(0, 0, 3));
            // Still clean after this step: its loss is the last finite one.
            let last = loss.where_self(&clean_before.logical_and(&ok), &self.flags.narrow(0, 3, 1));
            self.flags = Tensor::cat(&[kept, last], 0);
        });
        self.positions.push((step, before, after));
    }

    /// Reads the flags (one synchronization) and agrees on them with the other processes
    /// (`agree`: from this process's first bad step, or 0, the first any process holds): the first
    /// bad step, if there was one. A process whose own flags hold a later step or none reports that
    /// step's data positions with its values unknown (NaN).
    pub(super) fn read<E>(&mut self, agree: impl FnOnce(u64) -> Result<u64, E>) -> Result<Option<Caught>, E> {
        let values = Vec::<f64>::try_from(self.flags.to_device(Device::Cpu)).expect("four f64 flags");
        let positions = std::mem::take(&mut self.positions);
        let local = values[0] as u64;
        let step = agree(local)?;
        if step == 0 {
            return Ok(None);
        }
        let (_, position_before, position_after) = positions
            .iter()
            .copied()
            .find(|&(s, ..)| s == step)
            .expect("the first bad step was recorded since the last read");
        let mine = |v: f64| if step == local { v } else { f64::NAN };
        Ok(Some(Caught {
            step,
            loss: mine(values[1]),
            grad_norm: mine(values[2].sqrt()),
            last_finite_loss: mine(values[3]),
            position_before,
            position_after,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alone(local: u64) -> Result<u64, ()> {
        Ok(local)
    }

    #[test]
    fn the_first_bad_step_is_kept_however_late_it_is_read() {
        let mut guard = DeviceGuard::new(4, Device::Cpu);
        let sq = |x: f64| Tensor::from(x);
        guard.record(1, &Tensor::from(2.5f32), &sq(4.0), 0, 8);
        assert!(!guard.due(1) && guard.due(4) && guard.unread());
        assert_eq!(guard.read(alone), Ok(None));
        assert!(!guard.unread());
        guard.record(2, &Tensor::from(2.25f32), &sq(9.0), 8, 16);
        guard.record(3, &Tensor::from(f32::NAN), &sq(f64::NAN), 16, 24);
        guard.record(4, &Tensor::from(f32::NAN), &sq(f64::NAN), 24, 32);
        let caught = guard.read(alone).unwrap().expect("step 3 was not finite");
        assert_eq!(caught.step, 3);
        assert!(caught.loss.is_nan() && caught.grad_norm.is_nan());
        assert_eq!(caught.last_finite_loss, 2.25);
        assert_eq!((caught.position_before, caught.position_after), (16, 24));
    }

    #[test]
    fn finite_loss_with_overflowed_gradients_is_caught_with_its_loss() {
        let mut guard = DeviceGuard::new(1, Device::Cpu);
        guard.record(1, &Tensor::from(3.0f32), &Tensor::from(1.0f64), 0, 1);
        guard.record(2, &Tensor::from(2.0f32), &Tensor::from(f64::INFINITY), 1, 2);
        guard.record(3, &Tensor::from(f32::NAN), &Tensor::from(f64::NAN), 2, 3);
        let caught = guard.read(alone).unwrap().unwrap();
        assert_eq!((caught.step, caught.loss, caught.grad_norm, caught.last_finite_loss), (2, 2.0, f64::INFINITY, 3.0));
    }

    #[test]
    fn a_step_another_rank_caught_first_stops_this_one_with_its_positions() {
        let mut guard = DeviceGuard::new(2, Device::Cpu);
        guard.record(1, &Tensor::from(3.0f32), &Tensor::from(1.0f64), 0, 4);
        guard.record(2, &Tensor::from(f32::NAN), &Tensor::from(f64::NAN), 4, 8);
        let caught = guard.read(|local| Ok::<u64, ()>(if local == 2 { 1 } else { local })).unwrap().unwrap();
        assert_eq!((caught.step, caught.position_before, caught.position_after), (1, 0, 4));
        assert!(caught.loss.is_nan() && caught.last_finite_loss.is_nan(), "values of a step this rank did not flag");
    }
}
