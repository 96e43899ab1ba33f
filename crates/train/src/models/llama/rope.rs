//! Rotary position embeddings as Hugging Face's Llama applies them: each head's vector is split in
//! two halves that rotate as the real and imaginary parts of `head_dim / 2` complex numbers, at
//! frequencies `theta^(-2i / head_dim)`, optionally rescaled by Llama 3.1's rule.

use tch::{Device, Kind, Tensor};

use crate::config::{LlamaShape, RopeScaling};

/// The inverse frequencies `theta^(-2i / head_dim)` for `i < head_dim / 2`, rescaled when asked.
/// Computed in fp32 as transformers computes them, so imported models agree within rounding.
pub(super) fn inverse_frequencies(head_dim: usize, theta: f64, scaling: Option<RopeScaling>) -> Vec<f32> {
    let mut inv: Vec<f32> =
        (0..head_dim / 2).map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32)).collect();
    if let Some(scaling) = scaling {
        for f in &mut inv {
            *f = llama3_rescaled(*f, scaling);
        }
    }
    inv
}

/// Llama 3.1's rescaling of one frequency (transformers' `_compute_llama3_parameters`): long
/// wavelengths are slowed by `factor`, short ones kept, the ones between interpolated smoothly.
fn llama3_rescaled(inv_freq: f32, s: RopeScaling) -> f32 {
    let old_context = s.original_context as f32;
    let low_freq_wavelen = old_context / s.low_freq_factor as f32;
    let high_freq_wavelen = old_context / s.high_freq_factor as f32;
    let wavelen = 2.0 * std::f32::consts::PI / inv_freq;
    let factor = s.factor as f32;
    if wavelen > low_freq_wavelen {
        inv_freq / factor
    } else if wavelen < high_freq_wavelen {
        inv_freq
    } else {
        let smooth =
            (old_context / wavelen - s.low_freq_factor as f32) / (s.high_freq_factor as f32 - s.low_freq_factor as f32);
        (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
    }
}

/// The cosines and sines of every position up to the context, `[seq_len, head_dim]` fp32 each
/// (the half-width table repeated twice, matching the rotate-half layout).
pub(super) fn tables(shape: &LlamaShape, device: Device) -> (Tensor, Tensor) {
    let inv = Tensor::from_slice(&inverse_frequencies(shape.head_dim(), shape.rope_theta, shape.rope_scaling));
    let positions = Tensor::arange(shape.base.seq_len as i64, (Kind::Float, Device::Cpu));
    let freqs = positions.unsqueeze(1).matmul(&inv.unsqueeze(0));
    let angles = Tensor::cat(&[&freqs, &freqs], 1);
    (angles.cos().to_device(device), angles.sin().to_device(device))
}

/// `x` `[batch, heads, seq, head_dim]` rotated by position: `x * cos + rotate_half(x) * sin`,
/// with `rotate_half([a, b]) = [-b, a]` over the two halves of the head.
pub(super) fn apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let seq = x.size()[2];
    let half = x.size()[3] / 2;
    let (cos, sin) = (cos.narrow(0, 0, seq).to_kind(x.kind()), sin.narrow(0, 0, seq).to_kind(x.kind()));
    let rotated = Tensor::cat(&[&x.narrow(3, half, half).neg(), &x.narrow(3, 0, half)], 3);
    x * cos + rotated * sin
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 3.1's rule keeps the fastest frequency, divides the slowest by the factor, and
    /// moves those between monotonically.
    #[test]
    fn llama3_scaling_keeps_short_waves_and_slows_long_ones() {
        let scaling = RopeScaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_context: 8192 };
        let plain = inverse_frequencies(128, 500000.0, None);
        let scaled = inverse_frequencies(128, 500000.0, Some(scaling));
        assert_eq!(plain[0], scaled[0]);
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-12);
        let ratios: Vec<f32> = plain.iter().zip(&scaled).map(|(p, s)| s / p).collect();
        assert!(ratios.windows(2).all(|w| w[1] <= w[0] + 1e-6), "{ratios:?}");
    }

    /// A rotation keeps each pair's length, and position 0 is not rotated.
    #[test]
    fn rotation_keeps_norms_and_leaves_position_zero() {
        let shape = LlamaShape {
            base: crate::config::GptShape { n_layer: 1, n_head: 2, d_model: 16, seq_len: 5, vocab_size: 8 },
            n_kv_head: 1,
            ffn_hidden: 8,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            tie_head: false,
            rope_scaling: None,
        };
        let (cos, sin) = tables(&shape, Device::Cpu);
        let x = Tensor::randn([1, 2, 5, 8], (Kind::Float, Device::Cpu));
        let y = apply(&x, &cos, &sin);
        let diff = (x.narrow(2, 0, 1) - y.narrow(2, 0, 1)).abs().max().double_value(&[]);
        assert!(diff < 1e-7, "{diff}");
        let pair_norm = |t: &Tensor| t.narrow(3, 0, 4).square() + t.narrow(3, 4, 4).square();
        let drift = (pair_norm(&x) - pair_norm(&y)).abs().max().double_value(&[]);
        assert!(drift < 1e-5, "{drift}");
    }
}
