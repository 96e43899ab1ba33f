//! `nan-dump.json`: the plain record of why and where a run stopped on a non-finite value. A leaf,
//! so that the crate's error type can carry it without importing the loop.

use tch::{Kind, Tensor};

/// JSON has no NaN: a non-finite number is written as null.
pub(super) fn finite_or_null(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// `nan-dump.json`: why and where a run stopped on a non-finite value.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct NanDump {
    /// The first step (1-based) whose loss or gradients were not finite. Read on that step, its
    /// update was not applied; read later from the device's flags (`train.guard_every`), the
    /// steps up to `detected_at_step` ran with it, and none of them was logged or checkpointed.
    pub step: u64,
    /// The step on which the host read it.
    pub detected_at_step: u64,
    /// "loss" or "gradients": which check fired.
    pub detected_at: String,
    /// The step's loss (null when not finite).
    pub loss: Option<f64>,
    pub grad_norm: Option<f64>,
    /// The loss of the last step whose loss was finite (null when there was none).
    pub last_finite_loss: Option<f64>,
    /// The data source's position before and after the step's batches: the step read the
    /// samples in between (the loader's global sample positions; for the in-memory windows, the
    /// batch numbers).
    pub data_position_before: u64,
    pub data_position_after: u64,
    pub micro_batch: usize,
    pub grad_accum: usize,
    pub seq_len: usize,
    /// Every parameter or gradient tensor holding a NaN or an inf.
    pub offending: Vec<OffendingTensor>,
    /// The newest committed checkpoint (left as it was), if any.
    pub latest_checkpoint: Option<u64>,
    /// True when `train.debug_poison_step` caused it.
    pub poisoned_on_purpose: bool,
}

/// A tensor of `NanDump::offending`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct OffendingTensor {
    pub name: String,
    /// "parameter" or "gradient".
    pub kind: String,
    pub stats: TensorStats,
}

/// Statistics of a tensor's values.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TensorStats {
    pub numel: i64,
    pub nan: i64,
    pub inf: i64,
    /// Over the finite values (null when there are none).
    pub finite_min: Option<f64>,
    pub finite_max: Option<f64>,
    pub finite_abs_mean: Option<f64>,
}

impl TensorStats {
    pub(super) fn of(t: &Tensor) -> TensorStats {
        let t = t.detach().to_kind(Kind::Double);
        let nan = t.isnan().sum(Kind::Int64).int64_value(&[]);
        let inf = t.isinf().sum(Kind::Int64).int64_value(&[]);
        let finite = t.masked_select(&t.isfinite());
        let n_finite = finite.numel();
        let stat = |x: Tensor| (n_finite > 0).then(|| x.double_value(&[]));
        TensorStats {
            numel: t.numel() as i64,
            nan,
            inf,
            finite_min: stat(if n_finite > 0 { finite.min() } else { Tensor::from(0.0) }),
            finite_max: stat(if n_finite > 0 { finite.max() } else { Tensor::from(0.0) }),
            finite_abs_mean: stat(finite.abs().mean(Kind::Double)),
        }
    }
}
