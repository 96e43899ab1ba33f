//! The words the trainer and the profiler share: the phases of a step, milliseconds per phase,
//! and the precision of a run. They live here, in the crate without libtorch, so that the
//! trainer records and the report reads the same types instead of names compared as strings.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The phases a step's wall time splits into, in loop order. They add up to the step's wall time:
/// whatever is not measured as one of the named phases is `Other`. `comm_total` (all
/// communication, hidden or not) is reported beside them and is not one of them.
///
/// Serialized by its name (`"data_wait"`, `"h2d"`, ...), which is also `report.json`'s key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    DataWait,
    H2d,
    Forward,
    Backward,
    Recompute,
    CommExposed,
    Optimizer,
    CkptStall,
    Other,
}

/// Number of additive phases.
pub const N_PHASES: usize = Phase::ALL.len();

impl Phase {
    /// Every phase, in loop order (`phase as usize` is its index here).
    pub const ALL: [Phase; 9] = [
        Phase::DataWait,
        Phase::H2d,
        Phase::Forward,
        Phase::Backward,
        Phase::Recompute,
        Phase::CommExposed,
        Phase::Optimizer,
        Phase::CkptStall,
        Phase::Other,
    ];

    /// Phases that are the model's own arithmetic: the numerator of the effective compute ratio.
    pub const COMPUTE: [Phase; 4] = [Phase::Forward, Phase::Backward, Phase::Recompute, Phase::Optimizer];

    /// Phases that a change of configuration can remove entirely, so their Amdahl bound is meaningful.
    pub const REMOVABLE: [Phase; 6] =
        [Phase::DataWait, Phase::H2d, Phase::Recompute, Phase::CommExposed, Phase::CkptStall, Phase::Other];

    pub fn name(self) -> &'static str {
        match self {
            Phase::DataWait => "data_wait",
            Phase::H2d => "h2d",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Recompute => "recompute",
            Phase::CommExposed => "comm_exposed",
            Phase::Optimizer => "optimizer",
            Phase::CkptStall => "ckpt_stall",
            Phase::Other => "other",
        }
    }

    /// The phase with this name (`"data_wait"`, ...).
    pub fn from_name(name: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Phases that are the model's own arithmetic (the numerator of the effective compute ratio).
    pub fn is_compute(self) -> bool {
        Phase::COMPUTE.contains(&self)
    }

    /// Phases a change of configuration can remove entirely.
    pub fn is_removable(self) -> bool {
        Phase::REMOVABLE.contains(&self)
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Milliseconds per phase of one step, indexed by `Phase`. Serialized as the plain array, in
/// `Phase::ALL` order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PhaseTimes {
    pub ms: [f64; N_PHASES],
}

impl PhaseTimes {
    pub fn get(&self, phase: Phase) -> f64 {
        self.ms[phase as usize]
    }

    pub fn add(&mut self, phase: Phase, ms: f64) {
        self.ms[phase as usize] += ms;
    }

    /// The sum of all phases: the step's wall time when the phases are a step's laps.
    pub fn total(&self) -> f64 {
        self.ms.iter().sum()
    }

    /// The sum of the compute phases.
    pub fn compute(&self) -> f64 {
        Phase::COMPUTE.iter().map(|&p| self.get(p)).sum()
    }

    pub fn iter(&self) -> impl Iterator<Item = (Phase, f64)> + '_ {
        Phase::ALL.iter().map(|&p| (p, self.get(p)))
    }
}

/// The precision of a run's matrix multiplies: "fp32", "bf16" (bf16 matrix multiplies, fp32
/// master weights) or "fp16" (fp16 matrix multiplies with dynamic loss scaling); layer norms,
/// softmax and the loss stay fp32 in every case. Serialized lowercase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    #[default]
    Bf16,
    Fp16,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_names_are_the_names() {
        for phase in Phase::ALL {
            assert_eq!(serde_json::to_string(&phase).unwrap(), format!("\"{}\"", phase.name()));
            assert_eq!(Phase::from_name(phase.name()), Some(phase));
            assert_eq!(Phase::ALL[phase as usize], phase);
        }
        for precision in [Precision::Fp32, Precision::Bf16, Precision::Fp16] {
            assert_eq!(serde_json::to_string(&precision).unwrap(), format!("\"{precision}\""));
        }
        assert!(serde_json::from_str::<Precision>("\"fp8\"").is_err());
        let mut times = PhaseTimes::default();
        times.add(Phase::Forward, 2.0);
        times.add(Phase::Other, 1.0);
        assert_eq!(serde_json::to_string(&times).unwrap(), "[0.0,0.0,2.0,0.0,0.0,0.0,0.0,0.0,1.0]");
        assert_eq!((times.total(), times.compute()), (3.0, 2.0));
    }
}
