//! Mixed precision: which element type each kind of op runs in, and dynamic loss scaling for fp16.
//!
//! tch's `autocast` is CUDA-only, so stoke casts per op the way autocast does: matrix multiplies
//! (linear layers, attention's batched products) run in the compute type, everything listed in
//! `FP32_OPS` stays fp32, and master weights, gradients and optimizer state are always fp32.

use tch::{Device, Kind, Tensor};

use crate::config::{LossScaleConfig, Precision};

/// Ops that run in fp32 whatever the precision, because their sums or exponentials lose too
/// much in 16 bits. This list is the policy; the model's code follows it.
pub const FP32_OPS: &[&str] = &["layer_norm", "softmax (inside, even when its output is 16-bit)", "cross_entropy"];

/// The element type of the matrix multiplies under `precision`.
pub fn compute_kind(precision: Precision) -> Kind {
    match precision {
        Precision::Fp32 => Kind::Float,
        Precision::Bf16 => Kind::BFloat16,
        Precision::Fp16 => Kind::Half,
    }
}

/// Whether this CPU has bf16 dot-product instructions (x86 AVX512-BF16, which AMX machines also
/// have; Arm's BF16). Without them oneDNN converts bf16 to fp32 around every product, and a bf16
/// linear layer runs several times slower than an fp32 one (measured on an AVX2-only EPYC: about
/// 9 GFLOP/s against 44 on one core).
pub fn cpu_has_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("bf16")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// The matrix products of a model in the compute type. On a CPU without bf16 dot products
/// (`cpu_has_bf16`), bf16 products are widened: their bf16 operands are multiplied by fp32's
/// units and the result is rounded back to bf16. There libtorch's own bf16 products ran 7-70x
/// slower than its fp32 ones (an AVX2 EPYC, `[1960, 384] x [384, 1536]`: 14 GFLOP/s with the
/// weight transposed, 1.6 without, against 116-120 in fp32). The values are rounded at the same
/// points as a native bf16 product's (bf16 times bf16 is exact in fp32, summed in fp32); only the
/// order of the sums differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Products {
    compute: Kind,
    widen: bool,
}

impl Products {
    /// The products of `compute` on `device`, widened where the CPU does not multiply bf16.
    pub fn new(compute: Kind, device: Device) -> Products {
        Products::with(compute, compute == Kind::BFloat16 && device == Device::Cpu && !cpu_has_bf16())
    }

    /// The products of `compute`, widened (bf16 only) or not whatever the machine.
    pub fn with(compute: Kind, widen: bool) -> Products {
        Products { compute, widen: widen && compute == Kind::BFloat16 }
    }

    pub fn widened(self) -> bool {
        self.widen
    }

    /// An operand as the product reads it: in fp32 when widened, so that a value read by several
    /// products is widened once (a widened product takes fp32 operands as they are).
    pub fn operand(self, t: &Tensor) -> Tensor {
        if self.widen {
            t.to_kind(Kind::Float)
        } else {
            t.shallow_clone()
        }
    }

    /// A product's result in the compute type.
    fn down(self, t: Tensor) -> Tensor {
        if self.widen {
            t.to_kind(self.compute)
        } else {
            t
        }
    }

    /// `x W^T + b`, operands in the compute type (or, widened, its values held in fp32).
    pub fn linear(self, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Tensor {
        self.down(self.operand(x).linear(&self.operand(weight), bias.map(|b| self.operand(b)).as_ref()))
    }

    pub fn mm(self, a: &Tensor, b: &Tensor) -> Tensor {
        self.down(self.operand(a).mm(&self.operand(b)))
    }

    pub fn matmul(self, a: &Tensor, b: &Tensor) -> Tensor {
        self.down(self.operand(a).matmul(&self.operand(b)))
    }

    pub fn bmm(self, a: &Tensor, b: &Tensor) -> Tensor {
        self.down(self.operand(a).bmm(&self.operand(b)))
    }

    /// `a.bmm(b)` written into `out` (the compute type).
    pub fn bmm_out(self, out: &Tensor, a: &Tensor, b: &Tensor) {
        if self.widen {
            let mut out = out.shallow_clone();
            out.copy_(&self.operand(a).bmm(&self.operand(b)));
        } else {
            let _ = a.bmm_out(out, b);
        }
    }
}

/// Dynamic loss scaling (what `torch.cuda.amp.GradScaler` does): the loss is multiplied by
/// `scale` before the backward so small fp16 gradients do not flush to zero; the optimizer divides
/// it out. A step whose gradients hold an inf or NaN is skipped and the scale backs off; after
/// `interval` clean steps it grows.
#[derive(Debug, Clone, PartialEq)]
pub struct LossScaler {
    config: LossScaleConfig,
    scale: f64,
    clean_steps: u64,
    skipped_steps: u64,
}

/// What the scaler decided about one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleOutcome {
    /// The gradients were finite; the update goes ahead.
    Applied,
    /// The gradients overflowed; the update is skipped and the scale backed off.
    Skipped,
}

