//! The step clock: laps that partition one step's wall time into phases.
//!
//! One `StepClock` lives for one optimizer step and is passed by `&mut` to whatever runs inside
//! the step (the loop, the block executor, later the communicator), so each part records its own
//! phase where it happens. A lap charges the time since the previous lap to a phase; the laps
//! therefore add up to the step's wall time exactly.

use std::time::{Duration, Instant};

use tch::Device;

use crate::{Injections, Phase, PhaseTimes};

pub struct StepClock {
    start: Instant,
    mark: Instant,
    phases: PhaseTimes,
    /// On a GPU, synchronize before each lap so the lap holds the device's work, not just the
    /// launches (only on "timed" steps; see `Trainer::set_sync_every`).
    sync_device: Option<i64>,
    /// Test-only: the laps' injected slowdowns (`TrainConfig::test_inject`).
    inject: Injections,
}

impl StepClock {
    /// Starts a step. `device` is synchronized at each lap when `timed` and it is a GPU.
    pub fn start(device: Device, timed: bool) -> StepClock {
        let now = Instant::now();
        let sync_device = match device {
            Device::Cuda(ordinal) if timed => Some(ordinal as i64),
            _ => None,
        };
        StepClock { start: now, mark: now, phases: PhaseTimes::default(), sync_device, inject: Injections::default() }
    }

    /// Test-only: makes the forward, backward, optimizer and data-wait laps slower as `inject`
    /// says (`TrainConfig::test_inject`).
    pub fn inject(mut self, inject: Injections) -> StepClock {
        self.inject = inject;
        self
    }

    /// Charges the time since the previous lap (or the start) to `phase`.
    pub fn lap(&mut self, phase: Phase) {
        if let Some(ordinal) = self.sync_device {
            tch::Cuda::synchronize(ordinal);
        }
        let mut now = Instant::now();
        let lap = now - self.mark;
        let extra = match phase {
            Phase::Forward => lap.mul_f64(self.inject.slow_forward),
            Phase::Backward => lap.mul_f64(self.inject.slow_backward),
            Phase::Optimizer => lap.mul_f64(self.inject.slow_optimizer),
            Phase::DataWait => Duration::from_secs_f64(self.inject.data_wait_ms / 1e3),
            _ => Duration::ZERO,
        };
        if !extra.is_zero() {
            let until = now + extra;
            while Instant::now() < until {}
            now = Instant::now();
        }
        self.phases.add(phase, (now - self.mark).as_secs_f64() * 1e3);
        self.mark = now;
    }

    /// Milliseconds since the previous lap, not yet charged to any phase.
    pub fn pending_ms(&self) -> f64 {
        self.mark.elapsed().as_secs_f64() * 1e3
    }

    /// Ends the step: whatever is not yet charged goes to `Other`. Returns the phases and the
    /// step's wall time, which they sum to.
    pub fn finish(mut self) -> (PhaseTimes, f64) {
        self.lap(Phase::Other);
        let wall_ms = (self.mark - self.start).as_secs_f64() * 1e3;
        (self.phases, wall_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_sum_to_the_wall_time() {
        let mut clock = StepClock::start(Device::Cpu, true);
        std::thread::sleep(std::time::Duration::from_millis(2));
        clock.lap(Phase::Forward);
        clock.lap(Phase::Backward);
        std::thread::sleep(std::time::Duration::from_millis(1));
        let (phases, wall_ms) = clock.finish();
        let sum: f64 = phases.iter().map(|(_, ms)| ms).sum();
        assert!((sum - wall_ms).abs() < 1e-9, "{sum} vs {wall_ms}");
        assert!(phases.get(Phase::Forward) > 0.0 && phases.get(Phase::Other) > 0.0);
    }
}
