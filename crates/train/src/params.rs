//! Parameters and their gradients as views of two flat fp32 buffers, laid out unit by unit.
//!
//! A model is a sequence of units (embedding, blocks, head). Every parameter is a leaf tensor that
//! shares storage with `flat`, and its gradient is a view of `flat_grad` at the same offset, so
//! libtorch's autograd accumulates every gradient straight into one persistent buffer: no
//! per-step concatenation, and a unit's gradients are one contiguous range (the communication
//! bucket of a later data-parallel step). The optimizer walks ranges of the same buffers; weight
//! decay is a property of each parameter's range, not of its place in the buffer.

use std::ops::Range;

use tch::{Device, Kind, Tensor};

/// How a parameter starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Normal { std: f64 },
    Zeros,
    Ones,
}

/// One parameter's declaration.
#[derive(Debug, Clone)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<i64>,
    pub init: Init,
    pub decay: bool,
}

/// A unit's declaration: its name (for errors and reports) and its parameters, in order.
#[derive(Debug, Clone)]
pub struct UnitSpec {
    pub name: String,
    pub params: Vec<ParamSpec>,
}

/// One parameter's place in the flat buffers.
#[derive(Debug)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<i64>,
    pub offset: i64,
    pub numel: i64,
    pub decay: bool,
    /// The unit this parameter belongs to (index into `FlatParams::units`).
    pub unit: usize,
    /// A leaf view of `flat` that requires grad; its `.grad` is a view of `flat_grad`.
    pub tensor: Tensor,
}

impl ParamEntry {
    pub fn range(&self) -> Range<i64> {
        self.offset..self.offset + self.numel
    }
}

/// A unit's contiguous range of the flat buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitRange {
    pub name: String,
    pub range: Range<i64>,
    /// Its parameters, as indices into `FlatParams::entries`.
    pub entries: Range<usize>,
}

#[derive(Debug)]
pub struct FlatParams {
    flat: Tensor,
    flat_grad: Tensor,
    entries: Vec<ParamEntry>,
    units: Vec<UnitRange>,
}

impl FlatParams {
    /// Lays the parameters out unit by unit, in declaration order, initializes them from
    /// libtorch's RNG (which the caller seeds), and binds each parameter's gradient to its view of
    /// the flat gradient buffer.
    pub fn new(units: Vec<UnitSpec>, device: Device) -> FlatParams {
        let total: i64 = units.iter().flat_map(|u| &u.params).map(|s| s.shape.iter().product::<i64>()).sum();
        let flat = Tensor::zeros([total], (Kind::Float, device));
        let flat_grad = Tensor::zeros([total], (Kind::Float, device));
        let mut entries = Vec::new();
        let mut unit_ranges = Vec::with_capacity(units.len());
        let mut offset = 0i64;
        for (unit_idx, unit) in units.into_iter().enumerate() {
            let (first_offset, first_entry) = (offset, entries.len());
            for spec in unit.params {
                let numel: i64 = spec.shape.iter().product();
                let mut view = flat.narrow(0, offset, numel).view(spec.shape.as_slice());
                tch::no_grad(|| match spec.init {
                    Init::Normal { std } => {
                        let _ = view.normal_(0.0, std);
                    }
                    Init::Zeros => {
                        let _ = view.zero_();
                    }
                    Init::Ones => {
                        let _ = view.fill_(1.0);
                    }
                });
                let tensor = view.set_requires_grad(true);
                entries.push(ParamEntry {
                    name: spec.name,
                    shape: spec.shape,
                    offset,
                    numel,
                    decay: spec.decay,
                    unit: unit_idx,
                    tensor,
                });
                offset += numel;
            }
            unit_ranges.push(UnitRange {
                name: unit.name,
                range: first_offset..offset,
                entries: first_entry..entries.len(),
            });
        }
        let params = FlatParams { flat, flat_grad, entries, units: unit_ranges };
        params.bind_grads();
        params
    }

