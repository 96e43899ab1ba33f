//! AdamW with decoupled weight decay over the flat parameter buffer.

use tch::{Kind, Tensor};

use crate::params::FlatParams;

/// Hyper-parameters of one AdamW step.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// Moment estimates, flat like the parameters, and the count of steps taken.
pub struct AdamW {
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    pub n_steps: u64,
}

impl AdamW {
    pub fn new(params: &FlatParams) -> AdamW {
        let flat = params.flat();
        AdamW { exp_avg: flat.zeros_like(), exp_avg_sq: flat.zeros_like(), n_steps: 0 }
    }

    /// One update of every parameter from the flat gradient. The same arithmetic as PyTorch's
    /// `torch.optim.AdamW` (bias-corrected moments, decay applied to the weights before the step).
    pub fn step(&mut self, params: &mut FlatParams, grad: &Tensor, hp: AdamWStep) {
        self.n_steps += 1;
        let t = self.n_steps as i32;
        let bias_correction1 = 1.0 - hp.beta1.powi(t);
        let bias_correction2 = 1.0 - hp.beta2.powi(t);
        let n_decay = params.n_decay();
        tch::no_grad(|| {
            let mut flat = params.flat().shallow_clone();
            if hp.weight_decay > 0.0 && n_decay > 0 {
                let _ = flat.narrow(0, 0, n_decay).g_mul_scalar_(1.0 - hp.lr * hp.weight_decay);
            }
            let _ = self.exp_avg.lerp_(grad, 1.0 - hp.beta1);
            let _ = self.exp_avg_sq.lerp_(&grad.square(), 1.0 - hp.beta2);
            let mut denom = self.exp_avg_sq.sqrt();
            let _ = denom.g_div_scalar_(bias_correction2.sqrt()).g_add_scalar_(hp.eps);
            let mut update = self.exp_avg.divide(&denom);
            let _ = update.g_mul_scalar_(hp.lr / bias_correction1);
            let _ = flat.g_sub_(&update);
        });
    }
}

/// Scales `grad` in place so its global L2 norm is at most `max_norm`; returns the norm before.
pub fn clip_grad_norm(grad: &mut Tensor, max_norm: f64) -> f64 {
    let norm = grad.norm().to_kind(Kind::Double).double_value(&[]);
    if max_norm > 0.0 && norm > max_norm {
        let _ = grad.g_mul_scalar_(max_norm / (norm + 1e-6));
    }
    norm
}
