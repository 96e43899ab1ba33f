//! Parameters as views of one flat fp32 buffer.
//!
//! Every parameter is a leaf tensor that shares storage with `flat`, so the optimizer updates all
//! of them with a handful of vectorized operations over the whole buffer instead of a loop of
//! small ones per tensor, and a checkpoint is one contiguous copy. Parameters that take weight
//! decay come first, so decay applies to a prefix of the buffer.

use tch::{Device, Kind, Tensor};

/// How a parameter starts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    Normal { std: f64 },
    Zeros,
    Ones,
}

/// One parameter's place in the flat buffer.
#[derive(Debug, Clone)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<i64>,
    pub init: Init,
    pub decay: bool,
}

#[derive(Debug)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<i64>,
    pub offset: i64,
    pub numel: i64,
    pub decay: bool,
    /// A leaf view of `flat` that requires grad.
    pub tensor: Tensor,
}

#[derive(Debug)]
pub struct FlatParams {
    flat: Tensor,
    entries: Vec<ParamEntry>,
    n_decay: i64,
}

impl FlatParams {
    /// Lays the parameters out (decayed ones first) and initializes them from libtorch's RNG, which
    /// the caller seeds.
    pub fn new(mut specs: Vec<ParamSpec>, device: Device) -> FlatParams {
        // A stable sort keeps the model's order within each group, so names map to offsets the
        // same way on every run.
        specs.sort_by_key(|spec| !spec.decay);
        let total: i64 = specs.iter().map(|s| s.shape.iter().product::<i64>()).sum();
        let flat = Tensor::zeros([total], (Kind::Float, device));
        let mut entries = Vec::with_capacity(specs.len());
        let mut offset = 0i64;
        let mut n_decay = 0i64;
        for spec in specs {
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
            if spec.decay {
                n_decay += numel;
            }
            entries.push(ParamEntry { name: spec.name, shape: spec.shape, offset, numel, decay: spec.decay, tensor });
            offset += numel;
        }
        FlatParams { flat, entries, n_decay }
    }

    pub fn flat(&self) -> &Tensor {
        &self.flat
    }

    pub fn entries(&self) -> &[ParamEntry] {
        &self.entries
    }

    pub fn n_elements(&self) -> i64 {
        self.flat.size()[0]
    }

    /// Elements `0..n_decay()` of the flat buffer take weight decay.
    pub fn n_decay(&self) -> i64 {
        self.n_decay
    }

    pub fn get(&self, name: &str) -> &Tensor {
        match self.entries.iter().find(|e| e.name == name) {
            Some(entry) => &entry.tensor,
            None => panic!("model asked for parameter {name:?}, which it never declared"),
        }
    }

    /// The gradients of all parameters as one flat buffer (zeros where a parameter got none),
    /// and clears the per-parameter gradients for the next accumulation.
    pub fn take_flat_grad(&mut self) -> Tensor {
        let grads: Vec<Tensor> = self
            .entries
            .iter()
            .map(|e| {
                let grad = e.tensor.grad();
                if grad.defined() {
                    grad.reshape([-1])
                } else {
                    Tensor::zeros([e.numel], (Kind::Float, self.flat.device()))
                }
            })
            .collect();
        let flat_grad = Tensor::cat(&grads, 0);
        for entry in &mut self.entries {
            entry.tensor.zero_grad();
        }
        flat_grad
    }
}