    /// Makes every parameter's `.grad` a view of `flat_grad`. Autograd then accumulates into it
    /// in place (it adds to a defined gradient rather than replacing it), so the flat buffer is
    /// the only copy of the gradients.
    fn bind_grads(&self) {
        // A zero-weighted use of every parameter gives each one a defined `.grad` to rebind.
        let touch = self.entries.iter().fold(Tensor::zeros([], (Kind::Float, self.flat.device())), |acc, e| {
            acc + e.tensor.view([-1]).narrow(0, 0, 1).sum(Kind::Float) * 0.0
        });
        touch.backward();
        for entry in &self.entries {
            let mut grad = entry.tensor.grad();
            grad.set_data(&self.flat_grad.narrow(0, entry.offset, entry.numel).view(entry.shape.as_slice()));
        }
        tch::no_grad(|| {
            let _ = self.flat_grad.shallow_clone().zero_();
        });
        // Invariant: each gradient shares storage with `flat_grad` at its own offset.
        debug_assert!(self.grads_are_bound());
    }

    /// True when every parameter's gradient still lives in `flat_grad` at its offset.
    pub fn grads_are_bound(&self) -> bool {
        let base = self.flat_grad.data_ptr() as usize;
        self.entries.iter().all(|e| {
            let grad = e.tensor.grad();
            grad.defined() && grad.data_ptr() as usize == base + 4 * e.offset as usize
        })
    }

    pub fn flat(&self) -> &Tensor {
        &self.flat
    }

    /// The gradients of every parameter, laid out like `flat`.
    pub fn flat_grad(&self) -> &Tensor {
        &self.flat_grad
    }

    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }

    pub fn units(&self) -> &[UnitRange] {
        &self.units
    }

    pub fn n_elements(&self) -> i64 {
        self.flat.size()[0]
    }

    /// The parameter called `name`: resolved once when a model is built, not on every use.
    pub fn get(&self, name: &str) -> &Tensor {
        match self.entries.iter().find(|e| e.name == name) {
            Some(entry) => &entry.tensor,
            None => panic!("model asked for parameter {name:?}, which it never declared"),
        }
    }

    /// Sets every gradient to zero (in place, so they stay bound to `flat_grad`).
    pub fn zero_grad(&self) {
        tch::no_grad(|| {
            let _ = self.flat_grad.shallow_clone().zero_();
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, shape: Vec<i64>, decay: bool) -> ParamSpec {
        ParamSpec { name: name.into(), shape, init: Init::Normal { std: 0.1 }, decay }
    }

    #[test]
    fn gradients_accumulate_into_the_flat_buffer() {
        let params = FlatParams::new(
            vec![
                UnitSpec { name: "a".into(), params: vec![spec("w", vec![3, 2], true), spec("b", vec![2], false)] },
                UnitSpec { name: "c".into(), params: vec![spec("v", vec![4], true)] },
            ],
            Device::Cpu,
        );
        assert!(params.grads_are_bound());
        assert_eq!(params.units()[1].range, 8..12);
        for _ in 0..2 {
            let loss = params.get("w").sum(Kind::Float) * 2.0 + params.get("v").square().sum(Kind::Float);
            loss.backward();
        }
        assert!(params.grads_are_bound(), "backward replaced a bound gradient");
        let grad = Vec::<f32>::try_from(params.flat_grad()).unwrap();
        assert!(grad[..6].iter().all(|&g| g == 4.0), "{grad:?}");
        assert!(grad[6..8].iter().all(|&g| g == 0.0), "{grad:?}");
        let v = Vec::<f32>::try_from(params.get("v").detach()).unwrap();
        for (g, v) in grad[8..].iter().zip(v) {
            assert!((g - 4.0 * v).abs() < 1e-6);
        }
        params.zero_grad();
        assert!(params.grads_are_bound());
        assert_eq!(params.flat_grad().abs().sum(Kind::Float).double_value(&[]), 0.0);
    }
}