impl LossScaler {
    pub fn new(config: LossScaleConfig) -> LossScaler {
        LossScaler { config, scale: config.init, clean_steps: 0, skipped_steps: 0 }
    }

    pub fn scale(&self) -> f64 {
        self.scale
    }

    pub fn skipped_steps(&self) -> u64 {
        self.skipped_steps
    }

    /// Records one step whose (scaled) gradient norm is `scaled_norm`; a non-finite norm means an
    /// inf or NaN somewhere in the gradients.
    pub fn update(&mut self, scaled_norm: f64) -> ScaleOutcome {
        if !scaled_norm.is_finite() {
            self.scale *= self.config.backoff;
            self.clean_steps = 0;
            self.skipped_steps += 1;
            return ScaleOutcome::Skipped;
        }
        self.clean_steps += 1;
        if self.clean_steps >= self.config.interval {
            self.scale *= self.config.growth;
            self.clean_steps = 0;
        }
        ScaleOutcome::Applied
    }

    /// The scaler's state for a checkpoint: scale, clean steps in a row, skipped steps.
    pub fn state(&self) -> (f64, u64, u64) {
        (self.scale, self.clean_steps, self.skipped_steps)
    }

    pub fn restore(&mut self, scale: f64, clean_steps: u64, skipped_steps: u64) {
        self.scale = scale;
        self.clean_steps = clean_steps;
        self.skipped_steps = skipped_steps;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overflow_skips_backs_off_and_grows_back() {
        let mut scaler = LossScaler::new(LossScaleConfig { init: 1024.0, growth: 2.0, backoff: 0.5, interval: 3 });
        assert_eq!(scaler.update(1.0), ScaleOutcome::Applied);
        assert_eq!(scaler.update(f64::INFINITY), ScaleOutcome::Skipped);
        assert_eq!(scaler.scale(), 512.0);
        assert_eq!(scaler.update(f64::NAN), ScaleOutcome::Skipped);
        assert_eq!(scaler.scale(), 256.0);
        assert_eq!(scaler.skipped_steps(), 2);
        for _ in 0..2 {
            assert_eq!(scaler.update(3.0), ScaleOutcome::Applied);
            assert_eq!(scaler.scale(), 256.0, "grows only after `interval` clean steps");
        }
        assert_eq!(scaler.update(3.0), ScaleOutcome::Applied);
        assert_eq!(scaler.scale(), 512.0);
    }

    /// A widened product is bf16 in and out, its value the fp32 product of the bf16 operands
    /// rounded once (bit for bit), and within a bf16 rounding of libtorch's native bf16 product.
    #[test]
    fn widened_products_round_as_bf16_products_do() {
        let bf16 = (Kind::BFloat16, Device::Cpu);
        let (a, b) = (Tensor::randn([3, 40, 72], bf16), Tensor::randn([3, 72, 24], bf16));
        let (wide, native) = (Products::with(Kind::BFloat16, true), Products::with(Kind::BFloat16, false));
        assert!(wide.widened() && !native.widened() && !Products::with(Kind::Float, true).widened());
        let exact = a.to_kind(Kind::Float).bmm(&b.to_kind(Kind::Float));
        let product = wide.bmm(&a, &b);
        assert_eq!(product.kind(), Kind::BFloat16);
        assert!(product.equal(&exact.to_kind(Kind::BFloat16)));
        let out = Tensor::zeros([3, 40, 24], bf16);
        wide.bmm_out(&out, &a, &b);
        assert!(out.equal(&product));
        let weight = b.get(0).tr();
        let bias = Tensor::randn([24], bf16);
        let linear = wide.linear(&a.get(1), &weight, Some(&bias));
        let wide_ops =
            a.get(1).to_kind(Kind::Float).linear(&weight.to_kind(Kind::Float), Some(&bias.to_kind(Kind::Float)));
        let expect = wide_ops.to_kind(Kind::BFloat16);
        assert!(linear.equal(&expect));
        // Native: the same products, summed in another order, each rounded once to bf16.
        let native = native.bmm(&a, &b).to_kind(Kind::Float);
        let ulp = exact.abs().clamp_min(1e-3) * 2f64.powi(-7);
        let off = (native - &exact).abs() - ulp;
        assert!(
            off.max().double_value(&[]) <= 0.0,
            "native bf16 beyond one rounding of the exact product: {}",
            off.max().double_value(&[])
        );
    }
}
